"""A transport that runs matepoint's offload bookkeeping on the CPU, for tests without a GPU.

It treats CPU tensors as "device" tensors and copies them into separate host buffers, but it
completes each copy only at an explicit sync point: when the engine makes compute wait on the
copy's event, blocks on it, or (if asked) polls it. Until then the destination holds poison, so an
engine that reads a copy before ordering on it produces wrong numbers, and a copy whose source the
engine let go too early fails loudly. That is how CI tests the ordering that streams enforce on a
GPU (see Note [Stream ordering] in ``matepoint._engine.transport``).

Example:
    >>> import torch, matepoint
    >>> from matepoint.testing import CPUTestTransport, use_transport
    >>> with use_transport(CPUTestTransport()):
    ...     x = torch.randn(512, 512, requires_grad=True)
    ...     y = matepoint.checkpoint(torch.sin, x)
    ...     y.sum().backward()
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import Callable, Hashable, Iterator, MutableMapping
from typing import Any, Literal, TypeVar

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from matepoint._engine.active_transport import set_transport, transport
from matepoint._engine.transport import Channel, Transport
from matepoint._side_stream_delay import set_side_stream_delay, side_stream_delay

__all__ = [
    "POISON_BYTE",
    "CPUTestTransport",
    "CopyReadFreedMemory",
    "delay_side_stream",
    "use_transport",
]

_T = TypeVar("_T")

POISON_BYTE = 0xFF
"""Every byte of a copy's destination before the copy completes (NaN for floating dtypes)."""


class CopyReadFreedMemory(AssertionError):
    """A deferred copy ran after the engine had released its source: a lifetime bug."""


class _FakeEvent:
    def __init__(self) -> None:
        self.done = False


def _poison(tensor: torch.Tensor) -> None:
    """Fill every byte of ``tensor``'s storage with the poison byte, whatever its shape or dtype.

    Copy destinations own their storage (a fresh tensor, or an exact-size host block), so the
    whole storage is the destination.
    """
    tensor.new_empty(0, dtype=torch.uint8).set_(tensor.untyped_storage()).fill_(POISON_BYTE)


