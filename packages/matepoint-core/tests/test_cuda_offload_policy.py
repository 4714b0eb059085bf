"""Selective checkpointing's CPU-offload values on a CUDA device, through the real transport.

The CPU suite (``test_offload_policy.py``) checks the bookkeeping; this one the device: copies on
the side stream (delayed, so a missing wait shows as wrong numbers), device memory held after
forward, and gradients bitwise equal to torch's ``MUST_SAVE``. Values worth quoting are printed
(run with ``-s``).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
import matepoint_compat as compat
from matepoint.testing import delay_side_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not compat.SELECTIVE_OFFLOAD_POLICIES,
        reason="CheckpointPolicy has no CPU-offload values before torch 2.11",
    ),
]

WIDTH = 1024
TOKENS = 4096
DEPTH = 8


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    gc.collect()
    torch.cuda.synchronize()
    matepoint.reset_stats()
    yield
    gc.collect()
    torch.cuda.synchronize()


def sac(decision_name: str) -> Callable[[], Any]:
    decision = torch_checkpoint.CheckpointPolicy[decision_name]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default):
            return decision
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.dropout(nn.functional.gelu(self.up(self.norm(h))), p=0.1)
        return h + torch.tanh(self.down(hidden))


def make_stack(dtype: torch.dtype) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block() for _ in range(DEPTH)).to("cuda", dtype)


def run(blocks: nn.ModuleList, x: torch.Tensor, checkpoint: Callable[..., Any]) -> torch.Tensor:
    h = x * 1
    for block in blocks:
        h = checkpoint(block, h)
    return h


def torch_ckpt(decision_name: str) -> Callable[..., Any]:
    def call(block: nn.Module, h: torch.Tensor) -> Any:
        return torch_checkpoint.checkpoint(
            block, h, use_reentrant=False, context_fn=sac(decision_name)
        )

    return call


def mate_ckpt(decision_name: str, pipeline: bool = True) -> Callable[..., Any]:
    def call(block: nn.Module, h: torch.Tensor) -> Any:
        return matepoint.checkpoint(block, h, context_fn=sac(decision_name), pipeline=pipeline)

    return call


def train_step(checkpoint: Callable[..., Any], dtype: torch.dtype) -> list[torch.Tensor]:
    blocks = make_stack(dtype)
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=dtype, requires_grad=True)
    torch.manual_seed(1)
    run(blocks, x, checkpoint).float().square().mean().backward()
    torch.cuda.synchronize()
    assert x.grad is not None
    return [x.grad] + [p.grad for p in blocks.parameters() if p.grad is not None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pipeline", [True, False])
def test_gradients_bitwise_equal_torch_must_save(dtype: torch.dtype, pipeline: bool) -> None:
    expected = train_step(torch_ckpt("MUST_SAVE"), dtype)
    with delay_side_stream(2_000_000), matepoint.options(max_inflight_bytes=0, prefetch=3):
        got = train_step(mate_ckpt("MUST_CPU_OFFLOAD", pipeline), dtype)
    stats = matepoint.stats()
    assert stats.policy_offloads == 2 * DEPTH
    assert stats.bytes_fetched >= stats.bytes_offloaded_by_policy // 2
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _held_after_forward(checkpoint: Callable[..., Any]) -> int:
    blocks = make_stack(torch.bfloat16)
    x = torch.randn(TOKENS, WIDTH, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    out = run(blocks, x, checkpoint)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
    out.float().sum().backward()
    del out
    torch.cuda.synchronize()
    return held


def test_device_memory_held_after_forward() -> None:
    """The policy's outputs leave the device: held after forward drops to plain checkpointing's."""
    policy_bytes = DEPTH * TOKENS * 5 * WIDTH * 2  # up and down projection outputs, bf16
    held = {
        "torch MUST_SAVE": _held_after_forward(torch_ckpt("MUST_SAVE")),
        "torch PREFER_RECOMPUTE": _held_after_forward(torch_ckpt("PREFER_RECOMPUTE")),
        "matepoint MUST_CPU_OFFLOAD": _held_after_forward(mate_ckpt("MUST_CPU_OFFLOAD")),
    }
    print(f"\n[gpu] device bytes held after forward ({DEPTH} blocks): {held}")
    print(matepoint.report())
    assert held["torch MUST_SAVE"] >= held["torch PREFER_RECOMPUTE"] + policy_bytes
    assert held["matepoint MUST_CPU_OFFLOAD"] <= held["torch PREFER_RECOMPUTE"]
