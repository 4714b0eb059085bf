"""Process-wide views over every device's engine: stats, report, pool release."""

from __future__ import annotations

from matepoint._compiled import traffic
from matepoint._engine import engines
from matepoint._engine.engines import all_engines
from matepoint._engine.saving import kept_counters
from matepoint._engine.stats import OffloadStats, format_report
from matepoint._options import resolve

__all__ = ["prefetch_now", "release_pool", "report", "reset_stats", "stats"]


def stats(*, synchronize: bool = False) -> OffloadStats:
    """Return a snapshot of what matepoint has moved and waited for since the last reset.

    Args:
        synchronize: Wait for outstanding device timing events, so ``compute_wait_seconds``
            includes the latest waits (off by default: reading stats never stalls training).

    Returns:
        The counters summed over all devices, plus the pools' and engines' current sizes.
        Offloads and fetches include the copies of compiled graphs (the compiled path, Note
        [Counting compiled copies] in ``matepoint._compiled.traffic``): counted per graph
        run, at the traced sizes.

    Example:
        >>> import matepoint
        >>> matepoint.stats().bytes_offloaded >= 0
        True
    """
    snapshot = OffloadStats()
    snapshot.add(kept_counters)
    snapshot.add(engines.retired)
    snapshot.add(traffic.COMPILED_TRAFFIC)
    for engine in all_engines():
        engine.settle(block=synchronize)
        snapshot.add(engine.counters)
        snapshot.add(engine.pool.snapshot())
        snapshot.live_records += engine.live_records()
        snapshot.device_bytes_held += engine.held_bytes()
    return snapshot


def reset_stats() -> None:
    """Set every counter back to zero, for a fresh count over the next steps.

    Resets the event counts of :class:`OffloadStats` (offloads, fetches, waits, dedupe and
    prefetch hits, kept-in-place counts, the compiled graphs' copies) and the pools'
    ``pool_blocks_allocated``, ``pool_blocks_reused`` and ``pageable_fallbacks``. Sizes
    (``pool_pinned_bytes``, ``pool_in_use_bytes``, ``live_records``, ``device_bytes_held``) are
    current values and stay.

    Example:
        >>> import matepoint
        >>> matepoint.reset_stats()
        >>> matepoint.stats().offloads
        0
    """
    kept_counters.reset()
    traffic.COMPILED_TRAFFIC.reset()
    engines.retired = OffloadStats()
    for engine in all_engines():
        with engine.lock:
            engine.counters.reset()
            engine.pool.reset_counters()


def report(*, synchronize: bool = False) -> str:
    """Return a short readable report of :func:`stats`.

    Args:
        synchronize: As in :func:`stats`: wait for outstanding timing events first.
            Default: ``False``.

    Returns:
        A few aligned lines: what moved each way, what was served on the device, waits, the
        pinned pool and what is alive now.

    Example:
        >>> import matepoint
        >>> print(matepoint.report())  # doctest: +ELLIPSIS
        matepoint offload report
        ...
    """
    return format_report(stats(synchronize=synchronize))


def prefetch_now() -> None:
    """Start copying back, on every device, the newest offloaded inputs backward needs first.

    matepoint prefetches during backward by itself; this only lets the first copies start
    earlier, e.g. while the loss is computed. It is what the 0.1.x ``matepoint_pipeline()``
    call does now. Uses the process-wide ``prefetch`` look-ahead; it never waits.

    Example:
        >>> import matepoint
        >>> matepoint.prefetch_now()  # e.g. right after the forward, before the loss
    """
    options = resolve(None)
    assert options is not None  # only offload=False or a disabled OffloadOptions resolve to None
    for engine in all_engines():
        engine.prefetch_newest(options)


def release_pool() -> int:
    """Free every idle pinned host block (e.g. between training and evaluation).

    Blocks that hold inputs of graphs still alive stay. The memory goes back to torch's host
    allocator, which from torch 2.13 on may keep it cached for its own later use.

    Returns:
        The bytes of pinned memory freed.

    Example:
        >>> import matepoint
        >>> matepoint.release_pool() >= 0
        True
    """
    return sum(engine.release_pool() for engine in all_engines())
