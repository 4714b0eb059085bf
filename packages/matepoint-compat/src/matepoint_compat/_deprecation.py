"""Every deprecation of matepoint, in one place: the warning, and the 0.1.x surface it covers.

Every deprecated name, global and keyword in matepoint goes through :func:`warn_deprecated`, so a
user can silence (or turn into errors) exactly matepoint's deprecations with one filter on
:class:`MatepointDeprecationWarning`. What is deprecated is all here too, so that the release
that removes it deletes this module's sections and their calls:

- the 0.1.x keyword arguments of ``checkpoint`` (``stream=``, ``matepoint_ctx=``,
  ``check_inplace_modifications=``): :func:`pop_legacy_checkpoint_kwargs`;
- the 0.1.x module globals of ``matepoint`` (``NOPIPELINE``, ``Gmatepoint_ctx``,
  ``Gmatepoint_stream``, ``matepoint_pipeline``) and the 0.1.x module path
  ``matepoint.matepoint``: :func:`install_legacy_globals`, :func:`install_legacy_path`;
- the 0.2.0 device settings given per call (``OffloadOptions(prefetch=...)``) and the test delay
  as a setting: :func:`warn_per_call_settings`, :func:`warn_delay_setting`.

The core hands in what needs the engine (``prefetch_now``), since compat never imports it.
"""

from __future__ import annotations

import sys
import types
import warnings
from collections.abc import Callable, Iterable
from inspect import signature
from typing import Any

import torch

from matepoint_compat._compile import _torch_names, compile_tracing

__all__ = [
    "DELAY_SETTING",
    "MatepointDeprecationWarning",
    "accepts_keyword",
    "install_legacy_globals",
    "install_legacy_path",
    "legacy_pipeline_disabled",
    "pop_legacy_checkpoint_kwargs",
    "warn_delay_setting",
    "warn_deprecated",
    "warn_per_call_settings",
]

DEFAULT_SINCE: str = "0.2.0"
"""The release that first warned about the 0.1.x surface."""
DEFAULT_REMOVAL: str = "0.4.0"
"""The release planned to drop the 0.1.x surface."""


class MatepointDeprecationWarning(FutureWarning):
    """A matepoint feature is deprecated; the message says what to use instead.

    It subclasses :class:`FutureWarning`, Python's category for deprecations meant for the people
    who run the code: Python's default filters hide a :class:`DeprecationWarning` raised from an
    imported module, which is where a training script's checkpoint calls usually are, and show a
    :class:`FutureWarning` wherever it comes from. It carries the release that deprecated the
    feature and the release planned to remove it, so a filter or a test can look at them without
    parsing the text.

    Args:
        message: What is deprecated and what replaces it.
        since: The matepoint release that deprecated it. Default: ``"0.2.0"``.
        removal: The matepoint release planned to remove it. Default: ``"0.4.0"``.

    Example:
        >>> w = MatepointDeprecationWarning("`x` is deprecated", since="0.2.0", removal="0.4.0")
        >>> w.since, w.removal
        ('0.2.0', '0.4.0')
        >>> str(w)
        '`x` is deprecated (deprecated in matepoint 0.2.0, to be removed in 0.4.0)'
    """

    def __init__(
        self, message: str, *, since: str = DEFAULT_SINCE, removal: str = DEFAULT_REMOVAL
    ) -> None:
        super().__init__(f"{message} (deprecated in matepoint {since}, to be removed in {removal})")
        self.message = message
        self.since = since
        self.removal = removal


def warn_deprecated(
    name: str,
    *,
    replacement: str,
    since: str = DEFAULT_SINCE,
    removal: str = DEFAULT_REMOVAL,
    stacklevel: int = 2,
) -> None:
    """Emit a :class:`MatepointDeprecationWarning` for ``name``, pointing at the user's code.

    The warning is attributed to a caller's line rather than to matepoint's own, because that is
    the line the user has to change, and because Python's default filters only show a
    :class:`DeprecationWarning` attributed to ``__main__``.

    Args:
        name: The deprecated thing as the user wrote it, e.g. ``"`matepoint.NOPIPELINE`"`` or
            ``"`stream=`"``.
        replacement: A clause saying what to do instead, e.g.
            ``"use `checkpoint(..., pipeline=False)` instead"``.
        since: The matepoint release that deprecated it. Default: ``"0.2.0"``.
        removal: The matepoint release planned to remove it. Default: ``"0.4.0"``.
        stacklevel: Which frame the warning is attributed to, counted from the caller of this
            helper as :func:`warnings.warn` counts from its own caller: ``1`` is the function that
            calls ``warn_deprecated``, ``2`` (the default) is whoever called that function.
            Default: ``2``.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_deprecated("`old`", replacement="use `new` instead")
        >>> caught[0].message.message
        '`old` is deprecated; use `new` instead'
    """
    message = f"{name} is deprecated; {replacement}"
    # +1 skips this helper's own frame, so the caller's stacklevel means what it would for warn().
    if compile_tracing():
        # See Note [Deprecation warnings under torch.compile].
        _warn_while_tracing(message, since, removal, stacklevel + 1)
    else:
        warning = MatepointDeprecationWarning(message, since=since, removal=removal)
        warnings.warn(warning, stacklevel=stacklevel + 1)


