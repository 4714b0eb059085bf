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

    A frozen dataclass: build a new one (or use ``dataclasses.replace``) rather than changing
    one. A checkpoint call resolves its options once, and the same object governs that call's
    backward, so changing the defaults mid-step never changes a checkpoint already taken.

    Args:
        min_offload_bytes: Tensors smaller than this stay on the device; copying them costs more
            than it saves. Default: ``1 MiB``.
        stash_bytes: Device bytes of the most recent checkpoint inputs kept on the device instead
            of being released after their copy (the "tail" that backward needs first). Raising it
            saves a round trip at the start of backward and costs that much device memory held
            after forward. Default: ``0``.
        prefetch: How many earlier checkpoint inputs to start copying back when backward reaches
            one (look-ahead). ``0`` fetches each on demand. Default: ``2``.
        max_inflight_bytes: Device bytes whose copy to the host may still be running (originals
            handed to the allocator, and watched originals beyond ``stash_bytes``). When
            compute outruns the link, the host waits for the oldest copy so that device memory
            stays bounded. Default: ``2 GiB``.
        pool_cap_bytes: Most pinned host memory the pool of one device may hold; ``None`` means
            no cap. Default: ``None``.
        on_pool_exhausted: What to do when the cap is reached or pinned allocation fails:
            ``"pageable"`` uses ordinary host memory for that tensor (slower copies, one
            ``ResourceWarning``);
            ``"raise"`` raises :class:`matepoint.PinnedMemoryExhausted`. Default: ``"pageable"``.
        measure_waits: Record device events around each wait of the compute stream, to report the
            time it waited for copies back (``compute_wait_seconds``). Default: ``True``.
        side_stream_delay_cycles: Debug knob: busy-wait this many GPU cycles on the side stream
            before each copy, to make missing stream ordering show up as wrong numbers in tests.
            Default: ``0``.

    Raises:
        ValueError: If an ``int`` field is not an ``int >= 0`` (a ``bool`` is refused), if
            ``pool_cap_bytes`` is neither ``None`` nor an ``int >= 0``, or if
            ``on_pool_exhausted`` is not ``"pageable"`` or ``"raise"``.

    Example:
        >>> import torch, matepoint
        >>> opts = matepoint.OffloadOptions(prefetch=4, stash_bytes=256 << 20)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> y = matepoint.checkpoint(torch.sin, x, offload=opts)
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
    """Return the process-wide default offload options (see :func:`configure`)."""
    return _defaults


def configure(**fields: Any) -> OffloadOptions:
    """Change the process-wide default offload options.

    Every checkpoint call without an ``offload=`` argument uses these defaults. Fields not named
    keep their current value.

    Args:
        **fields: Any fields of :class:`OffloadOptions`.

    Returns:
        The new defaults.

    Raises:
        TypeError: For a name that is not an option (the message lists the valid ones).
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

    They are restored also when the block raises. The defaults are process-wide, not per thread:
    other threads see the change while the block runs; pass ``offload=`` to a call for options
    that must apply to one thread only. Each checkpoint call resolves its options in forward, so
    a backward after the block still uses the options its forward saw.

    Args:
        **fields: Any fields of :class:`OffloadOptions`.

    Yields:
        The defaults in force inside the block.

    Raises:
        TypeError: For a name that is not an option.
        ValueError: For a value out of range.

    Example:
        >>> import torch, matepoint
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> with matepoint.options(stash_bytes=0):
        ...     loss = matepoint.checkpoint(torch.sin, x).sum()
        >>> loss.backward()
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
