"""A budget plan's selective-checkpoint policy: keep, offload or recompute each op, per region.

A :class:`~matepoint.BudgetPlan` decides per class of op (Note [Op kinds] in
``matepoint._planner.op_kinds``); this module turns those decisions into torch's
selective-checkpoint contexts on every checkpoint call, a fresh policy per region, each region
named by its block (Note [A plan's regions]).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any, Literal

import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._planner.op_kinds import named_kind, occurrence_class, op_kind
from matepoint._planner.scoped_modes import scoped_contexts

__all__ = [
    "AVAILABLE",
    "OFFLOAD_AVAILABLE",
    "Decision",
    "context_fn_of",
    "policy_of",
    "scoped_kinds_of",
]

Decision = Literal["keep", "offload", "recompute"]


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

# The ids of the ops whose name alone makes them "other" (Note [Op kinds]): a plan's policy
# answers them first, from the op alone, since it meets every op of every region in training's
# hot path. op_kinds holds each op it has named, so an id names its op for good.
_OTHER_OPS: set[int] = set()

# The mark of a policy that answers "recompute" for every op (Note [A plan's regions], rule 5).
_RECOMPUTES_EVERYTHING = "_matepoint_recomputes_everything"
# A policy's kinds it keeps or offloads some op of (None where it decides "other"), and its
# counts per kind in forward (Note [Scoped selective-checkpoint modes], rules 2, 4 and 7).
_SCOPED_KINDS = "_matepoint_scoped_kinds"
_SEEN = "_matepoint_seen"


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
        Rule 5. A region whose policy recomputes every op (one before the last ``k`` of a plan
            that decides nothing else) runs without torch's selective-checkpoint modes: such a
            policy saves what plain checkpointing saves, and the modes would cost the host a
            Python call on every op of its forward and of its recomputation. Its policy is
            still made, for the region's count; under a tracer (``torch.compile``, export, a
            fake-tensor mode) the modes stay, since torch compiles a checkpoint by what they
            tag.
        Rule 6. Any other region runs torch's modes only around the module calls where its
            policy keeps or offloads ops, learnt on its block's first call (Note [Scoped
            selective-checkpoint modes] in ``matepoint._planner.scoped_modes``).
    """
    table = _table_of(_chosen_in(decisions, kept_in_last, regions, region))
    recompute = _POLICY_VALUES["recompute"]
    # Ops of each decided kind seen so far in the region, in forward and in the recomputation
    # apart (Note [Op kinds], rule 3); a kind no class of which is decided needs no count.
    seen_in_forward: dict[str, int] = {}
    seen_in_recomputation: dict[str, int] = {}
    # A profile never ranks "other" (Note [Op kinds]): unless a plan names it, such an op, most
    # of a region's, is recomputed uncounted, told apart by the op alone.
    skipped = frozenset() if "other" in table else _OTHER_OPS

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        del kwargs
        if id(func) in skipped:
            return recompute
        kind = op_kind(func, args)
        decided = table.get(kind)
        if decided is None:
            if kind == "other" and named_kind(func) == "other":
                _OTHER_OPS.add(id(func))
            return recompute
        seen = seen_in_recomputation if ctx.is_recompute else seen_in_forward
        occurrence = seen[kind] = seen.get(kind, 0) + 1
        kind_value, occurrence_values = decided
        return occurrence_values.get(occurrence, kind_value)

    values = [
        value
        for kind_value, by_occurrence in table.values()
        for value in (kind_value, *by_occurrence.values())
    ]
    if all(value is recompute for value in values):
        policy.__dict__[_RECOMPUTES_EVERYTHING] = True
    policy.__dict__[_SCOPED_KINDS] = _scoped_in(table)
    policy.__dict__[_SEEN] = seen_in_forward
    # A plan that offloads nothing needs no offload wrapper around its contexts.
    offloads = _POLICY_VALUES.get("offload")
    return policy if offloads in values else compat.never_offloading(policy)


def scoped_kinds_of(
    decisions: dict[str, Decision], kept_in_last: dict[str, int], regions: int, region: int
) -> frozenset[str] | None:
    """The kinds region ``region``'s policy keeps or offloads some op of: none where it
    recomputes every op and runs without torch's modes, None where it decides ``"other"`` and
    runs them over the whole region (Note [A plan's regions], rules 5 and 6)."""
    return _scoped_in(_table_of(_chosen_in(decisions, kept_in_last, regions, region)))


def _chosen_in(
    decisions: dict[str, Decision], kept_in_last: dict[str, int], regions: int, region: int
) -> dict[str, Decision]:
    """Region ``region``'s decisions: the plan's, and a keep for each class kept in the last
    regions that include it (Note [A plan's regions], rule 2)."""
    kept = [name for name, last in kept_in_last.items() if region >= regions - last]
    return {**decisions, **dict.fromkeys(kept, "keep")}


def _scoped_in(table: dict[str, tuple[Any, dict[int, Any]]]) -> frozenset[str] | None:
    """A table's kinds it keeps or offloads some op of, None where one is ``"other"`` (Note
    [Scoped selective-checkpoint modes], rule 2)."""
    recompute = _POLICY_VALUES["recompute"]
    scoped = frozenset(
        kind
        for kind, (kind_value, by_occurrence) in table.items()
        if any(value is not recompute for value in (kind_value, *by_occurrence.values()))
    )
    return None if "other" in scoped else scoped


def _table_of(chosen: dict[str, Decision]) -> dict[str, tuple[Any, dict[int, Any]]]:
    """A region's decisions as its policy reads them: per kind, the policy value of its ops,
    and the values of its occurrences decided apart (Note [Op kinds], rule 3).

    An op's class is its occurrence's where the plan names it, else its kind's, else it is
    recomputed; the table answers that with two lookups and no name made per op.
    """
    table: dict[str, tuple[Any, dict[int, Any]]] = {}
    for name in chosen:
        kind, separator, number = name.rpartition(" #")
        if not (separator and number.isdecimal() and occurrence_class(kind, int(number)) == name):
            kind = name
        if kind not in table:
            table[kind] = (_POLICY_VALUES[chosen.get(kind, "recompute")], {})
        if kind != name:
            table[kind][1][int(number)] = _POLICY_VALUES[chosen[name]]
    return table


def _contexts(policy: Callable[..., Any]) -> Any:
    """torch's selective-checkpoint contexts around ``policy``: none where it recomputes every
    op, scoped to where it decides otherwise, unless a tracer sees the ops (See Note [A plan's
    regions], rules 5 and 6)."""
    if compat.tracing_ops():
        return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            policy
        )
    if getattr(policy, _RECOMPUTES_EVERYTHING, False):
        return torch_checkpoint.noop_context_fn()  # type: ignore[no-untyped-call]
    return scoped_contexts(policy, policy.__dict__[_SCOPED_KINDS], policy.__dict__[_SEEN])


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
            return _contexts(policy_of(decisions, kept_in_last, regions, fixed))

        return region_context_fn
    calls = itertools.count()

    def context_fn() -> Any:
        counted = next(calls) % regions  # See Note [A plan's regions], rule 3
        return _contexts(policy_of(decisions, kept_in_last, regions, counted))

    return context_fn