# Note [Deprecation warnings under torch.compile]
#     Rule 1. While Dynamo traces, a deprecation warning is given at trace time, outside the
#             graph, by a function Dynamo calls for real. Dynamo cannot trace the construction of
#             a warning object with its own __init__: a 0.1.x keyword in a compiled model would
#             fail a fullgraph compile, or else skip the frame (nothing compiled or offloaded).
#     Rule 2. It is attributed to the traced line the stacklevel names (Dynamo's record of the
#             frames it traces) and shown once per line, as Python's default filter shows it,
#             with one registry per file.
#     Rule 3. A compiled graph runs without warning again, as an eager warning shows once per
#             line too.
#     Rule 4. Where matepoint has no compiled path (torch before 2.11, gate COMPILED_OFFLOAD),
#             Dynamo graph-breaks at matepoint's checkpoint anyway, and the warning is given as
#             in eager mode.
_TRACE_TIME_REGISTRIES: dict[str, dict[Any, Any]] = {}


@_torch_names.run_at_trace_time
def _warn_while_tracing(message: str, since: str, removal: str, stacklevel: int) -> None:
    """Warn now, at trace time, attributed to the traced frame ``stacklevel`` names.

    ``stacklevel`` counts as :func:`warnings.warn` counts from :func:`warn_deprecated`'s frame
    (the innermost traced one). Outside a trace (nothing recorded) it warns from here.
    """
    warning = MatepointDeprecationWarning(message, since=since, removal=removal)
    stack = _torch_names.traced_user_stack()
    if len(stack) < stacklevel:
        warnings.warn(warning, stacklevel=2)
        return
    frame = stack[-stacklevel]
    registry = _TRACE_TIME_REGISTRIES.setdefault(frame.filename, {})
    lineno = frame.lineno or 0
    warnings.warn_explicit(warning, type(warning), frame.filename, lineno, registry=registry)


# -- 0.1.x keyword arguments of checkpoint ---------------------------------------------------
# 0.1.x ``checkpoint`` took ``stream=`` (always overridden by its own stream), ``matepoint_ctx=``
# (the list it pushed CPU copies onto) and ``check_inplace_modifications=`` (off by default).
# None of them means anything to 0.2, but 0.1.x calls must keep working.

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
        signature(target).bind_partial(**{name: None})
    except (TypeError, ValueError):  # it does not bind, or a builtin without a signature
        return False
    return True


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


# -- 0.1.x module globals and module path ------------------------------------------------------
# 0.1.x exported ``Gmatepoint_ctx`` (the list every checkpoint pushed its CPU copies onto),
# ``Gmatepoint_stream`` (0.1.0, always ``None``) and ``matepoint_pipeline(ctx, stream)``
# (prefetch the newest entry of that list), switched pipelining off with
# ``matepoint.NOPIPELINE = True``, and was imported as ``matepoint.matepoint``. 0.2 keeps that
# state per device inside the engine: reading an old name warns and returns a stand-in,
# assigning ``NOPIPELINE`` warns, and :func:`legacy_pipeline_disabled` reads it on every call.

_PACKAGE = "matepoint"
_NOPIPELINE = "pass `pipeline=False` to `matepoint.checkpoint` instead"
# One object: 0.1.x code may hold on to the list it imported. Nothing reads or fills it.
LEGACY_CONTEXT_LIST: list[object] = []
# name -> (stand-in, what replaces it); matepoint_pipeline is added by install_legacy_globals.
# NOPIPELINE's stand-in is what the package holds now (see legacy_pipeline_disabled).
_NAMES: dict[str, tuple[object, str]] = {
    "NOPIPELINE": (None, _NOPIPELINE),
    "Gmatepoint_ctx": (
        LEGACY_CONTEXT_LIST,
        "nothing reads this list: the engine tracks saved inputs",
    ),
    "Gmatepoint_stream": (None, "matepoint manages its own side stream per device"),
}


def legacy_pipeline_disabled() -> bool:
    """Whether 0.1.x code set ``matepoint.NOPIPELINE`` true; every checkpoint call asks."""
    package = sys.modules.get(_PACKAGE)
    return package is not None and bool(vars(package).get("NOPIPELINE", False))


