"""Warnings that torch's own code raises on some releases, whatever the caller does.

A user of plain ``torch.utils.checkpoint`` sees them too; they say nothing about matepoint. Test
suites that turn warnings into errors ignore exactly these, on exactly the releases that raise
them, so a new warning from matepoint itself still fails the tests everywhere.
"""

from __future__ import annotations

import builtins
import warnings

from matepoint_compat._version import TORCH_2_5_PLUS

__all__ = ["TORCH_WARNING_FILTERS", "ignore_torch_warnings"]

TORCH_WARNING_FILTERS: tuple[str, ...] = (
    ()
    if TORCH_2_5_PLUS
    else (
        # torch 2.4's non-reentrant checkpoint recomputes under the deprecated
        # torch.cpu.amp.autocast(...) in every backward; 2.5 switched to torch.amp.autocast.
        # Entry can go when torch 2.5 is the oldest supported release.
        r"ignore:`torch\.cpu\.amp\.autocast\(args\.\.\.\)` is deprecated:FutureWarning",
    )
)
"""pytest ``filterwarnings`` entries (``action:message:category``) for the installed torch."""


def ignore_torch_warnings() -> None:
    """Add :data:`TORCH_WARNING_FILTERS` to the active warning filters.

    For code that records warnings itself (``warnings.catch_warnings(record=True)`` with
    ``simplefilter("always")``): call it inside the ``catch_warnings`` block, after the
    ``simplefilter``, so torch's own warnings on this release are not recorded.
    """
    for entry in TORCH_WARNING_FILTERS:
        action, message, category = entry.split(":")
        assert action == "ignore", entry
        warnings.filterwarnings("ignore", message=message, category=getattr(builtins, category))
