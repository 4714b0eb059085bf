"""Which transport is in use: the CUDA one, unless a test installed another.

Tests install a :class:`matepoint.testing.CPUTestTransport` through ``use_transport``; otherwise
the CUDA transport is in use (it holds nothing until it creates a channel). Swapping it out lets
the engine table forget the old transport's idle engines (``engines.forget_idle``), so an unused
transport and its pool can be freed.
"""

from __future__ import annotations

from matepoint._engine import engines
from matepoint._engine.transport import CudaTransport, Transport

__all__ = ["set_transport", "transport"]

_transport: Transport = CudaTransport()


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
    with engines.lock:
        _transport = new_transport
        engines.forget_idle(new_transport)
