"""The narrow interface between the offload engine and a device: allocate, copy, order, wait.

The engine keeps all bookkeeping (what is where, when it may be released); a transport only moves
bytes and orders streams. The CUDA transport is the real one; ``matepoint.testing`` has one that
treats CPU tensors as device tensors, so the bookkeeping runs in CI without a GPU.

Note [Stream ordering]
    Copies run on the device's side stream, ordered by events, never by a host synchronize.
    Rule 1. Copy out (forward): the side stream waits on an event recorded on the compute stream
            at pack time, so it reads the input after the kernels that produced it.
    Rule 2. While its copy out may still run, a device original stays referenced by the engine,
            or, when nothing else references it (so nothing can write it), goes to the allocator
            with ``record_stream(side)``. One referenced elsewhere stays watched until its copy
            has completed and its version is checked, so a write that raced the copy raises. A
            graph that dies mid-copy hands its originals over the same way.
    Rule 3. An original let go is also marked ``record_stream(compute)`` for the compute stream
            of its pack: the checkpointed function may read it on a stream other than the one
            that allocated it (torch's checkpoint, holding inputs until backward, hides that).
    Rule 4. Copy in (backward): the destination comes from the side stream's memory, so no
            compute kernel still uses it and the copy starts at once; the compute stream waits
            on the copy's event before reading it, and marks it ``record_stream(compute)``.
    Rule 5. One ``compute_done`` event per channel is re-recorded for every copy out: a wait
            binds to the event's most recent record when queued, so re-recording it later never
            changes a wait already queued.
    Rule 6. A host block is used only by its device's one side stream, so a block back in the
            pool is reused by the next copy without a wait; a synchronous copy
            (``pipeline=False``, on the compute stream) first waits on its last side-stream
            event.
    Example: block i's input x_i is copied after compute's ``compute_done`` (rules 1, 5); when
    the engine lets it go mid-copy, ``record_stream`` on both streams keeps its memory until
    the copy and block i's reads are done (rules 2, 3).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import torch

import matepoint_compat as compat
from matepoint._side_stream_delay import side_stream_delay

__all__ = ["Channel", "CudaTransport", "Transport"]


class Channel(Protocol):
    """One device's copy machinery: its side stream, events and host allocation."""

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        """Return ``nbytes`` of pinned host memory as 1-D uint8 (may raise RuntimeError)."""

    def allocate_pageable(self, nbytes: int) -> torch.Tensor:
        """Return ``nbytes`` of ordinary host memory as a 1-D uint8 tensor."""

    def current_compute(self) -> Any:
        """Return the compute stream now current on the device (a token for the engine)."""

    def memory_key(self, tensor: torch.Tensor) -> Hashable:
        """Return what identifies the memory ``tensor`` starts at, for dedupe.

        The address where tensors have one (``data_ptr``); a channel whose tensors hold no memory
        (the planner's meta channel) names the storage and offset instead.
        """

    def copy_out(self, source: torch.Tensor, host: torch.Tensor, compute: Any) -> Any:
        """Queue ``host.copy_(source)`` on the side stream after ``compute``; return its event.

        ``compute`` is :meth:`current_compute`'s token. None means the copy has finished.
        """

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue a copy of ``host`` into a new device tensor on the side stream; return both."""

    def copy_out_now(self, source: torch.Tensor, host: torch.Tensor) -> None:
        """Copy ``source`` into ``host`` on the compute stream, finished when this returns."""

    def copy_in_now(self, host: torch.Tensor) -> torch.Tensor:
        """Copy ``host`` into a new device tensor on the compute stream, done on return."""

    def hand_to_compute(self, tensor: torch.Tensor, event: Any, measure: bool) -> Any:
        """Make the compute stream wait on ``event``, then mark ``tensor`` as used by it.

        ``tensor`` was copied back on the side stream; the mark is for the allocator (lifetime).
        Returns a timing token (``measure``) or None.
        """

    def release_original(self, tensor: torch.Tensor, compute: Any, copying: bool) -> None:
        """Let ``tensor`` go once the work queued on ``compute`` so far is done.

        ``compute`` is the stream its checkpoint ran on (:meth:`current_compute` at pack time),
        which may differ from the stream the tensor was allocated on. With ``copying`` (its copy
        out may still run) the side stream's queued work must be done too. See Note [Stream
        ordering], rules 2 and 3. Allocator lifetime only.
        """

    def is_complete(self, event: Any) -> bool:
        """Return whether the work before ``event`` has finished, without blocking."""

    def synchronize(self, event: Any) -> float:
        """Block the host until ``event`` completes; return the seconds waited."""

    def wait_seconds(self, token: Any, block: bool) -> float | None:
        """Return the compute-stream stall a timing token measured, or None if not known yet."""


class Transport(Protocol):
    """Decides which tensors are device tensors and gives one channel per device."""

    def channel_key(self, tensor: torch.Tensor) -> Hashable | None:
        """Return the key of the channel that can offload ``tensor``, or None if it stays put."""

    def channel(self, tensor: torch.Tensor) -> Channel:
        """Create the channel for ``tensor``'s device (the engine calls it once per key)."""


