"""One-call ways to put ``matepoint.checkpoint`` behind the checkpointing of other libraries.

- :func:`enable_hf_gradient_checkpointing`: a Hugging Face ``transformers`` model's gradient
  checkpointing runs through matepoint.
- :func:`checkpoint_wrapper` and :func:`apply_matepoint_checkpointing`: torch's
  ``checkpoint_wrapper`` / ``apply_activation_checkpointing`` (what FSDP, FSDP2, DDP and
  torchtitan-style training loops use) with matepoint as the checkpoint function.

Each takes ``budget=`` (with ``example_batch=`` and ``optimizer=``): it wraps the blocks, plans
the fastest step within the budget from the live model (:func:`matepoint.plan_budget`) and
applies the plan, each block with its own region (Note [A plan's regions] in
``matepoint._planner.policy``); or ``budget_plan=``, a plan made before. With ``budget=``,
:func:`apply_matepoint_checkpointing` and :func:`enable_hf_gradient_checkpointing` also attach
a :class:`matepoint.BudgetGuard` to the model (``guard=False`` leaves it out): it reads the
first steps' measured peaks and plans again where they go over the budget (Note [The budget
guard] in ``matepoint._guard``).

None of these imports ``transformers``: the Hugging Face helper only calls the model's own
methods, so matepoint's runtime dependencies stay torch and matepoint-compat.

Example:
    >>> import torch
    >>> import matepoint.integrations as mi
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> mi.apply_matepoint_checkpointing(model, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from matepoint._checkpoint import checkpoint
from matepoint._compiled.blocks import CompiledBlockCheckpoint
from matepoint._guard import (
    BudgetGuard,
    CudaMemory,
    meta_batch,
    naming_the_plan,
    run_naming_the_plan,
)
from matepoint._options import configure, options
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.live_model import plan_prepared, rank_optimizer
from matepoint._planner.optimizer_states import optimizer_state_bytes
from matepoint._planner.time_model import DeviceModel
from matepoint_compat import torch_apply_activation_checkpointing, torch_checkpoint_wrapper

__all__ = [
    "apply_matepoint_checkpointing",
    "checkpoint_wrapper",
    "enable_hf_gradient_checkpointing",
    "matepoint_checkpoint_fn",
]


class _Unset:
    """``optimizer=`` not given: a budget needs it said, None included (no states to count)."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()


# The keywords a checkpoint call takes for itself, matepoint's and torch's (preserve_rng_state
# is read from torch's **kwargs); any other keyword goes to the checkpointed function.
_CHECKPOINT_KEYWORDS = frozenset({"preserve_rng_state"}) | frozenset(
    name
    for signature in (inspect.signature(checkpoint), inspect.signature(torch_checkpoint.checkpoint))
    for name, parameter in signature.parameters.items()
    if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD)
    and name != "function"
)


def _without_checkpoint(function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run a block as it is, where a plan checkpoints nothing (``BudgetPlan.checkpoint``
    False) or not its region (``BudgetPlan.unchecked_last``): the call's own keywords are
    dropped, the function's passed on."""
    return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_KEYWORDS})


