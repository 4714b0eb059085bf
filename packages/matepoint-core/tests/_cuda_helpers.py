"""A GPU model shared by the CUDA tests: pre-norm MLP blocks with dropout, and a training step.

Big enough (4096 tokens x 1024 features, 16 MiB per block input in fp32) that copies overlap
real compute; dropout makes every test check that the recomputation replays the RNG.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

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
