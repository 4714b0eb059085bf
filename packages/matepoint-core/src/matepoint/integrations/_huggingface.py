"""Hugging Face transformers: gradient checkpointing through matepoint, with a plan per layer."""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import nn

from matepoint._guard import BudgetGuard
from matepoint._guard_naming import meta_batch, naming_the_plan
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.time_model import DeviceModel
from matepoint.integrations._functions import (
    UNSET,
    attach_guard,
    check_blocks,
    matepoint_checkpoint_fn,
    plan_live_model,
)

__all__ = ["enable_hf_gradient_checkpointing"]


@contextlib.contextmanager
def _one_sequence_per_row(example_batch: Any) -> Iterator[None]:
    """transformers' search for packed sequences, answered on the meta device as the real step
    answers it: none.

    Without an attention mask, transformers reads the position ids' values to find sequences
    packed into one row, which a meta tensor has not. Where the batch brings no position ids,
    transformers makes one range per row, in which it finds none: the answer is None. The
    module is patched while planning only (other threads see it too), and only where
    transformers is loaded already: matepoint never imports it.
    """
    masking = sys.modules.get("transformers.masking_utils")
    name = "find_packed_sequence_indices"
    given = isinstance(example_batch, Mapping) and "position_ids" in example_batch
    if masking is None or given or not hasattr(masking, name):
        yield
        return
    original = getattr(masking, name)
    setattr(masking, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        setattr(masking, name, original)


def enable_hf_gradient_checkpointing(
    model: nn.Module,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = UNSET,
    loss_fn: Callable[[Any], Any] | None = None,
    device: DeviceModel | None = None,
    budget_plan: BudgetPlan | None = None,
    guard: bool = True,
    **checkpoint_kwargs: Any,
) -> BudgetPlan | None:
    """Turn on a ``transformers`` model's gradient checkpointing, run by ``matepoint.checkpoint``.

    transformers checkpoints each decoder layer through a ``_gradient_checkpointing_func`` that
    ``gradient_checkpointing_enable`` sets to a partial of torch's checkpoint. This helper calls
    the model's own enable method (so everything else transformers does there still happens:
    the per-layer flags, input gradients for PEFT), then points every layer's function at
    matepoint. Only what transformers passes positionally to the checkpoint (the hidden states)
    is offloaded; keyword arguments such as the attention mask and rotary tables are bound into
    the layer call by transformers and stay where they are.

    Call it instead of ``gradient_checkpointing_enable``, and do not also ask the ``Trainer``
    for checkpointing (``TrainingArguments(gradient_checkpointing=True)`` or
    ``activation_checkpointing=True``): the Trainer would enable torch's checkpoint again.
    ``model.gradient_checkpointing_disable()`` turns it off as usual.

    With ``budget=``, it also plans the fastest step within the budget from the live model
    (:func:`matepoint.plan_budget`, on a meta twin with the same layers checkpointed) and
    applies it: layer ``i`` (in module order) takes the plan's region ``i``.

    Args:
        model: A ``transformers.PreTrainedModel`` (or anything with the same
            ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` method).
        budget: Device memory the step may use, the optimizer's states included: bytes, a
            string such as ``"40GiB"``, or ``"auto"`` (see :func:`matepoint.plan_budget`).
            Default: None, no plan.
        example_batch: With ``budget``: one batch, as :func:`matepoint.plan_budget` takes it
            (``{"input_ids": ids, "labels": ids}``).
        optimizer: With ``budget``: the optimizer (None where none shares the device).
        loss_fn: With ``budget``: turns the output into the loss. Default: its ``loss``.
        device: With ``budget``: the time model's rates. Default: an H200's.
        budget_plan: A plan made before, applied layer by layer. Default: None.
        guard: With ``budget``: attach a :class:`matepoint.BudgetGuard` to the model
            (:func:`matepoint.budget_guard` finds it). Default: True.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint` (``pipeline``,
            ``offload``, ``preserve_rng_state``, ...). ``use_reentrant`` defaults to ``False``.

    Returns:
        The plan applied (a re-plan of the guard replaces it: ``budget_guard(model).plan``),
        or None without one.

    Raises:
        TypeError: If ``model`` has no gradient checkpointing to enable, or uses the format of
            transformers before 4.35, whose layers call torch's checkpoint directly; for
            ``budget`` without ``example_batch`` or ``optimizer``.
        ValueError: For a plan with fewer regions than the model has checkpointed layers.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM  # doctest: +SKIP
        >>> model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))  # doctest: +SKIP
        >>> enable_hf_gradient_checkpointing(model)  # doctest: +SKIP
        >>> model.train()  # doctest: +SKIP
    """
    replan = functools.partial(
        _replan_hf, model, checkpoint_kwargs, meta_batch(example_batch), optimizer, loss_fn, device
    )
    if budget is not None:
        budget_plan = replan(budget, budget_plan)
    _enable_hf(model, checkpoint_kwargs, budget_plan)
    if budget is not None and guard:
        assert budget_plan is not None
        apply = functools.partial(_apply_hf, model, checkpoint_kwargs)
        attach_guard(model, budget_plan, optimizer, replan, apply)
    return budget_plan


def _replan_hf(
    model: nn.Module,
    checkpoint_kwargs: dict[str, Any],
    example_batch: Any,
    optimizer: Any,
    loss_fn: Callable[[Any], Any] | None,
    device: DeviceModel | None,
    budget: int | float | str,
    budget_plan: BudgetPlan | None = None,
) -> BudgetPlan:
    """Plan the transformers ``model`` at ``budget``: its twin's layers enabled afresh, so
    they checkpoint without the plan in force."""
    prepare = functools.partial(_enable_hf, checkpoint_kwargs=checkpoint_kwargs)
    scope = _one_sequence_per_row(example_batch)
    args = (budget, budget_plan, example_batch, optimizer, loss_fn, device, scope)
    return plan_live_model(model, prepare, *args)


def _apply_hf(
    model: nn.Module,
    checkpoint_kwargs: dict[str, Any],
    plan: BudgetPlan,
    guard: BudgetGuard | None = None,
) -> None:
    """Apply ``plan`` to the transformers ``model``'s checkpointed layers, one region each,
    naming ``guard``'s plan in an out-of-memory error where there is one."""
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    functions = _hf_layer_functions(layers, plan, checkpoint_kwargs)
    for layer, function in zip(layers, functions, strict=True):
        named = function if guard is None else naming_the_plan(guard, function)
        layer._gradient_checkpointing_func = named  # type: ignore[assignment]


def _enable_hf(
    model: nn.Module, checkpoint_kwargs: dict[str, Any], budget_plan: BudgetPlan | None = None
) -> None:
    """Enable transformers' checkpointing on ``model`` and point its layers at matepoint."""
    function = matepoint_checkpoint_fn(**checkpoint_kwargs)
    # What transformers hands its own (replaced) checkpoint; only use_reentrant matters to it.
    hf_kwargs = {"use_reentrant": function.keywords["use_reentrant"]}
    # transformers 5 renamed the method and warns (FutureWarning) on the old name.
    if callable(enable := getattr(model, "activation_checkpointing_enable", None)):
        enable(activation_checkpointing_kwargs=hf_kwargs)
    elif callable(legacy_enable := getattr(model, "gradient_checkpointing_enable", None)):
        legacy_enable(gradient_checkpointing_kwargs=hf_kwargs)
    else:
        raise TypeError(
            f"{type(model).__name__} has no gradient_checkpointing_enable(): "
            "enable_hf_gradient_checkpointing() needs a transformers PreTrainedModel"
        )
    layers = [m for m in model.modules() if hasattr(m, "_gradient_checkpointing_func")]
    if not layers:
        raise TypeError(
            f"{type(model).__name__} enabled gradient checkpointing without a "
            "_gradient_checkpointing_func (the format of transformers before 4.35): its layers "
            "call torch's checkpoint directly and matepoint cannot be put in its place"
        )
    functions = [function] * len(layers)
    if budget_plan is not None:
        functions = _hf_layer_functions(layers, budget_plan, checkpoint_kwargs)
    for module, layer_function in zip(layers, functions, strict=True):
        module._gradient_checkpointing_func = layer_function  # type: ignore[assignment]


def _hf_layer_functions(
    layers: list[nn.Module], budget_plan: BudgetPlan, checkpoint_kwargs: dict[str, Any]
) -> list[functools.partial[Any]]:
    """Each layer's checkpoint function under ``budget_plan``: its own region per layer.

    transformers gives the function to every module with a ``gradient_checkpointing`` flag,
    the model's own included; the ones that call it are those with no such module inside
    (the decoder layers). Layer ``i`` of those takes region ``i``. Where one module calls it
    for every layer (a model that runs its layers through its own function), no block is
    known and the function counts (Note [A plan's regions], rule 3), as does any other.
    """
    counting = matepoint_checkpoint_fn(budget_plan, **checkpoint_kwargs)
    ids = {id(module) for module in layers}
    callers = [
        module
        for module in layers
        if not any(id(inner) in ids for inner in module.modules() if inner is not module)
    ]
    if len(callers) == 1:
        return [counting] * len(layers)
    check_blocks(budget_plan, len(callers), "checkpointed layers")
    regions = {id(module): index for index, module in enumerate(callers)}
    return [
        matepoint_checkpoint_fn(budget_plan, region=regions[id(module)], **checkpoint_kwargs)
        if id(module) in regions
        else counting
        for module in layers
    ]
