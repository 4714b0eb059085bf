"""Offload options: per-call values over process-wide defaults.

A checkpoint call resolves its options once; the engine reads only the resolved, frozen object,
so changing the defaults mid-step never changes a checkpoint already taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any, Literal

__all__ = ["OffloadOptions", "configure", "get_options", "options"]

PoolExhaustedPolicy = Literal["pageable", "raise"]

_MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class OffloadOptions:
    """How matepoint treats a checkpoint's saved inputs.

    Args:
        min_offload_bytes: Tensors smaller than this stay on the device; copying them costs more
            than it saves. Default: ``1 MiB``.
        stash_bytes: Device bytes of the most recent checkpoint inputs kept on the device instead
            of being released after their copy (the "tail" that backward needs first). Raising it
            saves a round trip at the start of backward and costs that much device memory held
            after forward. Default: ``0``.
        prefetch: How many earlier checkpoint inputs to start copying back when backward reaches
            one (look-ahead). ``0`` fetches each on demand. Default: ``2``.
        max_inflight_bytes: Device bytes whose copy to the host may still be running. When
            compute outruns the link, the host waits for the oldest copy so that device memory
            stays bounded. Default: ``2 GiB``.
        pool_cap_bytes: Most pinned host memory the pool may hold; ``None`` means no cap.
            Default: ``None``.
        on_pool_exhausted: What to do when the cap is reached or pinned allocation fails:
            ``"pageable"`` uses ordinary host memory for that tensor (slower copies, one warning);
            ``"raise"`` raises :class:`matepoint.PinnedMemoryExhausted`. Default: ``"pageable"``.
        measure_waits: Record device events around each wait of the compute stream, to report the
            time it waited for copies. Default: ``True``.
        side_stream_delay_cycles: Debug knob: busy-wait this many GPU cycles on the side stream
            before each copy, to make missing stream ordering show up as wrong numbers in tests.
            Default: ``0``.

    Example:
        >>> import matepoint
        >>> opts = matepoint.OffloadOptions(prefetch=4, stash_bytes=256 << 20)
        >>> # y = matepoint.checkpoint(block, x, offload=opts)
    """

    min_offload_bytes: int = 1 * _MIB
    stash_bytes: int = 0
    prefetch: int = 2
    max_inflight_bytes: int = 2048 * _MIB
    pool_cap_bytes: int | None = None
    on_pool_exhausted: PoolExhaustedPolicy = "pageable"
    measure_waits: bool = True
    side_stream_delay_cycles: int = 0

    def __post_init__(self) -> None:
        for name in (
            "min_offload_bytes",
            "stash_bytes",
            "prefetch",
            "max_inflight_bytes",
            "side_stream_delay_cycles",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OffloadOptions.{name} must be an int >= 0, got {value!r}")
        cap: object = self.pool_cap_bytes
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ValueError(
                f"OffloadOptions.pool_cap_bytes must be None or an int >= 0, got {cap!r}"
            )
        if self.on_pool_exhausted not in ("pageable", "raise"):
            raise ValueError(
                "OffloadOptions.on_pool_exhausted must be 'pageable' or 'raise', "
                f"got {self.on_pool_exhausted!r}"
            )


_FIELDS = frozenset(field.name for field in dataclasses.fields(OffloadOptions))
_lock = threading.Lock()
_defaults = OffloadOptions()


def _checked(fields: dict[str, Any]) -> None:
    unknown = sorted(set(fields) - _FIELDS)
    if unknown:
        raise TypeError(
            f"unknown offload option(s) {', '.join(unknown)}; valid: {', '.join(sorted(_FIELDS))}"
        )


def get_options() -> OffloadOptions:
    """Return the process-wide default offload options."""
    return _defaults


def configure(**fields: Any) -> OffloadOptions:
    """Change the process-wide default offload options.

    Every checkpoint call without an ``offload=`` argument uses these defaults.

    Args:
        **fields: Any fields of :class:`OffloadOptions`.

    Returns:
        The new defaults.

    Raises:
        TypeError: For a name that is not an option.
        ValueError: For a value out of range.

    Example:
        >>> import matepoint
        >>> _ = matepoint.configure(prefetch=3)
        >>> _ = matepoint.configure(prefetch=2)
    """
    global _defaults
    _checked(fields)
    with _lock:
        _defaults = dataclasses.replace(_defaults, **fields)
        return _defaults


@contextlib.contextmanager
def options(**fields: Any) -> Iterator[OffloadOptions]:
    """Change the process-wide defaults inside a ``with`` block, restoring them after.

    Args:
        **fields: Any fields of :class:`OffloadOptions`.

    Yields:
        The defaults in force inside the block.

    Example:
        >>> import matepoint
        >>> with matepoint.options(stash_bytes=0):
        ...     pass
    """
    global _defaults
    _checked(fields)
    with _lock:
        previous = _defaults
        _defaults = dataclasses.replace(previous, **fields)
        current = _defaults
    try:
        yield current
    finally:
        with _lock:
            _defaults = previous
