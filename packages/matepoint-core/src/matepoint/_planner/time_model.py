"""The planner's time model: the device's rates, the step-time estimate, and calibration.

Every time the planner reports or a budget search compares comes from here: compute is FLOPs at
``DeviceModel.peak_flops``, link time is bytes at its bandwidths, and the host's time is ops
times ``host_seconds_per_op``, plus ``policy_seconds_per_op`` for each op a selective-checkpoint
policy sees; the host's time overlaps the device's (Note [Host and device overlap]). The
defaults are an H200's; a calibration (:func:`calibrate`) measures the device itself, cached on
disk.

The default :class:`~matepoint.DeviceModel` holds an H200's published peak and the link
bandwidth measured on one H200 host. Real matrix rates are lower than the peak, hosts differ in
their link, and the host time of an op, and what a selective-checkpoint policy adds to it,
depend on the CPU. A calibration measures the five on the device itself in a second or two, and
caches them per device name and torch release, so the next plan on that machine reads them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat

if sys.platform != "win32":
    import fcntl

__all__ = [
    "DEFAULT_HOST_SECONDS_PER_OP",
    "DEFAULT_LINK_BANDWIDTH",
    "DEFAULT_PEAK_FLOPS",
    "DEFAULT_POLICY_SECONDS_PER_OP",
    "DeviceModel",
    "StepFigures",
    "cached_model",
    "calibrate",
    "compute_seconds",
    "link_seconds",
    "step_seconds",
]

# Bytes per second each way: pinned copies measured on an H200 host (PCIe 5).
DEFAULT_LINK_BANDWIDTH = 55e9
# FLOP/s: dense bf16 peak of an H100 / H200.
DEFAULT_PEAK_FLOPS = 989e12
# Host seconds a selective-checkpoint policy adds to one op (torch dispatches every op of a
# region through a Python mode); docs/benchmarks.md has the measurements behind it.
DEFAULT_POLICY_SECONDS_PER_OP = 10e-6
# Host seconds an eager op costs with no policy (Python, dispatch, the kernel's launch): what the
# device's work must outlast for a step to be bound by the device, not the host. calibrate()
# measures it; without a calibration, 0 leaves the host's time to the policy's cost alone.
DEFAULT_HOST_SECONDS_PER_OP = 0.0


@dataclasses.dataclass(frozen=True)
class DeviceModel:
    """The device a plan's times are estimated for: peak rates, no measurement needed.

    Attributes:
        peak_flops: Dense matrix FLOP/s (bf16 on an H100/H200 by default).
        to_host_bandwidth: Device-to-host link bytes per second.
        to_device_bandwidth: Host-to-device link bytes per second.
        policy_seconds_per_op: Host time a selective-checkpoint policy adds to one op (torch
            dispatches every op of a region through a Python mode, in forward and again in the
            recomputation). On an H200 host with torch 2.11, torch's own selective peers were
            slower than plain checkpointing on a 16-block stack of width 2048 for this reason.
        host_seconds_per_op: Host time every op of the step costs without a policy (Python,
            dispatch, the kernel's launch), as :func:`calibrate` measures it on a small op.
            Default 0: without a calibration, the host's time is the policy's alone.
    """

    peak_flops: float = DEFAULT_PEAK_FLOPS
    to_host_bandwidth: float = DEFAULT_LINK_BANDWIDTH
    to_device_bandwidth: float = DEFAULT_LINK_BANDWIDTH
    policy_seconds_per_op: float = DEFAULT_POLICY_SECONDS_PER_OP
    host_seconds_per_op: float = DEFAULT_HOST_SECONDS_PER_OP

    def __post_init__(self) -> None:
        """Refuse a rate the search cannot divide by or compare: each is checked by name.

        Raises:
            TypeError: For a field that is not a real number (a bool, a string, None).
            ValueError: For a rate that is zero, negative, NaN or infinite, or a host cost per
                op that is negative, NaN or infinite (it may be zero).
        """
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            may_be_zero = field.name.endswith("_seconds_per_op")
            wanted = "0 or more" if may_be_zero else "above 0"
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"DeviceModel.{field.name} must be a number ({wanted}), got {value!r} "
                    f"({type(value).__name__})"
                )
            if not math.isfinite(value) or value < 0 or (value == 0 and not may_be_zero):
                raise ValueError(
                    f"DeviceModel.{field.name} must be a finite number {wanted}, got {value!r}"
                )


class StepFigures(Protocol):
    """What the step-time estimate reads of a planned step (a ``StrategyPlan``)."""

    @property
    def forward_flops(self) -> int: ...
    @property
    def backward_flops(self) -> int: ...
    @property
    def bytes_to_host(self) -> int: ...
    @property
    def bytes_to_device(self) -> int: ...


def compute_seconds(flops: int, peak_flops: float) -> float:
    """Estimate compute time: ``flops`` at ``peak_flops`` FLOP/s."""
    return flops / peak_flops


def link_seconds(nbytes: int, bandwidth: float) -> float:
    """Estimate a transfer's time: ``nbytes`` at ``bandwidth`` bytes per second."""
    return nbytes / bandwidth


# Note [Host and device overlap]
#     Rule 1. The device's time is its compute (the step's FLOPs at ``peak_flops``, the
#         recomputation included) and the link's time beyond the compute it overlaps: copies to
#         the host overlap forward, copies back overlap backward where records are fetched
#         ahead (``prefetch`` above 0), and are waited for in full where they are not.
#     Rule 2. The host's time is every op's own cost (``host_seconds_per_op``).
#     Rule 3. The host queues work ahead of the device: the step takes the longer of the two,
#         so host time costs the step only where it is longer than the device's.
#     Rule 4. A selective-checkpoint policy's cost (``policy_seconds_per_op`` for each op it
#         sees) is not hidden: torch's modes run it in Python for every op they see of the
#         forward and of the recomputation (those inside a plan's windows, Note [The budget
#         search], rule 2, in ``matepoint._planner.search``), where the device's work per op is
#         short, so the device waits for it there however long the whole step's device time
#         is. Charged hidden, plans with a policy measured slower than planned
#         (docs/benchmarks.md, the one call on an H100), and keeping everything tied with no
#         checkpoint at all.
#     Example: a device time of 30 ms and 3000 ops at 4 us each: the host needs 12 ms, hidden,
#     and the step takes 30 ms; with 1000 of them through a policy at 10 us each, 40 ms.


def step_seconds(
    strategy_plan: StepFigures,
    device: DeviceModel,
    prefetch: int,
    policy_ops: int = 0,
    host_ops: int = 0,
) -> float:
    """Estimate a planned step's time: the longer of the device's and the host's, and the
    policy's cost on top.

    See Note [Host and device overlap]. ``host_ops`` ops run in the step, each costing
    ``device.host_seconds_per_op`` on the host; ``policy_ops`` of them pass through a
    selective-checkpoint policy (torch runs it in Python for every op its modes see, in forward
    and again in the recomputation), each costing ``device.policy_seconds_per_op`` more.
    """
    forward = compute_seconds(strategy_plan.forward_flops, device.peak_flops)
    backward = compute_seconds(strategy_plan.backward_flops, device.peak_flops)
    to_host = link_seconds(strategy_plan.bytes_to_host, device.to_host_bandwidth)
    to_device = link_seconds(strategy_plan.bytes_to_device, device.to_device_bandwidth)
    hidden_back = 0.0 if prefetch == 0 else backward  # rule 1
    exposed = max(0.0, to_host - forward) + max(0.0, to_device - hidden_back)
    host = host_ops * device.host_seconds_per_op
    policy = policy_ops * device.policy_seconds_per_op  # rule 4
    return max(forward + backward + exposed, host) + policy  # rules 2 to 4


def _seconds(device: torch.device, work: Callable[[], object]) -> float:
    """The median of five timings of ``work`` on ``device``'s current stream (device events)."""
    work()
    times: list[float] = []
    for _ in range(5):
        start, end = (compat.new_event(device, enable_timing=True) for _ in range(2))
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _host_seconds_per_op() -> tuple[float, float]:
    """Host time of one small op, and what torch's selective-checkpoint mode adds to it (forward
    mode): ``host_seconds_per_op`` and ``policy_seconds_per_op``."""
    x = torch.ones(8, device="cuda")
    ops = 200

    def run(mode: contextlib.AbstractContextManager[Any]) -> float:
        with mode:
            start = time.perf_counter()
            for _ in range(ops):
                x.add(1)
            return time.perf_counter() - start

    # The fastest of a few runs each (a fresh forward mode for each); the first plain run also
    # warms up.
    plain = min(run(contextlib.nullcontext()) for _ in range(6))
    if not compat.TORCH_2_5_PLUS:  # no selective checkpointing, no policy to charge
        torch.cuda.synchronize()
        return plain / ops, 0.0
    create_contexts: Any = torch_checkpoint.create_selective_checkpoint_contexts
    recompute = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    with_policy = min(run(create_contexts(lambda *_, **__: recompute)[0]) for _ in range(5))
    torch.cuda.synchronize()
    return plain / ops, max(0.0, (with_policy - plain) / ops)


def _measure(device: torch.device) -> DeviceModel:
    """Measure matrix rate, the link each way, and the host's cost per op with and without a
    policy."""
    with torch.cuda.device(device):
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        matmul = _seconds(device, lambda: a @ a)
        source = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        pinned = compat.allocate_pinned(source.numel())
        to_host = _seconds(device, lambda: pinned.copy_(source, non_blocking=True))
        to_device = _seconds(device, lambda: source.copy_(pinned, non_blocking=True))
        host, policy = _host_seconds_per_op()
        return DeviceModel(
            peak_flops=2 * a.shape[0] ** 3 / matmul,
            to_host_bandwidth=source.numel() / to_host,
            to_device_bandwidth=source.numel() / to_device,
            policy_seconds_per_op=policy,
            host_seconds_per_op=host,
        )


def calibrate(
    device: torch.device | str = "cuda",
    *,
    cache: str | os.PathLike[str] | None = None,
    refresh: bool = False,
) -> DeviceModel:
    """Return a :class:`~matepoint.DeviceModel` measured on ``device``, from the cache if there.

    Takes a second or two on a GPU (a bf16 matrix product, a 256 MiB copy each way over the
    link, a few hundred small ops with and without a selective-checkpoint mode). Pass the
    result to :meth:`matepoint.MemoryPlan.fastest_under` as ``device=``.

    Args:
        device: A CUDA device. Default: ``"cuda"`` (the current one).
        cache: The cache file (a path or a string), keyed by device name and torch release;
            see Note [The calibration cache]. Default:
            ``$XDG_CACHE_HOME/matepoint/device-models.json`` (``~/.cache`` without the variable).
        refresh: Measure again even if the cache has this device. Default: ``False``.

    Returns:
        The measured model (or the cached one). A cache that cannot be written costs a
        ``RuntimeWarning``, not the measurement.

    Raises:
        ValueError: If ``device`` is not a CUDA device, or no GPU is present.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"calibrate() measures a CUDA device and its link; got {device} "
            f"({'no GPU present' if not torch.cuda.is_available() else 'not CUDA'}); without "
            "one, plans use DeviceModel()'s H200 figures"
        )
    key = f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}"
    if cache is None:
        cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        cache = Path(cache_home) / "matepoint" / "device-models.json"
    return cached_model(cache, key, lambda: _measure(device), refresh=refresh)


# Note [The calibration cache]
#     One JSON file holds a DeviceModel per device name and torch release; several processes
#     (the ranks of a node) and threads may calibrate at once, each for its own device.
#     Rule 1. An entry is used only if it is a whole DeviceModel: every field and no other, each
#        accepted by DeviceModel's checks. Anything else (a missing field, a string, a zero or
#        NaN rate) is measured again and overwritten, never filled with the defaults.
#     Rule 2. A write never loses another entry: under a lock (a process-wide lock for threads,
#        and ``fcntl.flock`` on a lock file beside the cache between processes on POSIX; on
#        Windows only the threads of one process are kept apart), the file is read again, the
#        entry merged in and written to a temporary file that ``os.replace`` puts in place. A
#        reader, which takes no lock, sees the old file or the new one, never half of one.
#     Rule 3. A cache that cannot be written costs the next calibration a measurement, not this
#        one: a RuntimeWarning, and the measured model is returned.
#     Example: four ranks of a node, each calibrating its own GPU at once, leave four entries.

_CACHE_WRITES = threading.Lock()


def cached_model(
    path: str | os.PathLike[str],
    key: str,
    measure: Callable[[], DeviceModel],
    *,
    refresh: bool = False,
) -> DeviceModel:
    """Return the model stored under ``key`` in ``path``, or measure, store and return it.

    Other keys in the file are kept; see Note [The calibration cache].
    """
    path = Path(path)
    if not refresh and (stored := _stored_model(_read_cache(path).get(key))) is not None:
        return stored
    model = measure()
    try:
        _store(path, key, model)
    except OSError as error:  # See Rule 3 of Note [The calibration cache].
        warnings.warn(
            f"matepoint: could not write the calibration cache {path} ({error}); the "
            "measurement is used but not kept, so the next calibration measures again",
            RuntimeWarning,
            stacklevel=3,
        )
    return model


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; a file that is missing, unreadable or not a JSON object has none."""
    try:
        stored: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def _stored_model(entry: Any) -> DeviceModel | None:
    """``entry`` as a model, or None where it is not a whole, valid one (Rule 1 of Note [The
    calibration cache])."""
    names = {field.name for field in dataclasses.fields(DeviceModel)}
    if not isinstance(entry, dict) or set(entry) != names:
        return None
    try:
        return DeviceModel(**entry)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the cache's lock: Rule 2 of Note [The calibration cache]."""
    with _CACHE_WRITES:
        if sys.platform == "win32":  # no flock: the threads of this process are kept apart
            yield
            return
        with open(path.with_name(path.name + ".lock"), "ab") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)  # released when the file closes
            yield


def _store(path: Path, key: str, model: DeviceModel) -> None:
    """Merge ``model`` under ``key`` into the cache: Rule 2 of Note [The calibration cache]."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        stored = _read_cache(path)
        stored[key] = dataclasses.asdict(model)
        handle, temporary = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"
        )
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(json.dumps(stored, indent=2) + "\n")
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
