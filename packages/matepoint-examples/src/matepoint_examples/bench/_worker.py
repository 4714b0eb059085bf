"""What one benchmark subprocess measures: one (workload, strategy) pair, or the link itself.

Each measurement runs in its own process so that one strategy's allocator state, pinned pool and
resident memory never leak into the next one's numbers, and an out-of-memory failure costs one
row, not the run. The paired worker (:mod:`matepoint_examples.bench._paired`) shares two
helpers from here: the held-after-forward measurement and the partial-result file a killed
worker leaves behind.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import matepoint
from matepoint_examples._runtime import (
    allocated_bytes,
    parameter_bytes,
    peak_bytes,
    reset_peak,
    rss_bytes,
    synchronize,
)
from matepoint_examples._workloads import Built, Workload, build
from matepoint_examples.bench._compiled import CompiledForward
from matepoint_examples.bench._errors import error_note, portable
from matepoint_examples.strategies import Strategy, get_strategy

__all__ = [
    "environment",
    "held_forward",
    "run_train",
    "run_transfer",
    "write_partial",
]

_GB = 1e9


def environment(device: torch.device) -> dict[str, Any]:
    """Describe where a measurement ran (for the JSON report).

    Args:
        device: The device measured.

    Returns:
        Torch version, device name, Python version.
    """
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "device_name": name or "cpu",
        "matepoint": getattr(matepoint, "__version__", "unknown"),
    }


def write_partial(path: Path, payload: dict[str, Any]) -> None:
    """Replace ``path`` with ``payload`` as JSON in one step: a kill never leaves half a file.

    A worker keeps its result so far here (the paired worker after every round) so that the
    parent, which kills it at its timeout, still gets what was measured. The JSON goes to a
    temporary file next to ``path`` first, and ``os.replace`` puts it in place atomically. A
    file that cannot be written is reported on stderr, not raised: the run matters more.

    Args:
        path: The file the parent reads.
        payload: JSON-ready data (anything else is written as its ``str``).
    """
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(payload, default=str))
        os.replace(tmp, path)
    except OSError as exc:
        print(f"partial result not saved: {exc}", file=sys.stderr, flush=True)


def _stats_dict() -> dict[str, Any]:
    """Return ``matepoint.stats()`` as a plain dict (JSON-ready)."""
    return dataclasses.asdict(matepoint.stats())


def _one_step(built: Built, strategy: Strategy) -> None:
    """Run one forward and backward, gradients reset first."""
    built.model.zero_grad(set_to_none=True)
    with strategy.forward_context():
        loss = built.loss()
    torch.autograd.backward(loss)


def _timeline(built: Built, strategy: Strategy, device: torch.device) -> list[list[Any]]:
    """Sample device memory at every block boundary of one step.

    A forward pre-hook samples as each block starts (again when backward recomputes it), and a
    hook on each block's output samples when its gradient arrives, so the curve shows both the
    climb through forward and the descent through backward.

    Returns:
        ``[milliseconds since the step started, bytes allocated, label]`` per sample.
    """
    samples: list[list[Any]] = []
    phase = {"name": "fwd"}
    start = time.perf_counter()

    def sample(label: str) -> None:
        samples.append([(time.perf_counter() - start) * 1e3, allocated_bytes(device), label])

    handles = []
    for i, block in enumerate(built.blocks):

        def pre(_m: Any, _a: Any, i: int = i) -> None:
            sample(f"{'recompute' if phase['name'] == 'bwd' else 'fwd'} {i}")

        def post(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            if phase["name"] == "fwd" and isinstance(out, Tensor) and out.requires_grad:

                def on_grad(_g: Tensor, i: int = i) -> None:
                    sample(f"bwd {i}")

                out.register_hook(on_grad)  # type: ignore[no-untyped-call]

        handles.append(block.register_forward_pre_hook(pre))
        handles.append(block.register_forward_hook(post))
    try:
        built.model.zero_grad(set_to_none=True)
        sample("start")
        with strategy.forward_context():
            loss = built.loss()
        sample("forward done")
        phase["name"] = "bwd"
        torch.autograd.backward(loss)
        sample("backward done")
        synchronize(device)
    finally:
        for h in handles:
            h.remove()
    return samples


def run_train(
    workload: Workload,
    strategy_name: str,
    device: torch.device,
    steps: int,
    warmup: int,
    timeline: bool = True,
    compile_backend: str | None = None,
) -> dict[str, Any]:
    """Measure one strategy on one workload: step time, memory held, host RAM, offload stats.

    The step is forward plus backward (no optimizer, so every strategy does the same extra
    work). Device bytes held after forward are ``memory_allocated`` after forward and a
    synchronize minus the same before forward, where parameters and the batch are already
    counted, so the number is what the forward pass left behind for backward. A compiled
    strategy compiles in its first warm-up step (one is run even with ``warmup=0``).

    Args:
        workload: The model shape.
        strategy_name: A registered strategy.
        device: Where to run.
        steps: Timed steps (the median is reported).
        warmup: Untimed steps before them (these also fill pinned pools).
        timeline: Whether to record one step's memory timeline (CUDA only, not for a compiled
            strategy: a compiled forward has no block boundaries to sample at). Default: ``True``.
        compile_backend: ``torch.compile`` backend of a compiled strategy. Default: inductor on
            CUDA, aot_eager elsewhere.

    Returns:
        A JSON-ready dict; ``status`` is ``"ok"``, ``"skipped"``, ``"oom"`` or ``"error"``.
    """
    result: dict[str, Any] = {
        "mode": "train",
        **workload.row_fields(),
        "strategy": strategy_name,
        "block_input_bytes": workload.block_input_bytes(),
        "steps": steps,
        "warmup": warmup,
        **environment(device),
    }
    strategy = get_strategy(strategy_name)
    reason = strategy.unavailable_reason(device)
    if reason is not None:
        return {**result, "status": "skipped", "note": reason}
    try:
        with strategy.session(device):
            result.update(
                _measure(workload, strategy, device, steps, warmup, timeline, compile_backend)
            )
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="oom", note=str(exc).splitlines()[0][:300])
    except Exception as exc:
        result.update(status="error", note=error_note(exc))
        result["traceback"] = portable(traceback.format_exc())[-4000:]
    return result


def _measure(
    workload: Workload,
    strategy: Strategy,
    device: torch.device,
    steps: int,
    warmup: int,
    timeline: bool,
    compile_backend: str | None,
) -> dict[str, Any]:
    """Do the measurements of :func:`run_train` inside the strategy's session."""
    built = build(workload, strategy.checkpoint_fn, device)
    built = dataclasses.replace(
        built, loss=strategy.forward_fn(built.loss, device, compile_backend)
    )
    compiled = isinstance(built.loss, CompiledForward)
    out: dict[str, Any] = {"param_bytes": parameter_bytes(built.model)}
    synchronize(device)
    rss_base = rss_bytes()
    for index in range(max(warmup, int(compiled))):
        t0 = time.perf_counter()
        _one_step(built, strategy)
        synchronize(device)
        if compiled and index == 0:  # the compile step: how long compiling took
            out["compile_step_s"] = time.perf_counter() - t0
            if isinstance(built.loss, CompiledForward):
                built.loss.end_compile_step()

    reset_peak(device)
    base_alloc = allocated_bytes(device)
    times: list[float] = []
    for _ in range(max(1, steps)):
        synchronize(device)
        t0 = time.perf_counter()
        _one_step(built, strategy)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    peak = peak_bytes(device)
    out["step_times_s"] = times
    out["step_time_s"] = statistics.median(times)
    out["peak_bytes"] = peak
    out["peak_over_baseline_bytes"] = (
        None if peak is None or base_alloc is None else peak - base_alloc
    )

    # One more step, instrumented: memory held after forward, host RAM, matepoint's counters.
    built.model.zero_grad(set_to_none=True)
    gc.collect()
    synchronize(device)
    matepoint.reset_stats()
    t0 = time.perf_counter()
    loss, held, t_fwd = held_forward(built, strategy, device)
    rss_fwd = rss_bytes()
    torch.autograd.backward(loss)
    synchronize(device)
    t_step = time.perf_counter() - t0
    del loss
    out["forward_time_s"] = t_fwd
    out["held_after_forward_bytes"] = held
    out["host_rss_delta_bytes"] = (
        None if rss_fwd is None or rss_base is None else rss_fwd - rss_base
    )
    if strategy.uses_matepoint:
        stats = _stats_dict()
        out["matepoint_stats"] = stats
        moved = int(stats.get("bytes_offloaded", 0)) + int(stats.get("bytes_fetched", 0))
        out["bytes_offloaded"] = int(stats.get("bytes_offloaded", 0))
        out["pool_pinned_bytes"] = stats.get("pool_pinned_bytes")
        # On a CPU the "link" is a memcpy through the test transport and the host RAM is the
        # same memory the step runs in: neither figure means anything there, so none is given.
        on_device = device.type != "cpu"
        # stats() carries bytes but no copy durations, so this is link throughput averaged over
        # the step (both directions): a lower bound on what the copies achieved.
        out["link_gbps"] = moved / t_step / _GB if on_device and t_step > 0 else None
        out["host_per_offloaded"] = (
            out["host_rss_delta_bytes"] / out["bytes_offloaded"]
            if on_device and out["bytes_offloaded"] and out["host_rss_delta_bytes"] is not None
            else None
        )
    if timeline and device.type == "cuda" and not compiled:
        out["timeline"] = _timeline(built, strategy, device)
    if isinstance(built.loss, CompiledForward):  # the same test as ``compiled``, for the type
        out["compile"] = built.loss.report()
    return out


