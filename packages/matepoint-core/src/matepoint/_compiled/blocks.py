"""A checkpointed block compiled on its own, its inputs offloaded by the eager engine.

Note [A block compiled with its plan]
    torchtitan compiles each block, not the whole model. A block compiled with its checkpoint
    inside has its plan's selective-checkpoint policy resolved when torch traces it: no
    dispatch mode runs in the step, so a plan costs the host nothing per op (docs/selective.md,
    "Host cost").
    Rule 1. The compiled function is torch's checkpoint of the block with its region's
            ``context_fn``, compiled with ``fullgraph=True``: a graph break in the block is an
            error, never a silent fall back to eager. A region the plan leaves unchecked is the
            block itself, compiled alike.
    Rule 2. The block's inputs are inputs of the compiled graph, which saves them as they are:
            matepoint offloads them from outside, its eager pack hook pushed around the compiled
            call. The hook sees all the compiled function saves (its inputs, the parameters,
            what the policy keeps); it moves, by the pack hook's own rules (``stay_reason``:
            size, device, parameters), the saved tensors that share memory with the call's
            tensor arguments, and leaves every other where it is, uncounted: what the policy
            keeps stays on the device, as planned. The copies and their counts in
            ``matepoint.stats()`` are the eager engine's, look-ahead and stash included.
    Rule 3. Under a compiled graph torch's selective checkpointing keeps on the device an
            output its policy offloads (Note [The budget search], rule 11): a plan that offloads
            through its policy is refused. The integrations' ``compile=`` with ``budget=`` plans
            with ``compiled_offload`` in force, so that the search never offloads so.
    Rule 4. A wrapper compiled again by the user (torchtitan compiles each block it wrapped)
            is traced into the user's graph as torch's checkpoint with the region's policy, as
            a whole-model compile traces it: that graph's inputs are saved as they are, so
            nothing moves. The block's own ``compile=`` is what moves them.
    Rule 5. Without grad, under an outer saved-tensor hook (another checkpoint, ``save_on_cpu``),
            or with offloading off, the compiled call runs without the hook, as the eager
            path's does.
    Rule 6. The compiled function is made once per block, on its first call: the block is a
            module, or a ``functools.partial`` of a module or of a module's method (a model
            that binds a block's position or its rotary tensors each call). The partial's
            keywords holding tensors are passed at each call; its other arguments (none may
            hold a tensor positionally) name the block with
            the module, so each position is compiled once and a new partial of the same block
            reuses it. Dynamo keeps the compiled entries of one code object together, one per
            block where the blocks share their code, so matepoint raises its limit to the
            blocks it has compiled, beyond Dynamo's default (``compat.allow_recompiles``).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

import matepoint_compat as compat
from matepoint._engine.channel_engine import Record
from matepoint._engine.saving import KeptTensor, pack, unpack
from matepoint._options import OffloadOptions, ResolvedOptions, resolve

__all__ = ["CompiledBlockCheckpoint"]

# The blocks compiled in this process, and the entries Dynamo keeps of one code object by
# default (See Note [A block compiled with its plan], rule 6).
_BLOCKS_COMPILED = 0
_DYNAMO_DEFAULT_LIMIT = 8
_LOCK = threading.Lock()


class RegionPlan(Protocol):
    """What a block compiled with its plan reads of a :class:`matepoint.BudgetPlan` (the
    compiled path sits below the planner, and imports none of it)."""

    @property
    def decisions(self) -> tuple[tuple[str, str], ...]: ...

    def checkpoints_region(self, region: int) -> bool: ...

    def context_fn(self, region: int | None = None) -> Callable[[], Any]: ...


class CompiledBlockCheckpoint:
    """A checkpoint function, of torch's signature, that runs its block compiled with a plan's
    region (See Note [A block compiled with its plan]).

    Args:
        plan: The budget plan, or None for plain checkpointing.
        region: The plan's region of the block (0 where the plan has none apart).
        offload: The calls' ``offload=`` (``matepoint.checkpoint``'s).
        pipeline: The calls' ``pipeline=``.
        compile_options: Keyword arguments of ``torch.compile`` (``backend``, ``mode``, ...);
            ``fullgraph`` is always True.
        checkpoint_options: Keyword arguments of torch's checkpoint (``preserve_rng_state``,
            ``determinism_check``, ...); it is always non-reentrant.

    Raises:
        ValueError: For a plan that offloads through its policy (rule 3), or a reentrant
            checkpoint (which Dynamo does not compile).
    """

    # The block is run by the compiled function itself: the guard's renaming wraps the call
    # only (Note [The budget guard], rule 5, in matepoint._guard).
    runs_its_block_compiled = True

    def __init__(
        self,
        plan: RegionPlan | None,
        region: int,
        *,
        offload: OffloadOptions | bool | None = None,
        pipeline: bool = True,
        compile_options: dict[str, Any] | None = None,
        checkpoint_options: dict[str, Any] | None = None,
    ) -> None:
        checkpoint_options = dict(checkpoint_options or {})
        if checkpoint_options.pop("use_reentrant", False):
            raise ValueError(
                "a block compiled with its plan runs torch's non-reentrant checkpoint, the one "
                "torch compiles: leave use_reentrant out or False"
            )
        if plan is not None and "offload" in dict(plan.decisions).values():
            raise ValueError(
                "a block compiled with its plan keeps on the device what the plan offloads "
                "through its policy (torch's compiled selective checkpointing does), so this "
                "plan would hold more than planned: plan with compile=True on the integration, "
                "or under matepoint.options(compiled_offload=True)"
            )
        self.checkpoint_options = checkpoint_options
        self.checkpointed = plan is None or plan.checkpoints_region(region)
        self.context_fn = (
            torch_checkpoint.noop_context_fn if plan is None else plan.context_fn(region)
        )
        self.offload, self.pipeline = offload, pipeline
        self.compile_options = {**(compile_options or {}), "fullgraph": True}
        self._compiled: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledBlockCheckpoint:
        """A copy compiles afresh: the compiled functions are the blocks' they were made for
        (a model's meta twin copies its wrappers)."""
        twin = copy.copy(self)
        twin._compiled = {}
        return twin

    def function(self, block: Callable[..., Any]) -> Callable[..., Any]:
        """What is compiled: torch's checkpoint of ``block`` with the region's policy, or the
        block itself where the plan leaves it unchecked (rule 1)."""
        if not self.checkpointed:
            return block
        # Dynamo takes a context_fn only as a function of the user's: torch's own noop is left
        # out, as a call without one runs it.
        noop = self.context_fn is torch_checkpoint.noop_context_fn
        context: dict[str, Any] = {} if noop else {"context_fn": self.context_fn}
        return functools.partial(
            torch_checkpoint.checkpoint,
            block,
            use_reentrant=False,
            **self.checkpoint_options,
            **context,
        )

    def compiled(self, key: tuple[Any, ...], block: Callable[..., Any]) -> Callable[..., Any]:
        """The block's compiled function, made on its first call (rules 1 and 6)."""
        function = self._compiled.get(key)
        if function is None:
            function = torch.compile(self.function(block), **self.compile_options)
            self._compiled[key] = function
            with _LOCK:
                global _BLOCKS_COMPILED
                _BLOCKS_COMPILED += 1
                compat.allow_recompiles(_DYNAMO_DEFAULT_LIMIT + _BLOCKS_COMPILED)
        return function

    def __call__(self, block: Any, /, *args: Any, **kwargs: Any) -> Any:
        key, block, tensor_keywords = _named_block(block)
        kwargs = {**tensor_keywords, **kwargs}
        if compat.compile_tracing():  # rule 4
            return self.function(block)(*args, **kwargs)
        compiled = self.compiled(key, block)
        options = resolve(self.offload, self.pipeline) if self.checkpointed else None
        if not (
            options is not None
            and torch.is_grad_enabled()
            and not compat.saved_tensors_hooks_active()
            and compat.saved_tensors_hooks_enabled()
        ):
            return compiled(*args, **kwargs)  # rule 5
        inputs = [
            leaf
            for leaf in compat.tree_flatten((args, kwargs))[0]
            if isinstance(leaf, torch.Tensor)
        ]
        storages = {tensor.untyped_storage().data_ptr() for tensor in inputs}
        hooks = saved_tensors_hooks(
            functools.partial(_pack_inputs, storages=storages, options=options),
            functools.partial(unpack, options=options),
        )
        with hooks:
            return compiled(*args, **kwargs)


def _named_block(block: Any) -> tuple[tuple[Any, ...], Callable[..., Any], dict[str, Any]]:
    """The block's name in the cache, the function to compile, and the tensor keywords to pass
    at each call (See Note [A block compiled with its plan], rule 6)."""
    if isinstance(block, nn.Module):
        return (block,), block, {}
    if isinstance(block, functools.partial):
        target = block.func
        owner = getattr(target, "__self__", None)
        if isinstance(target, nn.Module) or isinstance(owner, nn.Module):
            tensors = {k: v for k, v in block.keywords.items() if _holds_tensors(v)}
            others = {k: v for k, v in block.keywords.items() if k not in tensors}
            if not _holds_tensors(block.args):
                name = getattr(target, "__func__", target)
                key = (owner or target, name, block.args, tuple(sorted(others.items())))
                try:
                    hash(key)
                except TypeError as error:
                    raise TypeError(
                        "a block compiled with its plan is named by its partial's arguments "
                        f"other than tensors, which must be hashable: {error}"
                    ) from None
                return key, functools.partial(target, *block.args, **others), tensors
    raise TypeError(
        "a block compiled with its plan is compiled once per block: the checkpoint function "
        f"got a {type(block).__name__}, not the block module or a functools.partial of it (or "
        "of its method) without tensor positional arguments; wrap the block with "
        "matepoint.integrations.checkpoint_wrapper"
    )


def _holds_tensors(value: Any) -> bool:
    """Whether ``value`` is a tensor or a container holding one (a rotary pair, say)."""
    return any(isinstance(leaf, torch.Tensor) for leaf in compat.tree_flatten(value)[0])


def _pack_inputs(
    tensor: torch.Tensor, storages: set[int], options: ResolvedOptions
) -> Record | KeptTensor:
    """Offload a saved tensor that shares memory with the call's inputs; keep any other in
    place, uncounted (See Note [A block compiled with its plan], rule 2)."""
    if type(tensor) is torch.Tensor and tensor.untyped_storage().data_ptr() in storages:
        return pack(tensor, options)
    return KeptTensor(tensor)
