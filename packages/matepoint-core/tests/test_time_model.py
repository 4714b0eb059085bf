"""The time model's inputs: a ``DeviceModel``'s rates and the calibration cache.

A calibration cache entry is used only when it is a whole, valid ``DeviceModel``; a write never
loses the measurement nor another device's entry (Note [The calibration cache] in
``matepoint._planner.time_model``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import matepoint
from matepoint._planner import time_model
from matepoint._planner.time_model import DeviceModel, cached_model

KEY = "H200 | torch 2.11"
MEASURED = DeviceModel(
    peak_flops=7e14, to_host_bandwidth=5e10, to_device_bandwidth=4e10, policy_seconds_per_op=3e-6
)
WHOLE_ENTRY = {
    "peak_flops": 1e15,
    "to_host_bandwidth": 6e10,
    "to_device_bandwidth": 6e10,
    "policy_seconds_per_op": 1e-6,
    "host_seconds_per_op": 2e-6,
}


class Counting:
    """A ``measure`` that returns :data:`MEASURED` and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> DeviceModel:
        self.calls += 1
        return MEASURED


def _write(path: Path, entry: Any) -> None:
    path.write_text(json.dumps({KEY: entry, "H100 | torch 2.11": WHOLE_ENTRY}), encoding="utf-8")


# --- DeviceModel --------------------------------------------------------------------------------

RATES = ("peak_flops", "to_host_bandwidth", "to_device_bandwidth")


@pytest.mark.parametrize("field", RATES)
@pytest.mark.parametrize("value", [0, 0.0, -1.0, math.nan, math.inf, -math.inf])
def test_a_rate_that_is_not_a_finite_positive_number_is_refused_by_name(
    field: str, value: float
) -> None:
    with pytest.raises(ValueError, match=rf"DeviceModel\.{field} must be"):
        DeviceModel(**{field: value})


@pytest.mark.parametrize("value", [-1e-6, math.nan, math.inf])
def test_the_policy_cost_may_be_zero_but_not_negative_or_nan(value: float) -> None:
    assert DeviceModel(policy_seconds_per_op=0).policy_seconds_per_op == 0
    with pytest.raises(ValueError, match=r"DeviceModel\.policy_seconds_per_op must be"):
        DeviceModel(policy_seconds_per_op=value)


@pytest.mark.parametrize("field", [*RATES, "policy_seconds_per_op"])
@pytest.mark.parametrize("value", ["7e14", None, True, [1.0]])
def test_a_rate_that_is_not_a_number_is_a_type_error_by_name(field: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"DeviceModel\.{field} must be a number"):
        DeviceModel(**{field: value})


def test_the_default_model_and_ordinary_numbers_are_accepted() -> None:
    assert DeviceModel() == DeviceModel(989e12, 55e9, 55e9, 10e-6)
    assert DeviceModel(peak_flops=1, to_host_bandwidth=2, to_device_bandwidth=3).peak_flops == 1


# --- the cache: what is trusted -----------------------------------------------------------------


def test_an_entry_missing_a_field_is_measured_again_not_filled_with_defaults(
    tmp_path: Path,
) -> None:
    path = tmp_path / "models.json"
    partial = {name: value for name, value in WHOLE_ENTRY.items() if name != "to_device_bandwidth"}
    _write(path, partial)
    measure = Counting()
    assert cached_model(path, KEY, measure) == MEASURED
    assert measure.calls == 1
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert stored[KEY]["to_device_bandwidth"] == MEASURED.to_device_bandwidth
    assert stored["H100 | torch 2.11"] == WHOLE_ENTRY  # the other device's entry is kept