def held_forward(
    built: Built, strategy: Strategy, device: torch.device
) -> tuple[Tensor, int | None, float]:
    """Run one forward and return its loss, the device bytes it left held, and its seconds.

    Held is ``memory_allocated`` after the forward and a synchronize minus the same before it
    (``None`` on CPU): what the forward left behind for backward. The memory mode and the
    paired mode's counted step both measure it here, so their numbers mean the same.

    Args:
        built: The workload's model and loss.
        strategy: The strategy to run (its checkpoint function already in the model).
        device: Where it runs.

    Returns:
        ``(loss, held_bytes, forward_seconds)``; the seconds end after the synchronize.
    """
    synchronize(device)
    before = allocated_bytes(device)
    t0 = time.perf_counter()
    with strategy.forward_context():
        loss = built.loss()
    synchronize(device)
    seconds = time.perf_counter() - t0
    after = allocated_bytes(device)
    return loss, None if after is None or before is None else after - before, seconds


def _cheap_block(x: Tensor) -> Tensor:
    """A block with almost no compute, so a chain of them is bound by the link.

    It must save its input (``sin`` does, for its backward): a checkpoint whose function saves
    nothing is never recomputed, so its inputs would never be fetched back.
    """
    return x.sin()


def _raw_bandwidth(device: torch.device, nbytes: int, reps: int) -> tuple[float, float]:
    """Measure plain copies between ``device`` and pinned host memory, in GB/s each way."""
    numel = nbytes // 2
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    host = torch.empty(numel, dtype=torch.bfloat16, pin_memory=device.type == "cuda")
    best_d2h = best_h2d = float("inf")
    for _ in range(reps + 1):
        synchronize(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        synchronize(device)
        t1 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        synchronize(device)
        t2 = time.perf_counter()
        best_d2h, best_h2d = min(best_d2h, t1 - t0), min(best_h2d, t2 - t1)
    return nbytes / best_d2h / _GB, nbytes / best_h2d / _GB


def _matepoint_bandwidth(
    device: torch.device, nbytes: int, layers: int, reps: int
) -> tuple[float, float, dict[str, Any]]:
    """Run a chain of compute-free checkpoints and return matepoint's offload and fetch GB/s."""
    best_fwd = best_bwd = 0.0
    stats: dict[str, Any] = {}
    for _ in range(reps + 1):  # the first pass fills the pinned pool
        x0 = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16, requires_grad=True)
        synchronize(device)
        matepoint.reset_stats()
        t0 = time.perf_counter()
        x = x0
        for _ in range(layers):
            x = matepoint.checkpoint(_cheap_block, x, use_reentrant=False)
        synchronize(device)
        t1 = time.perf_counter()
        torch.autograd.backward(x.sum())
        synchronize(device)
        t2 = time.perf_counter()
        stats = _stats_dict()
        best_fwd = max(best_fwd, int(stats.get("bytes_offloaded", 0)) / (t1 - t0) / _GB)
        best_bwd = max(best_bwd, int(stats.get("bytes_fetched", 0)) / (t2 - t1) / _GB)
        del x, x0
    return best_fwd, best_bwd, stats


