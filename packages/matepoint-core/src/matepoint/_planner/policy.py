"""A budget plan's selective-checkpoint policy: keep, offload or recompute each op, per region.

A :class:`~matepoint.BudgetPlan` decides per class of op (Note [Op kinds] in
``matepoint._planner.op_kinds``); this module turns those decisions into torch's
selective-checkpoint contexts on every checkpoint call, a fresh policy per region, each region
named by its block (Note [A plan's regions]).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any, Literal

import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._planner.op_kinds import _named_kind, occurrence_class, op_kind

__all__ = ["AVAILABLE", "OFFLOAD_AVAILABLE", "Decision", "context_fn_of", "policy_of"]

Decision = Literal["keep", "offload", "recompute"]


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


def policy_of(
    decisions: dict[str, Decision], kept_in_last: dict[str, int], regions: int, region: int
) -> Callable[..., Any]:
    """Region ``region``'s policy; it counts the ops it sees, so it serves one call.

    Note [A plan's regions]
        Rule 1. A plan's regions are the checkpoint calls of its planned step, in their order:
            region ``n`` is the step's ``n``-th call, which for a stack of blocks is block
            ``n``. Applied, a region is named by its block, never found by counting:
            ``BudgetPlan.context_fn(n)`` serves region ``n`` alone, and the integrations give
            the ``n``-th block they wrap (in the model's module order) region ``n``. A wrapper
            per block, a forward that raises part way, an evaluation forward or gradient
            accumulation then cannot move a region to another block.
        Rule 2. A class kept in the last ``k`` regions only (``BudgetPlan.kept_in_last``) is
            kept there and decided as every region decides it elsewhere: the last regions'
            outputs are the first backward frees, so they cost the least memory at a peak late
            in backward.
        Rule 3. Where no block is known (``BudgetPlan.context_fn()`` without a region), the
            ``context_fn`` counts the calls it serves: its ``n``-th is region ``n`` modulo the
            regions. That holds only while every forward through it makes all the plan's calls
            in order, once: one such ``context_fn`` per model, no forward that raises part way,
            none that checkpoints fewer blocks. The search plans each candidate step so, with a
            fresh one per planned step.
        Rule 4. A model that checkpoints a different number of regions from step to step needs
            a plan without ``kept_in_last``.
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


def context_fn_of(
    decisions: dict[str, Decision],
    kept_in_last: dict[str, int],
    regions: int,
    region: int | None = None,
) -> Callable[[], Any] | None:
    """A plan's ``context_fn``: torch's selective-checkpoint contexts around a fresh policy of
    region ``region`` on every call, or of the next region by count where ``region`` is None
    (Note [A plan's regions], rules 1 and 3); None when everything is recomputed.

    A plain function: Dynamo takes a checkpoint's ``context_fn`` only as one (or a partial), so
    a plan runs under a whole-model compile too.
    """
    if not kept_in_last and all(decision == "recompute" for decision in decisions.values()):
        return None
    if region is not None:
        fixed = region

        def region_context_fn() -> Any:
            return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
                policy_of(decisions, kept_in_last, regions, fixed)
            )

        return region_context_fn
    calls = itertools.count()

    def context_fn() -> Any:
        counted = next(calls) % regions  # See Note [A plan's regions], rule 3
        return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            policy_of(decisions, kept_in_last, regions, counted)
        )

    return context_fn
