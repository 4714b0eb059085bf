"""Questions about the saved-tensor hook stack that torch only answers through private calls."""

from __future__ import annotations

import torch

__all__ = ["saved_tensors_hooks_active", "saved_tensors_hooks_enabled"]


def saved_tensors_hooks_active() -> bool:
    """Return whether a ``saved_tensors_hooks`` context is in scope on this thread.

    matepoint.checkpoint uses it to tell a top-level call from one nested inside another
    checkpoint's forward or recomputation (or inside ``save_on_cpu``): there the outer hook owns
    the saved inputs and matepoint must not shadow it. torch exposes the hook stack only through
    ``torch._C._autograd._top_saved_tensors_default_hooks``; its ``ignore_is_tracing`` argument
    appeared after 2.4, hence the fallback.

    Returns:
        True when some saved-tensor hook would pack a tensor saved right now.
    """
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # no way to ask: behave as a top-level call
        return False
    try:
        hooks = top(False)
    except TypeError:  # releases whose binding takes no argument
        hooks = top()
    return hooks is not None


def saved_tensors_hooks_enabled() -> bool:
    """Return whether saved-tensor hooks may be pushed here (torch disables them in some tracing).

    Returns:
        False where pushing ``saved_tensors_hooks`` would raise.
    """
    is_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return True if is_enabled is None else bool(is_enabled())
