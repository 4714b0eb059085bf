"""The surface of the original matepoint 0.1.x, kept working behind deprecation warnings.

matepoint 0.1.x was a fork of ``torch.utils.checkpoint`` whose package exported ``checkpoint``,
``checkpoint_sequential``, the module globals ``Gmatepoint_ctx`` (the list every checkpoint pushed
its CPU copies onto), ``Gmatepoint_stream`` (0.1.0 only, always ``None``) and the function
``matepoint_pipeline(ctx, stream)`` (prefetch the newest entry of that list on a side stream). Up
to 0.1.7 pipelining was switched off with the module global ``NOPIPELINE``; ``checkpoint`` took
``stream=``, ``matepoint_ctx=`` and ``check_inplace_modifications=``. matepoint 0.2 keeps its
state per device and thread inside the offload engine, so none of these carry information any
more. Code written against 0.1.x must still import and run: each old name, global and keyword
is accepted here with a :class:`~matepoint_compat._deprecation.MatepointDeprecationWarning` that
says what replaces it, and never with an exception.

``matepoint/__init__.py`` ends with ``install_legacy_module(sys.modules[__name__])``, reads
:func:`legacy_pipeline_disabled` on every call, and passes its extra keyword arguments through
:func:`pop_legacy_checkpoint_kwargs`. This module must not import ``matepoint`` (compat sits below
core), which is why the engine hooks in through :func:`register_pipeline_callback`.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable, Mapping
from typing import Final, TypeAlias

import torch

from matepoint_compat._deprecation import warn_deprecated

__all__ = [
    "LEGACY_CHECKPOINT_KWARGS",
    "LegacyModule",
    "PipelineCallback",
    "install_legacy_module",
    "legacy_matepoint_pipeline",
    "legacy_pipeline_disabled",
    "pop_legacy_checkpoint_kwargs",
    "register_pipeline_callback",
]

PipelineCallback: TypeAlias = Callable[[], None]
"""What core registers to start fetching offloaded inputs back to the device now."""


class _LegacyState:
    """Process-wide values set through the legacy surface (one instance, :data:`_STATE`)."""

    __slots__ = ("nopipeline", "pipeline_callback")

    def __init__(self) -> None:
        self.nopipeline: bool = False
        self.pipeline_callback: PipelineCallback | None = None


_STATE: Final = _LegacyState()

# 0.1.x code may hold on to the list it imported, so every access returns this same object. The
# engine never reads or fills it.
_GMATEPOINT_CTX: Final[list[object]] = []

_PIPELINE_REPLACEMENT: Final = "pass `pipeline=False` to `matepoint.checkpoint` instead"

# name -> what replaces it, and how to read its stand-in value.
_LEGACY_ATTRIBUTES: Final[Mapping[str, tuple[str, Callable[[], object]]]] = {
    "NOPIPELINE": (_PIPELINE_REPLACEMENT, lambda: _STATE.nopipeline),
    "Gmatepoint_ctx": (
        "matepoint keeps each checkpoint's saved inputs itself, per device and thread; "
        "this stand-in list is never read",
        lambda: _GMATEPOINT_CTX,
    ),
    "Gmatepoint_stream": (
        "matepoint manages its own side stream per device; this stand-in is always None",
        lambda: None,
    ),
    "matepoint_pipeline": (
        "matepoint prefetches saved inputs during backward by itself; "
        "the stand-in only asks it to start now",
        lambda: legacy_matepoint_pipeline,
    ),
}

_LEGACY_KWARGS: Final[Mapping[str, str]] = {
    "stream": "remove it: matepoint manages its own side stream per device",
    "matepoint_ctx": (
        "remove it: it is no longer needed, the offload engine tracks saved inputs itself"
    ),
    "check_inplace_modifications": (
        "remove it: matepoint always checks saved inputs for in-place modification"
    ),
}

LEGACY_CHECKPOINT_KWARGS: Final[frozenset[str]] = frozenset(_LEGACY_KWARGS)
"""Keyword arguments 0.1.x ``checkpoint`` took that 0.2 drops with a warning."""


def _module_name(module: types.ModuleType) -> str:
    # Read __dict__ directly: a failed self.__name__ inside __getattr__ would recurse.
    name = module.__dict__.get("__name__")
    return name if isinstance(name, str) else "?"


def _probed_by_import_system() -> bool:
    # Note [fromlist probe]
    # `from matepoint import Gmatepoint_ctx` looks the name up twice: importlib's
    # _handle_fromlist first runs hasattr(package, name) to decide whether it is a submodule, then
    # the IMPORT_FROM opcode reads it. Warning on the first lookup would report the deprecation
    # twice, once against importlib's frozen code. Frame 0 is this helper, 1 is __getattr__, 2 is
    # whoever looked the name up.
    try:
        frame = sys._getframe(2)
    except ValueError:
        return False
    return frame.f_globals.get("__name__") == "importlib._bootstrap"


class LegacyModule(types.ModuleType):
    """A module type that answers the 0.1.x globals of matepoint with deprecation warnings.

    A plain module cannot notice ``matepoint.NOPIPELINE = True``: assignment just writes the
    module's ``__dict__``, and PEP 562 only covers reading. Swapping the module's class for this
    subclass (see :func:`install_legacy_module`) lets the assignment be intercepted, warned about
    and turned into process-wide state that :func:`legacy_pipeline_disabled` reports. Reading an
    old name (``NOPIPELINE``, ``Gmatepoint_ctx``, ``Gmatepoint_stream``, ``matepoint_pipeline``)
    warns once per lookup and returns a harmless stand-in; any other missing name raises
    :class:`AttributeError` exactly as a plain module would.

    Example:
        >>> import types, warnings
        >>> fake = types.ModuleType("fake")
        >>> install_legacy_module(fake)
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("ignore")
        ...     fake.NOPIPELINE = True
        ...     legacy_pipeline_disabled()
        ...     fake.NOPIPELINE = False
        True
    """

    def __getattr__(self, name: str) -> object:
        entry = _LEGACY_ATTRIBUTES.get(name)
        module_name = _module_name(self)
        if entry is None:
            raise AttributeError(
                f"module {module_name!r} has no attribute {name!r}", name=name, obj=self
            )
        replacement, read = entry
        if not _probed_by_import_system():  # See Note [fromlist probe]
            warn_deprecated(f"`{module_name}.{name}`", replacement=replacement)
        return read()

    def __setattr__(self, name: str, value: object) -> None:
        if name == "NOPIPELINE":
            warn_deprecated(f"`{_module_name(self)}.NOPIPELINE`", replacement=_PIPELINE_REPLACEMENT)
            _STATE.nopipeline = bool(value)
            return
        entry = _LEGACY_ATTRIBUTES.get(name)
        if entry is not None:
            warn_deprecated(
                f"`{_module_name(self)}.{name}`",
                replacement=f"{entry[0]}; assigning it has no effect",
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "NOPIPELINE":
            warn_deprecated(f"`{_module_name(self)}.NOPIPELINE`", replacement=_PIPELINE_REPLACEMENT)
            _STATE.nopipeline = False
            return
        super().__delattr__(name)


def install_legacy_module(module: types.ModuleType) -> None:
    """Give ``module`` the 0.1.x globals by making it a :class:`LegacyModule`.

    Changing the class of the module object already in ``sys.modules`` (rather than replacing it
    with a wrapper) keeps ``import matepoint`` returning the same object everywhere, with its
    ``__dict__``, ``__spec__`` and submodules untouched. Installing twice is a no-op.

    Args:
        module: The module to convert, normally ``sys.modules[__name__]`` at the end of
            ``matepoint/__init__.py``.

    Raises:
        TypeError: If ``module`` is an instance of some other :class:`types.ModuleType` subclass,
            whose behaviour the swap would silently drop.

    Example:
        >>> import types
        >>> fake = types.ModuleType("fake")
        >>> install_legacy_module(fake)
        >>> isinstance(fake, LegacyModule)
        True
    """
    if isinstance(module, LegacyModule):
        return
    if type(module) is not types.ModuleType:
        raise TypeError(
            f"install_legacy_module() needs a plain module, but {_module_name(module)!r} is a "
            f"{type(module).__qualname__}"
        )
    module.__class__ = LegacyModule


def legacy_pipeline_disabled() -> bool:
    """Return whether legacy code switched pipelining off with ``matepoint.NOPIPELINE = True``.

    The global is process-wide, as it was in 0.1.x, so core reads it on every checkpoint call
    rather than once at import: ``pipeline=False`` on the call or this returning ``True`` each
    disable pipelining for that call.

    Returns:
        ``True`` once ``NOPIPELINE`` was set to a true value, until it is set false again.

    Example:
        >>> legacy_pipeline_disabled()
        False
    """
    return _STATE.nopipeline


def register_pipeline_callback(callback: PipelineCallback | None) -> PipelineCallback | None:
    """Set what :func:`legacy_matepoint_pipeline` runs; core calls this once at import.

    compat cannot import the engine, so the engine hands compat the one operation the old
    ``matepoint_pipeline`` stood for: start bringing the next offloaded inputs back to the device.

    Args:
        callback: A function taking no arguments that starts that prefetch (and returns without
            waiting for it), or ``None`` to make :func:`legacy_matepoint_pipeline` a no-op.

    Returns:
        The callback registered before, so a caller (a test) can put it back.

    Example:
        >>> previous = register_pipeline_callback(lambda: None)
        >>> _ = register_pipeline_callback(previous)
    """
    previous = _STATE.pipeline_callback
    _STATE.pipeline_callback = callback
    return previous


def legacy_matepoint_pipeline(ctx: object = None, stream: object = None) -> None:
    """Stand-in for 0.1.x ``matepoint_pipeline(ctx, stream)``: ask the engine to prefetch now.

    In 0.1.x this copied the newest entry of a ``Gmatepoint_ctx``-style list back to its device
    on the given stream. matepoint 0.2 never fills such lists and prefetches on its own side
    stream, so both arguments are accepted and ignored and the call is forwarded to the callback
    core registered with :func:`register_pipeline_callback` (a no-op if none). The deprecation
    warning is emitted when the name is looked up on ``matepoint``, not here.

    Args:
        ctx: The 0.1.x context list. Ignored. Default: ``None``.
        stream: The 0.1.x side stream. Ignored. Default: ``None``.

    Example:
        >>> legacy_matepoint_pipeline([], None)
    """
    del ctx, stream
    callback = _STATE.pipeline_callback
    if callback is not None:
        callback()


def _accepts_keyword(function: Callable[..., object], name: str) -> bool:
    """Whether ``function(**{name: ...})`` would bind: a parameter of that name, or ``**kwargs``."""
    # A module's __call__ takes (*args, **kwargs); what it accepts is its forward's signature.
    target = function.forward if isinstance(function, torch.nn.Module) else function
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and C functions without a signature
        return False
    parameter = parameters.get(name)
    if parameter is not None:
        return parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
    return any(value.kind is inspect.Parameter.VAR_KEYWORD for value in parameters.values())


def pop_legacy_checkpoint_kwargs(
    kwargs: dict[str, object],
    *,
    function: Callable[..., object] | None = None,
    stacklevel: int = 2,
) -> None:
    """Remove the 0.1.x-only keyword arguments that ``function`` cannot take, warning for each.

    0.1.x ``checkpoint`` took ``stream=`` (always overridden by its own stream),
    ``matepoint_ctx=`` (the list it pushed CPU copies onto) and ``check_inplace_modifications=``
    (off by default). None of them means anything to 0.2, but legacy calls must keep working, so
    core strips them before handing the rest to torch. torch's checkpoint passes every keyword it
    does not know to the function, so a function that declares one of these names (or takes
    ``**kwargs``) gets it, as it would from torch, and no warning is given. Other keys are left
    untouched.

    Args:
        kwargs: The extra keyword arguments of a ``checkpoint`` call; modified in place.
        function: The checkpointed function, or None when nothing receives keyword arguments
            (``checkpoint_sequential``). Default: None.
        stacklevel: Which frame the warnings are attributed to, counted as
            :func:`warnings.warn` counts from the caller of this function: ``2`` (the default) is
            the caller of the function that calls this one, i.e. the user's ``checkpoint(...)``
            line. Default: ``2``.

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
        if key not in kwargs:
            continue
        if function is not None and _accepts_keyword(function, key):
            continue
        del kwargs[key]
        # +1 for this function's own frame; see warn_deprecated.
        warn_deprecated(f"`{key}=`", replacement=replacement, stacklevel=stacklevel + 1)
