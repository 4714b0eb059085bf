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
of those numbers, which says what to plan next and what to keep.

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
        and rules 7 and 9 charge it at the end, where every try is a candidate. It is not
        hidden by the device's time (Note [Host and device overlap] in
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

Note [The stash]
    ``stash_bytes`` keeps the newest offloaded inputs on the device: their copy to the host
    still happens, their copy back does not. It trades device memory for copies back.
    Rule 1. The stash is chosen last, over the plan the search returns (Note [The budget
        search], rule 9), keeping every other choice: it is tried only where that step's copies
        back cost it time (the time model estimates it faster without them: the link is its
        limit) and the step fits; elsewhere the settings' stash stays.
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
from typing import NamedTuple

import torch

from matepoint._options import OffloadSettings
from matepoint._planner import decision
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.op_kinds import KindProfile, RegionProfiler
from matepoint._planner.policy import (
    AVAILABLE,
    OFFLOAD_AVAILABLE,
    Decision,
    context_fn_of,
    scoped_kinds_of,
)
from matepoint._planner.step import Planned, SavedInput, StrategyPlan
from matepoint._planner.time_model import DeviceModel, step_seconds

__all__ = ["fastest_under"]


# Steps planned to keep kinds in the last regions only, at most (Note [The budget search], rule 5).
_REGION_TRIES = 2
# Steps planned to find how many last regions run without a checkpoint, at most (rule 10).
_UNCHECKED_TRIES = 4


class _Trial(NamedTuple):
    """One planned candidate: its step, its settings, its estimated time, whether it fits, and
    the checkpoint inputs it saved (Note [The stash] reads which it offloads)."""

    plan: StrategyPlan
    settings: OffloadSettings
    seconds: float
    fits: bool
    saves: tuple[SavedInput, ...] = ()

    @property
    def outcome(self) -> decision.Outcome:
        """What the decision rule sees of it."""
        return decision.Outcome(self.seconds, self.fits)


@dataclasses.dataclass(frozen=True)
class _Budget:
    """What a step may use.

    Attributes:
        device_bytes: Device memory the step may use.
        host_bytes: Pinned host RAM one node may use, or None for no limit.
        ranks_per_node: Ranks sharing a node's host RAM, each with its own pool.
    """

    device_bytes: int
    host_bytes: int | None
    ranks_per_node: int

    def fits(self, plan: StrategyPlan) -> bool:
        """Whether ``plan`` fits both budgets, its pool never raising."""
        return decision.fits(
            plan.peak_bytes,
            plan.pinned_bytes,
            self.ranks_per_node,
            self.device_bytes,
            self.host_bytes,
            plan.pool_would_raise,
        )

    def fits_host(self, plan: StrategyPlan) -> bool:
        """Whether ``plan``'s host side fits, whatever the device budget."""
        return decision.fits_host(
            plan.pinned_bytes, self.ranks_per_node, self.host_bytes, plan.pool_would_raise
        )


def _timed(
    plan: StrategyPlan,
    settings: OffloadSettings,
    device: DeviceModel,
    budget: _Budget,
    host_ops: int,
    policy_ops: int = 0,
    saves: tuple[SavedInput, ...] = (),
) -> _Trial:
    """``plan`` as a candidate, timed with ``host_ops`` ops on the host, ``policy_ops`` of them
    through a policy (Note [Host and device overlap] in ``matepoint._planner.time_model``)."""
    seconds = step_seconds(plan, device, settings.prefetch, policy_ops, host_ops)
    return _Trial(plan, settings, seconds, budget.fits(plan), saves)


class _Figures(NamedTuple):
    """A step's figures as the time model reads them (``StepFigures``), to time it otherwise."""

    forward_flops: int
    backward_flops: int
    bytes_to_host: int
    bytes_to_device: int


