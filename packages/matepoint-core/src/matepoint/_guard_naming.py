"""The blocks an integration runs under a budget plan name it in an out-of-memory error.

Note [The budget guard], rule 5, in ``matepoint._guard``: outside ``BudgetGuard.step()``, an
out-of-memory error in a planned block's forward or in its recomputation is re-raised as
:class:`matepoint.BudgetOutOfMemoryError`, naming the plan. Also the batch a guard keeps to
plan again with, on the meta device.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

import matepoint_compat as compat
from matepoint._errors import BudgetOutOfMemoryError

__all__ = ["meta_batch", "naming_the_plan", "run_naming_the_plan"]


class BudgetGuard(Protocol):
    """What naming the plan needs of ``matepoint.BudgetGuard`` (this module sits below it)."""

    _in_step: bool

    def _out_of_memory(
        self, error: BaseException, *, clear_now: bool = True
    ) -> BudgetOutOfMemoryError: ...


def naming_the_plan(
    guard: BudgetGuard, checkpoint_function: Callable[..., Any]
) -> functools.partial[Any]:
    """``checkpoint_function`` (what an integration runs a block with) with an out-of-memory
    error in the block's forward or its recomputation re-raised naming ``guard``'s plan (See
    Note [The budget guard], rule 5)."""
    return functools.partial(run_naming_the_plan, weakref.ref(guard), checkpoint_function)


def run_naming_the_plan(
    guard: weakref.ref[BudgetGuard],
    checkpoint_function: Callable[..., Any],
    block: Callable[..., Any],
    /,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run ``block`` through ``checkpoint_function``, both naming the plan: the call covers
    forward, the block given to it the recomputation too."""
    if guard() is None or compat.compile_tracing():
        return checkpoint_function(block, *args, **kwargs)
    # A block compiled with its plan recomputes inside its compiled backward, out of reach.
    compiled = getattr(checkpoint_function, "runs_its_block_compiled", False)
    named_block = block if compiled else functools.partial(_naming_the_plan, guard, block)
    return _naming_the_plan(guard, checkpoint_function, named_block, *args, **kwargs)


def _naming_the_plan(
    guard: weakref.ref[BudgetGuard], function: Callable[..., Any], /, *args: Any, **kwargs: Any
) -> Any:
    """Call ``function``; re-raise an out-of-memory error in it naming the plan (rule 5)."""
    try:
        return function(*args, **kwargs)
    except torch.cuda.OutOfMemoryError as error:
        watching = guard()
        if watching is None or watching._in_step or isinstance(error, BudgetOutOfMemoryError):
            raise  # step() names it; or named already, by the recomputation
        renamed = watching._out_of_memory(error, clear_now=not compat.in_backward())
        raise renamed from error


def meta_batch(batch: Any) -> Any:
    """``batch`` with its tensors on the meta device, for planning again: a plan reads only
    their shapes, and a guard keeping the batch itself would keep its device memory."""
    leaves, spec = compat.tree_flatten(batch)
    meta = [
        torch.empty_strided(
            leaf.size(), leaf.stride(), dtype=leaf.dtype, device="meta"
        ).requires_grad_(leaf.requires_grad)
        if isinstance(leaf, torch.Tensor)
        else leaf
        for leaf in leaves
    ]
    return compat.tree_unflatten(meta, spec)
