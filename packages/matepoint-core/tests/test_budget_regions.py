"""A budget plan's regions are its checkpointed blocks, named by the blocks themselves.

Defects 1 and 2 of the budget mode: a wrapper per block gave every block its own region counter,
and a forward that raised part way shifted a shared one for the rest of training, so a plan that
keeps a kind in its last blocks kept it in the wrong ones. Each test runs a plan keeping the up
projection in the last three of eight blocks through one way of applying it, records per
checkpoint call which region's policy served it and how many outputs that policy kept in
forward, and compares the gradients bitwise with torch's checkpoint under the same policy per
region (Note [A plan's regions] in ``matepoint._planner.policy``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
import matepoint.integrations as mi
from matepoint._planner import policy
from matepoint.testing import CPUTestTransport

pytestmark = pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5")

BLOCKS, LAST, KIND = 8, 3, "matmul 16x64"
SHAPE = (256, 16)
KEPT = [False] * (BLOCKS - LAST) + [True] * LAST


class Thin(nn.Module):
    """A block of two projections; the plan keeps the up projection's output (16 to 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("a forward that raises part way")
        return x + self.down(F.gelu(self.up(x)))


class Chain(nn.Module):
    """Blocks called in order; ``context_fn`` maps a block number to its call's context_fn."""

    def __init__(self, context_fn: Callable[[int], Any] | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Thin() for _ in range(BLOCKS))
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if self.context_fn is None:
                x = block(x)
            else:
                x = matepoint.checkpoint(block, x, context_fn=self.context_fn(index))
        return x


@pytest.fixture(scope="module")
def plan() -> matepoint.BudgetPlan:
    """A plan of eight blocks that keeps the up projection in the last three only."""
    with torch.device("meta"):
        model = Chain(lambda _index: torch_checkpoint.noop_context_fn)
        x = torch.randn(*SHAPE, requires_grad=True)
    memory_plan = matepoint.plan(model, x)
    base = memory_plan.fastest_under(memory_plan["matepoint"].peak_bytes * 4)
    assert base.regions == BLOCKS
    return dataclasses.replace(base, decisions=(), kept_in_last=((KIND, LAST),), checkpoint=True)


