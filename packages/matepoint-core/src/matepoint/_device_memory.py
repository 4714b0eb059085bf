"""Where the budget guard reads a step's memory: the peak allocated, and what the allocator held.

A plan bounds the bytes its step allocates. The caching allocator holds more: the free pieces
of its segments, which a later request of another size cannot use (fragmentation). Where the
device gives the process little more than the budget, those pieces decide whether the next
step runs (Note [The budget guard], rule 6, in ``matepoint._guard``).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

__all__ = ["AllocatorMemory", "CudaMemory", "DeviceMemory"]


class DeviceMemory(Protocol):
    """Where the guard reads a step's peak: the device's, or a test's simulation."""

    def reset_peak(self) -> None:
        """Start a new step: forget the peak so far."""

    def peak_bytes(self) -> int:
        """The peak allocated device memory since the last :meth:`reset_peak`."""


@runtime_checkable
class AllocatorMemory(DeviceMemory, Protocol):
    """A :class:`DeviceMemory` that also tells what its caching allocator held and whether it
    reached its limit (Note [The budget guard], rule 6)."""

    def reserved_peak_bytes(self) -> int:
        """The most the allocator held (its segments, used or not) since :meth:`reset_peak`."""

    def pieces_peak_bytes(self) -> int:
        """The most the allocator held since :meth:`reset_peak` in free pieces of segments in
        use: memory it can neither give a larger request nor give back to the device."""

    def reached_limit(self) -> bool:
        """Whether, since :meth:`reset_peak`, the allocator had to free its cache and retry a
        device allocation, or failed one: it reached what the device gives the process."""

    def unallocated_bytes(self) -> int:
        """What the allocator holds now beyond what is allocated. Read at an out-of-memory
        error, these are its segments' free pieces: it gave back every free segment before it
        failed."""


class CudaMemory:
    """A CUDA device's peak allocated memory (``torch.cuda.max_memory_allocated``) and what its
    caching allocator held (``max_memory_reserved``, its retries and failures)."""

    def __init__(self, device: torch.device | str | int | None = None) -> None:
        self.device = device
        self._limit_events = 0

    def _limit_events_now(self) -> int:
        stats = torch.cuda.memory_stats(self.device)
        return int(stats.get("num_alloc_retries", 0)) + int(stats.get("num_ooms", 0))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._limit_events = self._limit_events_now()

    def peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reserved_peak_bytes(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def pieces_peak_bytes(self) -> int:
        stats = torch.cuda.memory_stats(self.device)
        return int(stats.get("inactive_split_bytes.all.peak", 0))

    def reached_limit(self) -> bool:
        return self._limit_events_now() > self._limit_events

    def unallocated_bytes(self) -> int:
        reserved = torch.cuda.memory_reserved(self.device)
        return max(0, int(reserved - torch.cuda.memory_allocated(self.device)))