BAD_ENTRIES = {
    "empty": {},
    "null": None,
    "string": "fast",
    "zero": 0,
    "a field null": {**WHOLE_ENTRY, "peak_flops": None},
    "a field a string": {**WHOLE_ENTRY, "peak_flops": "7e14"},
    "a field a dict": {**WHOLE_ENTRY, "peak_flops": {}},
    "a field true": {**WHOLE_ENTRY, "peak_flops": True},
    "a zero rate": {**WHOLE_ENTRY, "to_host_bandwidth": 0},
    "a negative rate": {**WHOLE_ENTRY, "peak_flops": -1e15},
    "a nan rate": {**WHOLE_ENTRY, "to_device_bandwidth": math.nan},
    "an infinite rate": {**WHOLE_ENTRY, "peak_flops": math.inf},
    "a negative policy cost": {**WHOLE_ENTRY, "policy_seconds_per_op": -1e-6},
    "a field of another release": {**WHOLE_ENTRY, "warp_drive": 1.0},
}


@pytest.mark.parametrize("entry", list(BAD_ENTRIES.values()), ids=list(BAD_ENTRIES))
def test_an_entry_that_is_no_device_model_is_measured_again(tmp_path: Path, entry: Any) -> None:
    path = tmp_path / "models.json"
    _write(path, entry)
    measure = Counting()
    assert cached_model(path, KEY, measure) == MEASURED
    assert measure.calls == 1
    assert cached_model(path, KEY, measure) == MEASURED  # and the good entry replaced it
    assert measure.calls == 1


def test_a_whole_valid_entry_is_read_back_without_measuring(tmp_path: Path) -> None:
    path = tmp_path / "models.json"
    _write(path, {**WHOLE_ENTRY, "policy_seconds_per_op": 0})
    measure = Counting()
    expected = DeviceModel(**{**WHOLE_ENTRY, "policy_seconds_per_op": 0})
    assert cached_model(path, KEY, measure) == expected
    assert measure.calls == 0


# --- the cache: where it lives ------------------------------------------------------------------


class _PathLike:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return str(self.path)


