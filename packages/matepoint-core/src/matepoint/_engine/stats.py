"""Counters of what matepoint moved, served and waited for, and a one-call report.

Also the project's one byte formatter and one reader of the process's resident memory, which the
tests and ``matepoint_examples`` (pinned to this release) import from here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Counters", "OffloadStats", "format_bytes", "format_report", "rss_bytes"]


@dataclasses.dataclass
class _CounterFields:
    """The event counts matepoint keeps; see :class:`OffloadStats` for what each one means."""

    offloads: int = 0
    bytes_offloaded: int = 0
    policy_offloads: int = 0
    bytes_offloaded_by_policy: int = 0
    fetches: int = 0
    bytes_fetched: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    prefetches_skipped: int = 0
    stash_hits: int = 0
    bytes_served_from_stash: int = 0
    dedupe_hits: int = 0
    shared_fetch_hits: int = 0
    offloads_freed_nothing: int = 0
    throttled_waits: int = 0
    compute_wait_seconds: float = 0.0
    host_wait_seconds: float = 0.0
    skipped_small: int = 0
    skipped_parameters: int = 0
    skipped_other: int = 0

    def add(self, other: DataclassInstance) -> None:
        """Add every field of ``other`` to this one's field of the same name (``self`` has all).

        ``other`` may also be the compiled graphs' counts, whose fields are some of these.
        """
        for field in dataclasses.fields(other):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


@dataclasses.dataclass
class Counters(_CounterFields):
    """Mutable event counts of one channel (or of tensors kept in place); see OffloadStats."""

    def reset(self) -> None:
        """Set every count back to zero."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default)


@dataclasses.dataclass
class OffloadStats(_CounterFields):
    """A snapshot of matepoint's counters since the last :func:`matepoint.reset_stats`.

    A snapshot is a copy: changing it changes nothing in matepoint.

    Attributes:
        offloads: Tensors copied to host memory (a tensor shared by several checkpoints once).
        bytes_offloaded: Their bytes.
        policy_offloads: Of those, outputs a selective-checkpoint policy marked
            ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD`` (the rest are checkpoint inputs).
        bytes_offloaded_by_policy: Their bytes.
        fetches: Copies back to the device (prefetches included).
        bytes_fetched: Their bytes.
        prefetches: Copies back started ahead of need (look-ahead).
        prefetch_hits: Unpacks served by a prefetched copy.
        prefetches_skipped: Prefetches not started because device memory was short (those
            inputs were fetched on demand instead).
        stash_hits: Unpacks served by the device original (stash, copy in flight, or kept alive
            elsewhere), with no copy back.
        bytes_served_from_stash: Their bytes.
        dedupe_hits: Saves of a tensor already offloaded by another checkpoint.
        shared_fetch_hits: Unpacks of such a shared tensor served by the copy another of its
            checkpoints fetched in the same backward pass (no second copy back).
        offloads_freed_nothing: Offloads whose device original something else kept alive, so
            releasing it freed no device memory.
        throttled_waits: Times the host waited for a copy to bound the bytes in flight.
        compute_wait_seconds: Time the compute stream waited for copies back (device time).
        host_wait_seconds: Time the host waited for copies (throttling, pool recycling).
        skipped_small: Saved inputs below ``min_offload_bytes``, kept in place.
        skipped_parameters: Parameters, kept in place.
        skipped_other: Others kept in place (not on an offloadable device, sparse, inference,
            overlapping strides, tensor subclasses).
        pool_pinned_bytes: Pinned host bytes the pools hold (in use and idle).
        pool_in_use_bytes: Pinned host bytes holding live offloaded tensors.
        pool_blocks_allocated: Pinned blocks allocated.
        pool_blocks_reused: Acquisitions served by an idle block.
        pageable_fallbacks: Tensors stored in pageable memory because pinned memory was short.
        live_records: Offloaded tensors still referenced by some autograd graph.
        device_bytes_held: Device bytes of originals matepoint still references: the stash, the
            newest input, copies in flight, and originals referenced elsewhere whose copy is
            still watched.
    """

    pool_pinned_bytes: int = 0
    pool_in_use_bytes: int = 0
    pool_blocks_allocated: int = 0
    pool_blocks_reused: int = 0
    pageable_fallbacks: int = 0
    live_records: int = 0
    device_bytes_held: int = 0


def format_bytes(count: float | None) -> str:
    """Format a byte count in binary units (``"512 B"``, ``"1.50 GiB"``); ``"n/a"`` for None."""
    if count is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB"):
        if abs(count) < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} GiB"


def rss_bytes() -> int | None:
    """Return this process's resident set size in bytes, or None where it cannot be read.

    ``/proc/self/statm`` is read directly (Linux only): it is cheap, and it counts pinned host
    memory, which is what offloading adds. Its unit is the page, whose size is asked of the OS.
    """
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_REPORT = """\
matepoint offload report
  offloaded         {offloads} tensors, {bytes_offloaded}
  by kind           {input_offloads} checkpoint inputs, {input_bytes_offloaded}; \
{policy_offloads} policy outputs, {bytes_offloaded_by_policy}
  fetched back      {fetches} copies, {bytes_fetched} ({prefetches} prefetched, \
{prefetch_hits} used, {prefetches_skipped} skipped for memory)
  served on device  {stash_hits} unpacks, {bytes_served_from_stash} (no copy back)
  shared (dedupe)   {dedupe_hits} saves, {shared_fetch_hits} unpacks served by one fetch
  freed nothing     {offloads_freed_nothing} offloads (original kept alive elsewhere)
  compute waited    {compute_wait_ms:.2f} ms for copies back
  host waited       {host_wait_ms:.2f} ms ({throttled_waits} throttles)
  kept in place     {skipped_small} small, {skipped_parameters} parameters, {skipped_other} other
  pinned pool       {pool_pinned_bytes} pinned, {pool_in_use_bytes} in use, \
{pool_blocks_allocated} allocated, {pool_blocks_reused} reused, {pageable_fallbacks} pageable \
fallbacks
  now               {live_records} live offloaded tensors, {device_bytes_held} device bytes held"""


def format_report(stats: OffloadStats) -> str:
    """Render a snapshot as a short aligned text report (the fields named in ``_REPORT``)."""
    values: dict[str, Any] = dataclasses.asdict(stats)
    values["input_offloads"] = stats.offloads - stats.policy_offloads
    values["input_bytes_offloaded"] = stats.bytes_offloaded - stats.bytes_offloaded_by_policy
    values["compute_wait_ms"] = stats.compute_wait_seconds * 1e3
    values["host_wait_ms"] = stats.host_wait_seconds * 1e3
    # Every byte count, and only those, has "bytes" in its name.
    for name in [field for field in values if "bytes" in field]:
        values[name] = format_bytes(values[name])
    return _REPORT.format_map(values)
