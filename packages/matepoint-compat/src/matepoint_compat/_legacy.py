"""The keyword arguments of matepoint 0.1.x's ``checkpoint``, accepted with a deprecation warning.

0.1.x ``checkpoint`` took ``stream=`` (always overridden by its own stream), ``matepoint_ctx=``
(the list it pushed CPU copies onto) and ``check_inplace_modifications=`` (off by default). None
of them means anything to 0.2, but 0.1.x calls must keep working. The 0.1.x module globals live
in core (``matepoint/_legacy.py``): they need the engine, and compat never imports core.
"""

from __future__ import annotations

from collections.abc import Callable
from inspect import Parameter, signature

import torch

from matepoint_compat._deprecation import warn_deprecated

__all__ = ["accepts_keyword", "pop_legacy_checkpoint_kwargs"]

# keyword -> what replaces it
_LEGACY_KWARGS = {
    "stream": "remove it: matepoint manages its own side stream per device",
    "matepoint_ctx": "remove it: it is no longer needed, the offload engine tracks saved inputs",
    "check_inplace_modifications": (
        "remove it: matepoint always checks saved inputs for in-place modification"
    ),
}


def accepts_keyword(function: Callable[..., object], name: str) -> bool:
    """Whether ``function(**{name: ...})`` would bind: a parameter of that name, or ``**kwargs``."""
    # A module's __call__ takes (*args, **kwargs); what it accepts is its forward's signature.
    target = function.forward if isinstance(function, torch.nn.Module) else function
    try:
        parameters = signature(target).parameters
    except (TypeError, ValueError):  # builtins and C functions without a signature
        return False
    parameter = parameters.get(name)
    if parameter is not None:
        return parameter.kind in (Parameter.POSITIONAL_OR_KEYWORD, Parameter.KEYWORD_ONLY)
    return any(value.kind is Parameter.VAR_KEYWORD for value in parameters.values())


def pop_legacy_checkpoint_kwargs(
    kwargs: dict[str, object], *, function: Callable[..., object] | None = None
) -> None:
    """Remove the 0.1.x-only keyword arguments that ``function`` cannot take, warning for each.

    torch's checkpoint passes every keyword it does not know to the function, so a function that
    declares one of these names (or takes ``**kwargs``) gets it, as it would from torch, and no
    warning is given. Other keys are left untouched. Each warning is attributed to the line that
    called this function's caller: the user's ``checkpoint(...)`` line.

    Args:
        kwargs: The extra keyword arguments of a ``checkpoint`` call; modified in place.
        function: The checkpointed function, or None when nothing receives keyword arguments
            (``checkpoint_sequential``). Default: None.

    Example:
        >>> import warnings
        >>> extra = {"stream": None, "preserve_rng_state": True}
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     pop_legacy_checkpoint_kwargs(extra, function=lambda x: x)
        >>> extra
        {'preserve_rng_state': True}
        >>> extra = {"stream": None}
        >>> pop_legacy_checkpoint_kwargs(extra, function=lambda x, stream: x)
        >>> extra
        {'stream': None}
    """
    for key, replacement in _LEGACY_KWARGS.items():
        if key in kwargs and not (function is not None and accepts_keyword(function, key)):
            del kwargs[key]
            # 3: past this function and its caller (checkpoint), as warn_deprecated counts.
            warn_deprecated(f"`{key}=`", replacement=replacement, stacklevel=3)
