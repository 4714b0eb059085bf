"""The fastest step that fits a device-memory budget: keep, offload or recompute each kind of op.

A checkpointed step recomputes every activation of its regions in backward, a large share of a
transformer's step (docs/benchmarks.md); keeping what is expensive to recompute buys that time back
with device memory, and offloading it buys it back with link time that forward's compute can
hide. :func:`fastest_under` chooses, per kind of op inside the checkpointed regions (Note [Op
kinds] in ``matepoint._planner.op_kinds``), one of the three, in every region or keeping in the
last regions only (Note [A plan's regions]), and the look-ahead, so that the planned step is as
fast as the time model says it can be while its planned peak stays within the budget. Every
candidate is planned by running the step itself on the meta device through the real engine
(``matepoint.plan``), so its peak, host RAM and link bytes are the planner's exact figures; only
the times are estimates.

The search is two parts: the replanning loop here, which plans candidate steps and hands their
outcomes on as numbers, and the decision rule in ``matepoint._planner.decision``, pure functions
of those numbers, which says what to plan next and what to keep. The loop's state (a planned
candidate, the budgets, the best choice) is in ``matepoint._planner.search_state``, and its
answer (the fastest that fits or the finalist measured fastest, its inputs held and its stash
chosen) in ``matepoint._planner.conclusion``.

Note [The budget search]
    Rule 1. Kinds are ranked by recompute FLOPs per byte their outputs hold (attention near
        twice the sequence length, a matrix product near its inner width) and taken best first.
        A kind the profiled step's recomputation never runs (a block's last projection, after
        everything backward reads: torch's recomputation stops before it) is not tried: keeping
        or offloading it saves nothing.
    Rule 2. A policy costs host time (``DeviceModel.policy_seconds_per_op``) on each op torch's
        selective-checkpoint modes see, in forward and in the recomputation. A region runs them
        only in the windows around the module calls that run ops of the kinds its policy keeps
        or offloads (Note [Scoped selective-checkpoint modes] in
        ``matepoint._planner.scoped_modes``), over the whole region where it decides
        ``"other"``, and not at all where it recomputes everything: a plan that keeps two
        projections pays for the ops of their windows, not for every op. The profile counts
        each region's ops between its module events, in forward and in the recomputation as
        far as torch runs it (its early stop), and finds a plan's windows in them by the
        modes' own rule (``scoped_modes.window_runs``). Tries are compared without the cost,
        and rules 7 and 9 charge it at the end, where every try is a candidate: windows
        overlap, so a kind's cost depends on the kinds decided after it. Charged per try,
        attention (tried first) pays for its whole window from the QKV projection to the
        output projection, which the projections kept after it open anyway; on llama8 at
        torch checkpoint's peak that search drops attention for another projection. It is
        not hidden by the device's time (Note [Host and device overlap] in
        ``matepoint._planner.time_model``, rule 4).
    Rule 3. Where the starting step (matepoint on every region) does not fit with its
        look-ahead, it is planned again without (``prefetch`` 0), which is taken if it fits;
        where that does not fit either, with the checkpoint inputs held on the device (rule 6),
        which needs no host RAM: a host budget below the every-block pool still leaves keeps
        to try.
    Rule 4. Each kind is tried kept, then offloaded with the look-ahead in force, then offloaded
        with one record fetched ahead (``prefetch`` 1). The first try that fits decides: it is
        taken if the step gets faster (the link's time beyond the compute it overlaps counts
        against an offload), else the kind is recomputed. An offload saves no more recompute
        than keeping, so a keep that fits without helping rules it out; fewer records ahead
        only help to fit, never to be faster. Before torch 2.11, whose selective checkpointing
        has no offload values, a kind is kept or recomputed only.
    Rule 5. A kind whose keep did not fit in every region is then tried kept in the last
        regions only (Note [A plan's regions]): as many as the room left suggests (its bytes
        per region against the budget less the best peak), then half as many; best kind first,
        two steps planned at most over all kinds. A count is taken if it fits and the step gets
        faster.
    Rule 6. Where the policy offloads nothing, the same choice with the checkpoint inputs held
        on the device (``min_offload_bytes`` above them all, so torch's checkpoint where nothing
        is kept) is taken if it fits and is no slower: the link's copies cost the host time to
        issue and compete with compute on a small or launch-bound model, which the time model
        does not see, and the budget has no use for the memory they free. Where the profiled
        step moves no input, or the choice holds them already, there is nothing to try: the
        try never lowers ``min_offload_bytes``.
    Rule 7. A policy is kept only if the best step with it, its host cost counted (rule 2), is
        faster than the best step without one: on a small, launch-bound model it may not be.
    Rule 9. The plan returned is the fastest that fits of every candidate planned, each timed
        with its policy's host cost: the tries, the every-block step, the step without a policy
        (first, so that a tie goes to it) and rule 10's. No plan that fits is estimated faster
        than the one returned (rule 6's try, taken only where no slower, keeps it so).
    Rule 10. The step without any checkpoint (``MemoryPlan``'s ``"none"`` strategy) is a
        candidate where its peak fits: it recomputes nothing and pays no policy. Where it is the
        fastest, the plan says so (``checkpoint`` False), and the integrations then run every
        block as it is. Where it does not fit, the step that runs its last ``k`` regions
        without a checkpoint (their blocks as they are: no recomputation, no policy, no
        offload) and the others as the starting step does is a candidate too, with the most
        ``k`` that fits (``BudgetPlan.unchecked_last``): the last blocks' activations are the
        first backward frees. ``k`` is found by planning, each count where the line through
        the peaks of the most that fitted and the least that did not meets the budget
        (``decision.unchecked_count``), at most four steps; from the starting step as it is
        and again with its inputs held on the device (rule 6), since offloading them makes
        room for more unchecked regions but costs link time, and the time model weighs the
        two. It is tried only where every checkpoint call of the profiled step is a region
        (none nested in another's recomputation), so that the calls left unchecked are the
        regions' last.
    Rule 11. A plan made with ``compiled_offload`` in force offloads nothing through its
        policy: under a whole-model compile torch's selective checkpointing saves an offloaded
        output on the device (docs/selective.md), so an offload planned there held more than
        planned (llama8 at torch checkpoint's peak 0.10 GiB over it on an H200). Such a plan
        keeps or recomputes each kind, as before torch 2.11; matepoint still moves the
        checkpoint inputs. Its policy is resolved when torch traces the graph, whole-model or
        block by block (Note [A block compiled with its plan] in
        ``matepoint._compiled.blocks``): no selective mode runs in the step, so no policy host
        cost is charged (rule 2).
    Rule 8. A step fits where its peak fits the device budget and its host side fits too: its
        pinned pool, times the node's ranks, within the host budget, and no pool that would
        raise (``on_pool_exhausted="raise"`` past ``pool_cap_bytes``). The smallest budget
        that would fit is the least peak among the tries whose host side fits, so that
        planning again at it, with the same host budget, fits.
    A step is planned per try: one profile, then at most a few per kind.

Note [Steps the search spares]
    Each try of the search is a planned step, the search's whole cost; two bounds spare the
    tries whose outcome they already know, and change no choice the search makes.
    Rule 1. Keeping a kind holds its outputs of every region from forward into backward, on top
        of what forward already leaves: a keep whose outputs, added to the device bytes at the
        end of the best step so far's forward, exceed the budget cannot fit. It is not planned,
        and the kind goes on to an offload as after a keep planned that did not fit.
    Rule 2. Keeping a kind adds at most its outputs, each rounded as the allocator rounds it, to
        any moment of the step: where the best step's peak plus the outputs of every kind left
        fits the budget, every kind is planned kept at once, one step instead of one per kind.
        The search would have kept each (a keep that fits only saves recompute), so where that
        step fits and is faster it is taken; where it is not, the search goes on kind by kind.
    Rule 3. Neither bound decides on its own that a plan fits: only planned steps do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from matepoint._options import OffloadSettings
from matepoint._planner import decision
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.conclusion import conclude
from matepoint._planner.op_kinds import KindProfile, RegionProfiler
from matepoint._planner.policy import (
    AVAILABLE,
    OFFLOAD_AVAILABLE,
    Decision,
)
from matepoint._planner.search_state import Budget, Choice, Search, Trial, timed
from matepoint._planner.step import Planned, StrategyPlan
from matepoint._planner.time_model import DeviceModel

__all__ = ["fastest_under"]


# Steps planned to keep kinds in the last regions only, at most (Note [The budget search], rule 5).
_REGION_TRIES = 2
# Steps planned to find how many last regions run without a checkpoint, at most (rule 10).
_UNCHECKED_TRIES = 4


def fastest_under(
    replan: Callable[..., Planned],
    settings: OffloadSettings,
    budget_bytes: int,
    host_budget_bytes: int | None,
    ranks_per_node: int,
    device: DeviceModel,
    measure: Callable[[Sequence[BudgetPlan]], Sequence[float]] | None = None,
    no_checkpoint: StrategyPlan | None = None,
) -> BudgetPlan:
    """Search keep / offload / recompute per kind of op; see Note [The budget search].

    Args:
        replan: Plans the matepoint step with other settings (and a ``context_fn=`` on every
            checkpoint call).
        settings: The settings to start from (the look-ahead is lowered if that helps fit).
        budget_bytes: Device memory the step may use.
        host_budget_bytes: Pinned host RAM one node may use, or None for no limit.
        ranks_per_node: Ranks sharing a node's host RAM.
        device: The time model's device.
        measure: Times plans on the real device (Note [Measured finalists] in
            ``matepoint._planner.conclusion``), or None to
            trust the time model.
        no_checkpoint: The step planned without any checkpoint, a candidate where it fits
            (Note [The budget search], rule 10), or None.

    Returns:
        The plan.
    """
    if not AVAILABLE:
        raise RuntimeError(
            "a budget plan chooses through torch's selective checkpointing, which torch "
            f"{torch.__version__} lacks: it needs torch 2.5 or newer"
        )
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    budget = Budget(budget_bytes, host_budget_bytes, ranks_per_node)
    search = _profiled(replan, settings, budget, device)
    plain = _start(search)
    best = Choice(plain)
    overflowed = _decide_kinds(search, best)
    _keep_in_last_regions(search, best, overflowed)
    unchecked_last = _unchecked_last_regions(search, plain, no_checkpoint)
    return conclude(search, plain, best, measure, no_checkpoint, unchecked_last)


def _profiled(
    replan: Callable[..., Planned],
    settings: OffloadSettings,
    budget: Budget,
    device: DeviceModel,
) -> Search:
    """Plan the step once with every region profiled (Note [Op kinds]), and start a search."""
    profiler = RegionProfiler()
    profiled, saves = replan(settings, context_fn=profiler)
    search = Search(
        replan=replan,
        device=device,
        budget=budget,
        regions=max(profiler.regions, 1),
        # No selective mode runs in a compiled graph (rule 11).
        profile=None if settings.compiled_offload else profiler,
        host_ops=3 * profiler.ops,
        kinds=tuple(profiler.kinds()),
        every_block=timed(profiled, settings, device, budget, 3 * profiler.ops, saves=saves),
        calls_are_regions=profiled.checkpoint_calls == profiler.regions
        and not profiled.recomputed_checkpoint_calls,
        smallest=None,
    )
    search.note_peak(profiled)
    return search


def _start(search: Search) -> Trial:
    """The best step without a policy: the profiled one, or without look-ahead, or with the
    checkpoint inputs held on the device, the first of them that fits (Note [The budget
    search], rule 3)."""
    every_block = search.every_block
    settings = every_block.settings
    if every_block.fits:
        return every_block
    if decision.starts_without_look_ahead(every_block.fits, settings.prefetch):
        fewer = search.attempt({}, {}, dataclasses.replace(settings, prefetch=0))
        if fewer.fits:
            return fewer
    held = search.attempt_held(settings)
    return held if held is not None and held.fits else every_block


def _decide_kinds(search: Search, best: Choice) -> list[KindProfile]:
    """Keep, offload or recompute each kind worth a try, best first, into ``best``.

    Returns the kinds whose keep did not fit in every region (Note [The budget search], rules 1
    and 4).
    """
    if not best.trial.fits:
        return []
    recomputed = [kind.recomputed for kind in search.kinds]
    kinds = [search.kinds[index] for index in decision.kinds_to_try(recomputed)]
    # Note [Steps the search spares], rule 2: every kind kept at once, where that surely fits.
    surely_fits = len(kinds) > 1 and decision.surely_fits_kept(
        best.trial.plan.peak_bytes,
        [kind.output_bytes for kind in kinds],
        [kind.calls for kind in kinds],
        search.budget.device_bytes,
    )
    if surely_fits and _keep_every_kind(search, best, kinds):
        return []
    return [kind for kind in kinds if not _decide_kind(search, best, kind)]


def _keep_every_kind(search: Search, best: Choice, kinds: list[KindProfile]) -> bool:
    """Plan every kind kept at once; take it if it fits and is faster, and say whether it was
    taken (Note [Steps the search spares], rule 2)."""
    every_kind: dict[str, Decision] = {kind.kind: "keep" for kind in kinds}
    everything = search.attempt(every_kind, {}, best.trial.settings)
    if not decision.improves(everything.outcome, best.trial.seconds):
        return False
    best.trial, best.decisions = everything, every_kind
    return True


def _decide_kind(search: Search, best: Choice, kind: KindProfile) -> bool:
    """Try ``kind`` kept, then offloaded, until a try fits, and take what the decision rule
    says (Note [The budget search], rule 4). Returns whether its keep fitted."""
    trial = best.trial
    forward_end = trial.plan.baseline_bytes + trial.plan.held_after_forward_bytes
    # Note [Steps the search spares], rule 1: a keep that cannot fit is not planned.
    keep_can_fit = not decision.cannot_fit_kept(
        forward_end, kind.output_bytes, search.budget.device_bytes
    )
    # Rule 11: under the compiled path an offload is a keep; only eager offloads.
    offload = OFFLOAD_AVAILABLE and not trial.settings.compiled_offload
    tries = decision.kind_tries(trial.settings.prefetch, offload, keep_can_fit)
    planned: list[Trial] = []
    for choice, prefetch in tries:
        settings = dataclasses.replace(trial.settings, prefetch=prefetch)
        planned.append(search.attempt({**best.decisions, kind.kind: choice}, {}, settings))
        if planned[-1].fits:  # the first try that fits decides: no later one is planned
            break
    taken = decision.kind_choice(trial.seconds, [tried.outcome for tried in planned])
    if taken is not None:
        best.trial, best.decisions[kind.kind] = planned[taken], tries[taken][0]
    return keep_can_fit and planned[0].fits


def _keep_in_last_regions(search: Search, best: Choice, overflowed: list[KindProfile]) -> None:
    """Try the kinds whose keep did not fit everywhere kept in the last regions only, into
    ``best`` (Note [The budget search], rule 5)."""
    tries_left = _REGION_TRIES
    for kind in overflowed:
        room = search.budget.device_bytes - best.trial.plan.peak_bytes
        counts = decision.region_counts(
            search.regions, room, kind.calls, kind.output_bytes, tries_left
        )
        for count in counts:
            tries_left -= 1
            kept_in_last = {**best.kept_in_last, kind.kind: count}
            tried = search.attempt(best.decisions, kept_in_last, best.trial.settings)
            if decision.improves(tried.outcome, best.trial.seconds):
                best.trial, best.kept_in_last = tried, kept_in_last
                break


def _unchecked_last_regions(
    search: Search, plain: Trial, no_checkpoint: StrategyPlan | None
) -> Choice | None:
    """The starting step with the most last regions that fit run without a checkpoint, where
    that is faster, from the starting step as it is and with its inputs held on the device;
    None where no count is tried or none fits (Note [The budget search], rule 10). Every step
    planned joins the search's tries."""
    if not (_UNCHECKED_TRIES and plain.fits and search.calls_are_regions and search.regions > 1):
        return None
    if no_checkpoint is not None and search.budget.fits(no_checkpoint):
        return None  # every region unchecked fits: the step without any checkpoint is faster
    held = search.attempt_held(plain.settings)
    starts = [plain] if held is None or not held.fits else [plain, held]
    over_peak = None if no_checkpoint is None else no_checkpoint.peak_bytes
    found = [_most_unchecked(search, start, over_peak) for start in starts]
    # The inputs held first, so that a tie goes to them (rule 6).
    chosen = [choice for choice in reversed(found) if choice is not None]
    return min(chosen, key=lambda choice: choice.trial.seconds, default=None)


def _most_unchecked(search: Search, plain: Trial, over_peak: int | None) -> Choice | None:
    """``plain`` with the most last regions that fit unchecked, where that is faster than
    ``plain``; ``over_peak`` is the peak of the step without any checkpoint, if planned."""
    fitting, fitting_peak, over = 0, plain.plan.peak_bytes, search.regions
    chosen: Choice | None = None
    for _ in range(_UNCHECKED_TRIES):
        if over - fitting <= 1:
            break
        count = decision.unchecked_count(
            fitting, fitting_peak, over, over_peak, search.budget.device_bytes
        )
        trial = search.attempt({}, {}, plain.settings, unchecked_last=count)
        if not trial.fits:
            over, over_peak = count, trial.plan.peak_bytes
            continue
        fitting, fitting_peak = count, trial.plan.peak_bytes
        if decision.improves(trial.outcome, plain.seconds):
            chosen = Choice(trial, unchecked_last=count)
    return chosen
