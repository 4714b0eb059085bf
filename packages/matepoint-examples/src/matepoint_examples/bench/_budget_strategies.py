"""The budget benchmark's strategies beside its plans: torch's selective peers, a plan's
policy under other engines, and the compiled references."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._compiled.blocks import CompiledBlockCheckpoint
from matepoint._planner.op_kinds import op_kind
from matepoint.integrations._functions import next_region
from matepoint_examples.bench._budget_runner import Runner, no_checkpoint, plan_checkpoint_fn
from matepoint_examples.bench._budget_workloads import BudgetWorkload, CheckpointFn

__all__ = [
    "EAGER_STRATEGIES",
    "add_compiled",
    "add_compiled_blocks",
    "checkpoint_fns",
    "engine_variants",
    "selective_policy",
]


def selective_policy(saved_kinds: frozenset[str]) -> Callable[..., Any]:
    """torch's selective checkpoint saving the ops of ``saved_kinds`` (``matepoint`` op kinds)."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        del ctx, kwargs
        if op_kind(func, args) in saved_kinds:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# The eager strategies every run measures (``checkpoint_fns``).
EAGER_STRATEGIES = ("torch", "matepoint", "none", "sac-attention-down", "sac-every-matmul")


def checkpoint_fns(workload: BudgetWorkload) -> dict[str, CheckpointFn]:
    every_matmul, down = workload.projections
    sac = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

    def selective(kinds: frozenset[str]) -> CheckpointFn:
        context_fn = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts, selective_policy(kinds)
        )
        return functools.partial(sac, context_fn=context_fn)

    return {
        "torch": sac,
        "matepoint": functools.partial(matepoint.checkpoint, use_reentrant=False),
        "none": no_checkpoint,
        "sac-attention-down": selective(frozenset({"attention", down})),
        "sac-every-matmul": selective(frozenset({"attention", *every_matmul})),
    }


def add_compiled(
    runner: Runner,
    strategies: dict[str, CheckpointFn | None],
    plans: dict[str, dict[str, Any]],
    name: str,
    budget_plan: matepoint.BudgetPlan,
    measured_peaks: Mapping[str, int],
) -> str:
    """torch's compiled ``activation_memory_budget`` at the plan's budget, and the plan under
    matepoint's compiled path (``compiled_offload``, the whole model compiled). Returns the
    latter's name."""
    budget = plans[name]["budget_bytes"]
    suffix = name.removeprefix("budget@")
    if min(measured_peaks.values()) > 0:
        # torch's knob is a fraction of what recomputing nothing would hold.
        span = measured_peaks["none"] - measured_peaks["torch"]
        fraction = min(1.0, max(0.0, (budget - measured_peaks["torch"]) / span))
        runner.add_compiled(f"compiled-amb@{suffix}", fraction)
        strategies[f"compiled-amb@{suffix}"] = None
        plans[name]["compiled_activation_memory_budget"] = fraction
    else:
        print(
            f"{name}: no compiled activation_memory_budget: torch's checkpoint or no "
            "checkpoint ran out of memory, and its knob is a fraction of the way between "
            "their peaks",
            flush=True,
        )
    # The plan under matepoint's compiled path: torch's compiled selective checkpointing takes
    # its policy (offload values as save: docs/selective.md), matepoint moves the checkpoint
    # inputs.
    label = f"compiled-plan@{suffix}"
    runner.add_compiled(label)
    strategies[label] = plan_checkpoint_fn(budget_plan)
    runner.settings[label] = {**budget_plan.settings_changes(), "compiled_offload": True}
    return label


def add_compiled_blocks(
    runner: Runner,
    strategies: dict[str, CheckpointFn | None],
    name: str,
    blocks_plan: matepoint.BudgetPlan,
) -> str:
    """The plan compiled block by block, torchtitan's pattern (Note [A block compiled with its
    plan]): each block compiled with its checkpoint and its region's policy, its inputs
    offloaded by matepoint. ``blocks_plan`` is planned with ``compiled_offload`` in force, so
    its policy offloads nothing. Returns the strategy's name."""
    label = f"compiled-blocks-plan@{name.removeprefix('budget@')}"
    functions = [
        CompiledBlockCheckpoint(blocks_plan, region) for region in range(blocks_plan.regions)
    ]
    strategies[label] = functools.partial(next_region, itertools.count(), functions)
    runner.settings[label] = {**blocks_plan.settings_changes(), "compiled_offload": False}
    runner.may_fail.add(label)
    return label


def engine_variants(name: str, plan: matepoint.BudgetPlan) -> dict[str, CheckpointFn]:
    """The plan's policy run by torch's checkpoint, and by matepoint's with ``offload=False``.

    Beside the plan (matepoint's checkpoint with its policy and settings), they tell the
    engines' costs apart from the policy's: ``{name} on torch`` is torch's checkpoint with the
    plan's ``context_fn``, ``{name} offload off`` matepoint's call offloading nothing (torch's
    checkpoint reached through matepoint). Each has its own ``context_fn`` (each counts the
    regions of the calls it serves: Note [A plan's regions]). None for a plan without a policy
    (its ``context_fn`` is torch's ``noop_context_fn``).
    """
    if plan.context_fn() is torch_checkpoint.noop_context_fn:
        return {}
    return {
        f"{name} on torch": functools.partial(
            torch_checkpoint.checkpoint, use_reentrant=False, context_fn=plan.context_fn()
        ),
        f"{name} offload off": functools.partial(
            matepoint.checkpoint, use_reentrant=False, context_fn=plan.context_fn(), offload=False
        ),
    }
