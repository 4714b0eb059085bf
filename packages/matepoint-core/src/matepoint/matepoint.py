"""The 0.1.x module path ``matepoint.matepoint``, importable behind a deprecation warning.

0.1.x code imports ``from matepoint.matepoint import checkpoint`` (the implementation module of
0.1.x) and sets ``matepoint.matepoint.NOPIPELINE``. 0.2's implementation modules are private, so
this module only re-exports the public ``checkpoint`` and ``checkpoint_sequential`` and hands the
0.1.x globals to the ones of the ``matepoint`` package (matepoint/_legacy.py), each with a warning
that names the replacement. Delete it with the rest of the 0.1.x surface.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from matepoint import _legacy
from matepoint._checkpoint import checkpoint, checkpoint_sequential
from matepoint_compat import warn_deprecated

__all__ = ["checkpoint", "checkpoint_sequential"]

_IMPORT = "import from `matepoint` instead (`from matepoint import checkpoint`)"

# The module runs once, at the first import: stacklevel 2 is the line that imports it, since
# warnings skips importlib's frames in between. Python's cache keeps later imports silent, as
# Python's default filter would show only one per line anyway.
warn_deprecated("`matepoint.matepoint`", replacement=_IMPORT, stacklevel=2)


def _package() -> types.ModuleType:
    return sys.modules["matepoint"]


def _module_getattr(name: str) -> object:
    """A 0.1.x global of this module, read from the package's, with a warning."""
    if name not in _legacy._NAMES:
        raise AttributeError(f"module 'matepoint.matepoint' has no attribute {name!r}")
    value, replacement = _legacy._NAMES[name]
    warn_deprecated(f"`matepoint.matepoint.{name}`", replacement=replacement)
    if name == "NOPIPELINE":
        return _legacy.pipeline_disabled()
    return value


class _LegacyPathModule(types.ModuleType):
    """The class of this module, so that 0.1.x's ``matepoint.matepoint.NOPIPELINE = x`` works.

    In 0.1.x the code read this module's global (setting the package's did nothing); 0.2 reads
    the package's, so the assignment is forwarded there. See Note [NOPIPELINE warns at the
    assignment] in matepoint/_legacy.py.
    """

    def __setattr__(self, name: str, value: object) -> None:
        if name == "NOPIPELINE":
            warn_deprecated("`matepoint.matepoint.NOPIPELINE`", replacement=_legacy._NOPIPELINE)
            # The package's own assignment would warn a second time, at this line.
            types.ModuleType.__setattr__(_package(), name, value)
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "NOPIPELINE":
            vars(_package()).pop(name, None)
            return
        super().__delattr__(name)


if not TYPE_CHECKING:
    __getattr__ = _module_getattr
sys.modules[__name__].__class__ = _LegacyPathModule
