"""The budget search's answer: the fastest candidate that fits, or the finalist measured
fastest, with its inputs held and its stash chosen.

Note [The stash]
    ``stash_bytes`` keeps the newest offloaded inputs on the device: their copy to the host
    still happens, their copy back does not. It trades device memory for copies back.
    Rule 1. The stash is chosen last, over the plan the search returns (Note [The budget
        search], rule 9, in ``matepoint._planner.search``), keeping every other choice: it is
        tried only where that step's copies back cost it time (the time model estimates it
        faster without them: the link is its limit) and the step fits; elsewhere the
        settings' stash stays.
    Rule 2. The stash taken is the largest that still fits, by binary search over the newest
        inputs the step offloads (``decision.stash_levels``, ``decision.largest_stash``, the
        rule ``MemoryPlan.recommend`` uses too), above the settings' own; it is taken where the
        step gets faster.
    Example: eight blocks, every input offloaded and fetched without look-ahead (``prefetch``
    0, so every copy back waits), room for ten block inputs above the every-block peak, but not
    for holding them all: the plan keeps what it keeps, then stashes the newest inputs that
    still fit, and copies fewer back (test_budget_stash.py).

Note [Measured finalists]
    Rule 1. The time model's least certain term is the policy's host cost: how much of it the
        device's work hides depends on the host's speed and the model's op sizes
        (docs/benchmarks.md). Given ``measure``, the search does not decide on that estimate (Note
        [The budget search], rule 7).
    Rule 2. Where it found a plan with a policy, it hands two finalists to ``measure``: that
        plan and the best without a policy, each with the checkpoint inputs held on the device
        where that fits (Note [The budget search], rule 6), and, where rule 10 found them, the
        step with its last regions unchecked and the step without any checkpoint.
        ``measure`` times them on the real model (``math.inf`` for one that could not run,
        out of memory), and the fastest is returned with the times.
    Rule 3. A search that found no policy worth trying measures nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from matepoint._planner import decision
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.search_state import Choice, Figures, Search, Trial, timed
from matepoint._planner.step import StrategyPlan
from matepoint._planner.time_model import step_seconds

__all__ = ["conclude"]


def conclude(
    search: Search,
    plain: Trial,
    best: Choice,
    measure: Callable[[Sequence[BudgetPlan]], Sequence[float]] | None,
    no_checkpoint: StrategyPlan | None,
    unchecked_last: Choice | None,
) -> BudgetPlan:
    """The plan: the fastest candidate that fits, its policy's host cost counted, or the
    faster finalist measured (Note [The budget search], rules 7, 9 and 10; Note [Measured
    finalists])."""
    smallest = search.smallest  # the on-device tries of _budget_plan are never counted in it
    unchecked: Choice | None = None
    if no_checkpoint is not None:
        # No checkpoint: forward and backward, no recomputation and no policy.
        trial = timed(
            no_checkpoint, plain.settings, search.device, search.budget, 2 * search.host_ops // 3
        )
        unchecked = Choice(trial, checkpoint=False)
    if not (best.decisions or best.kept_in_last):  # Note [Measured finalists], rule 3
        measure = None
    if measure is not None:  # Note [Measured finalists], rule 2
        finalists = [
            _budget_plan(search, search.charged(best), smallest),
            _budget_plan(search, Choice(plain), smallest),
        ]
        if unchecked_last is not None:
            finalists.append(_budget_plan(search, unchecked_last, smallest))
        if unchecked is not None and unchecked.trial.fits:
            finalists.append(_budget_plan(search, unchecked, smallest))
        return _measured(tuple(finalists), measure)
    # Rule 9: every candidate planned, each with its policy's host cost; the step without a
    # policy first, so that a tie goes to it (rule 7), and without a checkpoint last (rule 10;
    # the tries with the last regions unchecked are among the search's).
    candidates = [Choice(plain), Choice(search.every_block), search.charged(best)]
    candidates += [search.charged(tried) for tried in search.tried]
    if unchecked is not None:
        candidates.append(unchecked)
    fastest = decision.fastest([candidate.trial.outcome for candidate in candidates])
    return _budget_plan(search, candidates[0 if fastest is None else fastest], smallest)


def _budget_plan(search: Search, chosen: Choice, smallest: int | None) -> BudgetPlan:
    """The plan of ``chosen``, its inputs held on the device where that fits and is no slower
    (Note [The budget search], rule 6), then its stash chosen (Note [The stash]); ``smallest``
    is the least peak the search planned."""
    trial = chosen.trial
    held = None
    if chosen.checkpoint:  # the step without any checkpoint has no inputs to hold
        held = search.attempt_held(
            trial.settings,
            chosen.decisions,
            chosen.kept_in_last,
            policy_cost=True,
            unchecked_last=chosen.unchecked_last,
        )
    if held is not None and decision.holds_inputs_on_device(held.outcome, trial.seconds):
        trial = held
    trial = _with_stash(search, chosen, trial)
    budget = search.budget
    least = trial.plan.peak_bytes if smallest is None else smallest
    fixed = 2 * trial.plan.parameter_bytes  # parameters and gradients: no batch shrinks them
    return BudgetPlan(
        budget_bytes=budget.device_bytes,
        host_budget_bytes=budget.host_bytes,
        ranks_per_node=budget.ranks_per_node,
        fits=trial.fits,
        decisions=tuple(sorted(chosen.decisions.items())),
        kept_in_last=tuple(sorted(chosen.kept_in_last.items())),
        regions=search.regions,
        settings=trial.settings,
        checkpoint=chosen.checkpoint,
        unchecked_last=chosen.unchecked_last,
        peak_bytes=trial.plan.peak_bytes,
        pinned_bytes_per_node=trial.plan.pinned_bytes * budget.ranks_per_node,
        step_seconds=trial.seconds,
        every_block_seconds=search.every_block.seconds,
        smallest_budget_bytes=least,
        kinds=search.kinds,
        strategy_plan=trial.plan,
        batch_fraction=None
        if trial.fits
        else decision.batch_fraction(budget.device_bytes, least, fixed),
    )


def _with_stash(search: Search, chosen: Choice, trial: Trial) -> Trial:
    """``trial`` with the largest stash that fits, where its copies back cost it time and the
    stash makes it faster; else ``trial`` itself (Note [The stash])."""
    if not (chosen.checkpoint and trial.fits):
        return trial
    plan, settings = trial.plan, trial.settings
    no_copies_back = Figures(plan.forward_flops, plan.backward_flops, plan.bytes_to_host, 0)
    seconds = step_seconds(
        no_copies_back,
        search.device,
        settings.prefetch,
        search.policy_ops_of(chosen.decisions, chosen.kept_in_last),
        search.host_ops_of(chosen.unchecked_last),
    )
    if not decision.stash_pays(trial.seconds, seconds):  # rule 1
        return trial
    offloaded = [save.nbytes for save in trial.saves if save.fate == "offloaded"]
    current = settings.stash_bytes
    levels = [current, *(level for level in decision.stash_levels(offloaded) if level > current)]
    tried: dict[int, Trial] = {}

    def fits(level: int) -> bool:
        stashed = dataclasses.replace(settings, stash_bytes=level)
        tried[level] = search.attempt(
            chosen.decisions,
            chosen.kept_in_last,
            stashed,
            policy_cost=True,
            unchecked_last=chosen.unchecked_last,
        )
        return tried[level].fits

    stash = decision.largest_stash(levels, fits)  # rule 2
    if stash == current or not decision.improves(tried[stash].outcome, trial.seconds):
        return trial
    return tried[stash]


def _measured(
    finalists: tuple[BudgetPlan, ...],
    measure: Callable[[Sequence[BudgetPlan]], Sequence[float]],
) -> BudgetPlan:
    """The finalist ``measure`` times fastest, with the times (Note [Measured finalists])."""
    seconds = [float(value) for value in measure(finalists)]
    if len(seconds) != len(finalists) or not all(value > 0 for value in seconds):
        raise ValueError(
            "measure= must return one positive step time in seconds per plan it is given "
            f"({len(finalists)}), math.inf for a plan that could not run; got {seconds}"
        )
    if min(seconds) == math.inf:
        raise ValueError(f"measure= could run none of the {len(finalists)} plans it was given")
    fastest = min(range(len(finalists)), key=seconds.__getitem__)
    others = [value for index, value in enumerate(seconds) if index != fastest]
    return dataclasses.replace(finalists[fastest], measured_seconds=(seconds[fastest], *others))
