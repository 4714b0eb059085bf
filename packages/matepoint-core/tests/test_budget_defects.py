"""Regression tests of the budget search's defects (issue 38: 3, 4, 5, 7, 8, 9), and of its
choice among every candidate it planned, no checkpoint included (Note [The budget search],
rules 9 and 10).

Each test plans a small stack on the meta device and checks that the chosen plan predicts what
its checkpoint calls really do under the settings it carries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_budget import BLOCKS, FREE_LINK, FREE_POLICY, TOKENS, WIDTH, Block, _plan
from torch import nn

import matepoint
from matepoint._planner import decision
from matepoint._planner.policy import AVAILABLE, OFFLOAD_AVAILABLE

pytestmark = pytest.mark.skipif(
    not AVAILABLE, reason="budget plans need torch's selective checkpointing (2.5+)"
)


class OwnOptions(nn.Module):
    """Blocks whose every checkpoint call passes its own ``offload=``."""

    def __init__(
        self, offload: matepoint.OffloadOptions, context_fn: Callable[[], Any] | None = None
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.offload, self.context_fn = offload, context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        for block in self.blocks:
            x = matepoint.checkpoint(block, x, offload=self.offload, **extra)
        return x


def _replanned(budget: matepoint.BudgetPlan, model: Callable[..., nn.Module]) -> Any:
    """The plan's step as its calls run it: its settings in force, its policy on every call."""
    with torch.device("meta"):
        stack = model(budget.context_fn())
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    with matepoint.options(**budget.settings_changes()):
        return matepoint.plan(stack, x, strategies=("matepoint",))["matepoint"]


def test_3_each_calls_own_offload_options_are_planned() -> None:
    """Every call keeps its inputs (min_offload_bytes=1<<40): nothing can move, nothing fits
    below torch's checkpoint, and the plan says what the calls do."""
    own = matepoint.OffloadOptions(min_offload_bytes=1 << 40)
    with torch.device("meta"):
        stack = OwnOptions(own)
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    # The settings in force would offload every input: the calls' own options win.
    with matepoint.options(min_offload_bytes=0):
        memory_plan = matepoint.plan(stack, x)
        torch_peak = memory_plan["torch"].peak_bytes
        assert memory_plan["matepoint"].bytes_to_host == 0
        budget = memory_plan.fastest_under(torch_peak - 1, device=FREE_LINK)
    assert not budget.fits
    assert budget.strategy_plan.bytes_to_host == 0
    replanned = _replanned(budget, lambda context_fn: OwnOptions(own, context_fn))
    assert replanned.peak_bytes == budget.peak_bytes
    assert replanned.bytes_to_host == budget.strategy_plan.bytes_to_host


class SeesTheSettings(nn.Module):
    """Blocks that record the process's settings in force each time their step runs."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.seen: list[matepoint.OffloadSettings] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(matepoint.get_options())
        for block in self.blocks:
            x = matepoint.checkpoint(block, x)
        return x


def test_3_a_search_never_changes_the_process_settings() -> None:
    """The candidates are the planned steps' own settings: code running during the search (here
    the model itself, as another thread would) sees the process's settings, never a
    candidate's, and the search still plans under its candidates."""
    with torch.device("meta"):
        stack = SeesTheSettings()
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    with matepoint.options(prefetch=3, stash_bytes=0):
        process = matepoint.get_options()
        memory_plan = matepoint.plan(stack, x)
        budget = memory_plan.fastest_under(memory_plan["torch"].peak_bytes, device=FREE_LINK)
        assert len(stack.seen) > 3  # the three strategies, then the search's steps
        assert set(stack.seen) == {process}
    assert budget.settings.prefetch <= 3