class _LegacyModule(types.ModuleType):
    """The class of ``matepoint`` and ``matepoint.matepoint``: their 0.1.x globals warn when used.

    Reading one goes through the class's ``__getattr__`` (what a module's own PEP 562
    ``__getattr__`` would do; type checkers see neither on the module, so a misspelt name still
    fails there) and gives its stand-in. In 0.1.x the code read ``matepoint.matepoint``'s
    ``NOPIPELINE``; 0.2 reads the package's, so an assignment on either module lands there, and
    ``del`` removes it there.
    """

    def __getattr__(self, name: str) -> object:
        if name not in _NAMES:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        value, replacement = _NAMES[name]
        # `from matepoint import X` looks X up twice (importlib's hasattr probe, then the
        # import); warnings skips importlib's frames, so both land on the user's line and
        # Python's default filter shows one.
        warn_deprecated(f"`{self.__name__}.{name}`", replacement=replacement)
        return legacy_pipeline_disabled() if name == "NOPIPELINE" else value

    # Note [NOPIPELINE warns at the assignment]
    #     Rule 1. Setting ``NOPIPELINE`` warns at the assignment (PEP 562 covers reading only):
    #             that is the line the user has to change, and where ``-W error`` should stop. A
    #             warning at the next checkpoint call would repeat at every call site, and from
    #             checkpoint_sequential or the decorator land on matepoint's own lines.
    #     Rule 2. The value is stored as a plain global of the package; checkpoint reads it at
    #             call time.
    def __setattr__(self, name: str, value: object) -> None:
        if name == "NOPIPELINE":
            warn_deprecated(f"`{self.__name__}.NOPIPELINE`", replacement=_NOPIPELINE)
        types.ModuleType.__setattr__(self._home(name), name, value)

    def __delattr__(self, name: str) -> None:
        types.ModuleType.__delattr__(self._home(name), name)

    def _home(self, name: str) -> types.ModuleType:
        """The module that holds ``name``: the package for ``NOPIPELINE``, else this one."""
        return sys.modules[_PACKAGE] if name == "NOPIPELINE" else self


def install_legacy_globals(package: types.ModuleType, prefetch_now: Callable[[], None]) -> None:
    """Give the ``matepoint`` package its 0.1.x globals, each warning when used.

    Args:
        package: The ``matepoint`` module.
        prefetch_now: What 0.1.x ``matepoint_pipeline(ctx, stream)`` does now.
    """

    def matepoint_pipeline(ctx: object = None, stream: object = None) -> None:
        """Stand-in for 0.1.x ``matepoint_pipeline(ctx, stream)``: runs ``prefetch_now``."""
        del ctx, stream
        prefetch_now()

    _NAMES["matepoint_pipeline"] = (
        matepoint_pipeline,
        "call `matepoint.prefetch_now()`, or nothing: backward prefetches by itself",
    )
    package.__class__ = _LegacyModule


def install_legacy_path(module: types.ModuleType, stacklevel: int) -> None:
    """Make ``module`` the 0.1.x path ``matepoint.matepoint``: warn now, forward its globals.

    Args:
        module: The ``matepoint.matepoint`` module, while it is first imported.
        stacklevel: The importing line, counted as :func:`warn_deprecated` counts from the
            caller (importlib's frames are skipped by ``warnings``).
    """
    warn_deprecated(
        "`matepoint.matepoint`",
        replacement="import from `matepoint` instead (`from matepoint import checkpoint`)",
        stacklevel=stacklevel + 1,
    )
    module.__class__ = _LegacyModule


# -- 0.2.0 settings given where they no longer belong ------------------------------------------

DELAY_SETTING = "side_stream_delay_cycles"
"""The test delay's 0.2.0 setting name; it is ``matepoint.testing.delay_side_stream`` now."""


def warn_per_call_settings(names: Iterable[str]) -> None:
    """Warn about device settings given to ``OffloadOptions`` (0.2.0's spelling), at its caller."""
    listed = ", ".join(f"`{name}=`" for name in sorted(names))
    warn_deprecated(
        f"{listed} in `matepoint.OffloadOptions`",
        replacement=(
            "set device settings once with `matepoint.configure(...)` or inside "
            "`with matepoint.options(...)`; the test delay is "
            "`matepoint.testing.delay_side_stream`, and per call it has no effect"
        ),
        stacklevel=3,
    )


def warn_delay_setting(stacklevel: int) -> None:
    """Warn about the test delay given to ``configure``/``options``, ``stacklevel`` up."""
    warn_deprecated(
        f"`{DELAY_SETTING}=` in `matepoint.configure`/`matepoint.options`",
        replacement="use `matepoint.testing.delay_side_stream(cycles)`",
        stacklevel=stacklevel + 1,
    )
