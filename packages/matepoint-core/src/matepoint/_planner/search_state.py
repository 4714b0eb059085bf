"""The budget search's state: a planned candidate, the budgets it must fit, the search's
running figures and the best choice so far (Note [The budget search] in
``matepoint._planner.search``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

from matepoint._options import OffloadSettings
from matepoint._planner import decision
from matepoint._planner.op_kinds import KindProfile, RegionProfiler
from matepoint._planner.policy import (
    Decision,
    context_fn_of,
    scoped_kinds_of,
)
from matepoint._planner.step import Planned, SavedInput, StrategyPlan
from matepoint._planner.time_model import DeviceModel, step_seconds

__all__ = ["Budget", "Choice", "Figures", "Search", "Trial", "timed"]


class Trial(NamedTuple):
    """One planned candidate: its step, its settings, its estimated time, whether it fits, and
    the checkpoint inputs it saved (Note [The stash] in ``matepoint._planner.conclusion`` reads
    which it offloads)."""

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
class Budget:
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


def timed(
    plan: StrategyPlan,
    settings: OffloadSettings,
    device: DeviceModel,
    budget: Budget,
    host_ops: int,
    policy_ops: int = 0,
    saves: tuple[SavedInput, ...] = (),
) -> Trial:
    """``plan`` as a candidate, timed with ``host_ops`` ops on the host, ``policy_ops`` of them
    through a policy (Note [Host and device overlap] in ``matepoint._planner.time_model``)."""
    seconds = step_seconds(plan, device, settings.prefetch, policy_ops, host_ops)
    return Trial(plan, settings, seconds, budget.fits(plan), saves)


class Figures(NamedTuple):
    """A step's figures as the time model reads them (``StepFigures``), to time it otherwise."""

    forward_flops: int
    backward_flops: int
    bytes_to_host: int
    bytes_to_device: int


@dataclasses.dataclass
class Search:
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
    budget: Budget
    regions: int
    profile: RegionProfiler | None
    host_ops: int
    kinds: tuple[KindProfile, ...]
    every_block: Trial
    calls_are_regions: bool
    smallest: int | None
    tried: list[Choice] = dataclasses.field(default_factory=list)

    def attempt(
        self,
        decisions: dict[str, Decision],
        kept_in_last: dict[str, int],
        settings: OffloadSettings,
        policy_cost: bool = False,
        unchecked_last: int = 0,
    ) -> Trial:
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
        trial = timed(planned, settings, self.device, self.budget, host_ops, ops, saves)
        self.tried.append(Choice(trial, dict(decisions), dict(kept_in_last), True, unchecked_last))
        return trial

    def host_ops_of(self, unchecked_last: int) -> int:
        """The ops the host runs in a step whose last ``unchecked_last`` regions have no
        checkpoint: theirs are not run again in backward."""
        recomputed = self.host_ops // 3  # one pass of the regions' ops
        return self.host_ops - recomputed * min(unchecked_last, self.regions) // self.regions

    def charged(self, choice: Choice) -> Choice:
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

    def attempt_held(
        self,
        settings: OffloadSettings,
        decisions: dict[str, Decision] | None = None,
        kept_in_last: dict[str, int] | None = None,
        *,
        policy_cost: bool = False,
        unchecked_last: int = 0,
    ) -> Trial | None:
        """Plan a candidate with ``settings`` but the checkpoint inputs held on the device, or
        None where rule 6 of Note [The budget search] tries no such step (the policy offloads,
        the settings hold them already, or the profiled step moves none)."""
        decided = decisions or {}
        holding = self.holding_min_offload_bytes
        if not decision.tries_inputs_on_device(
            decided.values(), settings.min_offload_bytes, holding
        ):
            return None
        assert holding is not None
        return self.attempt(
            decided,
            kept_in_last or {},
            dataclasses.replace(settings, min_offload_bytes=holding),
            policy_cost=policy_cost,
            unchecked_last=unchecked_last,
        )


@dataclasses.dataclass
class Choice:
    """The best candidate so far and the choice that gave it.

    Attributes:
        trial: Its planned step.
        decisions: Per class of op kept or offloaded in every region; the rest are recomputed.
        kept_in_last: Classes kept in the last regions only, with how many.
        checkpoint: False for the step without any checkpoint (Note [The budget search],
            rule 10).
        unchecked_last: The last regions run without a checkpoint (rule 10).
    """

    trial: Trial
    decisions: dict[str, Decision] = dataclasses.field(default_factory=dict)
    kept_in_last: dict[str, int] = dataclasses.field(default_factory=dict)
    checkpoint: bool = True
    unchecked_last: int = 0
