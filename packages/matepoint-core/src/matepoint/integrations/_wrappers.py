"""torch's ``checkpoint_wrapper`` and ``apply_activation_checkpointing`` with matepoint inside."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from matepoint._checkpoint import checkpoint
from matepoint._compiled.blocks import CompiledBlockCheckpoint
from matepoint._guard import BudgetGuard
from matepoint._guard_naming import meta_batch, naming_the_plan, run_naming_the_plan
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.time_model import DeviceModel
from matepoint.integrations._functions import (
    UNSET,
    attach_guard,
    block_function,
    check_blocks,
    last_regions_apart,
    matepoint_checkpoint_fn,
    next_region,
    plan_live_model,
    without_checkpoint,
)
from matepoint_compat import torch_apply_activation_checkpointing, torch_checkpoint_wrapper

__all__ = ["apply_matepoint_checkpointing", "checkpoint_wrapper"]


def checkpoint_wrapper(
    module: nn.Module,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = UNSET,
    loss_fn: Callable[[Any], Any] | None = None,
    device: DeviceModel | None = None,
    budget_plan: BudgetPlan | None = None,
    region: int | None = None,
    guard: bool = True,
    compile: bool | Mapping[str, Any] = False,
    **checkpoint_kwargs: Any,
) -> nn.Module:
    """Wrap ``module`` in torch's ``CheckpointWrapper`` with ``matepoint.checkpoint`` inside.

    The same as ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper(
    module, checkpoint_fn=matepoint.checkpoint)``: the wrapper keeps torch's state-dict names
    (no ``_checkpoint_wrapped_module.`` prefix) and is recognised by FSDP, FSDP2 and torchtitan.
    Apply ``fully_shard`` to the wrapper, not to the module inside it, so FSDP's all-gathers run
    outside the checkpoint and are not repeated by the recomputation.

    A model of several blocks is planned as a whole by :func:`apply_matepoint_checkpointing`
    (``budget=``); here ``budget=`` plans the wrapped module's own step, the module alone as
    the model, and ``budget_plan=`` applies region ``region`` of a plan made before.

    Args:
        module: The module to checkpoint on every call.
        budget: The module's step's device memory (:func:`matepoint.plan_budget`). Default: None.
        example_batch: With ``budget``: the module's input (:func:`matepoint.plan_budget`).
        optimizer: With ``budget``: the optimizer (None where none shares the device).
        loss_fn: With ``budget``: turns the output into the loss. Default: its sum.
        device: With ``budget``: the time model's rates. Default: an H200's.
        budget_plan: A plan made before. Default: None.
        region: The plan's region of this block: block ``i`` of the planned step (its
            ``i``-th checkpoint call) takes ``i``. Needed where the plan keeps in its last
            regions or leaves them unchecked (Note [A plan's regions]); else any region
            decides alike. Default: None.
        guard: With ``budget``: attach a :class:`matepoint.BudgetGuard`. Default: True.
        compile: Compile the block with its checkpoint and plan inside, True or
            ``torch.compile``'s keyword arguments (Note [A block compiled with its plan]).
            Default: False.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint`.
            ``use_reentrant`` defaults to ``False``.

    Returns:
        The wrapper module.

    Raises:
        TypeError: For a plan deciding its last regions apart, without ``region``; for
            ``budget`` without ``example_batch`` or ``optimizer``.
    """
    if budget is not None:
        wrap = functools.partial(checkpoint_wrapper, **checkpoint_kwargs)
        args = (budget, budget_plan, example_batch, optimizer, loss_fn, device)
        budget_plan, region = plan_live_model(module, wrap, *args, compile=compile), 0
    if budget_plan is not None and region is None:
        if (by_place := last_regions_apart(budget_plan)) and budget_plan.regions > 1:
            raise TypeError(
                f"{by_place.replace('the plan', 'this plan')}: name this block's region of "
                f"its {budget_plan.regions}, checkpoint_wrapper(block, budget_plan=plan, "
                "region=i), or wrap every block with "
                "apply_matepoint_checkpointing(budget_plan=plan)"
            )
        region = 0
    function = block_function(budget_plan, region, compile, checkpoint_kwargs)
    wrapper = torch_checkpoint_wrapper(module, function)
    if budget is not None and guard:
        assert budget_plan is not None
        apply = functools.partial(_apply_wrapped, [wrapper], checkpoint_kwargs, compile=compile)

        batch = meta_batch(example_batch)

        def replan(total: int) -> BudgetPlan:
            args = (total, None, batch, optimizer, loss_fn, device)
            return plan_live_model(module, wrap, *args, compile=compile)

        attach_guard(wrapper, budget_plan, optimizer, replan, apply)
    return wrapper


def apply_matepoint_checkpointing(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[[nn.Module, bool, int], bool] | None = None,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = UNSET,
    loss_fn: Callable[[Any], Any] | None = None,
    device: DeviceModel | None = None,
    budget_plan: BudgetPlan | None = None,
    guard: bool = True,
    compile: bool | Mapping[str, Any] = False,
    **checkpoint_kwargs: Any,
) -> BudgetPlan | None:
    """Wrap the submodules of ``model`` that ``check_fn`` selects with :func:`checkpoint_wrapper`.

    torch's ``apply_activation_checkpointing`` with matepoint as the checkpoint function: the
    selected submodules are replaced in place (the root itself is never wrapped). Select the
    repeated blocks (e.g. ``lambda m: isinstance(m, Block)``): each checkpoint then saves one
    block input, which matepoint offloads.

    With ``budget=``, it plans the fastest step within the budget from the live model
    (:func:`matepoint.plan_budget`, on a meta twin wrapped alike: ``check_fn`` is called on
    the twin's modules too, so select by type or name, not by identity) and applies it; with
    ``budget_plan=``, it applies a plan made before. Either way the ``i``-th wrapped block in
    the model's module order takes the plan's region ``i`` (Note [A plan's regions], rule 1):
    the order forward calls a stack's blocks in. A model that calls its blocks in another
    order, or one block twice, needs its own calls with ``context_fn=plan.context_fn(i)``.

    Args:
        model: The model to modify in place.
        check_fn: Which submodules to wrap. Default: every one (rarely what you want).
        auto_wrap_policy: torch's wrap policy, taken before ``check_fn``. Default: None.
        budget: Device memory the step may use, the optimizer's states included: bytes,
            ``"40GiB"`` or ``"auto"`` (:func:`matepoint.plan_budget`). Default: None, no plan.
        example_batch: With ``budget``: one batch, as :func:`matepoint.plan_budget` takes it.
        optimizer: With ``budget``: the optimizer (None where none shares the device).
        loss_fn: With ``budget``: turns the output into the loss. Default: its sum.
        device: With ``budget``: the time model's rates. Default: an H200's.
        budget_plan: A plan made before, applied block by block. Default: None.
        guard: With ``budget``: attach a :class:`matepoint.BudgetGuard`. Default: True.
        compile: Compile each block with its checkpoint and plan inside (torchtitan's
            pattern; see :func:`checkpoint_wrapper`). Default: False.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint`.
            ``use_reentrant`` defaults to ``False``.

    Returns:
        The plan applied (the guard's re-plan replaces it: ``budget_guard(model).plan``) or None.

    Raises:
        TypeError: For ``budget`` without ``example_batch`` or ``optimizer``.
        ValueError: Where the blocks and the plan's regions disagree (Note [A plan's regions]).
    """
    if budget is not None:
        calls: list[int] = []

        def prepare(twin: nn.Module) -> None:
            wrappers = _wrap_blocks(twin, check_fn, auto_wrap_policy, None, checkpoint_kwargs)
            for index, wrapper in enumerate(wrappers):
                wrapper.register_forward_pre_hook(functools.partial(_called, calls, index))

        args = (budget, budget_plan, example_batch, optimizer, loss_fn, device)
        budget_plan = plan_live_model(model, prepare, *args, compile=compile)
        _check_call_order(calls, budget_plan.regions)
    if budget_plan is not None and auto_wrap_policy is None:
        selected = [m for m in model.modules() if m is not model and check_fn(m)]
        check_blocks(budget_plan, len(selected), "blocks to wrap")
    wrappers = _wrap_blocks(
        model, check_fn, auto_wrap_policy, budget_plan, checkpoint_kwargs, compile
    )
    if budget is not None and guard:
        assert budget_plan is not None
        batch = meta_batch(example_batch)
        replan = functools.partial(
            _replan_wrapped, model, checkpoint_kwargs, batch, optimizer, loss_fn, device, compile
        )
        apply = functools.partial(_apply_wrapped, wrappers, checkpoint_kwargs, compile=compile)
        attach_guard(model, budget_plan, optimizer, replan, apply)
    return budget_plan


def _replan_wrapped(
    model: nn.Module,
    checkpoint_kwargs: dict[str, Any],
    example_batch: Any,
    optimizer: Any,
    loss_fn: Callable[[Any], Any] | None,
    device: DeviceModel | None,
    compile: bool | Mapping[str, Any],
    total: int,
) -> BudgetPlan:
    """Plan the wrapped ``model`` again at ``total`` bytes, its twin's blocks checkpointed
    without the plan in force (and eagerly: the twin runs on the meta device)."""

    def unplanned(twin: nn.Module) -> None:
        # The plan in force ran some blocks as they are, each region under its own policy, all
        # naming it: checkpoint every one again, without the plan.
        installed = (checkpoint, without_checkpoint, next_region, run_naming_the_plan)
        for module in twin.modules():
            function = getattr(module, "checkpoint_fn", None)
            inner = function.func if isinstance(function, functools.partial) else function
            if inner in installed or isinstance(inner, CompiledBlockCheckpoint):
                module.checkpoint_fn = matepoint_checkpoint_fn(**checkpoint_kwargs)  # type: ignore[assignment]

    args = (total, None, example_batch, optimizer, loss_fn, device)
    return plan_live_model(model, unplanned, *args, compile=compile)


def _apply_wrapped(
    wrappers: list[nn.Module],
    checkpoint_kwargs: dict[str, Any],
    plan: BudgetPlan,
    guard: BudgetGuard | None = None,
    compile: bool | Mapping[str, Any] = False,
) -> None:
    """Apply ``plan`` to the wrapped blocks, block ``i`` with region ``i``, compiled with it
    where ``compile`` says, naming ``guard``'s plan in an out-of-memory error where there is
    one."""
    check_blocks(plan, len(wrappers), "wrapped blocks")
    for region, wrapper in enumerate(wrappers):
        function = block_function(plan, region, compile, checkpoint_kwargs)
        named = function if guard is None else naming_the_plan(guard, function)
        wrapper.checkpoint_fn = named  # type: ignore[assignment]


def _wrap_blocks(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool],
    auto_wrap_policy: Callable[[nn.Module, bool, int], bool] | None,
    budget_plan: BudgetPlan | None,
    checkpoint_kwargs: dict[str, Any],
    compile: bool | Mapping[str, Any] = False,
) -> list[nn.Module]:
    """Wrap the selected blocks, block ``i`` with region ``i`` of ``budget_plan``, compiled
    where ``compile`` says; return the wrappers in the order they were made, block ``i``'s at
    ``i``."""
    wrappers: list[nn.Module] = []

    def wrap(module: nn.Module) -> nn.Module:
        region = None if budget_plan is None else len(wrappers)
        wrappers.append(
            checkpoint_wrapper(
                module,
                budget_plan=budget_plan,
                region=region,
                compile=compile,
                **checkpoint_kwargs,
            )
        )
        return wrappers[-1]

    torch_apply_activation_checkpointing(model, wrap, check_fn, auto_wrap_policy)
    return wrappers


def _called(calls: list[int], index: int, *_args: Any) -> None:
    """A wrapped block of the planned twin was called: record its number."""
    calls.append(index)


def _check_call_order(calls: list[int], regions: int) -> None:
    """The planned step's forward calls block ``i`` as its ``i``-th checkpoint, so block ``i``
    may take region ``i`` (Note [A plan's regions], rule 1); else say what to do."""
    if calls[:regions] != list(range(regions)):
        raise ValueError(
            "the planned step called the wrapped blocks in the order "
            f"{calls[:regions]}, not one after the other in module order: block i cannot take "
            "region i. Plan the model with matepoint.plan_budget and give each checkpoint "
            "call its region, context_fn=plan.context_fn(i), i its place in the calls"
        )