@pytest.mark.skipif(not OFFLOAD_AVAILABLE, reason="no selective offload values before 2.11")
def test_4_a_plan_whose_pool_would_raise_does_not_fit() -> None:
    """A pool capped at what every block pins, raising past it: offloading more cannot fit."""
    every_block = _plan()["matepoint"]
    capped = matepoint.OffloadSettings(
        min_offload_bytes=0, pool_cap_bytes=every_block.pinned_bytes, on_pool_exhausted="raise"
    )
    with torch.device("meta"):
        stack = matepoint_stack()
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    memory_plan = matepoint.plan(stack, x, options=capped)
    roomy = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_LINK)
    budget = memory_plan.fastest_under(
        (every_block.peak_bytes + roomy.peak_bytes) // 2, device=FREE_LINK
    )
    assert budget.fits
    assert not budget.strategy_plan.pool_would_raise
    assert "offload" not in dict(budget.decisions).values()


def matepoint_stack() -> nn.Module:
    from test_budget import Stack

    return Stack()


@pytest.mark.parametrize("through", ["plan-options", "configure"])
def test_5_a_plan_carries_every_setting_it_was_planned_under(through: str) -> None:
    stash = 3 * TOKENS * WIDTH * 4
    settings = {"min_offload_bytes": 0, "stash_bytes": stash, "max_inflight_bytes": 4096}
    with torch.device("meta"):
        stack = matepoint_stack()
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    if through == "plan-options":
        memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(**settings))
        budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes, device=FREE_POLICY)
    else:
        with matepoint.options(**settings):
            memory_plan = matepoint.plan(stack, x)
            budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes, device=FREE_POLICY)
    changes = budget.settings_changes()
    assert changes == dataclasses.asdict(budget.settings)
    assert changes["stash_bytes"] == stash
    assert changes["max_inflight_bytes"] == 4096
    # Applied on its own (process defaults otherwise), it reproduces the planned step.
    replanned = _replanned(budget, lambda context_fn: type(stack)(context_fn))
    assert replanned.peak_bytes == budget.peak_bytes
    assert replanned.bytes_to_host == budget.strategy_plan.bytes_to_host


def test_7_holding_the_inputs_never_switches_offloading_on() -> None:
    """A step that offloads nothing keeps offloading nothing."""
    with torch.device("meta"):
        stack = matepoint_stack()
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    nothing = matepoint.OffloadSettings(min_offload_bytes=1 << 40)
    memory_plan = matepoint.plan(stack, x, options=nothing)
    assert memory_plan["matepoint"].bytes_to_host == 0
    for share in (1, 2):
        budget = memory_plan.fastest_under(
            memory_plan["none"].peak_bytes * share, device=FREE_POLICY
        )
        assert budget.fits
        assert budget.strategy_plan.bytes_to_host == 0
        assert budget.min_offload_bytes == 1 << 40


def test_8_a_host_budget_below_the_pool_still_tries_keeps() -> None:
    memory_plan = _plan()
    assert memory_plan["matepoint"].pinned_bytes > 0
    budget = memory_plan.fastest_under(
        memory_plan["none"].peak_bytes * 4, host_budget_bytes=0, device=FREE_POLICY
    )
    assert budget.fits
    assert budget.pinned_bytes_per_node == 0
    assert "keep" in dict(budget.decisions).values(), budget
    assert budget.step_seconds < budget.every_block_seconds


def _thin_plan() -> matepoint.MemoryPlan:
    """Sixteen thin blocks whose inputs outweigh their weights: offloading lowers the peak."""
    from test_budget import Stack

    with torch.device("meta"):
        stack = Stack(block=lambda: nn.Linear(16, 16), count=16)
        x = torch.randn(4096, 16, requires_grad=True)
    return matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))


@pytest.mark.parametrize("host", [0, "half"])
def test_9_the_smallest_budget_fits_with_the_same_host_budget(host: object) -> None:
    memory_plan = _thin_plan()
    every_block = memory_plan["matepoint"]
    assert every_block.peak_bytes < memory_plan["torch"].peak_bytes
    host_budget = 0 if host == 0 else every_block.pinned_bytes // 2
    budget = memory_plan.fastest_under(every_block.peak_bytes, host_budget_bytes=host_budget)
    assert not budget.fits
    again = memory_plan.fastest_under(budget.smallest_budget_bytes, host_budget_bytes=host_budget)
    assert again.fits, again
    assert again.pinned_bytes_per_node <= host_budget


