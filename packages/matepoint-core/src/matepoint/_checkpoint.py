"""``matepoint.checkpoint``: torch's checkpoint with the saved inputs offloaded to host memory.

matepoint does not re-implement checkpointing. It runs ``torch.utils.checkpoint.checkpoint``
inside its own ``saved_tensors_hooks`` (where some input would move: Note [A call that moves
nothing]); torch's inner hooks shadow matepoint's inside the
checkpointed function, so the only tensors matepoint's pack hook sees are the checkpoint's saved
inputs. Every torch feature (reentrant and not, RNG preservation, ``context_fn``, determinism
checks, early stop) therefore behaves exactly as in torch; matepoint only decides where the saved
inputs live until backward.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.graph import saved_tensors_hooks

import matepoint_compat as compat
from matepoint import _compiled
from matepoint._engine.planning_scope import planning
from matepoint._engine.saving import pack, stays_in_place, unpack
from matepoint._options import (
    OffloadOptions,
    ResolvedOptions,
    check_misplaced_settings,
    get_options,
    resolve,
)
from matepoint._selective import offload_policy_outputs

__all__ = ["checkpoint", "checkpoint_sequential"]

_CHECKPOINT_OPTION_NAMES = frozenset(
    {
        "preserve_rng_state",
        "context_fn",
        "determinism_check",
        "debug",
        "early_stop",
        "respect_saved_tensors_hooks",
    }
)
# Arguments passed through as they are: plain values, and tensors given positionally.
_PLAIN_TYPES = (int, float, bool, str, type(None))
_SIMPLE_LEAF_TYPES = (torch.Tensor, *_PLAIN_TYPES)
# What checkpoint runs under when it offloads nothing (nullcontext keeps no state).
_NO_HOOKS = contextlib.nullcontext()


# The hooks of the last call: a training loop repeats one set of options (``resolve`` returns
# the same object while nothing changes), so building the hooks is off the per-call path. Not
# functools.lru_cache: Dynamo warns where it traces a call to one (the graph break's resume).
_last_hooks: tuple[ResolvedOptions, saved_tensors_hooks] | None = None


def _hooks_for(options: ResolvedOptions) -> saved_tensors_hooks:
    """Return matepoint's outer saved-tensor hooks for checkpoint calls with these options.

    Entering pushes the two hooks and leaving pops them; the object keeps no other state, so one
    instance serves every call (nested and threaded ones too) with the same options.
    """
    global _last_hooks
    last = _last_hooks
    if last is None or last[0] is not options:
        hooks = saved_tensors_hooks(
            functools.partial(pack, options=options), functools.partial(unpack, options=options)
        )
        last = _last_hooks = (options, hooks)
    return last[1]


def _flattened_call(
    function: Callable[..., Any], args: tuple[Any, ...], function_kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    """Turn ``function(*args, **kwargs)`` into ``run(*tensors)`` over the tensor leaves.

    torch's checkpoint saves only top-level tensor arguments; tensors in tuples, lists, dicts or
    keyword arguments are held by plain reference, so no hook could move them. Passing tensor
    leaves as top-level arguments lets them be offloaded too, and version-checked: torch itself
    would recompute from a nested tensor modified in place without noticing.

    See Note [Keyword tensors and device RNG state] for which keyword tensors stay keywords.
    A call with nothing nested (plain values, tensors given positionally) is returned as it is.
    """
    if all(isinstance(value, _SIMPLE_LEAF_TYPES) for value in args) and all(
        isinstance(value, _PLAIN_TYPES) for value in function_kwargs.values()
    ):
        return function, args, function_kwargs
    # Every positional tensor is on one of these devices, so all of them are lifted.
    devices = {torch.device("cpu")}
    devices.update(leaf.device for leaf in compat.tree_flatten(args)[0] if torch.is_tensor(leaf))
    leaves, spec = compat.tree_flatten((args, function_kwargs))
    lifted = [torch.is_tensor(leaf) and leaf.device in devices for leaf in leaves]
    tensors = tuple(leaf for leaf, lift in zip(leaves, lifted, strict=True) if lift)
    # torch keeps ``run`` until backward: it must not reference the tensors it is given, or
    # their device memory could never be released after the offload. Keyword tensors left in
    # place are held by reference, as torch holds every keyword argument.
    template = [None if lift else leaf for leaf, lift in zip(leaves, lifted, strict=True)]

    def run(*tensor_args: torch.Tensor) -> Any:
        given = iter(tensor_args)
        filled = [
            next(given) if lift else leaf for leaf, lift in zip(template, lifted, strict=True)
        ]
        call_args, call_kwargs = compat.tree_unflatten(filled, spec)
        return function(*call_args, **call_kwargs)

    return run, tensors, {}


# Note [A call that moves nothing]
#     Rule 1. A call none of whose saved inputs would move (``stay_reason`` keeps each: small, a
#             parameter or a view of one, on a device the transport does not offload, or not
#             one block of storage) runs torch's checkpoint without matepoint's saved-tensor
#             hooks. Python hooks cost host time on every saved input, in forward and backward,
#             which a host-bound step (a selective policy's, on a fast device) shows.
#     Rule 2. Its inputs are counted as kept, as the pack hook would count them.
#     Rule 3. torch checks their versions itself, raising its own RuntimeError where matepoint's
#             unpack raises InplaceModificationError, a subclass (the docs promise the subclass
#             for offloaded inputs only).
#     Rule 4. Nothing else about the call changes: nested tensors are lifted to arguments first
#             (so torch version-checks them too), and a selective policy's offload wrapper
#             needs no hook. A planned step always runs the hooks: it records every save.
#     Example: ``checkpoint(block, x)`` with ``x`` below ``min_offload_bytes`` is
#     ``torch.utils.checkpoint.checkpoint(block, x)``, and ``stats().skipped_small`` grows by 1.


# Note [Keyword tensors and device RNG state]
#     Rule 1. torch's checkpoint picks the devices whose RNG states it saves and restores for the
#             recomputation (``preserve_rng_state``), and the device whose autocast state it
#             replays, from its positional arguments only (nested ones included).
#     Rule 2. matepoint must not change which devices torch sees: a keyword tensor becomes a
#             positional argument (and is offloaded) only when it is on the CPU or on a device
#             some positional tensor is on already.
#     Rule 3. Any other keyword tensor stays a keyword argument, held by reference and
#             recomputed from as torch does, and is not offloaded.
#     Example: in ``checkpoint(f, ids_on_cpu, h=h_on_cuda)`` ``h`` stays a keyword; lifted, it
#     would make torch restore the CUDA RNG state, which torch's own checkpoint does not (its
#     dropout draws a fresh mask in the recomputation).


def checkpoint(
    function: Callable[..., Any] | None = None,
    *args: Any,
    use_reentrant: bool | None = False,
    pipeline: bool = True,
    offload: OffloadOptions | bool | None = None,
    **kwargs: Any,
) -> Any:
    """Checkpoint ``function`` like ``torch.utils.checkpoint.checkpoint``, offloading its inputs.

    Activations inside ``function`` are recomputed in backward, as with torch's checkpoint; the
    inputs torch keeps for that recomputation are copied to pinned host memory in forward and
    back before backward needs them, on a side stream that overlaps compute: device memory stays
    flat in depth, for host RAM and link traffic. Nested tensors are offloaded too (keyword ones
    as Note [Keyword tensors and device RNG state] says); parameters and their views, conj/neg
    views, tensors below ``min_offload_bytes`` and tensors not on an accelerator stay put.
    Gradients are identical to torch's checkpoint; ``use_reentrant`` defaults to ``False``.

    With ``offload=False``, gradients disabled, another saved-tensor hook active (an enclosing
    checkpoint, ``save_on_cpu``) or such hooks disabled by torch, the call is torch's checkpoint;
    so is a call none of whose inputs would move (Note [A call that moves nothing]), without
    matepoint's hooks. The docs' "How it works" and "Differences from torch" have the details.

    Args:
        function: What to run. With no function and no positional arguments, returns a decorator
            configured by the keyword arguments: ``@checkpoint(offload=...)``, with the
            parentheses (``@checkpoint`` alone would run the function at once).
        *args: Arguments of ``function``.
        use_reentrant: torch's flag. Default: ``False`` (``None`` means ``True`` with torch's
            warning, as in torch).
        pipeline: Copy on a side stream overlapping compute (``True``) or synchronously on the
            compute stream (``False``, for debugging; no prefetch; the 0.1.x
            ``matepoint.NOPIPELINE = True`` means the same). Default: ``True``.
        offload: :class:`OffloadOptions` for this call (the rest comes from
            :func:`matepoint.configure`), ``None`` or ``True`` for the settings alone, or
            ``False`` to offload nothing (plain torch checkpoint). Default: ``None``.
        **kwargs: torch's checkpoint options (``preserve_rng_state``, ``context_fn``,
            ``determinism_check``, ``debug``, ``early_stop`` on every supported torch,
            ``respect_saved_tensors_hooks`` from torch 2.14), then keyword arguments of
            ``function``. The 0.1.x keywords ``stream=``, ``matepoint_ctx=`` and
            ``check_inplace_modifications=`` reach a ``function`` that takes them; otherwise
            they are dropped with a deprecation warning.

    Returns:
        What ``function`` returns.

    Raises:
        InplaceModificationError: In backward, if an offloaded input was modified in place after
            the forward (torch raises a ``RuntimeError`` for the same case; this is a subclass).
        PinnedMemoryExhausted: In forward, if pinned memory runs out and the policy is
            ``on_pool_exhausted="raise"``.
        TypeError: For an ``offload=`` of the wrong type, positional arguments without a
            function, or ``respect_saved_tensors_hooks=`` on torch older than 2.14.
        ValueError: Whatever ``torch.utils.checkpoint.checkpoint`` raises for the same arguments,
            for example keyword arguments with ``use_reentrant=True``.

    Example:
        >>> import torch
        >>> from matepoint import OffloadOptions, checkpoint
        >>> block = torch.nn.Linear(64, 64)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> checkpoint(block, x).sum().backward()
        >>> everything = OffloadOptions(min_offload_bytes=0)
        >>> y = checkpoint(block, x, offload=everything)  # options for this call only
        >>> @checkpoint(offload=everything)
        ... def mlp(h, scale=1.0):
        ...     return block(h) * scale
        >>> y = mlp(x, scale=2.0)
    """
    if function is not None:
        compat.pop_legacy_checkpoint_kwargs(kwargs, function=function)
        return _checkpoint(function, args, kwargs, use_reentrant, pipeline, offload)
    if args:
        raise TypeError("checkpoint() got positional arguments but no function to run")
    # Checked now, not at the first call: the decorator line is the one to fix.
    resolve(offload, pipeline)
    compat.pop_legacy_checkpoint_kwargs(kwargs)
    return _decorator(kwargs, use_reentrant, pipeline, offload)


def _decorator(
    kwargs: dict[str, Any],
    use_reentrant: bool | None,
    pipeline: bool,
    offload: OffloadOptions | bool | None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Return the decorator ``checkpoint(**kwargs)`` stands for: each call is :func:`checkpoint`."""

    def decorate(decorated: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(decorated)
        def checkpointed(*call_args: Any, **call_kwargs: Any) -> Any:
            # Here, so that a 0.1.x keyword's warning points at the caller's line.
            compat.pop_legacy_checkpoint_kwargs(call_kwargs, function=decorated)
            merged = {**kwargs, **call_kwargs}
            return _checkpoint(decorated, call_args, merged, use_reentrant, pipeline, offload)

        return checkpointed

    return decorate


def _checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    use_reentrant: bool | None,
    pipeline: bool,
    offload: OffloadOptions | bool | None,
) -> Any:
    """:func:`checkpoint` once the 0.1.x keywords are gone (the decorator enters here too)."""
    # See Note [The compiled path] (matepoint._compiled); experimental and opt-in.
    if compat.compile_tracing() and get_options().compiled_offload:
        return _compiled.checkpoint(
            function, args, kwargs, use_reentrant=use_reentrant, pipeline=pipeline, offload=offload
        )
    reentrant = True if use_reentrant is None else bool(use_reentrant)
    plan = planning()  # See Note [Planning scope] in matepoint._engine.planning_scope.
    options = resolve(offload, pipeline) if plan is None else plan.options_for(offload, pipeline)
    # What is left in kwargs is the function's keyword arguments.
    checkpoint_options = {
        name: kwargs.pop(name) for name in list(kwargs) if name in _CHECKPOINT_OPTION_NAMES
    }
    if kwargs:
        check_misplaced_settings(kwargs, function)
    if plan is not None:
        if plan.strategy == "none" or not (reentrant or plan.runs_checkpointed()):
            return function(*args, **kwargs)
        if plan.context_fn is not None and not reentrant:
            checkpoint_options["context_fn"] = plan.context_fn
    adapted = compat.adapt_checkpoint_kwargs(checkpoint_options, use_reentrant=reentrant)
    # Without options, with nothing to save, or under an outer saved-tensor hook (another
    # checkpoint's forward or recomputation, save_on_cpu) that owns the saved inputs, the call is
    # plain torch checkpoint.
    hooks: contextlib.AbstractContextManager[None] = _NO_HOOKS
    if (
        options is not None
        and torch.is_grad_enabled()
        and not compat.saved_tensors_hooks_active()
        and compat.saved_tensors_hooks_enabled()
    ):
        if not reentrant:
            context_fn = checkpoint_options.get("context_fn", torch_checkpoint.noop_context_fn)
            if context_fn is not torch_checkpoint.noop_context_fn:
                # See Note [Offloading what a selective policy saves] (matepoint/_selective.py).
                checkpoint_options["context_fn"] = offload_policy_outputs(context_fn, options)
            function, args, kwargs = _flattened_call(function, args, kwargs)
        # See Note [A call that moves nothing], rules 1 and 4.
        if plan is not None or not stays_in_place(args, options):
            hooks = _hooks_for(options)
    # unwind_failed_checkpoint: on torch < 2.13 a raising function leaves torch's hooks pushed
    # above any context around the call; it pops them first, so such a context pops its own.
    with adapted, hooks, compat.unwind_failed_checkpoint():
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=use_reentrant, **checkpoint_options, **kwargs
        )


