"""Adapters between matepoint's checkpoint call and the installed ``torch.utils.checkpoint``.

torch's checkpoint grew keyword arguments over the releases matepoint supports. matepoint accepts
the newest spelling on every release and translates it here, so users write one call whatever
torch they have.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import MutableMapping
from traceback import walk_tb
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from matepoint_compat._version import TORCH_2_9_PLUS, TORCH_2_13_PLUS, TORCH_2_14_PLUS

__all__ = ["adapt_checkpoint_kwargs", "unwind_failed_checkpoint"]


# One no-op context serves every call: a nullcontext keeps no state, and checkpoint() asks for
# one on each call of a training loop.
_NO_CONTEXT = contextlib.nullcontext()


def adapt_checkpoint_kwargs(
    kwargs: MutableMapping[str, Any], *, use_reentrant: bool
) -> contextlib.AbstractContextManager[None]:
    """Rewrite checkpoint keyword arguments in place for the installed torch.

    Returns a context manager to run torch's checkpoint under, for options that older releases
    only offer as a global switch.

    - ``early_stop=`` (a keyword from torch 2.9): on older releases it is removed from ``kwargs``
      and applied through ``torch.utils.checkpoint.set_checkpoint_early_stop`` around the call,
      which those releases already have. Shim can go when torch 2.9 is the oldest supported.
    - ``respect_saved_tensors_hooks=`` (a keyword from torch 2.14): matepoint's own saved-tensor
      hooks are always in scope, so on 2.14+ with ``context_fn`` and no explicit choice, matepoint
      passes ``False`` (torch's legacy default) to keep SAC-cached tensors on the device as torch
      does, without torch's FutureWarning about a hook the user never installed. On older torch
      the keyword raises ``TypeError``: silently ignoring it would change what is offloaded.

    Args:
        kwargs: The keyword arguments of the checkpoint call, minus matepoint's own.
        use_reentrant: The resolved ``use_reentrant`` flag.

    Returns:
        A context manager that the torch checkpoint call must run inside.

    Raises:
        TypeError: If a keyword needs a newer torch than the installed one.
    """
    # nullcontext, not a generator-based @contextmanager: dynamo before torch 2.8 cannot carry a
    # live generator context across the graph break at matepoint.checkpoint ("NYI: Returning a
    # @contextmanager object from a torch.compile function").
    context: contextlib.AbstractContextManager[None] = _NO_CONTEXT
    if not TORCH_2_9_PLUS and "early_stop" in kwargs:
        early_stop = bool(kwargs.pop("early_stop"))
        if not use_reentrant:
            context = torch_checkpoint.set_checkpoint_early_stop(early_stop)
    if not TORCH_2_14_PLUS and "respect_saved_tensors_hooks" in kwargs:
        raise TypeError(
            "checkpoint() got respect_saved_tensors_hooks=, which needs torch>=2.14; "
            f"the installed torch is {torch.__version__}"
        )
    if TORCH_2_14_PLUS and not use_reentrant and "context_fn" in kwargs:
        kwargs.setdefault("respect_saved_tensors_hooks", False)
    return context


class _UnwindFailedCheckpoint(contextlib.AbstractContextManager["_UnwindFailedCheckpoint"]):
    """See :func:`unwind_failed_checkpoint` (a class, not a generator: dynamo, see above).

    It keeps no state, so one instance serves every call.
    """

    def __exit__(self, kind: object, error: object, traceback: types.TracebackType | None) -> None:
        """Close the generators of torch's non-reentrant checkpoint calls in ``traceback``.

        Innermost first, so each one pops the saved-tensor hooks on top of the stack.
        """
        generators = [
            frame.f_locals.get("gen")
            for frame, _ in walk_tb(traceback)
            if frame.f_code.co_name == "checkpoint"
            and frame.f_code.co_filename == torch_checkpoint.__file__
        ]
        for generator in reversed(generators):
            if isinstance(generator, types.GeneratorType) and generator.gi_frame is not None:
                generator.close()


_UNWIND = _UnwindFailedCheckpoint()


def unwind_failed_checkpoint() -> contextlib.AbstractContextManager[object]:
    """A context to run torch's checkpoint in, directly inside any saved-tensor hook context.

    torch 2.4-2.12 run the checkpointed function between two ``next(gen)`` calls with no
    ``try``: when the function raises, the non-reentrant checkpoint's generator stays suspended
    inside its saved-tensor hook context (its hooks stay pushed) for as long as the exception's
    traceback keeps ``checkpoint``'s frame alive. A hook context around the call then pops
    torch's hooks instead of its own, and its own stay in force for every later save in the
    thread. On those releases this context closes the suspended generators when an exception
    leaves it, as torch 2.13 does itself (``gen.throw``), so the hooks unwind in order. The
    exception and its traceback are unchanged. Shim (gate ``TORCH_2_13_PLUS``) can go when torch
    2.13 is the oldest supported release.

    Returns:
        The unwinding context on torch < 2.13, else a no-op context.
    """
    return _NO_CONTEXT if TORCH_2_13_PLUS else _UNWIND