@dataclasses.dataclass(eq=False)
class CPUTestTransport:
    """Treat CPU tensors as device tensors and defer every copy to an explicit sync point.

    The transport is also its one channel (the CPU stands in for one device), and keeps the
    FIFO of deferred copies that stands in for the side stream.

    Args:
        completion: When deferred copies run. ``"deferred"`` (default): only when the engine
            waits on or blocks for the copy's event; polling never completes it, as with a slow
            link. ``"on_query"``: polling completes it too, as with a fast link. ``"immediate"``:
            at once (no deferral).
        pinned_limit_bytes: Simulated page-locked memory limit: allocating past it raises the
            RuntimeError a real out-of-memory would, to exercise the exhaustion policy.

    Raises:
        ValueError: For an unknown ``completion`` mode.

    Attributes:
        completion: The completion mode.
        pinned_limit_bytes: The simulated page-locked limit, or None.
        host_buffers: Addresses of the simulated pinned blocks handed out.
        copies_out: Copies to the host queued so far.
        copies_in: Copies back queued so far.
        pinned_bytes: Simulated pinned bytes allocated so far (never decreases).
        originals_released: Device originals the engine let go (each ordered against the
            stream its checkpoint ran on, on a real device).
        pending: The copies queued on the stand-in side stream and not run yet, oldest first.
    """

    completion: Literal["deferred", "on_query", "immediate"] = "deferred"
    pinned_limit_bytes: int | None = None
    host_buffers: set[int] = dataclasses.field(default_factory=set, init=False, repr=False)
    copies_out: int = dataclasses.field(default=0, init=False)
    copies_in: int = dataclasses.field(default=0, init=False)
    pinned_bytes: int = dataclasses.field(default=0, init=False)
    originals_released: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.completion not in ("deferred", "on_query", "immediate"):
            raise ValueError(f"unknown completion mode {self.completion!r}")
        # Copies are only appended (a deque appends safely from any thread) and only popped
        # under drain_lock, so no other thread pops between a drainer's look and its pop.
        self.pending: deque[tuple[Callable[[], object], _FakeEvent]] = deque()
        self.drain_lock = threading.RLock()
        # Per source of a queued copy (weak keys: no tensor kept alive), the memory that
        # release_original keeps for the copies once the source tensor itself is let go.
        self.kept_memory: MutableMapping[Any, list[torch.Tensor]] = WeakTensorKeyDictionary()

    def channel_key(self, tensor: torch.Tensor) -> Hashable | None:
        return ("cpu-test", id(self)) if tensor.device.type == "cpu" else None

    def channel(self, tensor: torch.Tensor) -> Channel:
        return self

    def drain(self) -> None:
        """Complete every queued copy (what a device synchronize would do)."""
        self.run_until(None)

    def run_until(self, event: _FakeEvent | None) -> None:
        """Run queued copies in order until ``event``'s has run (every queued one for None)."""
        # One thread drains at a time: another thread's run_until may have popped ``event``'s
        # copy and still be running it. Copies are not autograd operations (a stream copy is
        # not recorded), whatever the grad mode of the thread that reaches the sync point.
        with self.drain_lock, torch.no_grad():
            while self.pending if event is None else not event.done:
                if not self.pending:
                    raise AssertionError("event was never queued on this stream")
                operation, queued = self.pending.popleft()
                operation()
                queued.done = True

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        limit = self.pinned_limit_bytes
        if limit is not None and self.pinned_bytes + nbytes > limit:
            raise RuntimeError("CUDA error: out of memory (simulated pinned host allocation)")
        self.pinned_bytes += nbytes
        block = self.allocate_pageable(nbytes)
        self.host_buffers.add(block.data_ptr())
        return block

    def allocate_pageable(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), POISON_BYTE, dtype=torch.uint8, device="cpu")

    def current_compute(self) -> Any:
        return None

    def memory_key(self, tensor: torch.Tensor) -> Hashable:
        return tensor.data_ptr()

    def copy_out(self, source: torch.Tensor, host: torch.Tensor, compute: Any = None) -> Any:
        self.copies_out += 1
        source_ref = weakref.ref(source)
        snapshot_version = source._version
        kept = self.kept_memory.setdefault(source, [])

        def run() -> None:
            # The source itself, or the memory kept for the copy once the source was let go.
            alive = kept[0] if kept else source_ref()
            if alive is None:
                raise CopyReadFreedMemory("a host copy ran after its device source was released")
            host.copy_(alive)
            if alive._version != snapshot_version:
                # A real stream would read the modified bytes: poison makes that visible.
                _poison(host)

        return self._queue(run)

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        self.copies_in += 1
        target = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device="cpu")
        _poison(target)
        return target, self._queue(lambda: target.copy_(host))

    def _queue(self, operation: Callable[[], object]) -> _FakeEvent:
        """Queue ``operation`` on the side stream (run at once in ``"immediate"`` mode)."""
        event = _FakeEvent()
        self.pending.append((operation, event))
        if self.completion == "immediate":
            self.run_until(event)
        return event

    def copy_out_now(self, source: torch.Tensor, host: torch.Tensor) -> None:
        self.copies_out += 1
        host.copy_(source)

    def copy_in_now(self, host: torch.Tensor) -> torch.Tensor:
        self.copies_in += 1
        return host.clone()

    def hand_to_compute(self, tensor: torch.Tensor, event: Any, measure: bool) -> Any:
        self.run_until(event)
        return None

    def release_original(self, tensor: torch.Tensor, compute: Any, copying: bool) -> None:
        # The CPU stands in with one compute stream, which orders every read already.
        self.originals_released += 1
        if copying:
            # Stands in for record_stream on the side stream: the allocator keeps the memory
            # until queued copies finish. It keeps the memory only (a detached alias), never the
            # tensor: the tensor would keep its autograd graph, and the records in it, alive.
            # One alias per source, however often a source that survives is released.
            self.kept_memory.get(tensor, [])[:] = [tensor.detach()]

    def is_complete(self, event: Any) -> bool:
        if not event.done and self.completion == "on_query":
            self.run_until(event)
        return bool(event.done)

    def synchronize(self, event: Any) -> float:
        self.run_until(event)
        return 0.0

    def wait_seconds(self, token: Any, block: bool) -> float | None:
        return 0.0


@contextlib.contextmanager
def _swapped(read: Callable[[], _T], write: Callable[[_T], None], value: _T) -> Iterator[_T]:
    """Install ``value`` with ``write`` inside a ``with`` block; the previous value comes back."""
    previous = read()
    write(value)
    try:
        yield value
    finally:
        write(previous)


def use_transport(new_transport: Transport) -> contextlib.AbstractContextManager[Transport]:
    """Route every offload in this process through ``new_transport`` inside a ``with`` block.

    The switch is process-wide (every thread's checkpoints use it), and the previous transport
    comes back when the block ends, also when it raises. Engines of the transport left behind
    are forgotten once they hold nothing, so it can be freed.

    Args:
        new_transport: A transport, usually a :class:`CPUTestTransport`.

    Returns:
        A context manager whose ``with`` block yields the transport.
    """
    return _swapped(transport, set_transport, new_transport)


def delay_side_stream(cycles: int) -> contextlib.AbstractContextManager[int]:
    """Busy-wait ``cycles`` GPU cycles on the side stream before each copy, inside a block.

    A race probe: a copy that is not ordered correctly against compute then reads or writes at
    the wrong time every time, and shows up as wrong numbers. Process-wide; the previous delay
    comes back when the block ends. Without CUDA (or ``torch.cuda._sleep``) nothing is delayed.

    Args:
        cycles: GPU clock cycles (at 2 GHz, ``2_000_000`` is a millisecond); ``0`` for none.

    Returns:
        A context manager whose ``with`` block yields the delay in force.

    Raises:
        ValueError: If ``cycles`` is not an ``int >= 0``.

    Example:
        >>> from matepoint.testing import delay_side_stream
        >>> with delay_side_stream(2_000_000):
        ...     pass
    """
    return _swapped(side_stream_delay, set_side_stream_delay, cycles)
