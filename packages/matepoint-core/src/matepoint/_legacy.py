"""The module globals of matepoint 0.1.x, kept working behind deprecation warnings.

0.1.x exported ``Gmatepoint_ctx`` (the list every checkpoint pushed its CPU copies onto),
``Gmatepoint_stream`` (0.1.0, always ``None``) and ``matepoint_pipeline(ctx, stream)`` (prefetch
the newest entry of that list), and switched pipelining off with ``matepoint.NOPIPELINE = True``.
0.2 keeps that state per device inside the engine. Reading an old name warns and returns a
stand-in; assigning ``NOPIPELINE`` warns, and :func:`pipeline_disabled` reads it on every call.
The 0.1.x keyword arguments are ``matepoint_compat.pop_legacy_checkpoint_kwargs``'s. Delete this
module and its uses in ``__init__.py`` and ``_checkpoint.py`` with the 0.1.x surface.
"""

from __future__ import annotations

import sys
import types

from matepoint._monitor import prefetch_now
from matepoint_compat import warn_deprecated

_NOPIPELINE = "pass `pipeline=False` to `matepoint.checkpoint` instead"
# One object: 0.1.x code may hold on to the list it imported. Nothing reads or fills it.
_GMATEPOINT_CTX: list[object] = []


def matepoint_pipeline(ctx: object = None, stream: object = None) -> None:
    """Stand-in for 0.1.x ``matepoint_pipeline(ctx, stream)``: ignores both, runs prefetch_now."""
    del ctx, stream
    prefetch_now()


# name -> (stand-in, what replaces it)
_NAMES: dict[str, tuple[object, str]] = {
    "NOPIPELINE": (False, _NOPIPELINE),
    "Gmatepoint_ctx": (_GMATEPOINT_CTX, "nothing reads this list: the engine tracks saved inputs"),
    "Gmatepoint_stream": (None, "matepoint manages its own side stream per device"),
    "matepoint_pipeline": (
        matepoint_pipeline,
        "call `matepoint.prefetch_now()`, or nothing: backward prefetches by itself",
    ),
}


def module_getattr(name: str) -> object:
    """``matepoint.__getattr__`` (PEP 562): a 0.1.x name's stand-in, with a warning."""
    if name not in _NAMES:
        raise AttributeError(f"module 'matepoint' has no attribute {name!r}")
    value, replacement = _NAMES[name]
    # `from matepoint import X` looks X up twice (importlib's hasattr probe, then the import);
    # warnings skips importlib's frames, so both land on the user's line and Python's default
    # filter shows one.
    warn_deprecated(f"`matepoint.{name}`", replacement=replacement)
    return value


class LegacyModule(types.ModuleType):
    """The class of the ``matepoint`` module, only so that assigning ``NOPIPELINE`` warns."""

    # Note [NOPIPELINE warns at the assignment]
    # PEP 562 covers reading only. The assignment is the line the user has to change, and where
    # `-W error` should stop; a warning at the next checkpoint call would repeat at every call
    # site, and from checkpoint_sequential or the decorator land on matepoint's own lines. The
    # value is stored as a plain global, and checkpoint reads it at call time.
    def __setattr__(self, name: str, value: object) -> None:
        if name == "NOPIPELINE":
            warn_deprecated("`matepoint.NOPIPELINE`", replacement=_NOPIPELINE)
        super().__setattr__(name, value)


def pipeline_disabled() -> bool:
    """Whether 0.1.x code set ``matepoint.NOPIPELINE`` true; checkpoint asks on every call."""
    return bool(vars(sys.modules["matepoint"]).get("NOPIPELINE", False))
