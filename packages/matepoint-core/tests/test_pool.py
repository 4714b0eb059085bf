"""The pinned pool: exact-size reuse, the cap and its policies, allocation failure, new shapes."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from _helpers import (
    Stack,
    assert_grads_equal,
    assert_nothing_leaked,
    engine_of,
    grads_of,
    mate_ckpt,
    settle,
    torch_ckpt,
)

import matepoint
from matepoint._engine import pool as _pool
from matepoint.testing import CPUTestTransport, use_transport
from matepoint_compat import ignore_torch_warnings

DEPTH = 4
ONE = 4 * 16 * 4  # bytes of one block input (4 x 16 float32)


def _step(model: Stack, x: torch.Tensor) -> list[torch.Tensor]:
    return grads_of(model, x, mate_ckpt)


def test_exact_size_blocks_are_reused_across_steps(transport: CPUTestTransport) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(_step(model, x), reference)
    first = settle()
    assert first.pool_blocks_allocated == DEPTH
    assert first.pool_pinned_bytes == DEPTH * ONE  # exactly the bytes of one step, no rounding
    for step in range(2, 6):
        assert_grads_equal(_step(model, x), reference)
        snapshot = matepoint.stats()
        assert snapshot.pool_blocks_allocated == DEPTH
        assert snapshot.pool_blocks_reused == DEPTH * (step - 1)
        assert snapshot.pool_pinned_bytes == DEPTH * ONE
        assert snapshot.pool_in_use_bytes == 0
    assert transport.pinned_bytes == DEPTH * ONE


def test_odd_sizes_are_not_rounded(transport: CPUTestTransport) -> None:
    x = torch.randn(3, 7, requires_grad=True)  # 84 bytes
    y = matepoint.checkpoint(torch.sin, x * 1)
    assert matepoint.stats().pool_pinned_bytes == 84
    y.sum().backward()


def test_cap_with_pageable_policy_warns_once_and_stays_correct(transport: CPUTestTransport) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    with matepoint.options(pool_cap_bytes=2 * ONE, on_pool_exhausted="pageable"):
        with pytest.warns(ResourceWarning, match="pageable"):
            got = _step(model, x)
        assert_grads_equal(got, reference)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second warning would fail here
            ignore_torch_warnings()  # torch's own, on some releases
            for _ in range(3):
                assert_grads_equal(_step(model, x), reference)
    snapshot = settle()
    assert snapshot.pool_pinned_bytes <= 2 * ONE
    assert snapshot.pageable_fallbacks == 4 * (DEPTH - 2)
    assert snapshot.pool_in_use_bytes == 0
    assert engine_of(transport).pool.pageable_bytes == 0
    assert_nothing_leaked()


def test_cap_with_raise_policy_raises_then_next_step_works(transport: CPUTestTransport) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    with (
        matepoint.options(pool_cap_bytes=2 * ONE, on_pool_exhausted="raise"),
        pytest.raises(matepoint.PinnedMemoryExhausted, match="pool_cap_bytes") as caught,
    ):
        _step(model, x)
    assert isinstance(caught.value, MemoryError)
    assert isinstance(caught.value, matepoint.MatepointError)
    del caught  # its traceback holds the failed step's frames
    assert_nothing_leaked()
    # After fixing the cap, the next step works and leaves nothing behind.
    assert_grads_equal(_step(model, x), reference)
    assert_nothing_leaked()
    assert_grads_equal(_step(model, x), reference)
    assert_nothing_leaked()


def test_simulated_pinned_allocation_failure_falls_back_to_pageable(fresh_stats: None) -> None:
    test_transport = CPUTestTransport(pinned_limit_bytes=3 * ONE)
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        with pytest.warns(ResourceWarning, match="pinned host memory failed"):
            got = _step(model, x)
        assert_grads_equal(got, reference)
        snapshot = settle()
        assert snapshot.pageable_fallbacks == 1
        assert snapshot.pool_pinned_bytes == 3 * ONE
        # The next steps reuse the three pinned blocks; the fourth input goes pageable again.
        assert_grads_equal(_step(model, x), reference)
        assert settle().pageable_fallbacks == 2
    test_transport.drain()
    assert_nothing_leaked()


def test_simulated_pinned_allocation_failure_with_raise_policy(fresh_stats: None) -> None:
    test_transport = CPUTestTransport(pinned_limit_bytes=2 * ONE)
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        with (
            matepoint.options(on_pool_exhausted="raise"),
            pytest.raises(matepoint.PinnedMemoryExhausted, match="failed"),
        ):
            _step(model, x)
        gc.collect()
        assert_nothing_leaked()
        # Pageable policy again: the same transport still trains correctly.
        with pytest.warns(ResourceWarning):
            assert_grads_equal(_step(model, x), reference)
    test_transport.drain()
    assert_nothing_leaked()


def test_cap_releases_idle_blocks_of_old_sizes_before_falling_back(
    transport: CPUTestTransport,
) -> None:
    model = Stack(depth=DEPTH)
    with matepoint.options(pool_cap_bytes=DEPTH * 8 * 16 * 4):
        _step(model, torch.randn(4, 16))
        assert settle().pool_pinned_bytes == DEPTH * ONE
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no pageable fallback: old idle blocks make room
            ignore_torch_warnings()  # torch's own, on some releases
            _step(model, torch.randn(8, 16))
    snapshot = settle()
    assert snapshot.pool_pinned_bytes == DEPTH * 8 * 16 * 4
    assert snapshot.pageable_fallbacks == 0


def test_varying_shapes_trim_idle_blocks(
    transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The idle floor is 64 MiB for real workloads; a small one exercises the same trimming.
    monkeypatch.setattr(_pool, "_IDLE_FLOOR_BYTES", 4 * 1024)
    model = Stack(depth=DEPTH)
    largest_step = DEPTH * 64 * 16 * 4
    peak = 0
    for step in range(40):
        rows = 1 + (step * 7) % 64  # many distinct shapes
        x = torch.randn(rows, 16)
        assert_grads_equal(_step(model, x), grads_of(model, x, torch_ckpt))
        snapshot = matepoint.stats()  # records die by reference counting, no gc pass needed
        peak = max(peak, snapshot.pool_pinned_bytes)
        assert snapshot.pool_in_use_bytes == 0
    # Bounded by one step's working set plus the idle floor, not by every shape ever seen.
    assert peak <= largest_step + 4 * 1024 + largest_step
    assert transport.pinned_bytes > peak  # more was pinned over time than held: blocks released
    pinned = settle().pool_pinned_bytes
    assert matepoint.release_pool() == pinned
    assert settle().pool_pinned_bytes == 0


def test_release_pool_frees_idle_blocks_only(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    y = matepoint.checkpoint(torch.sin, x * 1)
    first = matepoint.checkpoint(torch.sin, y)  # y is still in use by the graph
    del y
    assert matepoint.release_pool() == 0
    assert settle().pool_pinned_bytes == 2 * ONE
    first.sum().backward()
    del first
    assert matepoint.release_pool() == 2 * ONE
    snapshot = settle()
    assert snapshot.pool_pinned_bytes == 0
    # The pool refills on demand.
    z = torch.randn(4, 16, requires_grad=True)
    matepoint.checkpoint(torch.sin, z * 1).sum().backward()
    assert settle().pool_pinned_bytes == ONE


def test_pipeline_false_copies_synchronously(fast_transport: CPUTestTransport) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    with matepoint.options(stash_bytes=0):
        got = grads_of(model, x, lambda *a: matepoint.checkpoint(*a, pipeline=False))
    assert_grads_equal(got, grads_of(model, x, torch_ckpt))
    snapshot = settle()
    assert snapshot.offloads == DEPTH
    assert snapshot.prefetches == 0
    assert fast_transport.copies_out == DEPTH
    assert not fast_transport.pending  # nothing was queued on the side stream
    assert_nothing_leaked()
