"""Which transport is in use, and the one engine per device channel it has.

Tests install a :class:`matepoint.testing.CPUTestTransport` through ``use_transport``; otherwise
the CUDA transport is in use (it holds nothing until it creates a channel). Engines are looked up
by their channel key; when the transport is swapped out, engines of the old one that hold nothing
any more are forgotten (their counts kept for stats), so an unused transport and its pool can be
freed.

Note [Planning scope]
    ``matepoint.plan`` runs the user's own step with a :class:`Planning` installed for its thread
    (``planning_scope``). While one is, that thread's checkpoint calls take their options from it
    (or, for the no-checkpoint strategy, run their function directly), and ``_saving.pack`` sends
    the saved inputs to the plan's own :class:`ChannelEngine`, over a channel that moves nothing,
    and tells the plan what became of each. Nothing process-wide changes: other threads offload
    as ever, and a record knows its engine, so backward restores each one where it was made,
    on whichever thread autograd runs it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

import torch

from matepoint._engine import ChannelEngine
from matepoint._options import ResolvedOptions
from matepoint._stats import OffloadStats
from matepoint._transport import CudaTransport, Transport

__all__ = [
    "Planning",
    "all_engines",
    "engine_of",
    "planning",
    "planning_scope",
    "retired",
    "set_transport",
    "transport",
]

_transport_lock = threading.Lock()
_transport: Transport = CudaTransport()
_engines: dict[Hashable, ChannelEngine] = {}
# What engines forgotten since the last reset counted, so stats still include it
# (``matepoint.reset_stats`` puts a fresh one in its place).
retired = OffloadStats()


def transport() -> Transport:
    """Return the process-wide transport (the CUDA one unless a test installed another)."""
    return _transport


def set_transport(new_transport: Transport) -> None:
    """Install ``new_transport`` for every offload from now on (tests use ``use_transport``).

    Engines of other transports that hold nothing any more are forgotten, so a transport that is
    no longer used (and its pool) can be freed. One whose records are still alive stays listed
    until a later switch finds it idle: its graph still owns it, and stats still count it.
    """
    global _transport
    with _transport_lock:
        _transport = new_transport
        for key, engine in list(_engines.items()):
            if engine.transport is not new_transport and engine.idle():
                del _engines[key]
                engine.release_pool()
                retired.add(engine.counters)
                retired.add(engine.pool.snapshot())  # an idle pool: only its event counts


def all_engines() -> list[ChannelEngine]:
    """Return every channel engine in use: the current transport's, and any still holding data."""
    with _transport_lock:
        return list(_engines.values())


class Planning(Protocol):
    """A plan running on this thread. See Note [Planning scope]."""

    # "none" (no checkpoint), "torch" (no offloading) or "matepoint".
    strategy: str
    # The plan's own engine, over a channel that moves nothing.
    engine: ChannelEngine
    # The context_fn every non-reentrant checkpoint call runs with, or None for its own: a budget
    # plan's candidate selective-checkpoint policy, or its per-region profiler.
    context_fn: Callable[[], Any] | None

    def options_for(self, call: ResolvedOptions | None) -> ResolvedOptions | None:
        """Return the options a checkpoint call runs with in the plan (None: no offloading)."""

    def saved(self, tensor: torch.Tensor, fate: str) -> None:
        """Hear what became of a saved input: offloaded, shared, or a ``KeepReason``."""


class _Local(threading.local):
    planning: Planning | None = None


_local = _Local()


def planning() -> Planning | None:
    """Return the plan running on this thread, if any."""
    return _local.planning


@contextlib.contextmanager
def planning_scope(plan: Planning) -> Iterator[None]:
    """Run this thread's checkpoints as part of ``plan`` inside the block."""
    previous = planning()
    _local.planning = plan
    try:
        yield
    finally:
        _local.planning = previous


def engine_of(tensor: torch.Tensor, active: Transport) -> ChannelEngine:
    """Return the engine of ``active``'s channel for ``tensor``, which moves (``stay_reason``)."""
    key = active.channel_key(tensor)
    engine = _engines.get(key)
    if engine is None:
        with _transport_lock:
            if key not in _engines:
                _engines[key] = ChannelEngine(active.channel(tensor), active)
            engine = _engines[key]
    return engine
