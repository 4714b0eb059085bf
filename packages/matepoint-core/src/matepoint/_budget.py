"""The fastest step that fits a device-memory budget: keep, offload or recompute each kind of op.

A checkpointed step recomputes every activation of its regions in backward, which costs about a
fifth of a transformer's step; keeping what is expensive to recompute buys that time back with
device memory, and offloading it buys it back with link time that forward's compute can hide.
:func:`fastest_under` chooses, per kind of op inside the checkpointed regions (Note [Op kinds]
in ``matepoint._budget_profile``), one of the three, in every region or keeping in the last
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

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._budget_profile import (
    DeviceModel,
    KindProfile,
    RegionProfiler,
    _named_kind,
    occurrence_class,
    op_kind,
)
from matepoint._options import OffloadSettings
from matepoint._plan_step import Planned, StrategyPlan

__all__ = ["BudgetPlan", "Decision", "fastest_under", "step_seconds"]

Decision = Literal["keep", "offload", "recompute"]
_GIB = float(1 << 30)


def step_seconds(
    strategy_plan: StrategyPlan, device: DeviceModel, prefetch: int, policy_ops: int = 0
) -> float:
    """Estimate a planned step's time: compute, plus link time the compute cannot hide.

    Compute is the step's FLOPs at ``device.peak_flops`` (recomputation included, so what is
    kept or offloaded shortens backward). Copies to the host overlap forward and copies back
    overlap backward; what they take beyond that is added. Without look-ahead every copy back
    is waited for. ``policy_ops`` ops pass through a selective-checkpoint policy (torch runs
    it in Python for every op of a region, in forward and again in the recomputation), each
    costing ``device.policy_seconds_per_op``.
    """
    forward = strategy_plan.forward_flops / device.peak_flops
    backward = strategy_plan.backward_flops / device.peak_flops
    to_host = strategy_plan.bytes_to_host / device.to_host_bandwidth
    to_device = strategy_plan.bytes_to_device / device.to_device_bandwidth
    hidden_back = 0.0 if prefetch == 0 else backward
    exposed = max(0.0, to_host - forward) + max(0.0, to_device - hidden_back)
    return forward + backward + exposed + policy_ops * device.policy_seconds_per_op


# The ids of the ops whose name alone makes them "other" (Note [Op kinds]): a plan's policy
# answers them first, from the op alone, since it meets every op of every region in training's
# hot path. An op's overload lives as long as torch, so its id names it for good.
_OTHER_OPS: set[int] = set()

# Torch's selective checkpointing (CheckpointPolicy, create_selective_checkpoint_contexts) came
# with 2.5, its offload values with 2.11 (gate SELECTIVE_OFFLOAD_POLICIES): before 2.11 a plan
# keeps or recomputes only; before 2.5 there is no budget plan.
AVAILABLE = compat.TORCH_2_5_PLUS
OFFLOAD_AVAILABLE = bool(compat.SELECTIVE_OFFLOAD_POLICIES)
_POLICY_VALUES: dict[str, Any] = {}
if AVAILABLE:
    _POLICY_VALUES["keep"] = torch_checkpoint.CheckpointPolicy.MUST_SAVE
    _POLICY_VALUES["recompute"] = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
if OFFLOAD_AVAILABLE:
    _POLICY_VALUES["offload"] = torch_checkpoint.CheckpointPolicy.MUST_CPU_OFFLOAD


def _policy(
    decisions: dict[str, Decision], kept_in_last: dict[str, int], regions: int, region: int
) -> Callable[..., Any]:
    """Region ``region``'s policy; it counts the ops it sees, so it serves one call.

    Note [A plan's regions]
        A plan's regions are the checkpoint calls of one step, in their order: the ``n``-th call
        a ``context_fn`` serves is region ``n`` modulo the number of regions the plan saw, so a
        step, each micro-batch of gradient accumulation and an evaluation forward of the same
        model all start again at region 0. A class kept in the last ``k`` regions only
        (``BudgetPlan.kept_in_last``) is kept there and decided as every region decides it
        elsewhere: the last regions' outputs are the first backward frees, so they cost the
        least memory at a peak late in backward. A model that checkpoints a different number of
        regions from step to step needs a plan without ``kept_in_last``.
    """
    kept = [name for name, last in kept_in_last.items() if region >= regions - last]
    chosen: dict[str, Decision] = {**decisions, **dict.fromkeys(kept, "keep")}
    # Ops of each kind seen so far in the region, in forward and in the recomputation apart
    # (Note [Op kinds]).
    seen: collections.Counter[tuple[bool, str]] = collections.Counter()
    # A profile never ranks "other" (Note [Op kinds]): unless a plan names it, such an op, most
    # of a region's, is recomputed without being counted, told apart by the op alone.
    other_decided = any(name.split(" #")[0] == "other" for name in chosen)
    recompute = _POLICY_VALUES["recompute"]

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        del kwargs
        if not other_decided and id(func) in _OTHER_OPS:
            return recompute
        kind = op_kind(func, args)
        if kind == "other" and not other_decided:
            if _named_kind(func.overloadpacket) == "other":
                _OTHER_OPS.add(id(func))
            return recompute
        key = (bool(ctx.is_recompute), kind)
        seen[key] += 1
        decision = chosen.get(occurrence_class(kind, seen[key]), chosen.get(kind, "recompute"))
        return _POLICY_VALUES[decision]

    # A plan that offloads nothing needs no offload wrapper around its contexts.
    return policy if "offload" in chosen.values() else compat.never_offloading(policy)


def _context_fn(
    decisions: dict[str, Decision], kept_in_last: dict[str, int], regions: int
) -> Callable[[], Any] | None:
    """A plan's ``context_fn``: torch's selective-checkpoint contexts around a fresh policy of
    the next region (Note [A plan's regions]); None when everything is recomputed.

    A plain function: Dynamo takes a checkpoint's ``context_fn`` only as one (or a partial), so
    a plan runs under a whole-model compile too.
    """
    if not kept_in_last and all(decision == "recompute" for decision in decisions.values()):
        return None
    calls = itertools.count()

    def context_fn() -> Any:
        region = next(calls) % regions
        return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            _policy(decisions, kept_in_last, regions, region)
        )

    return context_fn


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The fastest planned step found within a device-memory budget, and how to apply it.

    Apply it with ``matepoint.configure(**plan.settings_changes())`` and
    ``context_fn=plan.context_fn()`` on every checkpoint call, or in one call through
    ``matepoint.integrations`` (``plan=``).

    Attributes:
        budget_bytes: The device-memory budget, parameters and gradients included.
        host_budget_bytes: The pinned host RAM budget per node, or None.
        ranks_per_node: Processes per node sharing its host RAM (each pins its own pool).
        fits: Whether the chosen step fits both budgets.
        decisions: Per class of op (a kind, or one occurrence of a kind repeated in a
            region: Note [Op kinds]), ``"keep"``, ``"offload"`` or ``"recompute"``.
        kept_in_last: Classes kept in the last regions only, with how many (Note [A plan's
            regions]); elsewhere they do what ``decisions`` says.
        regions: The checkpoint calls of the planned step.
        prefetch: The look-ahead chosen (``OffloadSettings.prefetch``).
        min_offload_bytes: The smallest checkpoint input offloaded
            (``OffloadSettings.min_offload_bytes``): above every input when the budget holds
            them all on the device, as torch's checkpoint does, and nothing needs the link.
        peak_bytes: The chosen step's planned peak device memory.
        pinned_bytes_per_node: Pinned host RAM of one rank's pool times ``ranks_per_node``
            (the pool's exact-size blocks, so no rounding beyond what the pool holds).
        step_seconds: The chosen step's estimated time.
        every_block_seconds: The estimated time of matepoint on every block, nothing kept.
        smallest_budget_bytes: The least peak among the steps tried (the last, on-device try
            aside): the budget that would fit when nothing did.
        kinds: The kinds of op ranked, best first.
        strategy_plan: The chosen step's full plan (a :class:`matepoint.StrategyPlan`).
        measured_seconds: The measured step times of the search's finalists, this plan's
            (the fastest) first (Note [Measured finalists]); empty when none were measured.
    """

    budget_bytes: int
    host_budget_bytes: int | None
    ranks_per_node: int
    fits: bool
    decisions: tuple[tuple[str, Decision], ...]
    kept_in_last: tuple[tuple[str, int], ...]
    regions: int
    prefetch: int
    min_offload_bytes: int
    peak_bytes: int
    pinned_bytes_per_node: int
    step_seconds: float
    every_block_seconds: float
    smallest_budget_bytes: int
    kinds: tuple[KindProfile, ...]
    strategy_plan: StrategyPlan = dataclasses.field(repr=False, compare=False)
    measured_seconds: tuple[float, ...] = ()

    def policy(self, region: int = 0) -> Callable[..., Any]:
        """A selective-checkpoint policy for one checkpoint call: ``policy(ctx, op, *args)``.

        It is region ``region``'s (Note [A plan's regions]), and it tells a region's repeated
        kinds apart by counting them (Note [Op kinds]), so each checkpoint call needs a fresh
        one: :meth:`context_fn` makes one per call, for the call's region.
        """
        return _policy(dict(self.decisions), dict(self.kept_in_last), self.regions, region)

    def context_fn(self) -> Callable[[], Any] | None:
        """The ``context_fn`` for every checkpoint call (None when everything is recomputed).

        Each call makes torch's selective-checkpoint contexts around a fresh :meth:`policy` of
        the next region. Use one per model: it counts the calls it serves.
        """
        return _context_fn(dict(self.decisions), dict(self.kept_in_last), self.regions)

    def settings_changes(self) -> dict[str, Any]:
        """The settings to pass to :func:`matepoint.configure` with it."""
        return {"prefetch": self.prefetch, "min_offload_bytes": self.min_offload_bytes}

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"matepoint budget plan: {self.budget_bytes / _GIB:.2f} GiB device budget, {verdict}",
            f"  planned peak {self.peak_bytes / _GIB:.2f} GiB; pinned host RAM "
            f"{self.pinned_bytes_per_node / _GIB:.2f} GiB per node ({self.ranks_per_node} "
            "rank(s))",
            f"  estimated step {self.step_seconds * 1e3:.1f} ms against "
            f"{self.every_block_seconds * 1e3:.1f} ms for matepoint on every block "
            f"({self.step_seconds / self.every_block_seconds:.3f})",
            f"  look-ahead (prefetch) {self.prefetch}",
        ]
        if self.measured_seconds:
            lines.append(
                "  measured "
                + " against ".join(f"{value * 1e3:.1f} ms" for value in self.measured_seconds)
                + " for the other finalist: chosen as the fastest"
            )
        if not self.fits:
            lines.append(
                f"  the smallest budget that fits: {self.smallest_budget_bytes / _GIB:.2f} GiB"
            )
        decided, kept_last = dict(self.decisions), dict(self.kept_in_last)
        for kind in self.kinds:
            last = kept_last.get(kind.kind)
            where = f" (keep in the last {last} of {self.regions} regions)" if last else ""
            lines.append(
                f"  {kind.kind:<24} {decided.get(kind.kind, 'recompute'):<10} "
                f"{kind.output_bytes / _GIB:8.2f} GiB in {kind.calls} calls, "
                f"{kind.flops_per_byte:8.0f} FLOP/byte{where}"
            )
        return "\n".join(lines)


# Steps planned to keep kinds in the last regions only, at most (Note [The budget search]).
_REGION_TRIES = 2


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
        context_fn = _context_fn(decisions, kept_in_last, regions)
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
    for kind in [kind for kind in kinds if kind.recomputed] if fits(best) else ():
        kept = attempt({**decisions, kind.kind: "keep"}, {}, best.settings)
        if fits(kept):  # an offload saves what keeping saves, and costs link time
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