def _next_region(
    calls: Iterator[int],
    functions: list[functools.partial[Any]],
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
            return functools.partial(_without_checkpoint)
        if region is None and budget_plan.unchecked_last:
            functions = [
                matepoint_checkpoint_fn(budget_plan, region=index, **checkpoint_kwargs)
                for index in range(budget_plan.regions)
            ]
            return functools.partial(_next_region, itertools.count(), functions)
        context_fn = budget_plan.context_fn(region)
        configure(**budget_plan.settings_changes())
        # A plan that decides nothing leaves the call without a context_fn, so the compiled
        # path keeps its own (Note [The compiled path] in matepoint._compiled).
        if context_fn is not torch_checkpoint.noop_context_fn:
            checkpoint_kwargs["context_fn"] = context_fn
    return functools.partial(checkpoint, **{"use_reentrant": False, **checkpoint_kwargs})


def _block_function(
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


def _planned(
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
    if optimizer is _UNSET:
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


def _check_blocks(plan: BudgetPlan, blocks: int, what: str) -> None:
    """Block ``i`` takes region ``i`` (Note [A plan's regions], rule 1): the counts must agree
    where the plan decides its last regions apart, and the blocks never outnumber the
    regions."""
    by_place = _last_regions_apart(plan)
    if blocks > plan.regions or (by_place and blocks != plan.regions):
        raise ValueError(
            f"the plan has {plan.regions} regions (its planned step's checkpoint calls) but "
            f"{blocks} {what}: block i takes region i, so plan this model"
            + (f" ({by_place})" if by_place else "")
        )


def _last_regions_apart(plan: BudgetPlan) -> str:
    """What the plan does in its last regions only, in words, or "" where every region
    decides alike."""
    if plan.kept_in_last:
        return "the plan keeps in its last regions"
    if plan.unchecked_last and plan.checkpoint:
        return f"the plan leaves its last {plan.unchecked_last} regions unchecked"
    return ""


def enable_hf_gradient_checkpointing(
    model: nn.Module,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = _UNSET,
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
        _attach_guard(model, budget_plan, optimizer, replan, apply)
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
    return _planned(model, prepare, *args)


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


def _attach_guard(
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
    _check_blocks(budget_plan, len(callers), "checkpointed layers")
    regions = {id(module): index for index, module in enumerate(callers)}
    return [
        matepoint_checkpoint_fn(budget_plan, region=regions[id(module)], **checkpoint_kwargs)
        if id(module) in regions
        else counting
        for module in layers
    ]


def checkpoint_wrapper(
    module: nn.Module,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = _UNSET,
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
        budget_plan, region = _planned(module, wrap, *args, compile=compile), 0
    if budget_plan is not None and region is None:
        if (by_place := _last_regions_apart(budget_plan)) and budget_plan.regions > 1:
            raise TypeError(
                f"{by_place.replace('the plan', 'this plan')}: name this block's region of "
                f"its {budget_plan.regions}, checkpoint_wrapper(block, budget_plan=plan, "
                "region=i), or wrap every block with "
                "apply_matepoint_checkpointing(budget_plan=plan)"
            )
        region = 0
    function = _block_function(budget_plan, region, compile, checkpoint_kwargs)
    wrapper = torch_checkpoint_wrapper(module, function)
    if budget is not None and guard:
        assert budget_plan is not None
        apply = functools.partial(_apply_wrapped, [wrapper], checkpoint_kwargs, compile=compile)

        batch = meta_batch(example_batch)

        def replan(total: int) -> BudgetPlan:
            args = (total, None, batch, optimizer, loss_fn, device)
            return _planned(module, wrap, *args, compile=compile)

        _attach_guard(wrapper, budget_plan, optimizer, replan, apply)
    return wrapper


def apply_matepoint_checkpointing(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[[nn.Module, bool, int], bool] | None = None,
    *,
    budget: int | float | str | None = None,
    example_batch: Any = None,
    optimizer: Any = _UNSET,
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
        budget_plan = _planned(model, prepare, *args, compile=compile)
        _check_call_order(calls, budget_plan.regions)
    if budget_plan is not None and auto_wrap_policy is None:
        selected = [m for m in model.modules() if m is not model and check_fn(m)]
        _check_blocks(budget_plan, len(selected), "blocks to wrap")
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
        _attach_guard(model, budget_plan, optimizer, replan, apply)
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
        planned = (checkpoint, _without_checkpoint, _next_region, run_naming_the_plan)
        for module in twin.modules():
            function = getattr(module, "checkpoint_fn", None)
            inner = function.func if isinstance(function, functools.partial) else function
            if inner in planned or isinstance(inner, CompiledBlockCheckpoint):
                module.checkpoint_fn = matepoint_checkpoint_fn(**checkpoint_kwargs)  # type: ignore[assignment]

    args = (total, None, example_batch, optimizer, loss_fn, device)
    return _planned(model, unplanned, *args, compile=compile)


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
    _check_blocks(plan, len(wrappers), "wrapped blocks")
    for region, wrapper in enumerate(wrappers):
        function = _block_function(plan, region, compile, checkpoint_kwargs)
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
