"""What every integration shares: the checkpoint function a block runs with under a plan, and
planning from the live model with the guard attached."""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from matepoint._checkpoint import checkpoint
from matepoint._compiled.blocks import CompiledBlockCheckpoint
from matepoint._guard import (
    BudgetGuard,
    CudaMemory,
)
from matepoint._options import configure, options
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.live_model import plan_prepared, rank_optimizer
from matepoint._planner.optimizer_states import optimizer_state_bytes
from matepoint._planner.time_model import DeviceModel

__all__ = [
    "UNSET",
    "attach_guard",
    "block_function",
    "check_blocks",
    "last_regions_apart",
    "matepoint_checkpoint_fn",
    "next_region",
    "plan_live_model",
    "without_checkpoint",
]


class _Unset:
    """``optimizer=`` not given: a budget needs it said, None included (no states to count)."""

    def __repr__(self) -> str:
        return "<unset>"


UNSET: Any = _Unset()


# The keywords a checkpoint call takes for itself, matepoint's and torch's (preserve_rng_state
# is read from torch's **kwargs); any other keyword goes to the checkpointed function.
_CHECKPOINT_KEYWORDS = frozenset({"preserve_rng_state"}) | frozenset(
    name
    for signature in (inspect.signature(checkpoint), inspect.signature(torch_checkpoint.checkpoint))
    for name, parameter in signature.parameters.items()
    if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    and name != "function"
)


def without_checkpoint(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a block as it is, where a plan checkpoints nothing (``BudgetPlan.checkpoint``
    False) or not its region (``BudgetPlan.unchecked_last``): the call's own keywords are
    dropped, the function's passed on."""
    return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYWORDS})