# --- Note [The budget search], rules 9 and 10 ---------------------------------------------------


def test_no_checkpoint_is_chosen_where_it_fits_and_is_fastest() -> None:
    """Thin linear blocks: without a checkpoint the step peaks no higher than torch's."""
    memory_plan = _thin_plan()
    none = memory_plan["none"]
    budget = memory_plan.fastest_under(none.peak_bytes, device=FREE_POLICY)
    assert budget.fits
    assert not budget.checkpoint
    assert budget.decisions == ()
    assert budget.peak_bytes == none.peak_bytes
    assert budget.strategy_plan is none
    assert budget.step_seconds < budget.every_block_seconds
    assert "no checkpoint needed: the step without any checkpoint peaks at" in str(budget)
    assert "held on the device" not in str(budget)
    below = memory_plan.fastest_under(none.peak_bytes - 1, device=FREE_POLICY)
    assert below.checkpoint
    assert "no checkpoint needed" not in str(below)


def test_the_plan_returned_is_the_fastest_of_every_candidate_that_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every try, the every-block step and no checkpoint are compared, each with its policy's
    host cost: none that fits is estimated faster than the plan returned."""
    compared: list[list[decision.Outcome]] = []
    fastest = decision.fastest

    def logged(outcomes: Any) -> int | None:
        compared.append(list(outcomes))
        return fastest(outcomes)

    monkeypatch.setattr(decision, "fastest", logged)
    memory_plan = _plan()
    halfway = (memory_plan["matepoint"].peak_bytes + memory_plan["none"].peak_bytes) // 2
    for device in (FREE_POLICY, dataclasses.replace(FREE_POLICY, policy_seconds_per_op=1e-6)):
        compared.clear()
        budget = memory_plan.fastest_under(halfway, device=device)
        [outcomes] = compared
        assert len(outcomes) > 3  # the plain step, every block, the best, the tries
        assert budget.fits
        assert budget.step_seconds <= min(o.seconds for o in outcomes if o.fits)


def test_a_policys_host_cost_is_charged_on_top_and_taken_where_keeping_saves_more() -> None:
    """Note [Host and device overlap], rule 4: slow compute, a cheap policy: keeping saves more
    recomputation than the policy costs, and the estimate is the device's time plus the
    policy's. A dear policy on the same step is declined."""
    memory_plan = _plan()
    budget_bytes = memory_plan["none"].peak_bytes - 1
    cheap = dataclasses.replace(FREE_POLICY, peak_flops=1e9, policy_seconds_per_op=1e-6)
    budget = memory_plan.fastest_under(budget_bytes, device=cheap)
    assert "keep" in dict(budget.decisions).values(), budget
    planned = budget.strategy_plan
    device_seconds = (planned.forward_flops + planned.backward_flops) / cheap.peak_flops
    assert device_seconds < budget.step_seconds < budget.every_block_seconds
    dear = dataclasses.replace(cheap, policy_seconds_per_op=1.0)
    assert memory_plan.fastest_under(budget_bytes, device=dear).decisions == ()


def test_a_compiled_plan_pays_no_policy_host_cost() -> None:
    """Note [The budget search], rule 11: a compiled graph resolves the policy when it is
    traced, so a policy dear in eager is still taken where keeping pays, and offloads nothing."""
    memory_plan = _plan()
    assert memory_plan.options is not None
    compiled = dataclasses.replace(
        memory_plan, options=dataclasses.replace(memory_plan.options, compiled_offload=True)
    )
    dear = dataclasses.replace(FREE_POLICY, policy_seconds_per_op=1.0)
    lowest, highest = memory_plan["matepoint"].peak_bytes, memory_plan["none"].peak_bytes
    budget_bytes = lowest + (highest - lowest) // 50
    eager = memory_plan.fastest_under(budget_bytes, device=dear)
    plan = compiled.fastest_under(budget_bytes, device=dear)
    assert eager.decisions == ()  # in eager the policy costs a second per op
    assert dict(plan.decisions)
    assert "offload" not in dict(plan.decisions).values()
    assert plan.fits
    assert plan.step_seconds < eager.step_seconds < 1.0
