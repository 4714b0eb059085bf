"""Plans that run their last blocks without a checkpoint (Note [The budget search], rule 10).

Where the step without any checkpoint does not fit, its last blocks may: they hold their
activations from forward into backward, the first backward frees, and nothing of theirs is
recomputed. The tests check the pure rule that chooses the counts to plan, that the search
finds the most that fits and predicts the real step's peak, and that every way of applying a
plan runs those blocks as they are, with gradients bitwise equal to torch's.
"""

from __future__ import annotations

import pytest
import torch
from test_budget_one_call import SHAPE, Block, CheckpointCalls, _stack, planned_stack
from test_budget_one_call import _matches_torch as matches_torch
from torch import nn

import matepoint
import matepoint.integrations as mi
from matepoint import DeviceModel
from matepoint._guard import describe
from matepoint._planner import decision
from matepoint._planner.policy import AVAILABLE
from matepoint.testing import CPUTestTransport

needs_plans = pytest.mark.skipif(not AVAILABLE, reason="budget plans need torch 2.5")

# A policy that costs a millisecond per op: no plan keeps or offloads, so what the room buys
# is the last blocks unchecked.
DEAR_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=1e-3)
BLOCKS = 4


# --- the rule --------------------------------------------------------------------------------


def test_the_next_count_is_where_the_line_through_the_peaks_meets_the_budget() -> None:
    # 0 unchecked peak at 100, 4 at 140: 10 per region, a budget of 125 takes 2.
    assert decision.unchecked_count(0, 100, 4, 140, 125) == 2
    # Never the counts already known: at least one above the most that fitted ...
    assert decision.unchecked_count(0, 100, 4, 140, 101) == 1
    # ... and one below the least that did not.
    assert decision.unchecked_count(0, 100, 4, 140, 1000) == 3
    # Without the peak of the least that did not fit, halfway.
    assert decision.unchecked_count(2, 100, 8, None, 10**9) == 5
    assert decision.unchecked_count(2, 100, 8, 90, 10**9) == 5  # no slope: halfway


# --- the search ------------------------------------------------------------------------------


def _planned(budget: int | str) -> tuple[nn.Module, matepoint.BudgetPlan]:
    """A stack with its blocks wrapped, and the plan at ``budget`` applied to it."""
    return planned_stack(budget, DEAR_POLICY)


def _peak_unchecked(last: int, blocks: int) -> int:
    """The planned peak of the stack with its last ``last`` blocks called as they are."""

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for index, block in enumerate(self.blocks):
                checked = index < blocks - last
                x = matepoint.checkpoint(block, x) if checked else block(x)
            return x

    with torch.device("meta"):
        stack, x = Stack(), torch.randn(*SHAPE)
    return matepoint.plan(stack, x, strategies=("matepoint",))["matepoint"].peak_bytes


@pytest.fixture(scope="module")
def none_peak() -> int:
    """What the step without any checkpoint peaks at, for the stack of :data:`BLOCKS`."""
    plan = _planned("1GiB")[1]
    assert not plan.checkpoint
    return plan.peak_bytes


@needs_plans
def test_below_no_checkpoints_peak_the_most_last_blocks_that_fit_run_unchecked(
    none_peak: int,
) -> None:
    plan = _planned(none_peak - 1)[1]
    assert plan.fits
    assert plan.checkpoint
    assert plan.decisions == ()
    assert 0 < plan.unchecked_last < plan.regions == BLOCKS
    assert plan.step_seconds < plan.every_block_seconds
    # Its planned peak is the step's with those blocks called as they are, and one more
    # block unchecked would not fit.
    with matepoint.options(**plan.settings_changes()):
        assert _peak_unchecked(plan.unchecked_last, BLOCKS) == plan.peak_bytes
        assert _peak_unchecked(plan.unchecked_last + 1, BLOCKS) > plan.budget_bytes
    assert [plan.checkpoints_region(region) for region in range(BLOCKS)] == [
        region < BLOCKS - plan.unchecked_last for region in range(BLOCKS)
    ]
    text = str(plan)
    assert f"no checkpoint in the last {plan.unchecked_last} of {BLOCKS} regions" in text
    assert f"the last {plan.unchecked_last} unchecked" in describe(plan)


