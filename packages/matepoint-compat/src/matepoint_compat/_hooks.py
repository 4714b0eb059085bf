"""Questions about autograd's state (the saved-tensor hook stack, a running backward) that torch
only answers through private calls."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from matepoint_compat._version import TORCH_2_8_PLUS

__all__ = ["in_backward", "saved_tensors_hooks_active", "saved_tensors_hooks_enabled"]


class _HookDepth(threading.local):
    """Per-thread count of the saved-tensor hooks pushed through Python (torch < 2.8 only)."""

    depth: int = 0


_HOOK_DEPTH = _HookDepth()


def _install_hook_depth_counter() -> None:
    """Count pushes and pops of torch's saved-tensor default hooks on each thread.

    torch 2.4-2.7 keep the hook stack in C++ and have no call that reads it
    (``_top_saved_tensors_default_hooks`` arrived in 2.8). Every Python-level hook context
    (``saved_tensors_hooks``, ``save_on_cpu``, the non-reentrant checkpoint's own hooks) pushes
    and pops through ``torch._C._autograd._push/_pop_saved_tensors_default_hooks``, looked up at
    call time, so wrapping those two functions mirrors the stack depth per thread. The wrappers
    call torch's functions unchanged. Shim can go when torch 2.8 is the oldest supported release.
    """
    autograd: Any = torch._C._autograd
    push: Callable[[Any, Any], None] = autograd._push_saved_tensors_default_hooks
    pop: Callable[[], None] = autograd._pop_saved_tensors_default_hooks
    if getattr(push, "_matepoint_counts_depth", False):
        return

    def counted_push(pack_hook: Any, unpack_hook: Any) -> None:
        push(pack_hook, unpack_hook)
        _HOOK_DEPTH.depth += 1

    def counted_pop() -> None:
        pop()
        # A context entered before matepoint_compat was imported pops one more than we counted.
        _HOOK_DEPTH.depth = max(0, _HOOK_DEPTH.depth - 1)

    counted_push._matepoint_counts_depth = True  # type: ignore[attr-defined]
    counted_pop._matepoint_counts_depth = True  # type: ignore[attr-defined]
    autograd._push_saved_tensors_default_hooks = counted_push
    autograd._pop_saved_tensors_default_hooks = counted_pop


if not TORCH_2_8_PLUS:
    _install_hook_depth_counter()


def saved_tensors_hooks_active() -> bool:
    """Return whether a ``saved_tensors_hooks`` context is in scope on this thread.

    matepoint.checkpoint uses it to tell a top-level call from one nested inside another
    checkpoint's forward or recomputation (or inside ``save_on_cpu``): there the outer hook owns
    the saved inputs and matepoint must not shadow it. From torch 2.8 the hook stack is read
    through ``torch._C._autograd._top_saved_tensors_default_hooks``; on 2.4-2.7 it is the depth
    counted by the push/pop wrappers above (gate ``TORCH_2_8_PLUS``).

    Returns:
        True when some saved-tensor hook would pack a tensor saved right now.
    """
    if not TORCH_2_8_PLUS:
        return _HOOK_DEPTH.depth > 0
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def saved_tensors_hooks_enabled() -> bool:
    """Return whether saved-tensor hooks may be pushed here (torch disables them in some tracing).

    torch answers through the private ``torch._C._autograd._saved_tensors_hooks_is_enabled``
    (2.4 to 2.15 have it, checked by the test matrix); a release without it is taken as always
    enabled, which is what torch did before it could disable them.

    Returns:
        False where pushing ``saved_tensors_hooks`` would raise.
    """
    is_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def in_backward() -> bool:
    """Return whether this thread runs inside a backward pass (a hook, a recomputation).

    torch answers through the private ``torch._C._current_graph_task_id`` (-1 outside a
    backward; 2.4 to 2.15 have it, checked by the test matrix, and torch's own checkpoint reads
    it); a release without it is taken as never inside one.

    Returns:
        True while autograd's engine runs a graph task on this thread.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and int(task_id()) != -1
