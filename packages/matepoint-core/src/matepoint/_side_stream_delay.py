"""The test delay queued on every device's side stream before each copy (race probes).

It belongs to the transport, not to a call's options: the CUDA channel reads it at each copy.
It lives apart from the transport so that the settings (``matepoint._options``, which still
accept the deprecated setting) can set it without importing the engine.
"""

from __future__ import annotations

__all__ = ["set_side_stream_delay", "side_stream_delay"]

_side_stream_delay = 0


def side_stream_delay() -> int:
    """Return the test delay, in GPU cycles, queued on the side stream before each copy."""
    return _side_stream_delay


def set_side_stream_delay(cycles: int) -> None:
    """Set the test delay (``matepoint.testing.delay_side_stream`` is the public way).

    The delay belongs to the transport, not to a call's options: the CUDA channel reads it at
    each copy, so a race probe acts on every copy while it is set.

    Raises:
        ValueError: If ``cycles`` is not an ``int >= 0`` (a ``bool`` is refused).
    """
    global _side_stream_delay
    value: object = cycles  # checked as any object: callers may pass anything
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"delay_side_stream.cycles must be an int >= 0, got {value!r}")
    _side_stream_delay = value