@pytest.mark.parametrize("kind", ["str", "PathLike"])
def test_the_cache_may_be_named_by_a_string_or_any_path_like(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "models.json"
    named: Any = str(path) if kind == "str" else _PathLike(path)
    measure = Counting()
    assert cached_model(named, KEY, measure) == MEASURED
    assert cached_model(named, KEY, measure) == MEASURED
    assert measure.calls == 1
    assert set(json.loads(path.read_text(encoding="utf-8"))) == {KEY}


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Counting:
    """``calibrate()`` on a pretended GPU: its measurement is :data:`MEASURED`."""
    measure = Counting()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Pretend GPU")
    monkeypatch.setattr(time_model, "_measure", lambda device: measure())
    return measure


def test_calibrate_takes_the_cache_as_a_string(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_gpu: Counting
) -> None:
    monkeypatch.chdir(tmp_path)
    assert matepoint.calibrate(cache="x.json") == MEASURED
    assert matepoint.calibrate(cache="x.json") == MEASURED
    assert fake_gpu.calls == 1
    [key] = json.loads((tmp_path / "x.json").read_text(encoding="utf-8"))
    assert key.startswith("Pretend GPU | torch ")


def test_a_cache_that_cannot_be_written_warns_and_keeps_the_measurement(
    tmp_path: Path, fake_gpu: Counting
) -> None:
    blocker = tmp_path / "a file"
    blocker.write_text("not a folder", encoding="utf-8")
    with pytest.warns(RuntimeWarning, match="could not write the calibration cache"):
        assert matepoint.calibrate(cache=blocker / "models.json") == MEASURED
    assert fake_gpu.calls == 1


def test_a_cache_file_that_cannot_be_replaced_warns_and_keeps_the_measurement(
    tmp_path: Path,
) -> None:
    path = tmp_path / "models.json"
    path.mkdir()  # a folder where the file should be: readable as nothing, never replaced
    with pytest.warns(RuntimeWarning, match="could not write the calibration cache"):
        assert cached_model(path, KEY, Counting()) == MEASURED
    leftovers = {entry.name for entry in tmp_path.iterdir()} - {"models.json", "models.json.lock"}
    assert not leftovers  # no temporary file left behind


# --- the cache: writers at once -----------------------------------------------------------------


def test_four_threads_calibrating_four_devices_leave_four_entries(tmp_path: Path) -> None:
    """Each thread has read the file (finding nothing) before any writes its measurement."""
    path = tmp_path / "models.json"
    path.write_text(json.dumps({"older device": WHOLE_ENTRY}), encoding="utf-8")
    keys = [f"GPU {index} | torch 2.11" for index in range(4)]
    everyone_read = threading.Barrier(len(keys), timeout=30)
    results: dict[str, DeviceModel] = {}

    def calibrate_one(key: str, index: int) -> None:
        def measure() -> DeviceModel:
            everyone_read.wait()
            return DeviceModel(peak_flops=1e14 * (index + 1))

        results[key] = cached_model(path, key, measure)

    threads = [
        threading.Thread(target=calibrate_one, args=(key, index)) for index, key in enumerate(keys)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert set(stored) == {"older device", *keys}
    for index, key in enumerate(keys):
        assert stored[key]["peak_flops"] == results[key].peak_flops == 1e14 * (index + 1)
    leftovers = {entry.name for entry in tmp_path.iterdir()} - {"models.json", "models.json.lock"}
    assert not leftovers  # no temporary file left behind


_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from matepoint._planner.time_model import DeviceModel, cached_model

    path, index, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])

    def measure():
        # Every writer has read the cache (and found nothing) before any writes.
        (path.parent / f"read {index}").touch()
        deadline = time.monotonic() + 60
        while len(list(path.parent.glob("read *"))) < count and time.monotonic() < deadline:
            time.sleep(0.01)
        return DeviceModel(peak_flops=1e14 * (index + 1))

    cached_model(path, f"GPU {index} | torch 2.11", measure)
    """
)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="processes are kept apart by flock on POSIX")
def test_four_processes_calibrating_four_devices_leave_four_entries(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "models.json"
    path.parent.mkdir()
    count = 4
    writers = [
        subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(index), str(count)])
        for index in range(count)
    ]
    assert [writer.wait(timeout=120) for writer in writers] == [0] * count
    stored = json.loads(path.read_text(encoding="utf-8"))
    assert set(stored) == {f"GPU {index} | torch 2.11" for index in range(count)}


# --- Note [Host and device overlap] -------------------------------------------------------------


@pytest.mark.parametrize(
    ("host_ops", "policy_ops", "expected"),
    [
        (0, 0, 30.0),  # the device's time alone
        (20, 0, 30.0),  # host 20 s hidden under the device's 30
        (20, 10, 35.0),  # the policy's 10 x 0.5 s on top, never hidden (rule 4)
        (40, 30, 55.0),  # host-bound, and the policy's 15 s on top
        (40, 0, 40.0),  # host-bound without any policy
    ],
)
def test_host_time_costs_the_step_only_beyond_the_devices(
    host_ops: int, policy_ops: int, expected: float
) -> None:
    planned = types.SimpleNamespace(
        forward_flops=10, backward_flops=20, bytes_to_host=0, bytes_to_device=0
    )
    device = DeviceModel(
        peak_flops=1.0,
        to_host_bandwidth=1.0,
        to_device_bandwidth=1.0,
        policy_seconds_per_op=0.5,
        host_seconds_per_op=1.0,
    )
    seconds = time_model.step_seconds(planned, device, 2, policy_ops, host_ops)
    assert seconds == expected


def test_the_base_host_cost_may_be_zero_but_not_negative() -> None:
    assert DeviceModel(host_seconds_per_op=0).host_seconds_per_op == 0
    with pytest.raises(ValueError, match="host_seconds_per_op"):
        DeviceModel(host_seconds_per_op=-1e-6)


def test_calibration_measures_an_ops_host_cost_and_the_policys_on_top(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The small ops run on the CPU here: the host cost of each, and the policy's above it."""
    ones = torch.ones
    monkeypatch.setattr(torch, "ones", lambda *size, device=None: ones(*size))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    host, policy = time_model._host_seconds_per_op()
    assert 0 < host < 1e-2
    assert policy >= 0
    assert DeviceModel(host_seconds_per_op=host, policy_seconds_per_op=policy)
