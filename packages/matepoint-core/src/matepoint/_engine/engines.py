"""The one engine per device channel of a transport, looked up by the channel's key.

When the transport is swapped out (``active_transport.set_transport``), engines of the old one
that hold nothing any more are forgotten, their counts kept in ``retired`` for stats.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from matepoint._engine.channel_engine import ChannelEngine
from matepoint._engine.stats import OffloadStats
from matepoint._engine.transport import Transport

__all__ = ["all_engines", "engine_of", "forget_idle", "lock", "retired"]

# Guards the table and the transport switch (``active_transport.set_transport``).
lock = threading.Lock()
_engines: dict[Hashable, ChannelEngine] = {}
# What engines forgotten since the last reset counted, so stats still include it
# (``matepoint.reset_stats`` puts a fresh one in its place).
retired = OffloadStats()


def all_engines() -> list[ChannelEngine]:
    """Return every channel engine in use: the current transport's, and any still holding data."""
    with lock:
        return list(_engines.values())


def forget_idle(current: Transport) -> None:
    """Forget the engines of transports other than ``current`` that hold nothing; hold ``lock``.

    Their pools are released and their counts go to ``retired``.
    """
    for key, engine in list(_engines.items()):
        if engine.transport is not current and engine.idle():
            del _engines[key]
            engine.release_pool()
            retired.add(engine.counters)
            retired.add(engine.pool.snapshot())  # an idle pool: only its event counts


def engine_of(tensor: torch.Tensor, active: Transport) -> ChannelEngine:
    """Return the engine of ``active``'s channel for ``tensor``, which moves (``stay_reason``)."""
    key = active.channel_key(tensor)
    engine = _engines.get(key)
    if engine is None:
        with lock:
            if key not in _engines:
                _engines[key] = ChannelEngine(active.channel(tensor), active)
            engine = _engines[key]
    return engine
