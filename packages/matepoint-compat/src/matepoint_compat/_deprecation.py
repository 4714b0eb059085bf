"""The one warning class matepoint deprecates things with, and the helper that raises it.

Every deprecated name, global and keyword in matepoint goes through :func:`warn_deprecated`, so a
user can silence (or turn into errors) exactly matepoint's deprecations with one filter on
:class:`MatepointDeprecationWarning`, and a maintainer can find every deprecation by grepping for
the helper before a removal release.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from matepoint_compat._compile._torch_names import (
    COMPILED_OFFLOAD,
    run_at_trace_time,
    traced_user_stack,
)

__all__ = ["MatepointDeprecationWarning", "warn_deprecated"]

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

    message: str
    since: str
    removal: str

    def __init__(
        self, message: str, *, since: str = DEFAULT_SINCE, removal: str = DEFAULT_REMOVAL
    ) -> None:
        super().__init__(message)
        self.message = message
        self.since = since
        self.removal = removal

    def __str__(self) -> str:
        versions = f"deprecated in matepoint {self.since}, to be removed in {self.removal}"
        return f"{self.message} ({versions})"


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
    if COMPILED_OFFLOAD and torch.compiler.is_compiling():
        # See Note [Deprecation warnings under torch.compile].
        _warn_while_tracing(message, since, removal, stacklevel + 1)
        return
    warning = MatepointDeprecationWarning(message, since=since, removal=removal)
    # +1 skips this helper's own frame, so the caller's stacklevel means what it would for warn().
    warnings.warn(warning, stacklevel=stacklevel + 1)


# Note [Deprecation warnings under torch.compile]
#     Dynamo cannot trace the construction of a warning object with its own __init__: a 0.1.x
#     keyword in a compiled model would fail a fullgraph compile, and without fullgraph skip
#     the frame (nothing compiled, nothing offloaded). So while Dynamo traces, the warning is
#     given at trace time, outside the graph, by a function Dynamo calls for real: attributed to
#     the traced line the stacklevel names (Dynamo's record of the frames it traces), and once
#     per line as Python's default filter shows it, with one registry per file. A compiled
#     graph runs without warning again, as a warning in eager mode shows once per line too.
#     Where matepoint has no compiled path (torch before 2.11, gate COMPILED_OFFLOAD), Dynamo
#     graph-breaks at matepoint's checkpoint anyway, and the warning is given as in eager mode.
_TRACE_TIME_REGISTRIES: dict[str, dict[Any, Any]] = {}


@run_at_trace_time
def _warn_while_tracing(message: str, since: str, removal: str, stacklevel: int) -> None:
    """Warn now, at trace time, attributed to the traced frame ``stacklevel`` names.

    ``stacklevel`` counts as :func:`warnings.warn` counts from :func:`warn_deprecated`'s frame
    (the innermost traced one). Outside a trace (nothing recorded) it warns from here.
    """
    warning = MatepointDeprecationWarning(message, since=since, removal=removal)
    stack = traced_user_stack()
    if len(stack) < stacklevel:
        warnings.warn(warning, stacklevel=2)
        return
    frame = stack[-stacklevel]
    registry = _TRACE_TIME_REGISTRIES.setdefault(frame.filename, {})
    lineno = frame.lineno or 0
    warnings.warn_explicit(warning, type(warning), frame.filename, lineno, registry=registry)