@dataclasses.dataclass
class _Search:
    """One budget search: what it plans with, and the least peak it has planned.

    Attributes:
        replan: Plans the matepoint step with other settings and a ``context_fn=``.
        device: The time model's device.
        budget: What the step may use.
        regions: The profiled step's checkpoint calls, at least 1 (Note [A plan's regions]).
        profile: The profiled step's regions, op by op between module events, from which a
            plan's policy is charged the ops torch's modes see (Note [The budget search], rule
            2); None where no mode runs in the step (rule 11).
        host_ops: Ops the host runs in one checkpointed step: the regions' forward, its
            recomputation and backward, taken as many again as forward.
        kinds: The profiled kinds of op, best to keep first (Note [Op kinds]).
        every_block: The profiled step: matepoint on every region, nothing kept.
        calls_are_regions: Whether every non-reentrant checkpoint call of the profiled step is
            a region (Note [The budget search], rule 10).
        smallest: The least peak among the steps planned so far whose host side fits, the
            profile's included (Note [The budget search], rule 8); None before there is one.
    """

    replan: Callable[..., Planned]
    device: DeviceModel
    budget: _Budget
    regions: int
    profile: RegionProfiler | None
    host_ops: int
    kinds: tuple[KindProfile, ...]
    every_block: _Trial
    calls_are_regions: bool
    smallest: int | None
    tried: list[_Choice] = dataclasses.field(default_factory=list)

    def attempt(
        self,
        decisions: dict[str, Decision],
        kept_in_last: dict[str, int],
        settings: OffloadSettings,
        policy_cost: bool = False,
        unchecked_last: int = 0,
    ) -> _Trial:
        """Plan one candidate, its last ``unchecked_last`` regions without a checkpoint; its
        time leaves out the policy's host cost unless asked."""
        context_fn = context_fn_of(decisions, kept_in_last, self.regions)
        checkpointed = self.regions - unchecked_last if unchecked_last else None
        planned, saves = self.replan(
            settings, context_fn=context_fn, checkpointed_calls=checkpointed
        )
        self.note_peak(planned)
        ops = self.policy_ops_of(decisions, kept_in_last) if policy_cost else 0
        host_ops = self.host_ops_of(unchecked_last)
        trial = _timed(planned, settings, self.device, self.budget, host_ops, ops, saves)
        self.tried.append(_Choice(trial, dict(decisions), dict(kept_in_last), True, unchecked_last))
        return trial

    def host_ops_of(self, unchecked_last: int) -> int:
        """The ops the host runs in a step whose last ``unchecked_last`` regions have no
        checkpoint: theirs are not run again in backward."""
        recomputed = self.host_ops // 3  # one pass of the regions' ops
        return self.host_ops - recomputed * min(unchecked_last, self.regions) // self.regions

    def charged(self, choice: _Choice) -> _Choice:
        """``choice`` timed with its policy's host cost, where it has a policy (Note [The
        budget search], rules 2 and 7)."""
        if not (choice.decisions or choice.kept_in_last):
            return choice
        trial = choice.trial
        ops = self.policy_ops_of(choice.decisions, choice.kept_in_last)
        host_ops = self.host_ops_of(choice.unchecked_last)
        seconds = step_seconds(trial.plan, self.device, trial.settings.prefetch, ops, host_ops)
        return dataclasses.replace(choice, trial=trial._replace(seconds=seconds))

    def policy_ops_of(self, decisions: dict[str, Decision], kept_in_last: dict[str, int]) -> int:
        """The ops a plan's policy meets in a step: in each region that runs torch's modes,
        those inside the windows its scoped kinds open, in forward and in the recomputation
        (Note [The budget search], rule 2); a region that recomputes everything runs none
        (Note [A plan's regions], rule 5, in ``matepoint._planner.policy``)."""
        profile = self.profile
        if profile is None:
            return 0
        ops = 0
        for region in range(self.regions):
            scoped = scoped_kinds_of(decisions, kept_in_last, self.regions, region)
            if scoped is None or scoped:
                ops += profile.policy_ops(region, scoped)
        return ops

    def note_peak(self, planned: StrategyPlan) -> None:
        """Count ``planned``'s peak in the smallest, where its host side fits (Note [The budget
        search], rule 8)."""
        if self.budget.fits_host(planned):
            peak = planned.peak_bytes
            self.smallest = peak if self.smallest is None else min(self.smallest, peak)

    @property
    def holding_min_offload_bytes(self) -> int | None:
        """The ``min_offload_bytes`` that holds every checkpoint input on the device, or None
        where the profiled step moves none (Note [The budget search], rule 6)."""
        return decision.inputs_on_device_min_offload_bytes(self.every_block.plan.bytes_to_host)


