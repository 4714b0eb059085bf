"""Shared fixtures for the matepoint-core tests.

- ``cpu_transport``: installs a :class:`matepoint.testing.CPUTestTransport` (one per completion
  mode: ``"deferred"``, ``"on_query"``, ``"immediate"``) with thresholds small enough that the
  tiny tensors of a CPU test really are offloaded. Yields the transport.
- ``_cheap_gc`` (session, autouse): freezes the objects alive before the first test, so the many
  ``gc.collect()`` calls (records die with their graphs) stay cheap.
- ``matepoint_reset`` (autouse): every test starts with zeroed stats and no live records, and
  leaves the process-wide defaults and legacy globals as it found them.
- ``pipeline`` / ``use_reentrant``: the two axes every parity test runs over.
- ``offload_mode``: ``"default"`` (the process defaults, as a user gets them: on the CPU nothing
  is offloaded) or ``"forced"`` (every saved input, however small, through a deferred-completion
  :class:`~matepoint.testing.CPUTestTransport` and back). Yields the mode's name.
- ``undo_debug_logging``: restores the logger torch's ``debug=True`` checkpoints reconfigure.
- ``hook_calls``: the options of every checkpoint call that takes matepoint's saved-tensor hooks
  (Note [A call that moves nothing] in ``matepoint._checkpoint``).
- ``clean_start`` (CUDA tests, by ``usefixtures``): no graph of an earlier failed test alive, the
  device idle, empty idle pools and zeroed stats; afterwards no memory cap left set.
"""

from __future__ import annotations

import gc
import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint

import matepoint
from matepoint import _checkpoint
from matepoint.testing import CPUTestTransport, use_transport
from matepoint_compat._deprecation import LEGACY_CONTEXT_LIST

COMPLETION_MODES = ("deferred", "on_query", "immediate")
OFFLOAD_MODES = ("default", "forced")

SMALL_THRESHOLDS = {
    # Offload every non-empty tensor, however small.
    "min_offload_bytes": 0,
    # Two small activations may be in flight: in "deferred" mode some originals stay held until
    # backward while older ones are waited for and released, so both restore paths run.
    "max_inflight_bytes": 512,
    "stash_bytes": 0,
    "prefetch": 2,
}


@pytest.fixture(scope="session", autouse=True)
def _cheap_gc() -> Iterator[None]:
    """Make the many ``gc.collect()`` calls cheap (records die with their graphs).

    One warm-up checkpoint imports what torch loads lazily on first use (its first checkpoint
    call imports dynamo, sympy and more); freezing every object alive after that leaves
    ``gc.collect()`` only the objects the tests create: microseconds instead of ~0.1-0.3 s.
    """
    x = torch.ones(2, requires_grad=True)
    torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    del x
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(autouse=True)
def matepoint_reset() -> Iterator[None]:
    """Start from zeroed stats; restore defaults and the 0.1.x legacy globals afterwards."""
    defaults = matepoint.get_options()
    gc.collect()
    matepoint.reset_stats()
    yield
    vars(matepoint).pop("NOPIPELINE", None)
    LEGACY_CONTEXT_LIST.clear()
    if matepoint.get_options() != defaults:
        matepoint.configure(
            **{name: getattr(defaults, name) for name in defaults.__dataclass_fields__}
        )
    gc.collect()
    matepoint.reset_stats()


@pytest.fixture(params=COMPLETION_MODES)
def cpu_transport(request: pytest.FixtureRequest) -> Iterator[CPUTestTransport]:
    """A CPU test transport in each completion mode, with small offload thresholds in force."""
    transport = CPUTestTransport(completion=request.param)
    with use_transport(transport), matepoint.options(**SMALL_THRESHOLDS):
        yield transport
        gc.collect()
        transport.drain()


FORCED_OFFLOAD = {
    **SMALL_THRESHOLDS,
    # Nothing may stay in flight: every original not referenced elsewhere is released as soon as
    # its copy has finished, so backward really reads each saved input back from the host.
    "max_inflight_bytes": 0,
}


@pytest.fixture(params=OFFLOAD_MODES)
def offload_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with matepoint's defaults, or with every saved input forced through the host."""
    if request.param == "default":
        yield "default"
        return
    transport = CPUTestTransport()
    with use_transport(transport), matepoint.options(**FORCED_OFFLOAD):
        yield "forced"
        gc.collect()
        transport.drain()


@pytest.fixture(params=[True, False], ids=["pipeline", "nopipeline"])
def pipeline(request: pytest.FixtureRequest) -> bool:
    """matepoint's ``pipeline=`` flag."""
    return bool(request.param)


@pytest.fixture(params=[False, True], ids=["nonreentrant", "reentrant"])
def use_reentrant(request: pytest.FixtureRequest) -> bool:
    """torch's ``use_reentrant=`` flag, passed to both twins."""
    return bool(request.param)


@pytest.fixture
def fresh_stats() -> None:
    """Start from zeroed counters and empty idle pools (conftest has collected garbage)."""
    matepoint.release_pool()
    matepoint.reset_stats()


@pytest.fixture
def transport(fresh_stats: None) -> Iterator[CPUTestTransport]:
    """A deferred-completion CPU test transport, with every tensor big enough to offload."""
    test_transport = CPUTestTransport()
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        yield test_transport
    test_transport.drain()


@pytest.fixture
def fast_transport(fresh_stats: None) -> Iterator[CPUTestTransport]:
    """A transport whose copies complete when polled (a fast link): originals are released."""
    test_transport = CPUTestTransport(completion="on_query")
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        yield test_transport
    test_transport.drain()


@pytest.fixture
def undo_debug_logging() -> Iterator[None]:
    """Restore the ``LoggingTensor`` logger that torch's ``debug=True`` leaves non-propagating.

    Left so, pytest's capture handler (attached to every non-propagating logger) fails on the
    records of every later ``debug=True`` checkpoint.
    """
    logger = logging.getLogger("LoggingTensor")
    propagate = logger.propagate
    yield
    logger.propagate = propagate


@pytest.fixture
def clean_start() -> Iterator[None]:
    """Start a CUDA test from nothing of an earlier one; lift any device memory cap afterwards."""
    # pytest keeps the last failed test's traceback in sys.last_*; its frames would keep that
    # test's graphs (and their records) alive into this one.
    sys.last_type = sys.last_value = sys.last_traceback = None
    if hasattr(sys, "last_exc"):
        sys.last_exc = None
    gc.collect()
    torch.cuda.synchronize()
    matepoint.release_pool()
    matepoint.reset_stats()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.synchronize()


@pytest.fixture
def hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The resolved options of every checkpoint call that takes matepoint's saved-tensor hooks."""
    calls: list[Any] = []
    hooks_for = _checkpoint._hooks_for

    def recorded(options: Any) -> Any:
        calls.append(options)
        return hooks_for(options)

    monkeypatch.setattr(_checkpoint, "_hooks_for", recorded)
    return calls
