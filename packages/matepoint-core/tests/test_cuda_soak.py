"""Long runs on a real GPU: changing shapes and dropped graphs, device and host memory flat.

The GPU counterpart of the CPU soak in test_reliability.py: the CUDA transport's copies,
``record_stream`` hand-offs and pinned pool over hundreds (``--run-slow``: thousands) of steps.
Records its numbers as data (see _recording.py).
"""

from __future__ import annotations

import random

import pytest
import torch
from _cuda_helpers import WIDTH, levels, make_stack, run_blocks
from _recording import Record, rss_bytes

import matepoint

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_start")]


def _mate(block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = matepoint.checkpoint(block, h)
    return out


def _soak(steps: int) -> dict[str, int]:
    """Train with changing sequence lengths, dropping every tenth graph; return the numbers."""
    depth = 8
    blocks = make_stack(depth)
    lengths = [1024, 2048, 3072, 4096]
    rng = random.Random(0)
    mate = _mate
    warmup = 20
    at_warmup: dict[str, int] = {}
    peak_allocated = peak_pinned = peak_rss = 0
    for step in range(steps):
        length = lengths[step % len(lengths)] if step < warmup else rng.choice(lengths)
        x = torch.randn(length, WIDTH, device="cuda", requires_grad=True)
        out = run_blocks(blocks, x * 1, mate)
        if step % 10 == 9:
            del out  # graph dropped without backward
        else:
            out.square().mean().backward()  # parameter gradients accumulate: allocated once
            del out
        del x
        if step == warmup:
            at_warmup = levels()
        elif step > warmup:
            snapshot = matepoint.stats()
            assert snapshot.live_records == 0, f"step {step}: records outlive their graph"
            peak_allocated = max(peak_allocated, torch.cuda.memory_allocated())
            peak_pinned = max(peak_pinned, snapshot.pool_pinned_bytes)
            if step % 50 == 0:
                peak_rss = max(peak_rss, rss_bytes())
    final = levels()
    assert final["live_records"] == final["pool_in_use_bytes"] == final["device_bytes_held"] == 0
    # Device memory: exactly the warm-up level once the allocator has reclaimed the originals
    # given back with record_stream; between steps at most one step's originals are pending.
    assert final["device_allocated_bytes"] == at_warmup["device_allocated_bytes"]
    largest_step = depth * max(lengths) * WIDTH * 4
    assert peak_allocated <= at_warmup["device_allocated_bytes"] + largest_step
    # Pinned pool: every size was seen in warm-up and blocks are reused. A graph dropped while its
    # copies still run returns its blocks when they end, so a step of the same size right after
    # it may need one step's blocks more, once; no growth beyond that.
    assert peak_pinned <= at_warmup["pool_pinned_bytes"] + largest_step
    rss_growth = max(peak_rss, final["rss_bytes"]) - at_warmup["rss_bytes"]
    assert rss_growth < 256 << 20, f"RSS grew by {rss_growth} bytes after warm-up"
    numbers = {f"{name}_before": value for name, value in at_warmup.items()}
    numbers |= {f"{name}_after": value for name, value in final.items()}
    return {
        **numbers,
        "peak_device_allocated_bytes": peak_allocated,
        "peak_pool_pinned_bytes": peak_pinned,
        "peak_rss_bytes": peak_rss,
        "offloads": matepoint.stats().offloads,
    }


_SOAK_CHECKS = (
    "8 checkpoints of 1024-4096 x 1024 fp32 inputs, lengths at random, every 10th graph dropped "
    "without backward: no record outlives its step; device memory back to the byte at the end "
    "and never more than one step's inputs above it; the pinned pool grows by at most one step's "
    "blocks after warm-up; "
    "RSS grows less than 256 MiB"
)


def _record_soak(record_property: Record, case: str, steps: int) -> None:
    numbers = _soak(steps)
    record_property("area", "long runs")
    record_property("case", case)
    record_property("checks", _SOAK_CHECKS)
    record_property("guarantees", "bounded,no-leak")
    record_property("steps", steps)
    record_property("faults_injected", steps // 10)
    for name, value in numbers.items():
        record_property(name, value)


def test_soak_short(record_property: Record) -> None:
    _record_soak(record_property, "GPU soak, short", 200)


@pytest.mark.slow
def test_soak_long(record_property: Record) -> None:
    _record_soak(record_property, "GPU soak, long", 2000)