def next_region(
    calls: Iterator[int],
    functions: Sequence[Callable[..., Any]],
    function: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Serve one call with the function of the next region by count (Note [A plan's regions],
    rule 3), which checkpoints it or runs it as it is."""
    return functions[next(calls) % len(functions)](function, *args, **kwargs)


def matepoint_checkpoint_fn(
    budget_plan: BudgetPlan | None = None, *, region: int | None = None, **checkpoint_kwargs: Any
) -> functools.partial[Any]:
    """Return ``matepoint.checkpoint`` with its keyword arguments bound, non-reentrant by default.

    This is the callable the integrations install; it is also what to hand to any library that
    takes a ``checkpoint_fn`` / ``gradient_checkpointing_func`` of torch's signature. Every
    integration below takes ``budget_plan=`` through it.

    Args:
        budget_plan: A plan from :func:`matepoint.plan_budget` or
            :meth:`matepoint.MemoryPlan.fastest_under`: its selective-checkpoint policy becomes
            the calls' ``context_fn``, and its settings are applied with
            :func:`matepoint.configure`. Default: None.
        region: The plan's region this function serves: give each block its own function
            with its number (block ``i``, the planned step's ``i``-th checkpoint call). None
            serves every call of one model by counting them, right only while every forward
            makes all the plan's calls in order (Note [A plan's regions], rule 3).
            Default: None.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint` (``pipeline``,
            ``offload``, ``preserve_rng_state``, ``context_fn``, ...). ``use_reentrant``
            defaults to ``False``.

    Raises:
        TypeError: For a ``budget_plan`` together with a ``context_fn`` of the caller's, or a
            ``region`` without a plan.
        ValueError: For a region outside the plan's.

    Returns:
        A ``functools.partial`` of :func:`matepoint.checkpoint`; of a function that runs the
        block as it is where the plan checkpoints nothing (``budget_plan.checkpoint`` False:
        the step without any checkpoint fits and is the fastest) or leaves ``region``
        unchecked (``budget_plan.checkpoints_region(region)`` False); without ``region``, of
        one that counts the calls and does either per region, for a plan that leaves its last
        regions unchecked.

    Example:
        >>> import torch
        >>> fn = matepoint_checkpoint_fn(pipeline=False)
        >>> fn(torch.sin, torch.ones(2, requires_grad=True)).shape
        torch.Size([2])
    """
    if budget_plan is None and region is not None:
        raise TypeError("region= names a region of a budget_plan; pass the plan too")
    if budget_plan is not None:
        if "context_fn" in checkpoint_kwargs:
            raise TypeError("a budget_plan brings its own context_fn; pass one or the other")
        if not budget_plan.checkpoint or (
            region is not None and not budget_plan.checkpoints_region(region)
        ):
            # The step without any checkpoint, or without one in this block, fits and is the
            # fastest: run the block as it is (no recomputation, no policy, no hooks).
            return functools.partial(without_checkpoint)
        if region is None and budget_plan.unchecked_last:
            functions = [
                matepoint_checkpoint_fn(budget_plan, region=index, **checkpoint_kwargs)
                for index in range(budget_plan.regions)
            ]
            return functools.partial(next_region, itertools.count(), functions)
        context_fn = budget_plan.context_fn(region)
        configure(**budget_plan.settings_changes())
        # A plan that decides nothing leaves the call without a context_fn, so the compiled
        # path keeps its own (Note [The compiled path] in matepoint._compiled).
        if context_fn is not torch_checkpoint.noop_context_fn:
            checkpoint_kwargs["context_fn"] = context_fn
    return functools.partial(checkpoint, **{"use_reentrant": False, **checkpoint_kwargs})


def block_function(
    plan: BudgetPlan | None,
    region: int | None,
    compile: bool | Mapping[str, Any],
    checkpoint_kwargs: dict[str, Any],
) -> Callable[..., Any]:
    """What a wrapper runs its block with: :func:`matepoint_checkpoint_fn`, or, with
    ``compile``, the block compiled with its region of the plan (Note [A block compiled with its
    plan] in ``matepoint._compiled.blocks``; ``compile`` True or ``torch.compile``'s keyword
    arguments)."""
    if not compile:
        return matepoint_checkpoint_fn(plan, region=region, **checkpoint_kwargs)
    options = dict(checkpoint_kwargs)
    offload, pipeline = options.pop("offload", None), options.pop("pipeline", True)
    if plan is not None:
        # compiled_offload chose the search's rule 11; the block's compile needs no more of it.
        configure(**{**plan.settings_changes(), "compiled_offload": False})
    return CompiledBlockCheckpoint(
        plan,
        region or 0,
        offload=offload,
        pipeline=pipeline,
        compile_options=None if compile is True else dict(compile),
        checkpoint_options=options,
    )


def plan_live_model(
    model: nn.Module,
    prepare: Callable[[nn.Module], nn.Module | None],
    budget: int | float | str,
    budget_plan: BudgetPlan | None,
    example_batch: Any,
    optimizer: Any,
    loss_fn: Callable[[Any], Any] | None,
    device: DeviceModel | None,
    scope: contextlib.AbstractContextManager[Any] | None = None,
    compile: bool | Mapping[str, Any] = False,
) -> BudgetPlan:
    """The plan of ``model`` with ``prepare`` applied to its meta twin, after the checks;
    planned within ``scope`` where one is given, and for compiled blocks with ``compile``
    (Note [A block compiled with its plan], rule 3, in ``matepoint._compiled.blocks``)."""
    if budget_plan is not None:
        raise TypeError(
            "pass budget= to plan here or budget_plan= for a plan made before, not both"
        )
    if example_batch is None:
        raise TypeError("budget= plans from one example batch: pass example_batch=")
    if optimizer is UNSET:
        raise TypeError(
            "budget= counts the optimizer's states: pass optimizer= (None where none share "
            "the device)"
        )
    compiled = options(compiled_offload=True) if compile else contextlib.nullcontext()
    with scope or contextlib.nullcontext(), compiled:
        return plan_prepared(
            model,
            example_batch,
            optimizer=optimizer,
            budget=budget,
            loss_fn=loss_fn,
            host_budget_bytes=None,
            device=device,
            prepare=prepare,
        )


def check_blocks(plan: BudgetPlan, blocks: int, what: str) -> None:
    """Block ``i`` takes region ``i`` (Note [A plan's regions], rule 1): the counts must agree
    where the plan decides its last regions apart, and the blocks never outnumber the
    regions."""
    by_place = last_regions_apart(plan)
    if blocks > plan.regions or (by_place and blocks != plan.regions):
        raise ValueError(
            f"the plan has {plan.regions} regions (its planned step's checkpoint calls) but "
            f"{blocks} {what}: block i takes region i, so plan this model"
            + (f" ({by_place})" if by_place else "")
        )


def last_regions_apart(plan: BudgetPlan) -> str:
    """What the plan does in its last regions only, in words, or "" where every region
    decides alike."""
    if plan.kept_in_last:
        return "the plan keeps in its last regions"
    if plan.unchecked_last and plan.checkpoint:
        return f"the plan leaves its last {plan.unchecked_last} regions unchecked"
    return ""


def attach_guard(
    model: nn.Module,
    plan: BudgetPlan,
    optimizer: Any,
    replan: Callable[[int], BudgetPlan],
    apply: Callable[..., None],
) -> None:
    """Attach a guard on ``plan``'s first steps to ``model``, reading its device's peaks, and
    apply the plan again with the blocks naming it in an out-of-memory error (See Note [The
    budget guard], rules 1 and 5, in ``matepoint._guard``); on a CPU model it reads nothing.
    ``apply`` takes the plan and ``guard=``."""
    # Counted as the plan counted them: one rank's, for an FSDP2 model.
    counted = rank_optimizer(model, optimizer)
    states = 0 if counted is None else optimizer_state_bytes(counted)
    guards: list[BudgetGuard] = []

    def apply_naming(new_plan: BudgetPlan) -> None:
        apply(new_plan, guard=guards[0])

    guard = BudgetGuard(
        plan,
        replan=replan,
        apply=apply_naming,
        states_bytes=states,
        model=model,
        optimizer=optimizer,
    )
    guards.append(guard)
    apply_naming(plan)
    device = next((p.device for p in model.parameters()), None)
    guard.memory = CudaMemory(device) if device is not None and device.type == "cuda" else None
    guard.attach(model)