def checkpoint_sequential(
    functions: torch.nn.Sequential | Iterable[Callable[[Any], Any]],
    segments: int,
    input: torch.Tensor,
    use_reentrant: bool | None = False,
    pipeline: bool = True,
    offload: OffloadOptions | bool | None = None,
    **kwargs: Any,
) -> Any:
    """Run a sequence of modules in ``segments`` chunks, each but the last checkpointed.

    Same contract as ``torch.utils.checkpoint.checkpoint_sequential`` (one tensor flows through
    the sequence; the last segment runs without checkpointing, its activations are needed at
    once), with each segment's input offloaded as in :func:`checkpoint`.

    Args:
        functions: A ``torch.nn.Sequential`` or a sequence of modules or functions.
        segments: Number of chunks.
        input: The tensor fed to the first function.
        use_reentrant: As in :func:`checkpoint`; ``None`` warns (``UserWarning``) and means
            ``True``, as in torch. Default: ``False``.
        pipeline: As in :func:`checkpoint`. Default: ``True``.
        offload: As in :func:`checkpoint`.
        **kwargs: ``preserve_rng_state`` only (default ``True``), as in torch; the 0.1.x
            keywords are dropped with a deprecation warning.

    Returns:
        The output of the last function.

    Raises:
        ValueError: For keyword arguments other than ``preserve_rng_state``, or ``segments`` < 1;
            otherwise what :func:`checkpoint` raises.

    Example:
        >>> import torch
        >>> from matepoint import checkpoint_sequential
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
        >>> out = checkpoint_sequential(model, 2, torch.randn(2, 16, requires_grad=True))
    """
    compat.pop_legacy_checkpoint_kwargs(kwargs)
    preserve = kwargs.pop("preserve_rng_state", True)
    if kwargs:
        raise ValueError("Unexpected keyword arguments: " + ",".join(kwargs))
    if use_reentrant is None:
        warnings.warn(
            "matepoint.checkpoint_sequential: use_reentrant=None means use_reentrant=True, as "
            "in torch.utils.checkpoint; pass use_reentrant explicitly (False is recommended).",
            stacklevel=2,  # a UserWarning, as torch's
        )
        use_reentrant = True
    function_list: list[Callable[[Any], Any]] = list(
        functions.children() if isinstance(functions, torch.nn.Sequential) else functions
    )
    if segments < 1:
        raise ValueError(f"checkpoint_sequential() needs segments >= 1, got {segments}")
    segment_size = len(function_list) // segments
    last_start = segment_size * (segments - 1)
    for start in range(0, last_start, segment_size):
        segment = functools.partial(_run_in_order, function_list[start : start + segment_size])
        options = {"preserve_rng_state": preserve}
        input = _checkpoint(segment, (input,), options, use_reentrant, pipeline, offload)
    return _run_in_order(function_list[last_start:], input)


def _run_in_order(functions: list[Callable[[Any], Any]], value: Any) -> Any:
    """Feed ``value`` through ``functions``, each taking the previous one's output."""
    for function in functions:
        value = function(value)
    return value
