"""The budget search plans fewer steps where two bounds know the outcome, and chooses the same.

Note [Steps the search spares] in ``matepoint._planner.search``: each test runs the search with and
without the bounds and compares the whole choice, and counts the steps planned.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import pytest
from test_budget import BLOCKS, FREE_LINK, FREE_POLICY, _plan

import matepoint
from matepoint._planner import decision, policy, search_state
from matepoint._planner.policy import AVAILABLE

pytestmark = pytest.mark.skipif(
    not AVAILABLE, reason="budget plans need torch's selective checkpointing (2.5+)"
)


def _choice(plan: matepoint.BudgetPlan) -> tuple[Any, ...]:
    return (
        plan.fits,
        plan.decisions,
        plan.kept_in_last,
        plan.prefetch,
        plan.min_offload_bytes,
        plan.peak_bytes,
        plan.step_seconds,
        plan.smallest_budget_bytes,
    )


def _search(
    monkeypatch: pytest.MonkeyPatch, share: float, device: Any, bounds: bool, blocks: int = BLOCKS
) -> tuple[matepoint.BudgetPlan, list[dict[str, str]]]:
    """The search at ``share`` of the way from every block's peak to no checkpoint's, and each
    try's decisions; with the bounds off where ``bounds`` is False."""
    tried: list[dict[str, str]] = []
    context_fn = policy.context_fn_of

    def logged(decisions: dict[str, str], *args: Any) -> Any:
        tried.append(dict(decisions))
        return context_fn(decisions, *args)

    with monkeypatch.context() as patch:
        patch.setattr(search_state, "context_fn_of", logged)
        if not bounds:
            patch.setattr(decision, "cannot_fit_kept", lambda *args: False)
            patch.setattr(decision, "surely_fits_kept", lambda *args: False)
        memory_plan = _plan(blocks)
        lowest, highest = memory_plan["matepoint"].peak_bytes, memory_plan["none"].peak_bytes
        budget = lowest + int((highest - lowest) * share)
        return memory_plan.fastest_under(budget, device=device), tried


def test_a_budget_that_surely_holds_every_kind_plans_them_kept_in_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spared, spared_tries = _search(monkeypatch, 2.0, FREE_POLICY, bounds=True)
    full, full_tries = _search(monkeypatch, 2.0, FREE_POLICY, bounds=False)
    assert _choice(spared) == _choice(full)
    kept = [kind for kind, decision in spared.decisions if decision == "keep"]
    assert len(kept) > 1
    # The full search tries one kind more per step; the spared one all of them at once.
    assert spared_tries[0] == dict.fromkeys(kept, "keep")
    assert len(full_tries) == len(spared_tries) + len(kept) - 1


@pytest.mark.parametrize("share", [0.0, 0.05, 0.1, 0.3, 0.6])
def test_keeps_that_cannot_fit_are_not_planned_and_the_choice_is_the_same(
    monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    spared, spared_tries = _search(monkeypatch, share, FREE_LINK, bounds=True)
    full, full_tries = _search(monkeypatch, share, FREE_LINK, bounds=False)
    assert _choice(spared) == _choice(full)
    assert len(spared_tries) <= len(full_tries)
    assert all(tried in full_tries for tried in spared_tries)


def test_a_tight_budget_skips_a_keep_the_forward_alone_cannot_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight blocks, a tenth of the way to no checkpoint's peak: some kind kept in every block
    cannot fit beside what forward leaves, and is not planned."""
    spared, spared_tries = _search(monkeypatch, 0.1, FREE_LINK, bounds=True, blocks=8)
    full, full_tries = _search(monkeypatch, 0.1, FREE_LINK, bounds=False, blocks=8)
    assert _choice(spared) == _choice(full)
    skipped = [tried for tried in full_tries if tried not in spared_tries]
    assert skipped
    assert all(list(tried.values())[-1] == "keep" for tried in skipped)


def test_the_policy_is_charged_on_the_regions_that_run_it() -> None:
    """A region that recomputes everything runs without torch's modes (Note [A plan's regions],
    rule 5): a plan that keeps only in its last regions pays the policy there alone. Each region
    that runs the modes is charged 100 ops here, whatever its windows
    (test_budget_scoped_charge.py charges the windows themselves)."""
    profile = types.SimpleNamespace(policy_ops=lambda region, scoped: 100)
    state = types.SimpleNamespace(profile=profile, regions=16)
    charge = functools.partial(search_state.Search.policy_ops_of, state)
    assert charge({"attention": "keep"}, {}) == 1600
    assert charge({"attention": "recompute"}, {"matmul 8x8": 4}) == 400
    assert charge({}, {"matmul 8x8": 1, "attention": 2}) == 200
    assert charge({"attention": "offload"}, {"matmul 8x8": 1}) == 1600
    assert charge({"attention": "recompute"}, {}) == 0
