"""A selective policy's CPU-offload output that is a view of a parameter stays on the device.

torch stores a detached alias of each output, made below autograd, so a view of a parameter
(``weight.t()``, a slice, ``view``) reaches matepoint without its ``_base``; the op's argument
it shares memory with comes along instead, and the keep rules see through to it (Note
[Offloading what a selective policy saves], rule 4). Moving such a view would free nothing: the
parameter keeps its memory.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport

pytestmark = pytest.mark.skipif(
    not compat.SELECTIVE_OFFLOAD_POLICIES,
    reason="CheckpointPolicy has no CPU-offload values before torch 2.11",
)

WIDTH, ROWS, DEPTH = 8, 4, 3
aten = torch.ops.aten
# Each op below is applied to a parameter once per block, and to nothing else.
PARAMETER_VIEWS = {"t": aten.t.default, "slice": aten.slice.Tensor, "view": aten.view.default}
# The block's two matrix products: ROWS x 2*WIDTH and ROWS x WIDTH, fp32.
MM_BYTES_PER_BLOCK = ROWS * 2 * WIDTH * 4 + ROWS * WIDTH * 4


class Block(nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(2 * WIDTH, WIDTH, generator=generator) * 0.3)
        self.scale = nn.Parameter(torch.randn(4 * WIDTH, generator=generator))
        self.down = nn.Parameter(torch.randn(WIDTH, 2 * WIDTH, generator=generator) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(h @ self.up.t()) * self.scale[: 2 * WIDTH]
        return h + torch.tanh(hidden @ self.down.view(2 * WIDTH, WIDTH))


def _context_fn(decision: str, chosen: frozenset[Any]) -> Any:
    value = torch_checkpoint.CheckpointPolicy[decision]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return value if op in chosen else torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)


def _step(checkpoint: Any, decision: str, chosen: frozenset[Any]) -> list[torch.Tensor]:
    """One seeded forward and backward through ``DEPTH`` checkpointed blocks; the gradients."""
    generator = torch.Generator().manual_seed(7)
    blocks = [Block(generator) for _ in range(DEPTH)]
    x = torch.randn(ROWS, WIDTH, generator=generator, requires_grad=True)
    h = x * 1
    for block in blocks:
        h = checkpoint(block, h, use_reentrant=False, context_fn=_context_fn(decision, chosen))
    h.square().sum().backward()
    return [x.grad] + [p.grad for block in blocks for p in block.parameters()]  # type: ignore[misc]


def _assert_torch_save(chosen: frozenset[Any]) -> matepoint.OffloadStats:
    """matepoint's offload gives torch's MUST_SAVE gradients; return matepoint's stats."""
    expected = _step(torch_checkpoint.checkpoint, "MUST_SAVE", chosen)
    matepoint.reset_stats()
    actual = _step(matepoint.checkpoint, "MUST_CPU_OFFLOAD", chosen)
    stats = matepoint.stats()
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got, want)
    return stats


@pytest.mark.parametrize("view", sorted(PARAMETER_VIEWS))
def test_an_offloaded_view_of_a_parameter_stays_on_the_device(
    cpu_transport: CPUTestTransport, view: str
) -> None:
    stats = _assert_torch_save(frozenset({PARAMETER_VIEWS[view]}))
    assert stats.policy_offloads == 0
    assert stats.bytes_offloaded_by_policy == 0
    assert stats.skipped_parameters == DEPTH
    # Only the checkpoints' inputs moved.
    assert stats.offloads == DEPTH
    assert stats.bytes_offloaded == DEPTH * ROWS * WIDTH * 4


def test_parameter_views_stay_and_activations_move_under_one_policy(
    cpu_transport: CPUTestTransport,
) -> None:
    chosen = frozenset({*PARAMETER_VIEWS.values(), aten.mm.default})
    stats = _assert_torch_save(chosen)
    assert stats.skipped_parameters == len(PARAMETER_VIEWS) * DEPTH
    assert stats.policy_offloads == 2 * DEPTH
    assert stats.bytes_offloaded_by_policy == DEPTH * MM_BYTES_PER_BLOCK
