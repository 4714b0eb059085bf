"""The plan running on this thread, if any: how the planner borrows the engine.

Note [Planning scope]
    Rule 1. ``matepoint.plan`` runs the user's own step with a :class:`Planning` installed for
            its thread (``planning_scope``); nothing process-wide changes, so other threads
            offload as ever.
    Rule 2. While one is installed, that thread's checkpoint calls take their options from it,
            and each non-reentrant call asks it whether to checkpoint at all
            (``runs_checkpointed``): under the no-checkpoint strategy, or in a region a budget
            plan leaves unchecked, the call runs its function directly.
    Rule 3. ``saving.pack`` sends the saved inputs to the plan's own engine, over a channel
            that moves nothing, and tells the plan what became of each.
    Rule 4. A record knows its engine, so backward restores each one where it was made, on
            whichever thread autograd runs it.
    The engine only defines this protocol; the planner implements it (the engine never imports
    the planner).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from matepoint._engine.channel_engine import ChannelEngine
from matepoint._options import OffloadOptions, ResolvedOptions

__all__ = ["Planning", "planning", "planning_scope"]


class Planning(Protocol):
    """A plan running on this thread. See Note [Planning scope]."""

    # "none" (no checkpoint), "torch" (no offloading) or "matepoint".
    strategy: str
    # The plan's own engine, over a channel that moves nothing.
    engine: ChannelEngine
    # The context_fn every non-reentrant checkpoint call runs with, or None for its own: a budget
    # plan's candidate selective-checkpoint policy, or its per-region profiler.
    context_fn: Callable[[], Any] | None

    def options_for(
        self, offload: OffloadOptions | bool | None, pipeline: bool
    ) -> ResolvedOptions | None:
        """Return the options a call with these choices runs with in the plan (None: none)."""

    def saved(self, tensor: torch.Tensor, fate: str) -> None:
        """Hear what became of a saved input: offloaded, shared, or a ``KeepReason``."""

    def runs_checkpointed(self) -> bool:
        """Count one non-reentrant checkpoint call and say whether it checkpoints (False: its
        function runs directly)."""


class _Local(threading.local):
    planning: Planning | None = None


_local = _Local()


def planning() -> Planning | None:
    """Return the plan running on this thread, if any."""
    return _local.planning


@contextlib.contextmanager
def planning_scope(plan: Planning) -> Iterator[None]:
    """Run this thread's checkpoints as part of ``plan`` inside the block.

    See Note [Planning scope].
    """
    previous = planning()
    _local.planning = plan
    try:
        yield
    finally:
        _local.planning = previous
