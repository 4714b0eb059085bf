"""Which transport is in use, and the one engine per device channel it has.

Tests install a :class:`matepoint.testing.CPUTestTransport` through ``use_transport``; otherwise
the CUDA transport is in use (it holds nothing until it creates a channel). Engines are looked up
by their channel key; when the transport is swapped out, engines of the old one that hold nothing
any more are forgotten (their counts kept for stats), so an unused transport and its pool can be
freed.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from matepoint._engine import ChannelEngine
from matepoint._stats import OffloadStats
from matepoint._transport import CudaTransport, Transport

__all__ = ["all_engines", "engine_for", "retired", "set_transport", "transport"]

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
                with engine.lock:
                    engine.pool.release_idle()
                    retired.add(engine.counters)
                    retired.add(engine.pool.snapshot())  # an idle pool: only its event counts


def all_engines() -> list[ChannelEngine]:
    """Return every channel engine in use: the current transport's, and any still holding data."""
    with _transport_lock:
        return list(_engines.values())


def engine_for(key: Hashable, tensor: torch.Tensor, active: Transport) -> ChannelEngine:
    engine = _engines.get(key)
    if engine is None:
        with _transport_lock:
            engine = _engines.get(key)
            if engine is None:
                engine = ChannelEngine(active.channel(tensor), active)
                _engines[key] = engine
    return engine
