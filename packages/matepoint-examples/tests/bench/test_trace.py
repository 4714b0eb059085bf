"""Tests for matepoint_examples.bench._trace: one profiled step reduced to per-phase figures."""

from __future__ import annotations

from typing import Any

import pytest

from matepoint_examples.bench._trace import FORWARD_MARK, summarize_trace


def _event(cat: str, name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": args}


def test_summarize_trace_splits_phases_and_finds_the_compute_stream() -> None:
    events = [
        _event("user_annotation", FORWARD_MARK, 0.0, 100.0),
        _event("kernel", "gemm", 10.0, 30.0, stream=7),
        _event("kernel", "gemm", 50.0, 20.0, stream=7),
        _event("kernel", "small", 60.0, 5.0, stream=20),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 45.0, 10.0, stream=20, bytes=1000),
        _event("cuda_runtime", "cudaEventRecord", 5.0, 2.0),
        _event("cuda_runtime", "cudaEventRecord", 6.0, 2.0),
        _event("kernel", "gemm_bwd", 120.0, 50.0, stream=7),
        _event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 110.0, 8.0, stream=20, bytes=1000),
        _event("cuda_runtime", "cudaStreamWaitEvent", 115.0, 1.0),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 1.0},
    ]
    summary = summarize_trace({"traceEvents": events})
    assert summary["compute_stream"] == 7
    forward, backward = summary["forward"], summary["backward"]
    assert forward["compute_busy_ms"] == pytest.approx(0.05)
    assert forward["compute_span_ms"] == pytest.approx(0.06)
    assert forward["compute_idle_ms"] == pytest.approx(0.01)
    assert forward["kernels"] == 2
    assert forward["copies"] == {"Memcpy DtoH (Device -> Pinned)": [1, 0.01, 1000]}
    assert forward["runtime"] == {"cudaEventRecord": [2, pytest.approx(0.004)]}
    assert backward["compute_busy_ms"] == pytest.approx(0.05)
    assert backward["copies"]["Memcpy HtoD (Pinned -> Device)"][0] == 1
    assert backward["runtime"]["cudaStreamWaitEvent"][0] == 1
    # The forward copy (45-55) runs on stream 20 while the gemm (50-70) runs: 5 us under compute.
    assert forward["copies_under_compute_ms"] == pytest.approx(0.005)
    assert forward["copies_on_compute_stream_ms"] == 0.0
    # The backward copy (110-118) ends before the backward gemm starts: nothing under compute.
    assert backward["copies_under_compute_ms"] == 0.0
    # The small kernel on stream 20 ran off the compute stream; backward had none there.
    assert forward["kernels_off_compute_stream"] == 1
    assert forward["kernels_off_compute_stream_ms"] == pytest.approx(0.005)
    assert backward["kernels_off_compute_stream"] == 0


def test_copies_on_the_compute_stream_are_counted_apart() -> None:
    events = [
        _event("user_annotation", FORWARD_MARK, 0.0, 100.0),
        _event("kernel", "gemm", 0.0, 40.0, stream=7),
        _event("kernel", "gemm", 30.0, 20.0, stream=7),  # overlapping kernels merge
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50.0, 10.0, stream=7, bytes=8),
        _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 20.0, 40.0, stream=9, bytes=8),
    ]
    forward = summarize_trace({"traceEvents": events})["forward"]
    assert forward["copies_on_compute_stream_ms"] == pytest.approx(0.01)
    assert forward["copies_under_compute_ms"] == pytest.approx(0.03)  # 20-50 under 0-50
