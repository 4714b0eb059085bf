"""The 0.1.x module path ``matepoint.matepoint``, importable behind a deprecation warning.

0.1.x code imports ``from matepoint.matepoint import checkpoint`` (the implementation module of
0.1.x) and sets ``matepoint.matepoint.NOPIPELINE``. This module re-exports the public
``checkpoint`` and ``checkpoint_sequential``; its 0.1.x globals are the package's, each with a
warning (``matepoint_compat.install_legacy_path``). Delete it with the rest of the 0.1.x surface.
"""

from __future__ import annotations

import sys

import matepoint_compat as compat
from matepoint._checkpoint import checkpoint, checkpoint_sequential

__all__ = ["checkpoint", "checkpoint_sequential"]

# The module runs once, at the first import: stacklevel 2 is the line that imports it, since
# warnings skips importlib's frames in between. Python's cache keeps later imports silent, as
# Python's default filter would show only one per line anyway.
compat.install_legacy_path(sys.modules[__name__], stacklevel=2)