@dataclasses.dataclass
class _Choice:
    """The best candidate so far and the choice that gave it.

    Attributes:
        trial: Its planned step.
        decisions: Per class of op kept or offloaded in every region; the rest are recomputed.
        kept_in_last: Classes kept in the last regions only, with how many.
        checkpoint: False for the step without any checkpoint (Note [The budget search],
            rule 10).
        unchecked_last: The last regions run without a checkpoint (rule 10).
    """

    trial: _Trial
    decisions: dict[str, Decision] = dataclasses.field(default_factory=dict)
    kept_in_last: dict[str, int] = dataclasses.field(default_factory=dict)
    checkpoint: bool = True
    unchecked_last: int = 0


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
        measure: Times plans on the real device (Note [Measured finalists]), or None to
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
    budget = _Budget(budget_bytes, host_budget_bytes, ranks_per_node)
    search = _profiled(replan, settings, budget, device)
    plain = _start(search)
    best = _Choice(plain)
    overflowed = _decide_kinds(search, best)
    _keep_in_last_regions(search, best, overflowed)
    unchecked_last = _unchecked_last_regions(search, plain, no_checkpoint)
    return _conclude(search, plain, best, measure, no_checkpoint, unchecked_last)


def _profiled(
    replan: Callable[..., Planned],
    settings: OffloadSettings,
    budget: _Budget,
    device: DeviceModel,
) -> _Search:
    """Plan the step once with every region profiled (Note [Op kinds]), and start a search."""
    profiler = RegionProfiler()
    profiled, saves = replan(settings, context_fn=profiler)
    search = _Search(
        replan=replan,
        device=device,
        budget=budget,
        regions=max(profiler.regions, 1),
        # No selective mode runs in a compiled graph (rule 11).
        profile=None if settings.compiled_offload else profiler,
        host_ops=3 * profiler.ops,
        kinds=tuple(profiler.kinds()),
        every_block=_timed(profiled, settings, device, budget, 3 * profiler.ops, saves=saves),
        calls_are_regions=profiled.checkpoint_calls == profiler.regions
        and not profiled.recomputed_checkpoint_calls,
        smallest=None,
    )
    search.note_peak(profiled)
    return search


def _start(search: _Search) -> _Trial:
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
    holding = search.holding_min_offload_bytes
    if not decision.tries_inputs_on_device((), settings.min_offload_bytes, holding):
        return every_block
    assert holding is not None
    held = search.attempt({}, {}, dataclasses.replace(settings, min_offload_bytes=holding))
    return held if held.fits else every_block


def _decide_kinds(search: _Search, best: _Choice) -> list[KindProfile]:
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


def _keep_every_kind(search: _Search, best: _Choice, kinds: list[KindProfile]) -> bool:
    """Plan every kind kept at once; take it if it fits and is faster, and say whether it was
    taken (Note [Steps the search spares], rule 2)."""
    every_kind: dict[str, Decision] = {kind.kind: "keep" for kind in kinds}
    everything = search.attempt(every_kind, {}, best.trial.settings)
    if not decision.improves(everything.outcome, best.trial.seconds):
        return False
    best.trial, best.decisions = everything, every_kind
    return True


def _decide_kind(search: _Search, best: _Choice, kind: KindProfile) -> bool:
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
    planned: list[_Trial] = []
    for choice, prefetch in tries:
        settings = dataclasses.replace(trial.settings, prefetch=prefetch)
        planned.append(search.attempt({**best.decisions, kind.kind: choice}, {}, settings))
        if planned[-1].fits:  # the first try that fits decides: no later one is planned
            break
    taken = decision.kind_choice(trial.seconds, [tried.outcome for tried in planned])
    if taken is not None:
        best.trial, best.decisions[kind.kind] = planned[taken], tries[taken][0]
    return keep_can_fit and planned[0].fits


def _keep_in_last_regions(search: _Search, best: _Choice, overflowed: list[KindProfile]) -> None:
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
    search: _Search, plain: _Trial, no_checkpoint: StrategyPlan | None
) -> _Choice | None:
    """The starting step with the most last regions that fit run without a checkpoint, where
    that is faster, from the starting step as it is and with its inputs held on the device;
    None where no count is tried or none fits (Note [The budget search], rule 10). Every step
    planned joins the search's tries."""
    if not (_UNCHECKED_TRIES and plain.fits and search.calls_are_regions and search.regions > 1):
        return None
    if no_checkpoint is not None and search.budget.fits(no_checkpoint):
        return None  # every region unchecked fits: the step without any checkpoint is faster
    starts = [plain]
    holding = search.holding_min_offload_bytes
    if decision.tries_inputs_on_device((), plain.settings.min_offload_bytes, holding):
        assert holding is not None
        held = search.attempt(
            {}, {}, dataclasses.replace(plain.settings, min_offload_bytes=holding)
        )
        starts += [held] if held.fits else []
    over_peak = None if no_checkpoint is None else no_checkpoint.peak_bytes
    found = [_most_unchecked(search, start, over_peak) for start in starts]
    # The inputs held first, so that a tie goes to them (rule 6).
    chosen = [choice for choice in reversed(found) if choice is not None]
    return min(chosen, key=lambda choice: choice.trial.seconds, default=None)


