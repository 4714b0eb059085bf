"""Tests for matepoint_examples.bench._paired: ratios, quartiles, rotation and a tiny CPU run."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from matepoint_examples import strategies
from matepoint_examples._workloads import get_workload
from matepoint_examples.bench import _paired
from matepoint_examples.bench._paired import (
    StrategySwitch,
    per_round_ratios,
    quartiles,
    round_order,
    run_paired,
)
from matepoint_examples.bench._worker import write_partial
from matepoint_examples.strategies import get_strategy

CPU = torch.device("cpu")
TINY = get_workload("nanochat12").with_overrides(
    depth=2, width=64, batch=2, tokens=16, vocab_size=64, head_dim=32
)
TINY = dataclasses.replace(TINY, dtype="fp32")


def test_quartiles_interpolate_inside_the_data() -> None:
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == (2.0, 3.0, 4.0)
    assert quartiles([1.0, 2.0, 3.0, 4.0]) == (1.75, 2.5, 3.25)
    assert quartiles([1.5]) == (1.5, 1.5, 1.5)
    with pytest.raises(ValueError, match="at least one"):
        quartiles([])


def test_per_round_ratios_pair_rounds_and_skip_missing_steps() -> None:
    times: dict[str, list[float | None]] = {
        "torch": [1.0, 2.0, None, 4.0],
        "matepoint": [1.1, 2.0, 3.0, None],
    }
    ratios = per_round_ratios(times, "torch")
    assert ratios["torch"] == [1.0, 1.0, 1.0]
    assert ratios["matepoint"] == pytest.approx([1.1, 1.0])
    # A slow round for both strategies does not move the ratio: that is the point of pairing.
    drifting = {"torch": [1.0, 3.0, 1.0], "other": [1.05, 3.15, 1.05]}
    assert per_round_ratios(drifting)["other"] == pytest.approx([1.05] * 3)
    assert per_round_ratios({"other": [1.0]}, "torch") == {"other": []}


def test_round_order_rotates_every_strategy_through_every_position() -> None:
    names = ["torch", "matepoint", "copies-floor"]
    orders = [round_order(names, r) for r in range(3)]
    assert orders[0] == names
    assert orders[1] == ["matepoint", "copies-floor", "torch"]
    for position in range(3):
        assert sorted(order[position] for order in orders) == sorted(names)
    assert round_order(names, 3) == names
    assert round_order([], 5) == []


def test_switch_runs_the_current_strategy() -> None:
    calls: list[str] = []

    def tagged(tag: str) -> Callable[..., Tensor]:
        def fn(function: Callable[..., Tensor], /, *args: Tensor) -> Tensor:
            calls.append(tag)
            return function(*args)

        return fn

    a = dataclasses.replace(get_strategy("none"), name="a", checkpoint_fn=tagged("a"))
    b = dataclasses.replace(get_strategy("none"), name="b", checkpoint_fn=tagged("b"))
    switch = StrategySwitch(a)
    x = torch.ones(2)
    switch(torch.neg, x)
    switch.current = b
    assert torch.equal(switch(torch.neg, x), -x)
    assert calls == ["a", "b"]


def test_run_paired_on_cpu() -> None:
    names = ["torch", "copies-floor", "matepoint", "link-busy", "none"]
    rows = {r["strategy"]: r for r in run_paired(TINY, names, CPU, rounds=3, warmup=1)}
    assert list(rows) == names
    assert rows["link-busy"]["status"] == "skipped"
    for name in ("torch", "copies-floor", "matepoint", "none"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert len(row["times"]) == 3
        assert row["ratios"]["step_s"]["rounds"] == 3
        assert row["ratio_q1"] <= row["ratio"] <= row["ratio_q3"]
        assert row["step_time_s"] > 0
        assert row["medians_s"]["forward_host_s"] > 0
        assert "forward_gpu_s" not in row["medians_s"]  # no device timer on a CPU
    assert rows["torch"]["ratio"] == 1.0
    assert rows["copies-floor"]["stats"]["copies_out"] == TINY.depth
    assert rows["matepoint"]["stats"]["bytes_offloaded"] > 0
    assert "stats" not in rows["torch"]
    assert rows["matepoint"]["held_after_forward_bytes"] is None  # no allocator count on a CPU


def test_run_paired_saves_its_rows_so_far_after_every_round(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker killed by its timeout leaves the rows of the rounds it finished, summarized."""
    saved: list[dict[str, Any]] = []

    def keep(path: Path, payload: dict[str, Any]) -> None:
        write_partial(path, payload)
        saved.append(json.loads(path.read_text()))

    monkeypatch.setattr(_paired, "write_partial", keep)
    path = tmp_path / "partial.json"
    names = ["torch", "torch-compile", "matepoint", "link-busy"]
    final = run_paired(TINY, names, CPU, rounds=2, warmup=1, partial=path, compile_backend="eager")
    progress = [(s["progress"]["rounds_done"], s["progress"]["counted_step"]) for s in saved]
    assert progress == [(0, False), (1, False), (2, False), (3, False), (3, True)]
    compiled, warm, first, last_round, counted = (
        {r["strategy"]: r for r in s["rows"]} for s in saved
    )
    assert compiled["torch-compile"]["compile_step_s"] > 0
    assert compiled["torch-compile"]["compile"]["backend"] == "eager"
    assert warm["torch"]["times"] == []  # the warm-up round is not timed
    assert warm["torch"]["ratio"] is None
    assert len(first["matepoint"]["times"]) == 1
    assert first["matepoint"]["ratios"]["step_s"]["rounds"] == 1  # summarized so far
    assert first["torch"]["ratio"] == 1.0
    assert first["torch-compile"]["ratio_to_torch_compile"]["median"] == 1.0
    assert first["link-busy"]["status"] == "skipped"
    assert last_round["matepoint"]["ratios"]["step_s"]["rounds"] == 2
    assert "stats" not in last_round["matepoint"]  # the counted step had not run
    assert "held_after_forward_bytes" not in last_round["matepoint"]
    assert counted["matepoint"]["stats"]["bytes_offloaded"] > 0
    assert counted["matepoint"]["ratio"] == {r["strategy"]: r for r in final}["matepoint"]["ratio"]
    assert json.loads(path.read_text()) == saved[-1]
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.gpu
def test_run_paired_on_cuda_measures_what_each_strategy_holds_after_forward() -> None:
    workload = get_workload("deep48").with_overrides(depth=8, batch=1)
    names = ["torch", "matepoint"]
    rows = {r["strategy"]: r for r in run_paired(workload, names, torch.device("cuda"), 1, 1)}
    assert all(row["status"] == "ok" for row in rows.values()), rows
    held = {name: rows[name]["held_after_forward_bytes"] for name in names}
    assert 0 < held["matepoint"] < held["torch"], held


def test_run_paired_drops_a_failing_strategy_and_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(function: Callable[..., Tensor], /, *args: Tensor) -> Any:
        raise RuntimeError("boom")

    registry = dict(strategies.STRATEGIES)
    registry["broken"] = dataclasses.replace(
        get_strategy("torch"), name="broken", checkpoint_fn=broken
    )
    monkeypatch.setattr(strategies, "STRATEGIES", registry)
    rows = {r["strategy"]: r for r in run_paired(TINY, ["torch", "broken"], CPU, 2, 0)}
    assert rows["broken"]["status"] == "error"
    assert "boom" in rows["broken"]["note"]
    assert rows["broken"]["ratio"] is None
    assert rows["torch"]["status"] == "ok"
    assert len([t for t in rows["torch"]["times"] if t is not None]) == 2


def test_run_paired_trace_on_cpu() -> None:
    rows = run_paired(TINY, ["torch"], CPU, rounds=1, warmup=0, trace=True)
    trace = rows[0]["trace"]
    assert trace["compute_stream"] is None  # no device activity on a CPU
    assert set(trace) == {"compute_stream", "forward", "backward"}
