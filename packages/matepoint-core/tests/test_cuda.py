"""GPU behaviour of the CUDA transport: exact gradients, flat device memory, race probes.

These run only with CUDA (``gpu`` marker). Values worth quoting are printed (run with ``-s``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import matepoint

pytestmark = pytest.mark.gpu

WIDTH = 1024
TOKENS = 4096


class Block(torch.nn.Module):
    """A pre-norm MLP block with dropout: enough compute to overlap copies, RNG to preserve."""

    def __init__(self, width: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        return x + F.dropout(h, self.dropout, self.training)


def _stack(depth: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(WIDTH) for _ in range(depth)).to("cuda", dtype)


def _forward(
    blocks: torch.nn.ModuleList, x: torch.Tensor, checkpoint_fn: Callable[..., Any]
) -> torch.Tensor:
    h = x
    for block in blocks:
        h = checkpoint_fn(block, h)
    return h


def _train_step(
    depth: int, checkpoint_fn: Callable[..., Any], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    blocks = _stack(depth, dtype)
    torch.manual_seed(1)
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.manual_seed(2)
    out = _forward(blocks, x, checkpoint_fn)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in blocks.parameters() if p.grad is not None] + [x.grad.clone()]


def _torch_ckpt(block: torch.nn.Module, x: torch.Tensor) -> Any:
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


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
    reference = _train_step(8, _torch_ckpt, dtype)
    options = matepoint.OffloadOptions(prefetch=prefetch)

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x, pipeline=pipeline, offload=options)

    result = _train_step(8, mate, dtype)
    stats = matepoint.stats()
    assert stats.offloads >= 7
    assert stats.fetches >= 1
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def _held_after_forward(depth: int, checkpoint_fn: Callable[..., Any]) -> int:
    blocks = _stack(depth)
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = _forward(blocks, x, checkpoint_fn)
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
    torch_held = {depth: _held_after_forward(depth, _torch_ckpt) for depth in (16, 64)}
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

    _train_step(8, mate)
    first = matepoint.stats()
    _train_step(8, mate)
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
    reference = _train_step(6, _torch_ckpt)
    # No bytes in flight allowed: every original is released as soon as its delayed copy ends,
    # so backward must bring each input back through the delayed side stream.
    options = matepoint.OffloadOptions(
        side_stream_delay_cycles=delay_cycles, prefetch=2, max_inflight_bytes=0
    )

    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x, offload=options)

    result = _train_step(6, mate)
    assert matepoint.stats().fetches >= 1
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_contended_link_keeps_gradients_exact() -> None:
    """Another thread floods the copy engines while matepoint trains: numbers must not change."""
    reference = _train_step(6, _torch_ckpt)
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

        results = [_train_step(6, mate) for _ in range(3)]
    finally:
        stop.set()
        worker.join()
    for result in results:
        assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))


def test_inplace_modification_after_forward_raises() -> None:
    blocks = _stack(2)
    x = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True)
    h = x * 1.0
    out = matepoint.checkpoint(blocks[0], h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_compute_wait_is_measured_and_report_renders() -> None:
    def mate(block: torch.nn.Module, x: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, x, offload=matepoint.OffloadOptions(prefetch=0))

    _train_step(8, mate)
    stats = matepoint.stats(synchronize=True)
    assert stats.compute_wait_seconds > 0
    assert "matepoint offload report" in matepoint.report()