def _most_unchecked(search: _Search, plain: _Trial, over_peak: int | None) -> _Choice | None:
    """``plain`` with the most last regions that fit unchecked, where that is faster than
    ``plain``; ``over_peak`` is the peak of the step without any checkpoint, if planned."""
    fitting, fitting_peak, over = 0, plain.plan.peak_bytes, search.regions
    chosen: _Choice | None = None
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
            chosen = _Choice(trial, unchecked_last=count)
    return chosen


def _conclude(
    search: _Search,
    plain: _Trial,
    best: _Choice,
    measure: Callable[[Sequence[BudgetPlan]], Sequence[float]] | None,
    no_checkpoint: StrategyPlan | None,
    unchecked_last: _Choice | None,
) -> BudgetPlan:
    """The plan: the fastest candidate that fits, its policy's host cost counted, or the
    faster finalist measured (Note [The budget search], rules 7, 9 and 10; Note [Measured
    finalists])."""
    smallest = search.smallest  # the on-device tries of _budget_plan are never counted in it
    unchecked: _Choice | None = None
    if no_checkpoint is not None:
        # No checkpoint: forward and backward, no recomputation and no policy.
        trial = _timed(
            no_checkpoint, plain.settings, search.device, search.budget, 2 * search.host_ops // 3
        )
        unchecked = _Choice(trial, checkpoint=False)
    if not (best.decisions or best.kept_in_last):  # Note [Measured finalists], rule 3
        measure = None
    if measure is not None:  # Note [Measured finalists], rule 2
        finalists = [
            _budget_plan(search, search.charged(best), smallest),
            _budget_plan(search, _Choice(plain), smallest),
        ]
        if unchecked_last is not None:
            finalists.append(_budget_plan(search, unchecked_last, smallest))
        if unchecked is not None and unchecked.trial.fits:
            finalists.append(_budget_plan(search, unchecked, smallest))
        return _measured(tuple(finalists), measure)
    # Rule 9: every candidate planned, each with its policy's host cost; the step without a
    # policy first, so that a tie goes to it (rule 7), and without a checkpoint last (rule 10;
    # the tries with the last regions unchecked are among the search's).
    candidates = [_Choice(plain), _Choice(search.every_block), search.charged(best)]
    candidates += [search.charged(tried) for tried in search.tried]
    if unchecked is not None:
        candidates.append(unchecked)
    fastest = decision.fastest([candidate.trial.outcome for candidate in candidates])
    return _budget_plan(search, candidates[0 if fastest is None else fastest], smallest)


def _budget_plan(search: _Search, chosen: _Choice, smallest: int | None) -> BudgetPlan:
    """The plan of ``chosen``, its inputs held on the device where that fits and is no slower
    (Note [The budget search], rule 6), then its stash chosen (Note [The stash]); ``smallest``
    is the least peak the search planned."""
    trial = chosen.trial
    holding = search.holding_min_offload_bytes if chosen.checkpoint else None
    if decision.tries_inputs_on_device(
        chosen.decisions.values(), trial.settings.min_offload_bytes, holding
    ):
        assert holding is not None
        on_device = dataclasses.replace(trial.settings, min_offload_bytes=holding)
        held = search.attempt(
            chosen.decisions,
            chosen.kept_in_last,
            on_device,
            policy_cost=True,
            unchecked_last=chosen.unchecked_last,
        )
        if decision.holds_inputs_on_device(held.outcome, trial.seconds):
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


def _with_stash(search: _Search, chosen: _Choice, trial: _Trial) -> _Trial:
    """``trial`` with the largest stash that fits, where its copies back cost it time and the
    stash makes it faster; else ``trial`` itself (Note [The stash])."""
    if not (chosen.checkpoint and trial.fits):
        return trial
    plan, settings = trial.plan, trial.settings
    no_copies_back = _Figures(plan.forward_flops, plan.backward_flops, plan.bytes_to_host, 0)
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
    tried: dict[int, _Trial] = {}

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
