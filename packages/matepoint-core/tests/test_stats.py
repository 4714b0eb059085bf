"""Stats snapshots, the one-call report, and resetting counters."""

from __future__ import annotations

import dataclasses

import torch
from _helpers import Stack, grads_of, mate_ckpt, settle

import matepoint
from matepoint._engine.stats import Counters, OffloadStats, format_report
from matepoint.testing import CPUTestTransport

SECTIONS = (
    "matepoint offload report",
    "offloaded",
    "fetched back",
    "served on device",
    "shared (dedupe)",
    "freed nothing",
    "compute waited",
    "host waited",
    "kept in place",
    "pinned pool",
    "now",
)


def _train(depth: int = 4) -> None:
    with matepoint.options(stash_bytes=0):
        grads_of(Stack(depth=depth), torch.randn(4, 16), mate_ckpt)


def test_report_has_every_section(fast_transport: CPUTestTransport) -> None:
    _train()
    text = matepoint.report()
    for section in SECTIONS:
        assert section in text
    assert "4 tensors, 1.00 KiB" in text  # four 256-byte inputs offloaded
    assert matepoint.report(synchronize=True).splitlines()[0] == "matepoint offload report"


def test_stats_count_a_training_step(fast_transport: CPUTestTransport) -> None:
    _train(depth=5)
    snapshot = settle()
    assert snapshot.offloads == 5
    assert snapshot.bytes_offloaded == 5 * 256
    assert snapshot.fetches + snapshot.stash_hits == 5
    assert snapshot.bytes_fetched + snapshot.bytes_served_from_stash == 5 * 256
    assert snapshot.prefetch_hits <= snapshot.prefetches
    assert snapshot.pool_blocks_allocated == 5
    assert snapshot.live_records == 0
    assert snapshot.device_bytes_held == 0


def test_reset_stats_zeroes_counters_but_not_current_sizes(
    fast_transport: CPUTestTransport,
) -> None:
    _train()
    with matepoint.options(min_offload_bytes=1 << 20):
        x = torch.randn(4, requires_grad=True)
        matepoint.checkpoint(torch.sin, x * 1).sum().backward()  # counted as kept in place
    before = settle()
    assert before.offloads
    assert before.skipped_small
    assert before.pool_pinned_bytes
    matepoint.reset_stats()
    after = settle()
    for field in dataclasses.fields(Counters):
        assert getattr(after, field.name) == 0, field.name
    assert after.pool_blocks_allocated == 0
    assert after.pool_blocks_reused == 0
    assert after.pageable_fallbacks == 0
    assert after.pool_pinned_bytes == before.pool_pinned_bytes  # a current size, not a counter


def test_stats_is_a_snapshot(fast_transport: CPUTestTransport) -> None:
    _train()
    snapshot = matepoint.stats()
    snapshot.offloads = 10**9
    assert matepoint.stats().offloads == 4
    assert isinstance(snapshot, matepoint.OffloadStats)


def test_format_report_units() -> None:
    text = format_report(
        OffloadStats(bytes_offloaded=3 << 30, pool_pinned_bytes=512, compute_wait_seconds=0.25)
    )
    assert "3.00 GiB" in text
    assert "512 B" in text
    assert "250.00 ms" in text


def test_stats_without_any_engine_is_zero(fresh_stats: None) -> None:
    snapshot = matepoint.stats(synchronize=True)
    assert snapshot.offloads == 0
    assert snapshot.live_records == 0


def test_a_snapshot_is_not_a_counter_it_could_reset() -> None:
    """A snapshot is a copy; resetting goes through matepoint.reset_stats()."""
    snapshot = matepoint.stats()
    assert not hasattr(snapshot, "reset")
