"""What the CUDA tests share: a model, a training step and memory levels.

The model (pre-norm MLP blocks with dropout) is big enough (4096 tokens x 1024 features, 16 MiB
per block input in fp32) that copies overlap real compute; dropout makes every test check that
the recomputation replays the RNG. The ``clean_start`` fixture they use lives in conftest.py.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from _recording import rss_bytes

import matepoint

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


def make_stack(
    depth: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str = "cuda",
    dropout: float = 0.1,
) -> torch.nn.ModuleList:
    """``depth`` blocks, seeded, on ``device``."""
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(WIDTH, dropout) for _ in range(depth)).to(device, dtype)


def run_blocks(
    blocks: torch.nn.ModuleList, x: torch.Tensor, checkpoint_fn: Callable[..., Any]
) -> torch.Tensor:
    """Checkpoint each block in turn with ``checkpoint_fn(block, h)``."""
    h = x
    for block in blocks:
        h = checkpoint_fn(block, h)
    return h


def train_step(
    depth: int, checkpoint_fn: Callable[..., Any], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """A fresh seeded stack, one forward and backward; the parameter and input gradients."""
    blocks = make_stack(depth, dtype)
    torch.manual_seed(1)
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=dtype, requires_grad=True)
    torch.cuda.manual_seed(2)
    out = run_blocks(blocks, x, checkpoint_fn)
    out.float().square().mean().backward()
    torch.cuda.synchronize()
    return [p.grad.clone() for p in blocks.parameters() if p.grad is not None] + [x.grad.clone()]


def torch_ckpt(block: torch.nn.Module, x: torch.Tensor) -> Any:
    """torch's own non-reentrant checkpoint of one block, the reference."""
    return torch_checkpoint.checkpoint(block, x, use_reentrant=False)


def bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    """Whether two gradient lists are equal bit for bit (same length, same values)."""
    return len(actual) == len(expected) and all(
        torch.equal(a, b) for a, b in zip(actual, expected, strict=True)
    )


def levels() -> dict[str, int]:
    """Memory levels after collecting garbage and letting the allocator reclaim finished frees.

    ``empty_cache()`` also processes the caching allocator's pending ``record_stream`` frees, so
    ``device_allocated_bytes`` counts only tensors that are really alive.
    """
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    snapshot = matepoint.stats(synchronize=True)
    return {
        "live_records": snapshot.live_records,
        "pool_in_use_bytes": snapshot.pool_in_use_bytes,
        "pool_pinned_bytes": snapshot.pool_pinned_bytes,
        "device_bytes_held": snapshot.device_bytes_held,
        "device_allocated_bytes": torch.cuda.memory_allocated(),
        "rss_bytes": rss_bytes(),
    }


def assert_restored(before: dict[str, int], after: dict[str, int]) -> None:
    """Every level but RSS (the interpreter's) is back where it was before the fault."""
    for name, value in before.items():
        if name != "rss_bytes":
            assert after[name] == value, f"{name}: {value} before the fault, {after[name]} after"