def run_transfer(device: torch.device, quick: bool = False) -> dict[str, Any]:
    """Compare raw pinned-copy bandwidth with what matepoint's offload and fetch achieve.

    The matepoint side is a chain of checkpoints around a function with almost no compute, so
    forward is bound by device-to-host copies and backward by host-to-device ones: the ratio to
    the raw numbers is the fraction of the link matepoint uses.

    Args:
        device: Where to measure (on a CPU the "link" is a memcpy through the test transport).
        quick: Smaller tensors and fewer repetitions. Default: ``False``.

    Returns:
        A JSON-ready dict with GB/s each way, raw and matepoint, and their ratios.
    """
    cuda = device.type == "cuda"
    nbytes = (256 << 20) if cuda and not quick else (64 << 20) if cuda else (8 << 20)
    layers = 24 if cuda and not quick else 8
    reps = 2 if quick else 3
    result: dict[str, Any] = {
        "mode": "transfer",
        "tensor_bytes": nbytes,
        "layers": layers,
        **environment(device),
    }
    try:
        strategy = get_strategy("matepoint")
        d2h, h2d = _raw_bandwidth(device, nbytes, reps)
        with strategy.session(device):
            off, fetch, stats = _matepoint_bandwidth(device, nbytes, layers, reps)
        result.update(
            status="ok",
            raw_d2h_gbps=d2h,
            raw_h2d_gbps=h2d,
            matepoint_offload_gbps=off,
            matepoint_fetch_gbps=fetch,
            offload_fraction=off / d2h if d2h else None,
            fetch_fraction=fetch / h2d if h2d else None,
            matepoint_stats=stats,
        )
        if not cuda:
            result["note"] = "CPU: memcpy through the test transport, not a PCIe/NVLink link"
    except torch.cuda.OutOfMemoryError as exc:
        result.update(status="oom", note=str(exc).splitlines()[0][:300])
    except Exception as exc:
        result.update(status="error", note=error_note(exc))
        result["traceback"] = portable(traceback.format_exc())[-4000:]
    return result