class Recorder:
    """Records, per checkpoint call, its policy's region and the outputs it kept in forward."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[int]] = []
        original = policy.policy_of
        save = torch_checkpoint.CheckpointPolicy.MUST_SAVE

        def recording(*args: Any) -> Callable[..., Any]:
            inner = original(*args)
            record = [args[3], 0]
            self.calls.append(record)

            def wrapped(ctx: Any, func: Any, *op_args: Any, **op_kwargs: Any) -> Any:
                decision = inner(ctx, func, *op_args, **op_kwargs)
                if not ctx.is_recompute and decision == save:
                    record[1] += 1
                return decision

            wrapped.__dict__.update(inner.__dict__)  # the never-offloading mark
            return wrapped

        monkeypatch.setattr(policy, "policy_of", recording)

    def take(self) -> tuple[list[int], list[bool]]:
        """The regions of the calls since the last take, and whether each kept anything."""
        calls, self.calls = self.calls, []
        return [region for region, _ in calls], [kept > 0 for _, kept in calls]


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    return Recorder(monkeypatch)


def _step_matches_torch(
    model: nn.Module,
    blocks: nn.ModuleList | nn.Sequential,
    plan: matepoint.BudgetPlan,
    recorder: Recorder,
    micro_batches: int = 1,
) -> None:
    """One step of ``model`` (micro-batches accumulated), recorded: every block in its own
    region, the last three keeping; then the same step through torch's checkpoint per region
    on a twin of the same weights, and the gradients bitwise equal."""
    reference = copy.deepcopy(list(_inner_blocks(blocks)))  # the weights and any gradients
    for micro_batch in range(micro_batches):
        torch.manual_seed(10 + micro_batch)
        x = torch.randn(*SHAPE, requires_grad=True)
        model(x).sum().backward()
        assert recorder.take() == (list(range(BLOCKS)), KEPT)
        y = x.detach().clone().requires_grad_()
        for index, block in enumerate(reference):
            y = torch_checkpoint.checkpoint(
                block, y, use_reentrant=False, context_fn=plan.context_fn(index)
            )
        y.sum().backward()
        recorder.take()
    mine = [p for block in _inner_blocks(blocks) for p in block.parameters()]
    theirs = [p for block in reference for p in block.parameters()]
    for got, want in zip(mine, theirs, strict=True):
        assert got.grad is not None
        assert torch.equal(got.grad, want.grad)


def _inner_blocks(blocks: nn.ModuleList | nn.Sequential) -> Iterator[Thin]:
    for block in blocks:
        yield block if isinstance(block, Thin) else block._checkpoint_wrapped_module  # type: ignore[misc]


def _fail_once(model: nn.Module, block: Thin, recorder: Recorder) -> None:
    """A forward that raises in ``block``, part way through the model."""
    block.fail = True
    with pytest.raises(RuntimeError, match="part way"):
        model(torch.randn(*SHAPE, requires_grad=True))
    block.fail = False
    recorder.take()


# --- the ways a plan is applied ----------------------------------------------------------------


def _own_calls(plan: matepoint.BudgetPlan) -> tuple[nn.Module, nn.ModuleList]:
    model = Chain(plan.context_fn)
    return model, model.blocks


def _one_wrapper_per_block(plan: matepoint.BudgetPlan) -> tuple[nn.Module, nn.ModuleList]:
    blocks = Chain().blocks
    wrapped = nn.Sequential(
        *[
            mi.checkpoint_wrapper(block, budget_plan=plan, region=index)
            for index, block in enumerate(blocks)
        ]
    )
    return wrapped, wrapped  # type: ignore[return-value]


def _applied(plan: matepoint.BudgetPlan) -> tuple[nn.Module, nn.ModuleList]:
    model = Chain()
    mi.apply_matepoint_checkpointing(model, lambda m: isinstance(m, Thin), budget_plan=plan)
    return model, model.blocks


WAYS = {"own-calls": _own_calls, "wrapper-per-block": _one_wrapper_per_block, "apply": _applied}


@pytest.mark.parametrize("way", WAYS)
def test_every_step_keeps_in_the_last_blocks(
    way: str, plan: matepoint.BudgetPlan, recorder: Recorder, cpu_transport: CPUTestTransport
) -> None:
    """Defect 1: one wrapper per block made every block region 0 of its own counter."""
    model, blocks = WAYS[way](plan)
    for _ in range(3):
        for block in blocks:
            block.zero_grad(set_to_none=True)
        _step_matches_torch(model, blocks, plan, recorder)


@pytest.mark.parametrize("way", WAYS)
def test_a_forward_that_raises_part_way_moves_no_region(
    way: str, plan: matepoint.BudgetPlan, recorder: Recorder, cpu_transport: CPUTestTransport
) -> None:
    """Defect 2: an exception in block 4 shifted a counting context_fn for good."""
    model, blocks = WAYS[way](plan)
    _fail_once(model, list(_inner_blocks(blocks))[4], recorder)
    for _ in range(2):
        for block in blocks:
            block.zero_grad(set_to_none=True)
        _step_matches_torch(model, blocks, plan, recorder)


@pytest.mark.parametrize("way", WAYS)
def test_gradient_accumulation_and_an_evaluation_forward_move_no_region(
    way: str, plan: matepoint.BudgetPlan, recorder: Recorder, cpu_transport: CPUTestTransport
) -> None:
    model, blocks = WAYS[way](plan)
    _step_matches_torch(model, blocks, plan, recorder, micro_batches=3)
    with torch.no_grad():
        model(torch.randn(*SHAPE))
    model.eval()
    with torch.no_grad():
        model(torch.randn(*SHAPE))
    model.train()
    recorder.take()
    for block in blocks:
        block.zero_grad(set_to_none=True)
    _step_matches_torch(model, blocks, plan, recorder, micro_batches=2)


def test_a_counting_context_fn_serves_whole_forwards_only(
    plan: matepoint.BudgetPlan, recorder: Recorder, cpu_transport: CPUTestTransport
) -> None:
    """Without a block, the context_fn counts (Note [A plan's regions], rule 3): right for
    whole forwards, shifted by one that raises; the limit the block-named regions remove."""
    counting = plan.context_fn()
    model = Chain(lambda _index: counting)
    _step_matches_torch(model, model.blocks, plan, recorder)
    _fail_once(model, model.blocks[4], recorder)
    model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    regions, _ = recorder.take()
    assert regions == [(5 + index) % BLOCKS for index in range(BLOCKS)]


def test_a_region_is_checked(plan: matepoint.BudgetPlan) -> None:
    with pytest.raises(ValueError, match="outside this plan's 8 regions"):
        plan.context_fn(BLOCKS)
    with pytest.raises(ValueError, match="outside"):
        plan.context_fn(-1)
    with pytest.raises(TypeError, match="whole number"):
        plan.context_fn(True)  # type: ignore[arg-type]
    assert plan.context_fn(0) is not torch_checkpoint.noop_context_fn


def test_the_integrations_refuse_blocks_without_their_region(plan: matepoint.BudgetPlan) -> None:
    with pytest.raises(TypeError, match="region=i"):
        mi.checkpoint_wrapper(Thin(), budget_plan=plan)
    with pytest.raises(TypeError, match="budget_plan"):
        mi.matepoint_checkpoint_fn(region=0)
    fewer = nn.Sequential(*[Thin() for _ in range(BLOCKS - 1)])
    with pytest.raises(ValueError, match="8 regions"):
        mi.apply_matepoint_checkpointing(fewer, lambda m: isinstance(m, Thin), budget_plan=plan)
    assert not any(isinstance(m, type(mi.checkpoint_wrapper(Thin()))) for m in fewer)
    more = nn.Sequential(*[Thin() for _ in range(BLOCKS + 1)])
    uniform = dataclasses.replace(plan, kept_in_last=(), decisions=((KIND, "keep"),))
    with pytest.raises(ValueError, match="9 blocks to wrap"):
        mi.apply_matepoint_checkpointing(more, lambda m: isinstance(m, Thin), budget_plan=uniform)
    # A plan that decides every region alike takes any block without a region.
    mi.checkpoint_wrapper(Thin(), budget_plan=uniform)
