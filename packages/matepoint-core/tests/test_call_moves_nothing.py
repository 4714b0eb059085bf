"""A checkpoint call none of whose inputs would move runs without matepoint's saved-tensor hooks.

Note [A call that moves nothing] in ``matepoint._checkpoint``: the same gradients, the same
counters, torch's own version checks (nested tensors included), and the hooks back the moment
one input would move.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_offload_policy import sac

import matepoint
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport, use_transport

MATRIX_PRODUCT = torch.ops.aten.mm.default


def _block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight) * x.sigmoid()


def test_inputs_that_all_stay_take_no_hooks_and_are_counted_as_kept(
    fresh_stats: None, hook_calls: list[Any]
) -> None:
    weight = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    x_torch = x.detach().clone().requires_grad_()
    matepoint.checkpoint(_block, x, weight).sum().backward()
    torch.utils.checkpoint.checkpoint(_block, x_torch, weight, use_reentrant=False).sum().backward()
    assert hook_calls == []
    assert torch.equal(x.grad, x_torch.grad)  # type: ignore[arg-type]
    stats = matepoint.stats()
    # What the pack hook counted for the same call: the input (below the minimum size) and the
    # parameter; nothing moved.
    assert (stats.skipped_small, stats.skipped_parameters, stats.skipped_other) == (1, 1, 0)
    assert stats.offloads == 0


def test_one_input_that_would_move_brings_the_hooks_back(
    fresh_stats: None, hook_calls: list[Any]
) -> None:
    small, large = torch.randn(2, requires_grad=True), torch.randn(4, 256, requires_grad=True)
    with (
        use_transport(CPUTestTransport(completion="immediate")),
        matepoint.options(min_offload_bytes=1024),
    ):
        matepoint.checkpoint(lambda a, b: (a.sum() * b).sum(), small, large).backward()
        assert len(hook_calls) == 1
        assert matepoint.stats().offloads == 1
        matepoint.checkpoint(lambda a: a.square().sum(), small).backward()
        assert len(hook_calls) == 1  # the small input alone moves nothing
    assert matepoint.stats().skipped_small == 2


@pytest.mark.parametrize("nested", [False, True], ids=["positional", "nested-in-a-list"])
def test_an_input_modified_in_place_after_forward_still_fails_backward(
    hook_calls: list[Any], nested: bool
) -> None:
    """torch checks the versions now; a nested tensor too, being lifted to an argument first."""
    h = torch.randn(4, 16, requires_grad=True) * 1
    if nested:
        y = matepoint.checkpoint(lambda items: items[0].sin(), [h])
    else:
        y = matepoint.checkpoint(torch.sin, h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert hook_calls == []


def test_a_planned_step_still_records_every_save(hook_calls: list[Any]) -> None:
    with torch.device("meta"):
        layer = torch.nn.Linear(8, 8)
        x = torch.randn(4, 8, requires_grad=True)
    planned = matepoint.plan(lambda x: matepoint.checkpoint(layer, x), x)
    assert hook_calls
    assert planned["matepoint"].counters["skipped_small"] == 1


@pytest.mark.skipif(
    not compat.SELECTIVE_OFFLOAD_POLICIES, reason="torch's offload policy values arrived in 2.11"
)
@pytest.mark.parametrize("completion", ["immediate", "deferred"])
def test_a_policy_still_offloads_its_outputs_when_no_input_moves(
    fresh_stats: None, hook_calls: list[Any], completion: str
) -> None:
    """The only input is a parameter (it stays); the policy's matrix product goes to the host."""
    weight = torch.nn.Parameter(torch.randn(64, 64))

    def step(w: torch.Tensor) -> torch.Tensor:
        return torch.tanh(w @ w).sin().sum()

    transport = CPUTestTransport(completion=completion)
    with use_transport(transport), matepoint.options(min_offload_bytes=1024):
        offloading = sac("MUST_CPU_OFFLOAD", MATRIX_PRODUCT)
        matepoint.checkpoint(step, weight, context_fn=offloading).backward()
        transport.drain()
    offloaded_grad, weight.grad = weight.grad, None
    torch.utils.checkpoint.checkpoint(
        step, weight, use_reentrant=False, context_fn=sac("MUST_SAVE", MATRIX_PRODUCT)
    ).backward()
    assert torch.equal(offloaded_grad, weight.grad)  # type: ignore[arg-type]
    assert hook_calls == []
    assert transport.copies_out == 1
    assert matepoint.stats().policy_offloads == 1
