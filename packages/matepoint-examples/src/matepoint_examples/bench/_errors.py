"""A failure as a report records it: short, and naming no folder of the machine it ran on.

A compile error or a traceback names the files it passed through by their full paths (where the
project was copied, where torch is installed): a report kept with the docs must not carry them.
"""

from __future__ import annotations

import re

__all__ = ["error_note", "portable"]

# Everything up to a file's place in its package: the project's own ``packages/matepoint...``
# or an installed package under ``site-packages/``.
_MACHINE_PREFIX = re.compile(r"[^\s\"']*?/(?:site-packages/|(?=packages/matepoint))")
# Characters of an error kept in a report.
_NOTE_CHARACTERS = 500


def portable(text: str) -> str:
    """``text`` with each file path cut to its place in its package."""
    return _MACHINE_PREFIX.sub("", text)


def error_note(error: BaseException) -> str:
    """An error as one report field: its type and message, paths cut, 500 characters at most."""
    return portable(f"{type(error).__name__}: {error}")[:_NOTE_CHARACTERS]
