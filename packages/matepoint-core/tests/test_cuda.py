"""GPU behaviour of the CUDA transport: exact gradients, flat device memory, race probes.

These run only with CUDA (``gpu`` marker). Values worth quoting are printed (run with ``-s``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from _cuda_helpers import TOKENS, WIDTH, make_stack, run_blocks, torch_ckpt, train_step

import matepoint
from matepoint.testing import delay_side_stream

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fresh_stats() -> Iterator[None]:
    matepoint.reset_stats()
    yield
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_gradients_bitwise_equal_to_torch_checkpoint(
    dtype: torch.dtype, pipeline: bool, prefetch: int
) -> None:
    reference = train_step(8, torch_ckpt, dtype)

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x, pipeline=pipeline)

    with matepoint.options(prefetch=prefetch):
        result = train_step(8, mate, dtype)
    stats = matepoint.stats()
    assert stats.offloads >= 7
    assert stats.fetches >= 1
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def _held_after_forward(depth: int, checkpoint_fn: Callable[..., Any]) -> int:
    blocks = make_stack(depth)
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = run_blocks(blocks, x, checkpoint_fn)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.sum().backward()
    del out
    torch.cuda.synchronize()
    return held


def test_device_memory_after_forward_flat_in_depth() -> None:
    block_input = TOKENS * WIDTH * 4

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x)

    held = {depth: _held_after_forward(depth, mate) for depth in (16, 64)}
    torch_held = {depth: _held_after_forward(depth, torch_ckpt) for depth in (16, 64)}
    print(
        f"\n[gpu] device bytes held after forward: matepoint 16 blocks={held[16]} "
        f"64 blocks={held[64]}; torch checkpoint 16={torch_held[16]} 64={torch_held[64]}; "
        f"one block input={block_input}"
    )
    assert held[64] <= block_input
    assert held[16] <= block_input
    assert torch_held[64] >= 60 * block_input  # the baseline really grows with depth


def test_pinned_host_memory_is_exact_size() -> None:
    matepoint.release_pool()

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x)

    train_step(8, mate)
    first = matepoint.stats()
    train_step(8, mate)
    second = matepoint.stats()
    offloaded_per_step = first.bytes_offloaded
    print(
        f"\n[gpu] pinned pool {second.pool_pinned_bytes} bytes for {offloaded_per_step} "
        f"bytes offloaded per step; blocks reused {second.pool_blocks_reused}"
    )
    assert second.pool_pinned_bytes <= 1.05 * offloaded_per_step
    assert second.pool_blocks_reused >= 7


@pytest.mark.parametrize("delay_cycles", [2_000_000, 20_000_000])
def test_delayed_side_stream_keeps_gradients_exact(delay_cycles: int) -> None:
    reference = train_step(6, torch_ckpt)

    # No bytes in flight allowed: every original is released as soon as its delayed copy ends,
    # so backward must bring each input back through the delayed side stream.
    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x)

    with delay_side_stream(delay_cycles), matepoint.options(prefetch=2, max_inflight_bytes=0):
        result = train_step(6, mate)
    assert matepoint.stats().fetches >= 1
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_contended_link_keeps_gradients_exact() -> None:
    """Another thread floods the copy engines while matepoint trains: numbers must not change."""
    reference = train_step(6, torch_ckpt)
    stop = threading.Event()
    big_host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    big_device = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    noisy = torch.cuda.Stream()

    def flood() -> None:
        with torch.cuda.stream(noisy):
            while not stop.is_set():
                big_device.copy_(big_host, non_blocking=True)
                big_host.copy_(big_device, non_blocking=True)
                noisy.synchronize()

    worker = threading.Thread(target=flood)
    worker.start()
    try:

        def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
            return matepoint.checkpoint(block, x)

        results = [train_step(6, mate) for _ in range(3)]
    finally:
        stop.set()
        worker.join()
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_inplace_modification_after_forward_raises() -> None:
    blocks = make_stack(2)
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)
    h = x * 1.0
    out = matepoint.checkpoint(blocks[0], h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_compute_wait_is_measured_and_report_renders() -> None:
    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x)

    with matepoint.options(prefetch=0):
        train_step(8, mate)
    stats = matepoint.stats(synchronize=True)
    assert stats.compute_wait_seconds > 0
    assert "matepoint offload report" in matepoint.report()


def test_two_devices_in_one_process_use_their_own_channels() -> None:
    """Half the blocks on cuda:0, half on cuda:1: one engine per device, exact gradients.

    The current device stays cuda:0 throughout, so the cuda:1 copies must pick their device from
    the tensor, not from the current-device setting.
    """
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    from matepoint._engine import engines as _engines_table

    def step(checkpoint_fn: Callable[..., Any]) -> list[torch.Tensor]:
        first = make_stack(3, seed=0, device="cuda:0")
        second = make_stack(3, seed=1, device="cuda:1")
        torch.manual_seed(1)
        x = torch.randn(TOKENS, WIDTH, device="cuda:0", requires_grad=True)
        torch.cuda.manual_seed_all(2)
        h = run_blocks(first, x, checkpoint_fn)
        out = run_blocks(second, h.to("cuda:1"), checkpoint_fn)
        out.square().mean().backward()
        for index in (0, 1):
            torch.cuda.synchronize(index)
        blocks = [*first.parameters(), *second.parameters()]
        return [p.grad.clone() for p in blocks if p.grad is not None] + [x.grad.clone()]

    reference = step(torch_ckpt)

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x)

    with matepoint.options(prefetch=2, max_inflight_bytes=0):
        result = step(mate)
    with _engines_table.lock:
        keys = set(_engines_table._engines)
    print(f"\n[gpu] engines after a two-device step: {sorted(keys)}")
    assert {("cuda", 0), ("cuda", 1)} <= keys
    assert matepoint.stats(synchronize=True).offloads >= 5
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_forward_and_backward_make_no_synchronizing_call() -> None:
    """No host-side synchronize on the hot path: CUDA's sync debug mode raises on any.

    After warm-up (pinned pool, cuBLAS handles, caching allocator filled), a whole step under
    ``torch.cuda.set_sync_debug_mode("error")`` must run: copies out and back, prefetches,
    releases and waits are all ordered by events on the device.
    """
    blocks = make_stack(8)
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)

    def mate(block: torch.nn.Module, h: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, h)

    def step(checkpoint_fn: Callable[..., Any]) -> None:
        run_blocks(blocks, x, checkpoint_fn).sum().backward()

    for checkpoint_fn in (torch_ckpt, mate, mate):
        step(checkpoint_fn)
    torch.cuda.synchronize()
    matepoint.reset_stats()
    previous = torch.cuda.get_sync_debug_mode()
    try:
        with warnings.catch_warnings():
            # Setting the mode warns that it is a prototype; the suite turns warnings into errors.
            warnings.simplefilter("ignore", UserWarning)
            torch.cuda.set_sync_debug_mode("error")
        try:
            step(torch_ckpt)
        except RuntimeError as error:
            pytest.skip(f"torch's own checkpoint synchronizes on this release: {error}")
        step(mate)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    snapshot = matepoint.stats()
    assert snapshot.offloads >= 7
    assert snapshot.fetches >= 1
    assert snapshot.throttled_waits == 0
