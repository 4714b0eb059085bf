"""The budget search's last choice, the stash, and what it says when nothing fits.

See Note [The stash] in ``matepoint._planner.search``: over the plan it returns, the search
takes the largest stash that still fits where the link is the step's limit. Planned on the meta
device only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import matepoint
from matepoint._planner import decision, search
from matepoint._planner.policy import AVAILABLE
from matepoint._planner.time_model import DeviceModel, step_seconds

# The pure rules run on any torch; the search needs torch's selective checkpointing (2.5).
needs_budget_plans = pytest.mark.skipif(
    not AVAILABLE, reason="budget plans need torch's selective checkpointing (2.5)"
)

# Copies back a thousand times slower than copies out: the link limits backward, and compute
# and the policy cost little.
SLOW_BACK = DeviceModel(
    peak_flops=1e12,
    to_host_bandwidth=1e12,
    to_device_bandwidth=1e6,
    policy_seconds_per_op=0,
    host_seconds_per_op=0,
)
FREE_LINK = dataclasses.replace(SLOW_BACK, to_device_bandwidth=1e18, to_host_bandwidth=1e18)
WIDTH, TOKENS, BLOCKS = 64, 128, 8
BLOCK_INPUT = TOKENS * WIDTH * 4  # one block's input, fp32


def test_stash_levels_add_up_the_newest_inputs_before_the_last() -> None:
    assert decision.stash_levels([10, 20, 30, 40]) == [0, 30, 50, 60]
    assert decision.stash_levels([10]) == [0]
    assert decision.stash_levels([]) == [0]


def test_the_largest_stash_that_fits_is_found_by_binary_search() -> None:
    asked: list[int] = []

    def fits(level: int) -> bool:
        asked.append(level)
        return level <= 50

    assert decision.largest_stash([0, 30, 50, 60, 70, 80], fits) == 50
    assert 0 not in asked  # the first level is taken to fit
    assert len(asked) <= 3
    assert decision.largest_stash([0, 30], lambda level: False) == 0


def test_a_stash_pays_only_where_copies_back_cost_the_step_time() -> None:
    assert decision.stash_pays(2.0, 1.5)
    assert not decision.stash_pays(2.0, 2.0)


def test_the_batch_share_takes_activations_as_proportional_to_the_batch() -> None:
    assert decision.batch_fraction(60, 110, 10) == pytest.approx(0.5)
    assert decision.batch_fraction(5, 110, 10) == 0.0
    assert decision.batch_fraction(60, 10, 10) is None


@pytest.fixture
def offloading_everything(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every block input offloaded and fetched when needed, not ahead; no region left unchecked.

    Leaving the last blocks unchecked (Note [The budget search], rule 10) spares their copies
    back too, and on these blocks it takes the room the stash would: these tests look at the
    stash's rule alone.
    """
    monkeypatch.setattr(search, "_UNCHECKED_TRIES", 0)
    before = matepoint.get_options()
    matepoint.configure(min_offload_bytes=0, prefetch=0)
    try:
        yield
    finally:
        matepoint.configure(**dataclasses.asdict(before))


def _stack(context_fn: object = None) -> tuple[torch.nn.Module, torch.Tensor]:
    from test_budget import Stack

    with torch.device("meta"):
        stack = Stack(context_fn=context_fn, count=BLOCKS)  # type: ignore[arg-type]
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    return stack, x


@needs_budget_plans
def test_the_search_stashes_the_most_that_fits_where_the_link_limits_the_step(
    offloading_everything: None,
) -> None:
    memory_plan = matepoint.plan(*_stack())
    budget = memory_plan["matepoint"].peak_bytes + 10 * BLOCK_INPUT
    budget_plan = memory_plan.fastest_under(budget, device=SLOW_BACK)
    assert budget_plan.fits
    stash = budget_plan.stash_bytes
    assert stash > 0
    assert budget_plan.settings_changes()["stash_bytes"] == stash
    assert f"stash (stash_bytes={stash})" in str(budget_plan)
    # The largest: the next level, the same plan otherwise, does not fit.
    replan = memory_plan._search_replan
    unstashed, saves = replan(
        dataclasses.replace(budget_plan.settings, stash_bytes=0), budget_plan.context_fn()
    )
    levels = decision.stash_levels([save.nbytes for save in saves if save.fate == "offloaded"])
    assert stash in levels
    above = [level for level in levels if level > stash]
    assert above, "the stash holds every input: nothing to compare with"
    larger = dataclasses.replace(budget_plan.settings, stash_bytes=above[0])
    assert replan(larger, budget_plan.context_fn())[0].peak_bytes > budget
    # It spares copies back, and the time model says the step is faster for it.
    assert budget_plan.strategy_plan.bytes_to_device < unstashed.bytes_to_device
    prefetch = budget_plan.prefetch
    assert budget_plan.step_seconds < step_seconds(unstashed, SLOW_BACK, prefetch, 0, 0) or (
        budget_plan.decisions  # with a policy, its host time is charged as well
    )


@needs_budget_plans
def test_applying_the_plans_settings_reproduces_its_planned_peak(
    offloading_everything: None,
) -> None:
    memory_plan = matepoint.plan(*_stack())
    budget = memory_plan["matepoint"].peak_bytes + 10 * BLOCK_INPUT
    budget_plan = memory_plan.fastest_under(budget, device=SLOW_BACK)
    assert budget_plan.stash_bytes > 0
    matepoint.configure(**budget_plan.settings_changes())
    assert matepoint.get_options().stash_bytes == budget_plan.stash_bytes
    again = matepoint.plan(*_stack(budget_plan.context_fn()), strategies=("matepoint",))
    assert again["matepoint"].peak_bytes == budget_plan.peak_bytes
    assert again["matepoint"].bytes_to_device == budget_plan.strategy_plan.bytes_to_device


@needs_budget_plans
def test_no_stash_where_the_copies_back_hide(offloading_everything: None) -> None:
    # Fetched ahead over a free link, the copies back hide behind backward's compute.
    matepoint.configure(prefetch=2)
    memory_plan = matepoint.plan(*_stack())
    budget = memory_plan["matepoint"].peak_bytes + 10 * BLOCK_INPUT
    budget_plan = memory_plan.fastest_under(budget, device=FREE_LINK)
    assert budget_plan.prefetch > 0
    assert budget_plan.stash_bytes == 0
    assert "stash_bytes" not in str(budget_plan)


@needs_budget_plans
def test_where_nothing_fits_the_plan_says_how_much_of_the_batch_would(
    offloading_everything: None,
) -> None:
    memory_plan = matepoint.plan(*_stack())
    fixed = 2 * memory_plan["matepoint"].parameter_bytes
    least = memory_plan.fastest_under(1, device=SLOW_BACK).smallest_budget_bytes
    budget = (fixed + least) // 2
    budget_plan = memory_plan.fastest_under(budget, device=SLOW_BACK)
    assert not budget_plan.fits
    assert budget_plan.batch_fraction == pytest.approx((budget - fixed) / (least - fixed))
    assert f"about {budget_plan.batch_fraction:.2f}x the example batch would fit" in str(
        budget_plan
    )
    below = memory_plan.fastest_under(fixed // 2, device=SLOW_BACK)
    assert below.batch_fraction == 0
    assert "parameters and gradients alone exceed the budget" in str(below)
    assert memory_plan.fastest_under(budget * 4, device=SLOW_BACK).batch_fraction is None