class _CudaChannel:
    """A CUDA device's side stream and copy operations. See Note [Stream ordering].

    The copy-out path runs once per checkpoint in forward, which is often launch-bound, so its
    host cost is kept low: the device's module and index are looked up once, the compute-done
    event is reused, and the side stream is made current with one call when the copy's device
    is the current device (the usual case).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index
        self._module = compat.device_module(device)
        self.side_stream = compat.new_stream(device)
        self._compute_done = compat.new_event(device)

    allocate_host = staticmethod(compat.allocate_pinned)

    def allocate_pageable(self, nbytes: int) -> torch.Tensor:
        # Host blocks name their device: a default-device context must not put them on the GPU.
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def current_compute(self) -> Any:
        return self._module.current_stream(self.index)

    def memory_key(self, tensor: torch.Tensor) -> Hashable:
        return tensor.data_ptr()

    def _on_side_stream(self, compute: Any, copy: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run ``copy`` with the side stream current, then make ``compute`` current again."""
        if self._module.current_device() != self.index:
            with compat.stream_context(self.side_stream):
                return copy()
        compat.set_current_stream(self._module, self.side_stream)
        try:
            return copy()
        finally:
            compat.set_current_stream(self._module, compute)

    def copy_out(self, source: torch.Tensor, host: torch.Tensor, compute: Any) -> Any:
        self._compute_done.record(compute)
        self.side_stream.wait_event(self._compute_done)
        compat.delay_stream(self.side_stream, side_stream_delay())
        self._on_side_stream(compute, lambda: host.copy_(source, non_blocking=True))
        return self.side_stream.record_event()

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        compat.delay_stream(self.side_stream, side_stream_delay())
        # ``to`` allocates a dense host's exact strides (``empty_strided``), then copies.
        target = self._on_side_stream(
            self.current_compute(), lambda: host.to(self.device, non_blocking=True)
        )
        return target, self.side_stream.record_event()

    def copy_out_now(self, source: torch.Tensor, host: torch.Tensor) -> None:
        host.copy_(source, non_blocking=False)

    def copy_in_now(self, host: torch.Tensor) -> torch.Tensor:
        return host.to(self.device)

    def hand_to_compute(self, tensor: torch.Tensor, event: Any, measure: bool) -> Any:
        compute = self.current_compute()
        # Only marks the allocator block: ordered against ``compute`` when the tensor is freed.
        tensor.record_stream(compute)
        if not measure or event.query():
            compute.wait_event(event)
            return None
        before = compute.record_event(compat.new_event(self.device, enable_timing=True))
        compute.wait_event(event)
        return before, compute.record_event(compat.new_event(self.device, enable_timing=True))

    def release_original(self, tensor: torch.Tensor, compute: Any, copying: bool) -> None:
        tensor.record_stream(compute)
        if copying:
            tensor.record_stream(self.side_stream)

    def is_complete(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> float:
        start = time.perf_counter()
        event.synchronize()
        return time.perf_counter() - start

    def wait_seconds(self, token: Any, block: bool) -> float | None:
        before, after = token
        if not block and not after.query():
            return None
        after.synchronize()
        return float(before.elapsed_time(after)) / 1000.0


class CudaTransport:
    """The real transport: CUDA tensors go to pinned host memory on a per-device side stream.

    It keeps no registry of its own: the engine creates one channel per device key and keeps it
    with that device's engine.
    """

    def channel_key(self, tensor: torch.Tensor) -> Hashable | None:
        return ("cuda", tensor.device.index) if tensor.device.type == "cuda" else None

    def channel(self, tensor: torch.Tensor) -> Channel:
        return _CudaChannel(tensor.device)
