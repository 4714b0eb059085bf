"""Counters of what matepoint moved, served and waited for, and a one-call report.

Also the project's one byte formatter and one reader of the process's resident memory, which the
tests and ``matepoint_examples`` (pinned to this release) import from here.
"""

from __future__ import annotations

import dataclasses
import os

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

    def add(self, other: _CounterFields) -> None:
        """Add every field of ``other`` to this one's field of the same name (``self`` has all)."""
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


def format_report(stats: OffloadStats) -> str:
    """Render a snapshot as a short aligned text report."""
    rows = {
        "offloaded": f"{stats.offloads} tensors, {format_bytes(stats.bytes_offloaded)}",
        "by kind": (
            f"{stats.offloads - stats.policy_offloads} checkpoint inputs, "
            f"{format_bytes(stats.bytes_offloaded - stats.bytes_offloaded_by_policy)}; "
            f"{stats.policy_offloads} policy outputs, "
            f"{format_bytes(stats.bytes_offloaded_by_policy)}"
        ),
        "fetched back": (
            f"{stats.fetches} copies, {format_bytes(stats.bytes_fetched)} ({stats.prefetches} "
            f"prefetched, {stats.prefetch_hits} used, "
            f"{stats.prefetches_skipped} skipped for memory)"
        ),
        "served on device": (
            f"{stats.stash_hits} unpacks, {format_bytes(stats.bytes_served_from_stash)} "
            "(no copy back)"
        ),
        "shared (dedupe)": (
            f"{stats.dedupe_hits} saves, {stats.shared_fetch_hits} unpacks served by one fetch"
        ),
        "freed nothing": f"{stats.offloads_freed_nothing} offloads (original kept alive elsewhere)",
        "compute waited": f"{stats.compute_wait_seconds * 1e3:.2f} ms for copies back",
        "host waited": (
            f"{stats.host_wait_seconds * 1e3:.2f} ms ({stats.throttled_waits} throttles)"
        ),
        "kept in place": (
            f"{stats.skipped_small} small, {stats.skipped_parameters} parameters, "
            f"{stats.skipped_other} other"
        ),
        "pinned pool": (
            f"{format_bytes(stats.pool_pinned_bytes)} pinned, "
            f"{format_bytes(stats.pool_in_use_bytes)} in use, {stats.pool_blocks_allocated} "
            f"allocated, {stats.pool_blocks_reused} reused, "
            f"{stats.pageable_fallbacks} pageable fallbacks"
        ),
        "now": (
            f"{stats.live_records} live offloaded tensors, "
            f"{format_bytes(stats.device_bytes_held)} device bytes held"
        ),
    }
    width = max(map(len, rows))
    lines = ["matepoint offload report"]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows.items()]
    return "\n".join(lines)