@needs_plans
def test_no_count_is_tried_where_a_checkpoint_call_is_nested_in_anothers(none_peak: int) -> None:
    """Calls made again by a recomputation are no regions of their own: the calls left
    unchecked would not be the last blocks."""

    class Nested(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def pair(x: torch.Tensor, first: nn.Module, second: nn.Module) -> torch.Tensor:
                return matepoint.checkpoint(second, matepoint.checkpoint(first, x))

            for index in range(0, BLOCKS, 2):
                x = matepoint.checkpoint(pair, x, self.blocks[index], self.blocks[index + 1])
            return x

    with torch.device("meta"):
        model, x = Nested(), torch.randn(*SHAPE)
    memory_plan = matepoint.plan(model, x)
    assert memory_plan["matepoint"].recomputed_checkpoint_calls > 0
    budget = (memory_plan["matepoint"].peak_bytes + memory_plan["none"].peak_bytes) // 2
    plan = memory_plan.fastest_under(budget, device=DEAR_POLICY)
    assert plan.unchecked_last == 0


# --- applying it -----------------------------------------------------------------------------


def _matches_torch(model: nn.Module, plan: matepoint.BudgetPlan, steps: int = 2) -> None:
    """Steps of ``model`` against its blocks' twins under torch's checkpoint, the plan's policy
    per region, its unchecked regions called as they are: gradients bitwise equal."""
    blocks = [wrapper._checkpoint_wrapped_module for wrapper in model]
    matches_torch(model, blocks, plan, steps=steps)


@needs_plans
def test_the_integrations_run_the_last_blocks_as_they_are(
    none_peak: int, cpu_transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = CheckpointCalls(monkeypatch)  # before the wrappers bind matepoint's checkpoint
    model, plan = _planned(none_peak - 1)
    assert plan.unchecked_last > 0
    calls.count = 0  # the twin's planned step ran it
    _matches_torch(model, plan)
    assert calls.count == 2 * (BLOCKS - plan.unchecked_last)
    # The same plan applied again, block by block.
    again = _stack()
    for region, block in enumerate(again):
        again[region] = mi.checkpoint_wrapper(block, budget_plan=plan, region=region)
    calls.count = 0
    _matches_torch(again, plan, steps=1)
    assert calls.count == BLOCKS - plan.unchecked_last


@needs_plans
def test_the_counting_function_leaves_the_last_calls_of_every_forward_unchecked(
    none_peak: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = CheckpointCalls(monkeypatch)
    plan = _planned(none_peak - 1)[1]
    calls.count = 0
    function = mi.matepoint_checkpoint_fn(plan)
    blocks = _stack()
    for _ in range(2):  # each forward: the first blocks checkpointed, the last as they are
        x = torch.randn(*SHAPE, requires_grad=True)
        for block in blocks:
            x = function(block, x)
        x.sum().backward()
    assert calls.count == 2 * (BLOCKS - plan.unchecked_last)


@needs_plans
def test_a_block_without_its_region_or_a_stack_of_another_depth_is_refused(
    none_peak: int,
) -> None:
    plan = _planned(none_peak - 1)[1]
    with pytest.raises(TypeError, match=r"leaves its last \d+ regions unchecked: name this block"):
        mi.checkpoint_wrapper(Block(), budget_plan=plan)
    deeper = nn.Sequential(*[Block() for _ in range(BLOCKS - 1)])
    with pytest.raises(ValueError, match=r"leaves its last \d+ regions unchecked"):
        mi.apply_matepoint_checkpointing(
            deeper, lambda module: isinstance(module, Block), budget_plan=plan
        )
    with pytest.raises(ValueError, match="outside this plan's"):
        plan.checkpoints_region(BLOCKS)
