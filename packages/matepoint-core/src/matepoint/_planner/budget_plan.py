"""A budget plan: the choice the search made, and the selective-checkpoint policy that applies it.

The search (``matepoint._planner.search``) decides keep, offload or recompute per kind of op; a
:class:`BudgetPlan` carries that choice with its planned figures, and its ``context_fn`` turns
the choice into torch's selective-checkpoint contexts on every checkpoint call, a fresh policy
per region (Note [A plan's regions]).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

from matepoint._options import OffloadSettings
from matepoint._planner.op_kinds import KindProfile
from matepoint._planner.policy import Decision, context_fn_of, policy_of
from matepoint._planner.step import StrategyPlan

__all__ = ["BudgetPlan"]
_GIB = float(1 << 30)
# A planned peak above this share of the budget gets a word on fragmentation when printed: a
# budget bounds allocated memory, and a device capped at the budget must also hold what the
# caching allocator reserves beyond it (docs/budget.md, "What the planned numbers are", has a
# plan within its budget that ran out of memory under a cap of that size).
_NEAR_BUDGET = 0.9
_DEFAULT_STASH_BYTES = OffloadSettings().stash_bytes


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
        settings: Every offload setting the step was planned under, the look-ahead
            (``prefetch``), ``min_offload_bytes`` and ``stash_bytes`` the search chose among
            them (Note [The stash] in ``matepoint._planner.conclusion``); applying all of them
            (:meth:`settings_changes`) reproduces the planned step.
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
            (the fastest) first (Note [Measured finalists] in
            ``matepoint._planner.conclusion``); empty when none were measured.
        checkpoint: False where the step without any checkpoint fits and is estimated fastest
            (Note [The budget search], rule 10): train without checkpointing; ``decisions``
            is then empty and ``strategy_plan`` is that step's.
        unchecked_last: The last regions run without a checkpoint, their blocks as they are
            (Note [The budget search], rule 10): where the step without any checkpoint does
            not fit, its last blocks may. 0 for none; :meth:`checkpoints_region` says it per
            region, and the integrations apply it.
        batch_fraction: Where nothing fits, the share of the example batch that would, the
            activation memory of the least peak planned taken as proportional to the batch (0:
            parameters and gradients alone, or the optimizer step, exceed the budget; None: no
            activation memory); None where the plan fits.
        optimizer_step_bytes: What the optimizer step holds beyond its states: the
            parameters, their gradients and the step's own temporaries (Note [The optimizer
            step's temporaries]). The step fits only where this does too: no plan of forward
            and backward makes it smaller. 0 where no optimizer was counted
            (:meth:`matepoint.MemoryPlan.fastest_under` plans forward and backward alone).
    """

    budget_bytes: int
    host_budget_bytes: int | None
    ranks_per_node: int
    fits: bool
    decisions: tuple[tuple[str, Decision], ...]
    kept_in_last: tuple[tuple[str, int], ...]
    regions: int
    settings: OffloadSettings
    peak_bytes: int
    pinned_bytes_per_node: int
    step_seconds: float
    every_block_seconds: float
    smallest_budget_bytes: int
    kinds: tuple[KindProfile, ...]
    strategy_plan: StrategyPlan = dataclasses.field(repr=False, compare=False)
    measured_seconds: tuple[float, ...] = ()
    checkpoint: bool = True
    batch_fraction: float | None = None
    optimizer_step_bytes: int = 0
    unchecked_last: int = 0

    def checkpoints_region(self, region: int) -> bool:
        """Whether region ``region`` (block ``region`` of the planned step) runs checkpointed:
        False where the plan runs no checkpoint at all or leaves its last regions unchecked
        (:attr:`unchecked_last`), and the block then runs as it is.

        Raises:
            TypeError: For a region that is not a whole number.
            ValueError: For a region outside the plan's.
        """
        self._check_region(region)
        return self.checkpoint and region < self.regions - self.unchecked_last

    def _check_region(self, region: int) -> None:
        """Refuse a region that is not one of the plan's."""
        if isinstance(region, bool) or not isinstance(region, int):
            raise TypeError(f"region must be a whole number, got {region!r}")
        if not 0 <= region < self.regions:
            raise ValueError(
                f"region {region} is outside this plan's {self.regions} regions "
                f"(0 to {self.regions - 1}): the planned step made {self.regions} "
                "checkpoint calls"
            )

    def policy(self, region: int = 0) -> Callable[..., Any]:
        """A selective-checkpoint policy for one checkpoint call: ``policy(ctx, op, *args)``.

        It is region ``region``'s (Note [A plan's regions]), and it tells a region's repeated
        kinds apart by counting them (Note [Op kinds]), so each checkpoint call needs a fresh
        one: :meth:`context_fn` makes one per call, for the call's region.
        """
        return policy_of(dict(self.decisions), dict(self.kept_in_last), self.regions, region)

    def context_fn(self, region: int | None = None) -> Callable[[], Any]:
        """The ``context_fn`` for a checkpoint call: ``context_fn=plan.context_fn(i)`` for block i.

        Each call makes torch's selective-checkpoint contexts around a fresh :meth:`policy`.
        A region is the planned step's checkpoint call of that number, in order: block ``i``
        of a stack is region ``i``. Give each block its own, ``context_fn=plan.context_fn(i)``,
        so that nothing but the block decides its region (See Note [A plan's regions], rule
        1); the integrations do so for the blocks they wrap. Without ``region`` the
        ``context_fn`` counts the calls it serves, its ``n``-th being region ``n`` modulo
        :attr:`regions`: use one per model, and only where every forward through it makes all
        the plan's calls in order (rule 3: a forward that raises part way shifts it for good).

        A plan that decides nothing (every op recomputed) gives torch's own
        ``noop_context_fn``, what a checkpoint call without ``context_fn`` runs, so the same
        call works for every plan; compare with it (``plan.context_fn() is
        torch.utils.checkpoint.noop_context_fn``) to tell whether a plan has a policy.

        The ``context_fn`` does not skip a checkpoint: where :meth:`checkpoints_region` is
        False for a block (the plan runs its last blocks, or all, without one), call the block
        itself, or take :func:`matepoint.integrations.matepoint_checkpoint_fn`, which does.
        A block checkpointed anyway holds less than planned, and runs slower.

        Args:
            region: The block's region, from 0 to ``regions - 1``; or None to count the calls.
                Default: None.

        Raises:
            TypeError: For a region that is not a whole number.
            ValueError: For a region outside the plan's.
        """
        if region is not None:
            self._check_region(region)
        context_fn = context_fn_of(
            dict(self.decisions), dict(self.kept_in_last), self.regions, region
        )
        return torch_checkpoint.noop_context_fn if context_fn is None else context_fn

    @property
    def prefetch(self) -> int:
        """The look-ahead chosen (``OffloadSettings.prefetch``)."""
        return self.settings.prefetch

    @property
    def stash_bytes(self) -> int:
        """The stash chosen (``OffloadSettings.stash_bytes``): bytes of the newest offloaded
        inputs kept on the device, their copies back spared (Note [The stash] in
        ``matepoint._planner.conclusion``)."""
        return self.settings.stash_bytes

    @property
    def min_offload_bytes(self) -> int:
        """The smallest checkpoint input offloaded (``OffloadSettings.min_offload_bytes``):
        above every input when the budget holds them all on the device, as torch's checkpoint
        does, and nothing needs the link."""
        return self.settings.min_offload_bytes

    def settings_changes(self) -> dict[str, Any]:
        """Every setting the plan was planned under, to pass to :func:`matepoint.configure`
        (or :func:`matepoint.options`) with it: the step runs as planned under them alone,
        whatever was in force when it was planned. A call's own ``offload=`` still wins for
        the fields it sets, as it did in the planned step."""
        return dataclasses.asdict(self.settings)

    def __str__(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        lines = [
            f"matepoint budget plan: {self.budget_bytes / _GIB:.2f} GiB device budget, {verdict}",
            f"  planned peak {self.peak_bytes / _GIB:.2f} GiB; pinned host RAM "
            f"{self.pinned_bytes_per_node / _GIB:.2f} GiB per node ({self.ranks_per_node} "
            "rank(s))",
            self._estimate_line(),
            f"  look-ahead (prefetch) {self.prefetch}",
        ]
        if self.stash_bytes != _DEFAULT_STASH_BYTES:
            lines.append(
                f"  stash (stash_bytes={self.stash_bytes}): the newest offloaded inputs, "
                f"{self.stash_bytes / _GIB:.2f} GiB, stay on the device and are not copied back"
            )
        if not self.checkpoint:
            lines.append(
                f"  no checkpoint needed: the step without any checkpoint peaks at "
                f"{self.peak_bytes / _GIB:.2f} GiB, within the budget, and is estimated fastest"
            )
        else:
            if self.unchecked_last:
                lines.append(
                    f"  no checkpoint in the last {self.unchecked_last} of {self.regions} "
                    "regions: those blocks run as they are, nothing recomputed"
                )
            if held := self._inputs_line():
                lines.append(held)
        if self.measured_seconds:
            chosen, *others = (f"{value * 1e3:.1f} ms" for value in self.measured_seconds)
            lines.append(
                f"  measured {chosen} against {', '.join(others)} for the other finalist"
                + ("s" if len(others) > 1 else "")
                + ": chosen as the fastest"
            )
        if not self.fits:
            lines.append(
                f"  the smallest budget that fits: {self.smallest_budget_bytes / _GIB:.2f} GiB"
            )
            if self.optimizer_step_bytes > self.budget_bytes:
                lines.append(
                    "  the optimizer step alone exceeds the budget, whatever the batch: it "
                    f"holds {self.optimizer_step_bytes / _GIB:.2f} GiB beside its states "
                    "(parameters, gradients and its temporaries)"
                )
            elif self.batch_fraction == 0:
                lines.append(
                    "  parameters and gradients alone exceed the budget, whatever the batch"
                )
            elif self.batch_fraction is not None:
                lines.append(
                    f"  about {self.batch_fraction:.2f}x the example batch would fit "
                    "(activations taken as proportional to the batch)"
                )
        elif self.peak_bytes > _NEAR_BUDGET * self.budget_bytes:
            lines.append(
                f"  the peak is within {1 - _NEAR_BUDGET:.0%} of the budget, which bounds "
                "allocated memory: a device that holds only the budget also holds the caching "
                "allocator's fragmentation; leave room, or run with "
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            )
        decided, kept_last = dict(self.decisions), dict(self.kept_in_last)
        for kind in self.kinds if self.checkpoint else ():
            last = kept_last.get(kind.kind)
            where = f" (keep in the last {last} of {self.regions} regions)" if last else ""
            lines.append(
                f"  {kind.kind:<24} {decided.get(kind.kind, 'recompute'):<10} "
                f"{kind.output_bytes / _GIB:8.2f} GiB in {kind.calls} calls, "
                f"{kind.flops_per_byte:8.0f} FLOP/byte{where}"
            )
        return "\n".join(lines)

    def _estimate_line(self) -> str:
        """The estimated step against matepoint on every block, as a ratio where there is one."""
        line = (
            f"  estimated step {self.step_seconds * 1e3:.1f} ms against "
            f"{self.every_block_seconds * 1e3:.1f} ms for matepoint on every block"
        )
        if self.every_block_seconds > 0:
            return f"{line} ({self.step_seconds / self.every_block_seconds:.3f})"
        # The time model counts matrix-product FLOPs and link bytes: this step has neither.
        return f"{line} (no ratio: the step has no matrix products or link traffic to time)"

    def _inputs_line(self) -> str | None:
        """Where the checkpoint inputs are: ``min_offload_bytes`` may hold them on the device.

        Read from the chosen step's counters: inputs below ``min_offload_bytes`` are kept in
        place (``skipped_small``); the rest are offloaded (offloads less the policy's).
        """
        counters = self.strategy_plan.counters
        held = counters.get("skipped_small", 0)
        moved = counters.get("offloads", 0) - counters.get("policy_offloads", 0)
        setting = f"min_offload_bytes={self.min_offload_bytes}"
        if held and not moved:
            return f"  checkpoint inputs held on the device ({setting}): no link traffic for them"
        if held:
            return (
                f"  checkpoint inputs: {moved} offloaded, {held} below {setting} held on the device"
            )
        return f"  checkpoint inputs offloaded ({setting})" if moved else None
