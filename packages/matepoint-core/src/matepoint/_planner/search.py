"""The fastest step that fits a device-memory budget: keep, offload or recompute each kind of op.

A checkpointed step recomputes every activation of its regions in backward, which costs about a
fifth of a transformer's step; keeping what is expensive to recompute buys that time back with
device memory, and offloading it buys it back with link time that forward's compute can hide.
:func:`fastest_under` chooses, per kind of op inside the checkpointed regions (Note [Op kinds]
in ``matepoint._planner.op_kinds``), one of the three, in every region or keeping in the last
regions only (Note [A plan's regions]), and the look-ahead, so that the planned
step is as fast as the time model says it can be while its planned peak stays within the
budget. Every candidate is planned by running the step itself on the meta device through the
real engine (``matepoint.plan``), so its peak, host RAM and link bytes are the planner's exact
figures; only the times are estimates.

Note [The budget search]
    Kinds are ranked by recompute FLOPs per byte their outputs hold (attention near twice the
    sequence length, a matrix product near its inner width) and taken best first; a kind the
    profiled step's recomputation never runs (a block's last projection, after everything
    backward reads: torch's recomputation stops before it) is skipped, as keeping or offloading
    it saves nothing. Any policy at
    all costs host time on every op of the regions (``DeviceModel.policy_seconds_per_op``), the
    same whatever it keeps: the search compares choices without it, then keeps the policy only
    if what it saves pays for it (on a small, launch-bound model it may not). Each is kept on
    the device if the step still fits and gets faster; where keeping does not fit, it is
    offloaded if that fits and the step gets faster (the link's time beyond the compute it
    overlaps counts against it); else recomputed (an offload saves no more recompute than
    keeping, so a keep that fits without helping rules it out). When an offload does not fit
    with the look-ahead in force, fewer records fetched ahead (``prefetch`` 1) are tried. A kind
    that did not fit kept in every region is then tried kept in the last regions only (Note [A
    plan's regions]), as many as the room left suggests (its bytes per region against the budget
    less the peak), then half as many, best kind first and two steps planned at most. Last,
    where nothing is offloaded by the policy, the same choice with the checkpoint inputs held on
    the device (``min_offload_bytes`` above them all, so torch's checkpoint where nothing is
    kept) is taken if it fits: the link's copies cost the host time to issue and compete with
    compute on a small or launch-bound model, which the time model does not see, and the budget
    has no use for the memory they free. A step is planned per try: one profile, then at most a
    few per kind. Before torch 2.11, whose selective checkpointing has no offload values, a plan
    keeps or recomputes only.

Note [Measured finalists]
    The time model's least certain term is the policy's host cost: how much of it the
    device's work hides depends on the host's speed and the model's op sizes, and the share
    that shows differs several-fold between models and hosts (docs/budget.md). Given
    ``measure``, the search does not decide on that estimate: where it found a
    plan with a policy, it hands two finalists, that plan and the best without a policy (each
    with the checkpoint inputs held on the device where that fits), to ``measure``, which times
    them on the real model (``math.inf`` for one that could not run, out of memory), and
    returns the faster. A search that found no policy worth trying measures nothing.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from matepoint._options import OffloadSettings
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.op_kinds import KindProfile, RegionProfiler
from matepoint._planner.policy import AVAILABLE, OFFLOAD_AVAILABLE, Decision, context_fn_of
from matepoint._planner.step import Planned, StrategyPlan
from matepoint._planner.time_model import DeviceModel, step_seconds
from matepoint._planner.trace import ALLOCATION_GRANULARITY

__all__ = ["fastest_under"]


# Steps planned to keep kinds in the last regions only, at most (Note [The budget search]).
_REGION_TRIES = 2

# Note [Steps the search spares]
#     Each try of the search is a planned step, the search's whole cost; two bounds spare the
#     tries whose outcome they already know, and change no choice the search makes.
#     - Keeping a kind holds its outputs of every region from forward into backward, on top of
#       what forward already leaves: a keep whose outputs, added to the device bytes at the end
#       of the best step so far's forward, exceed the budget cannot fit, and is not planned (it
#       goes on to an offload, as a keep that was planned and did not fit).
#     - Keeping a kind adds at most its outputs (each rounded as the allocator rounds it) to any
#       moment of the step: where the best step's peak plus the outputs of every kind left
#       fits, every kind is planned kept at once, one step instead of one per kind. The search
#       would have kept each (a keep that fits only saves recompute), so where that step fits
#       and is faster it is taken; where it is not, the search goes on kind by kind.
#     Neither bound decides on its own that a plan fits: only planned steps do.

# Outputs of one op call, each rounded up to the allocator's granularity, at most (attention
# returns its output, its log-sum-exp and its random state): Note [Steps the search spares].
_OUTPUTS_PER_CALL = 4


def _cannot_fit_kept(best: StrategyPlan, kind: KindProfile, budget_bytes: int) -> bool:
    """Whether keeping ``kind`` on top of ``best`` surely exceeds the budget.

    Note [Steps the search spares].
    """
    forward_end = best.baseline_bytes + best.held_after_forward_bytes
    return forward_end + kind.output_bytes > budget_bytes


def _surely_fits_kept(best: StrategyPlan, kinds: Sequence[KindProfile], budget_bytes: int) -> bool:
    """Whether keeping every kind in ``kinds`` on top of ``best`` surely fits the budget.

    Note [Steps the search spares].
    """
    rounding = _OUTPUTS_PER_CALL * ALLOCATION_GRANULARITY
    added = sum(kind.output_bytes + kind.calls * rounding for kind in kinds)
    return best.peak_bytes + added <= budget_bytes


class _Trial(NamedTuple):
    """One planned candidate: its step, its settings and its estimated time."""

    plan: StrategyPlan
    settings: OffloadSettings
    seconds: float


def fastest_under(
    replan: Callable[..., Planned],
    settings: OffloadSettings,
    budget_bytes: int,
    host_budget_bytes: int | None,
    ranks_per_node: int,
    device: DeviceModel,
    measure: Callable[[Sequence[BudgetPlan]], Sequence[float]] | None = None,
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

    def fits(trial: _Trial) -> bool:
        host = trial.plan.pinned_bytes * ranks_per_node
        return trial.plan.peak_bytes <= budget_bytes and (
            host_budget_bytes is None or host <= host_budget_bytes
        )

    profiler = RegionProfiler()
    profiled = replan(settings, context_fn=profiler)[0]
    baseline = _Trial(profiled, settings, step_seconds(profiled, device, settings.prefetch))
    smallest, regions = baseline.plan.peak_bytes, max(profiler.regions, 1)
    kinds = profiler.kinds()
    # Every op of the regions meets the policy twice: in forward and in the recomputation.
    policy_ops = 2 * profiler.ops

    def attempt(
        decisions: dict[str, Decision],
        kept_in_last: dict[str, int],
        candidate: OffloadSettings,
        policy_cost: bool = False,
    ) -> _Trial:
        """Plan one candidate; its time leaves out the policy's host cost unless asked."""
        nonlocal smallest
        context_fn = context_fn_of(decisions, kept_in_last, regions)
        tried = replan(candidate, context_fn=context_fn)[0]
        smallest = min(smallest, tried.peak_bytes)
        ops = policy_ops if policy_cost and context_fn else 0
        return _Trial(tried, candidate, step_seconds(tried, device, candidate.prefetch, ops))

    best = baseline
    if not fits(baseline) and settings.prefetch > 0:
        fewer = attempt({}, {}, dataclasses.replace(settings, prefetch=0))
        best = fewer if fits(fewer) else best
    plain = best
    decisions: dict[str, Decision] = {}
    overflowed: list[KindProfile] = []  # kept everywhere, they did not fit
    # A kind backward never recomputes saves nothing kept or offloaded: not tried.
    candidates = [kind for kind in kinds if kind.recomputed] if fits(best) else []
    # Note [Steps the search spares]: every kind kept at once, where that surely fits.
    if len(candidates) > 1 and _surely_fits_kept(best.plan, candidates, budget_bytes):
        every_kind: dict[str, Decision] = {kind.kind: "keep" for kind in candidates}
        everything = attempt(every_kind, {}, best.settings)
        if fits(everything) and everything.seconds < best.seconds:
            best, decisions, candidates = everything, every_kind, []
    for kind in candidates:
        # Note [Steps the search spares]: a keep that cannot fit is not planned.
        kept = None
        if not _cannot_fit_kept(best.plan, kind, budget_bytes):
            kept = attempt({**decisions, kind.kind: "keep"}, {}, best.settings)
        if kept is not None and fits(kept):  # an offload saves what keeping saves, and link time
            if kept.seconds < best.seconds:
                best, decisions[kind.kind] = kept, "keep"
            continue
        overflowed.append(kind)
        ahead = best.settings.prefetch  # an offload that does not fit tries 1 record ahead
        for prefetch in dict.fromkeys((ahead, min(ahead, 1))) if OFFLOAD_AVAILABLE else ():
            offloaded = attempt(
                {**decisions, kind.kind: "offload"},
                {},
                dataclasses.replace(best.settings, prefetch=prefetch),
            )
            if fits(offloaded):  # fewer records ahead only helps to fit, never to be faster
                if offloaded.seconds < best.seconds:
                    best, decisions[kind.kind] = offloaded, "offload"
                break
    # Note [The budget search]: what did not fit everywhere, kept in the last regions.
    kept_in_last: dict[str, int] = {}
    tries = _REGION_TRIES
    for kind in overflowed if regions > 1 else ():
        room = budget_bytes - best.plan.peak_bytes
        last = min(regions - 1, room * kind.calls // max(kind.output_bytes, 1))
        for count in dict.fromkeys((last, last // 2)):
            if count < 1 or tries == 0:
                break
            tries -= 1
            trial_last = {**kept_in_last, kind.kind: count}
            tried = attempt(decisions, trial_last, best.settings)
            if fits(tried) and tried.seconds < best.seconds:
                best, kept_in_last = tried, trial_last
                break
    smallest_tried = smallest  # the on-device steps below are never counted in it

    def finish(trial: _Trial, chosen: dict[str, Decision], last: dict[str, int]) -> BudgetPlan:
        """The plan of ``trial``, its inputs held on the device if that fits and is no slower."""
        if "offload" not in chosen.values():
            # Note [The budget search]: no link at all where the budget holds the inputs too.
            on_device = dataclasses.replace(
                trial.settings, min_offload_bytes=baseline.plan.bytes_to_host + 1
            )
            tried = attempt(chosen, last, on_device, policy_cost=True)
            if fits(tried) and tried.seconds <= trial.seconds:
                trial = tried
        return BudgetPlan(
            budget_bytes=budget_bytes,
            host_budget_bytes=host_budget_bytes,
            ranks_per_node=ranks_per_node,
            fits=fits(trial),
            decisions=tuple(sorted(chosen.items())),
            kept_in_last=tuple(sorted(last.items())),
            regions=regions,
            prefetch=trial.settings.prefetch,
            min_offload_bytes=trial.settings.min_offload_bytes,
            peak_bytes=trial.plan.peak_bytes,
            pinned_bytes_per_node=trial.plan.pinned_bytes * ranks_per_node,
            step_seconds=trial.seconds,
            every_block_seconds=baseline.seconds,
            smallest_budget_bytes=smallest_tried,
            kinds=tuple(kinds),
            strategy_plan=trial.plan,
        )

    if not (decisions or kept_in_last):
        return finish(plain, {}, {})
    charged = best._replace(
        seconds=step_seconds(best.plan, device, best.settings.prefetch, policy_ops)
    )
    if measure is not None:  # Note [Measured finalists]
        return _measured((finish(charged, decisions, kept_in_last), finish(plain, {}, {})), measure)
    if charged.seconds < plain.seconds:
        return finish(charged, decisions, kept_in_last)
    return finish(plain, {}, {})  # the recompute it saves does not pay for the policy's host time


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
