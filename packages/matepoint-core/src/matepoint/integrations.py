"""One-call ways to put ``matepoint.checkpoint`` behind the checkpointing of other libraries.

- :func:`enable_hf_gradient_checkpointing`: a Hugging Face ``transformers`` model's gradient
  checkpointing runs through matepoint.
- :func:`checkpoint_wrapper` and :func:`apply_matepoint_checkpointing`: torch's
  ``checkpoint_wrapper`` / ``apply_activation_checkpointing`` (what FSDP, FSDP2, DDP and
  torchtitan-style training loops use) with matepoint as the checkpoint function.

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

import functools
from collections.abc import Callable
from typing import Any

import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from matepoint._checkpoint import checkpoint
from matepoint._options import configure
from matepoint._planner.budget_plan import BudgetPlan
from matepoint_compat import torch_apply_activation_checkpointing, torch_checkpoint_wrapper

__all__ = [
    "apply_matepoint_checkpointing",
    "checkpoint_wrapper",
    "enable_hf_gradient_checkpointing",
    "matepoint_checkpoint_fn",
]


def matepoint_checkpoint_fn(
    budget_plan: BudgetPlan | None = None, **checkpoint_kwargs: Any
) -> functools.partial[Any]:
    """Return ``matepoint.checkpoint`` with its keyword arguments bound, non-reentrant by default.

    This is the callable the integrations install; it is also what to hand to any library that
    takes a ``checkpoint_fn`` / ``gradient_checkpointing_func`` of torch's signature. Every
    integration below takes ``budget_plan=`` through it.

    Args:
        budget_plan: A plan from :meth:`matepoint.MemoryPlan.fastest_under`: its
            selective-checkpoint policy becomes every call's ``context_fn``, and its settings
            are applied with :func:`matepoint.configure`. Default: None.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint` (``pipeline``,
            ``offload``, ``preserve_rng_state``, ``context_fn``, ...). ``use_reentrant``
            defaults to ``False``.

    Raises:
        TypeError: For a ``budget_plan`` together with a ``context_fn`` of the caller's.

    Returns:
        A ``functools.partial`` of :func:`matepoint.checkpoint`.

    Example:
        >>> import torch
        >>> fn = matepoint_checkpoint_fn(pipeline=False)
        >>> fn(torch.sin, torch.ones(2, requires_grad=True)).shape
        torch.Size([2])
    """
    if budget_plan is not None:
        if "context_fn" in checkpoint_kwargs:
            raise TypeError("a budget_plan brings its own context_fn; pass one or the other")
        configure(**budget_plan.settings_changes())
        # A plan that decides nothing leaves the call without a context_fn, so the compiled
        # path keeps its own (Note [The compiled path] in matepoint._compiled).
        if (context_fn := budget_plan.context_fn()) is not torch_checkpoint.noop_context_fn:
            checkpoint_kwargs["context_fn"] = context_fn
    return functools.partial(checkpoint, **{"use_reentrant": False, **checkpoint_kwargs})


def enable_hf_gradient_checkpointing(model: nn.Module, **checkpoint_kwargs: Any) -> None:
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

    Args:
        model: A ``transformers.PreTrainedModel`` (or anything with the same
            ``activation_checkpointing_enable`` / ``gradient_checkpointing_enable`` method).
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint` (``pipeline``,
            ``offload``, ``preserve_rng_state``, ...). ``use_reentrant`` defaults to ``False``.

    Raises:
        TypeError: If ``model`` has no gradient checkpointing to enable, or uses the format of
            transformers before 4.35, whose layers call torch's checkpoint directly.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM  # doctest: +SKIP
        >>> model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2))  # doctest: +SKIP
        >>> enable_hf_gradient_checkpointing(model)  # doctest: +SKIP
        >>> model.train()  # doctest: +SKIP
    """
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
    for module in layers:
        module._gradient_checkpointing_func = function  # type: ignore[assignment]


def checkpoint_wrapper(module: nn.Module, **checkpoint_kwargs: Any) -> nn.Module:
    """Wrap ``module`` in torch's ``CheckpointWrapper`` with ``matepoint.checkpoint`` inside.

    The same as ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper(
    module, checkpoint_fn=matepoint.checkpoint)``: the wrapper keeps torch's state-dict names
    (no ``_checkpoint_wrapped_module.`` prefix) and is recognised by FSDP, FSDP2 and torchtitan.
    Apply ``fully_shard`` to the wrapper, not to the module inside it, so FSDP's all-gathers run
    outside the checkpoint and are not repeated by the recomputation.

    Args:
        module: The module to checkpoint on every call.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint`.
            ``use_reentrant`` defaults to ``False``.

    Returns:
        The wrapper module.
    """
    return torch_checkpoint_wrapper(module, matepoint_checkpoint_fn(**checkpoint_kwargs))


def apply_matepoint_checkpointing(
    model: nn.Module,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[[nn.Module, bool, int], bool] | None = None,
    **checkpoint_kwargs: Any,
) -> None:
    """Wrap the submodules of ``model`` that ``check_fn`` selects with :func:`checkpoint_wrapper`.

    torch's ``apply_activation_checkpointing`` with matepoint as the checkpoint function: the
    selected submodules are replaced in place (the root itself is never wrapped). Select the
    repeated blocks (e.g. ``lambda m: isinstance(m, Block)``): each checkpoint then saves one
    block input, which matepoint offloads.

    Args:
        model: The model to modify in place.
        check_fn: Which submodules to wrap. Default: every one (rarely what you want).
        auto_wrap_policy: torch's wrap policy; takes precedence over ``check_fn``.
            Default: ``None``.
        **checkpoint_kwargs: Keyword arguments of :func:`matepoint.checkpoint`.
            ``use_reentrant`` defaults to ``False``.
    """
    wrap = functools.partial(checkpoint_wrapper, **checkpoint_kwargs)
    torch_apply_activation_checkpointing(model, wrap, check_fn, auto_wrap_policy)
