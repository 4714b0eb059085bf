"""One benchmark step under ``torch.profiler``, reduced to per-phase device and runtime figures.

``matepoint-bench --trace`` profiles one step per strategy after the paired rounds; this module
runs that step and turns its Chrome trace into the forward and backward figures the report shows
(compute-stream busy and idle time, copies by kind, CUDA runtime calls).
"""

from __future__ import annotations

import json
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from matepoint_examples._runtime import synchronize
from matepoint_examples._workloads import Built
from matepoint_examples.strategies import Strategy

__all__ = ["FORWARD_MARK", "summarize_trace", "trace_step"]

FORWARD_MARK = "matepoint-bench forward"
"""The profiler range around a traced step's forward (see :func:`summarize_trace`)."""


def trace_step(built: Built, strategy: Strategy, device: torch.device) -> dict[str, Any]:
    """Run one step under ``torch.profiler`` and summarize its forward and backward.

    A synchronize ends the forward inside its profiler range, so the range's end splits the
    device activity cleanly into the two phases (the step is otherwise a normal one).

    Args:
        built: The workload's model and loss.
        strategy: The strategy to run (already current in the model's switch).
        device: Where it runs.

    Returns:
        :func:`summarize_trace` of the step.
    """
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    built.model.zero_grad(set_to_none=True)
    synchronize(device)
    with warnings.catch_warnings():
        # torch 2.11 warns on every profiler start that a new cycle drops the last one's
        # events; this profiles one step in one cycle.
        warnings.filterwarnings("ignore", "Warning: Profiler clears events", UserWarning)
        with profile(activities=activities) as prof:
            with record_function(FORWARD_MARK):
                with strategy.forward_context():
                    loss = built.loss()
                synchronize(device)
            torch.autograd.backward(loss)
            synchronize(device)
    del loss
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        data = json.loads(path.read_text())
    return summarize_trace(data)


def _phase_name(ts: float, boundary: float | None) -> str:
    return "forward" if boundary is not None and ts < boundary else "backward"


def _overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Total length of ``spans`` during which some interval of ``busy`` runs."""
    merged: list[list[float]] = []
    for start, end in sorted(busy):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return sum(
        max(0.0, min(end, busy_end) - max(start, busy_start))
        for start, end in spans
        for busy_start, busy_end in merged
    )


def summarize_trace(data: Mapping[str, Any]) -> dict[str, Any]:
    """Reduce a Chrome trace of one step to per-phase device and runtime figures.

    The compute stream is the stream with the most kernel time. Per phase (forward until the
    end of the ``matepoint-bench forward`` range, backward after it): the compute stream's
    busy time (sum of its kernels) and span (first kernel start to last kernel end), copies by
    kind (count, device milliseconds, bytes), and CUDA runtime calls by name (count, host
    milliseconds): event records and waits, copies, synchronizations. Whether copies overlap
    compute: ``copies_on_compute_stream_ms`` (copy time on the compute stream itself, which
    cannot overlap it) and ``copies_under_compute_ms`` (copy time on other streams during which
    a compute-stream kernel ran). And whether compute left the compute stream:
    ``kernels_off_compute_stream`` (count) and ``kernels_off_compute_stream_ms`` (device time)
    of kernels on other streams; a compiled graph whose generated code runs compute between a
    copy's fork to the transfer stream and its join back runs that compute on the transfer
    stream, in line with the copy.

    Args:
        data: The parsed trace (``export_chrome_trace``'s JSON).

    Returns:
        ``{"compute_stream": ..., "forward": {...}, "backward": {...}}``; device figures are
        absent when the trace holds no device activity (a CPU run).
    """
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    boundary: float | None = None
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("name") == FORWARD_MARK:
            boundary = float(e["ts"]) + float(e["dur"])
    kernel_time: dict[Any, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            stream = e.get("args", {}).get("stream", e.get("tid"))
            kernel_time[stream] = kernel_time.get(stream, 0.0) + float(e["dur"])
    compute = max(kernel_time, key=lambda k: kernel_time[k]) if kernel_time else None
    phases: dict[str, dict[str, Any]] = {}
    kernel_spans: dict[str, list[tuple[float, float]]] = {"forward": [], "backward": []}
    copy_spans: dict[str, list[tuple[float, float]]] = {"forward": [], "backward": []}
    for name in ("forward", "backward"):
        phases[name] = {"copies": {}, "runtime": {}}
        if compute is not None:
            phases[name].update(
                compute_busy_ms=0.0,
                kernels=0,
                first=None,
                last=None,
                copies_on_compute_stream_ms=0.0,
                kernels_off_compute_stream=0,
                kernels_off_compute_stream_ms=0.0,
            )
    for e in events:
        cat = e.get("cat")
        ts, dur = float(e["ts"]), float(e["dur"])
        phase_name = _phase_name(ts, boundary)
        phase = phases[phase_name]
        stream = e.get("args", {}).get("stream", e.get("tid"))
        if cat == "kernel" and stream == compute:
            kernel_spans[phase_name].append((ts, ts + dur))
            phase["compute_busy_ms"] += dur / 1e3
            phase["kernels"] += 1
            phase["first"] = ts if phase["first"] is None else min(phase["first"], ts)
            phase["last"] = ts + dur if phase["last"] is None else max(phase["last"], ts + dur)
        elif cat == "kernel" and compute is not None:
            phase["kernels_off_compute_stream"] += 1
            phase["kernels_off_compute_stream_ms"] += dur / 1e3
        elif cat == "gpu_memcpy":
            entry = phase["copies"].setdefault(e.get("name", "?"), [0, 0.0, 0])
            entry[0] += 1
            entry[1] += dur / 1e3
            entry[2] += int(e.get("args", {}).get("bytes", 0) or 0)
            if compute is not None and stream == compute:
                phase["copies_on_compute_stream_ms"] += dur / 1e3
            elif compute is not None:
                copy_spans[phase_name].append((ts, ts + dur))
        elif cat in ("cuda_runtime", "cuda_driver"):
            entry = phase["runtime"].setdefault(e.get("name", "?"), [0, 0.0])
            entry[0] += 1
            entry[1] += dur / 1e3
    for name, phase in phases.items():
        if compute is not None:
            phase["copies_under_compute_ms"] = _overlap(copy_spans[name], kernel_spans[name]) / 1e3
        first, last = phase.pop("first", None), phase.pop("last", None)
        if first is not None and last is not None:
            phase["compute_span_ms"] = (last - first) / 1e3
            phase["compute_idle_ms"] = phase["compute_span_ms"] - phase["compute_busy_ms"]
    return {"compute_stream": compute, **phases}
