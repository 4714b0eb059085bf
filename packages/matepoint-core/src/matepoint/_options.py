"""Offload options: what a call may choose, over settings that belong to each device.

Note [Options and settings]
    A checkpoint call chooses only what can differ from one call to the next
    (:class:`OffloadOptions`: on or off, pipelined or not, the minimum size to move). Everything
    that shapes a device's shared resources (the pinned pool's cap and policy, the stash, the
    in-flight bound, the look-ahead, wait timing) is set in one place, :func:`configure` or
    :func:`options`, as :class:`OffloadSettings`, and applies to every call alike. A call's
    unset fields take the settings in force when it runs. The call resolves both once, into a
    frozen :class:`ResolvedOptions`, which governs that call's forward and its backward, so
    changing the settings mid-step never changes a checkpoint already taken.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

from matepoint._transport import set_side_stream_delay, side_stream_delay
from matepoint_compat import (
    DELAY_SETTING,
    accepts_keyword,
    legacy_pipeline_disabled,
    warn_delay_setting,
    warn_per_call_settings,
)

__all__ = [
    "OffloadOptions",
    "OffloadSettings",
    "ResolvedOptions",
    "configure",
    "get_options",
    "misplaced_setting_error",
    "options",
    "resolve",
]

PoolExhaustedPolicy = Literal["pageable", "raise"]

_MIB = 1 << 20


def _check_count(owner: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        unit = " (a number of bytes, e.g. 1 << 30 for 1 GiB)" if name.endswith("_bytes") else ""
        raise ValueError(f"{owner}.{name} must be an int >= 0{unit}, got {value!r}")


def _check_flag(owner: str, name: str, value: object, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        allowed = "True, False or None" if optional else "True or False"
        raise ValueError(f"{owner}.{name} must be {allowed}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class OffloadSettings:
    """The process-wide offload settings: defaults for every call, and each device's resources.

    Set them with :func:`matepoint.configure` (or :func:`matepoint.options` for a ``with``
    block); read them with :func:`matepoint.get_options`. See Note [Options and settings].

    Args:
        min_offload_bytes: Tensors smaller than this stay on the device; copying them costs more
            than it saves. A call may choose its own (:class:`OffloadOptions`). Default: ``1 MiB``.
        pipeline: Copy on a side stream overlapping compute (``True``) or synchronously on the
            compute stream. A call may choose its own. Default: ``True``.
        stash_bytes: Device bytes of the most recent checkpoint inputs kept on the device instead
            of being released after their copy (the "tail" that backward needs first). Raising it
            saves a round trip at the start of backward and costs that much device memory held
            after forward. Default: ``0``.
        prefetch: How many earlier checkpoint inputs to start copying back when backward reaches
            one (look-ahead). ``0`` fetches each on demand. Default: ``2``.
        max_inflight_bytes: Device bytes whose copy to the host may still be running. When
            compute outruns the link, the host waits for the oldest copy so that device memory
            stays bounded. Under a whole-model compile (``compiled_offload``) it bounds the
            forward's copies the same way, the compute stream waiting for the oldest; ``0``
            there makes it wait for each copy right after starting it. Default: ``2 GiB``.
        pool_cap_bytes: Most pinned host memory the pool of one device may hold; ``None`` means
            no cap. Default: ``None``.
        on_pool_exhausted: What to do when the cap is reached or pinned allocation fails:
            ``"pageable"`` uses ordinary host memory for that tensor (slower copies, one
            ``ResourceWarning``); ``"raise"`` raises :class:`matepoint.PinnedMemoryExhausted`.
            Default: ``"pageable"``.
        measure_waits: Record device events around each wait of the compute stream, to report the
            time it waited for copies back (``compute_wait_seconds``). Default: ``True``.
        compiled_offload: Experimental. Under a whole-model ``torch.compile`` (torch 2.11 and
            newer), trace each checkpoint without a graph break and let the compiler copy its
            saved inputs to the host (see Note [The compiled path] in ``matepoint._compiled``).
            Off: the compiled model breaks the graph at each checkpoint, which runs eagerly with
            matepoint's engine. Off by default while it is experimental. Default: ``False``.

    Raises:
        ValueError: If a count is not an ``int >= 0`` (a ``bool`` is refused), if
            ``pool_cap_bytes`` is neither ``None`` nor such an int, or if ``on_pool_exhausted``
            is not ``"pageable"`` or ``"raise"``.

    Example:
        >>> import matepoint
        >>> matepoint.get_options().prefetch
        2
    """

    min_offload_bytes: int = 1 * _MIB
    pipeline: bool = True
    stash_bytes: int = 0
    prefetch: int = 2
    max_inflight_bytes: int = 2048 * _MIB
    pool_cap_bytes: int | None = None
    on_pool_exhausted: PoolExhaustedPolicy = "pageable"
    measure_waits: bool = True
    compiled_offload: bool = False

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name in ("min_offload_bytes", "stash_bytes", "prefetch", "max_inflight_bytes"):
            _check_count(owner, name, getattr(self, name))
        if self.pool_cap_bytes is not None:
            _check_count(owner, "pool_cap_bytes", self.pool_cap_bytes)
        if self.on_pool_exhausted not in ("pageable", "raise"):
            raise ValueError(
                f"{owner}.on_pool_exhausted must be 'pageable' or 'raise', "
                f"got {self.on_pool_exhausted!r}"
            )
        for name in ("pipeline", "measure_waits", "compiled_offload"):
            _check_flag(owner, name, getattr(self, name))


@dataclasses.dataclass(frozen=True)
class ResolvedOptions(OffloadSettings):
    """What one checkpoint call runs with: the settings and its own choices, resolved once.

    ``pipelined`` is the one answer to "copy on the side stream?": the call's ``pipeline=``
    argument, the options' ``pipeline`` and the 0.1.x ``matepoint.NOPIPELINE``, all at once.
    """

    pipelined: bool = True


_SETTING_FIELDS = frozenset(field.name for field in dataclasses.fields(OffloadSettings))
_DEVICE_FIELDS = _SETTING_FIELDS - {"min_offload_bytes", "pipeline", "compiled_offload"}
_CALL_FIELDS = frozenset({"enabled", "pipeline", "min_offload_bytes"})
_DELAY = DELAY_SETTING


@dataclasses.dataclass(frozen=True, init=False)
class OffloadOptions:
    """What one checkpoint call chooses for itself; unset fields take the settings in force.

    Pass it as ``matepoint.checkpoint(..., offload=OffloadOptions(...))``. Only what can differ
    from call to call is here; the device's resources (pool, stash, in-flight bound,
    look-ahead) are :class:`OffloadSettings`, set with :func:`matepoint.configure`. See
    Note [Options and settings]. ``dataclasses.replace`` works on it and keeps its deprecated
    settings without warning again.

    Args:
        enabled: ``False`` offloads nothing: the call is torch's checkpoint. Default: ``True``.
        pipeline: Copy on the side stream (``True``) or synchronously (``False``); ``None``
            takes the settings' ``pipeline``. Default: ``None``.
        min_offload_bytes: Tensors smaller than this stay on the device; ``None`` takes the
            settings' ``min_offload_bytes``. Default: ``None``.
        deprecated_settings: The deprecated settings already given, as ``(name, value)``
            pairs (what ``dataclasses.replace`` passes on). Default: none.
        **deprecated: The device settings that 0.2.0 accepted per call (``stash_bytes``,
            ``prefetch``, ``max_inflight_bytes``, ``pool_cap_bytes``, ``on_pool_exhausted``,
            ``measure_waits``). They still apply to the calls that carry them, with a
            deprecation warning: per call they also act on the device's other records and its
            shared pool. ``side_stream_delay_cycles`` is accepted with a warning and has no
            effect per call: the test delay belongs to the transport
            (``matepoint.testing.delay_side_stream``).

    Raises:
        TypeError: For a name that is neither an option nor a deprecated setting.
        ValueError: For a value out of range.

    Example:
        >>> import torch, matepoint
        >>> everything = matepoint.OffloadOptions(min_offload_bytes=0)
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> y = matepoint.checkpoint(torch.sin, x, offload=everything)
    """

    enabled: bool
    pipeline: bool | None
    min_offload_bytes: int | None
    deprecated_settings: tuple[tuple[str, Any], ...] = dataclasses.field(repr=False)

    def __init__(
        self,
        *,
        enabled: bool = True,
        pipeline: bool | None = None,
        min_offload_bytes: int | None = None,
        deprecated_settings: tuple[tuple[str, Any], ...] = (),
        **deprecated: Any,
    ) -> None:
        unknown = sorted(set(deprecated) - _DEVICE_FIELDS - {_DELAY})
        if unknown:
            raise TypeError(
                f"unknown offload option(s) {', '.join(unknown)}; valid: enabled, pipeline, "
                "min_offload_bytes (device settings go to matepoint.configure: "
                f"{', '.join(sorted(_DEVICE_FIELDS))})"
            )
        _check_flag("OffloadOptions", "enabled", enabled)
        _check_flag("OffloadOptions", "pipeline", pipeline, optional=True)
        if min_offload_bytes is not None:
            _check_count("OffloadOptions", "min_offload_bytes", min_offload_bytes)
        carried = dict(deprecated_settings)
        if set(carried) - _DEVICE_FIELDS - {_DELAY}:
            raise TypeError(
                "OffloadOptions.deprecated_settings holds what an OffloadOptions was given; "
                f"got {deprecated_settings!r}"
            )
        if deprecated:
            # Validate through the settings' own checks, with the settings' defaults elsewhere.
            ResolvedOptions(**{name: value for name, value in deprecated.items() if name != _DELAY})
            if _DELAY in deprecated:
                _check_count("OffloadOptions", _DELAY, deprecated[_DELAY])
            warn_per_call_settings(deprecated)
        carried.update(deprecated)
        object.__setattr__(self, "enabled", enabled)
        object.__setattr__(self, "pipeline", pipeline)
        object.__setattr__(self, "min_offload_bytes", min_offload_bytes)
        object.__setattr__(self, "deprecated_settings", tuple(sorted(carried.items())))


# Note [Settings layers]
#     The settings in force are the base (what configure() set) with every open options() block
#     laid over it, in the order the blocks were entered. Leaving a block removes its own layer
#     and nothing else, so blocks that overlap in two threads (A enters, B enters, A leaves, B
#     leaves) each undo exactly their own fields, whatever the order they leave in. configure()
#     changes the base for good and wins over open blocks for the fields it names (they no
#     longer restore those). The settings object in force is rebuilt only when a layer or the
#     base changes, so get_options() returns the same object while nothing changes.
_lock = threading.Lock()
_base = OffloadSettings()
_layers: list[dict[str, Any]] = []
_defaults = _base
# The last resolution, reused while neither the settings nor the call's choices change (the
# settings and options are frozen and held here, so identity is a safe key). See resolve().
_last: tuple[OffloadSettings, OffloadOptions | None, bool, bool, ResolvedOptions] | None = None


def _rebuild() -> OffloadSettings:
    """Recompute the settings in force from the base and the open layers (under ``_lock``)."""
    global _defaults
    merged: dict[str, Any] = {}
    for layer in _layers:
        merged.update(layer)
    _defaults = dataclasses.replace(_base, **merged) if merged else _base
    return _defaults


def _checked(fields: dict[str, Any], owner: str, stacklevel: int) -> dict[str, Any]:
    """Check ``fields`` as settings and return them without the deprecated test delay.

    Everything is checked before anything changes; the delay's warning is attributed
    ``stacklevel`` frames up (counted as ``warn_deprecated`` counts).
    """
    unknown = sorted(set(fields) - _SETTING_FIELDS - {_DELAY})
    if unknown:
        raise TypeError(
            f"unknown offload setting(s) {', '.join(unknown)} for {owner}; "
            f"valid: {', '.join(sorted(_SETTING_FIELDS))}"
        )
    if _DELAY in fields:
        warn_delay_setting(stacklevel)
        _check_count("settings", _DELAY, fields[_DELAY])
    settings = {name: value for name, value in fields.items() if name != _DELAY}
    try:
        dataclasses.replace(_base, **settings)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
    return settings


def get_options() -> OffloadSettings:
    """Return the process-wide offload settings (see :func:`configure`).

    Example:
        >>> import matepoint
        >>> matepoint.get_options().min_offload_bytes
        1048576
    """
    return _defaults


def configure(**fields: Any) -> OffloadSettings:
    """Change the process-wide offload settings; fields not named keep their value.

    The change is for good: it also wins over an open :func:`options` block that set the same
    field (that block no longer restores it). See Note [Settings layers].

    Args:
        **fields: Any fields of :class:`OffloadSettings`.

    Returns:
        The new settings.

    Raises:
        TypeError: For a name that is not a setting (the message lists the valid ones).
        ValueError: For a value out of range.

    Example:
        >>> import matepoint
        >>> _ = matepoint.configure(prefetch=3)
        >>> _ = matepoint.configure(prefetch=2)
    """
    global _base
    settings = _checked(fields, "matepoint.configure", stacklevel=3)
    with _lock:
        if _DELAY in fields:
            set_side_stream_delay(fields[_DELAY])
        _base = dataclasses.replace(_base, **settings)
        for layer in _layers:
            for name in settings:
                layer.pop(name, None)
        return _rebuild()


@contextlib.contextmanager
def options(**fields: Any) -> Iterator[OffloadSettings]:
    """Change the process-wide settings inside a ``with`` block, restoring them after.

    They are restored also when the block raises. The settings are process-wide, not per
    thread: other threads see the change while the block runs. Leaving the block undoes only
    its own fields, so blocks in several threads may overlap and end in any order (see
    Note [Settings layers]). Each checkpoint call resolves its options in forward, so a
    backward after the block still uses what its forward saw.

    Args:
        **fields: Any fields of :class:`OffloadSettings`.

    Yields:
        The settings in force inside the block.

    Raises:
        TypeError: For a name that is not a setting.
        ValueError: For a value out of range.

    Example:
        >>> import torch, matepoint
        >>> x = torch.randn(8, 64, requires_grad=True)
        >>> with matepoint.options(stash_bytes=0):
        ...     loss = matepoint.checkpoint(torch.sin, x).sum()
        >>> loss.backward()
    """
    layer = _checked(fields, "matepoint.options", stacklevel=4)
    previous_delay = side_stream_delay()
    with _lock:
        if _DELAY in fields:
            set_side_stream_delay(fields[_DELAY])
        _layers.append(layer)
        current = _rebuild()
    try:
        yield current
    finally:
        with _lock:
            # By identity: two blocks may set equal fields.
            for index, open_layer in enumerate(_layers):
                if open_layer is layer:
                    del _layers[index]
                    break
            _rebuild()
            if _DELAY in fields:
                set_side_stream_delay(previous_delay)


def misplaced_setting_error(
    function_kwargs: dict[str, Any], function: Callable[..., object]
) -> TypeError | None:
    """The error for an offload option or setting passed as a keyword of ``checkpoint`` itself.

    ``checkpoint(fn, x, prefetch=4)`` would reach ``fn`` as a keyword argument and fail there
    with Python's bare "unexpected keyword argument". A name ``function`` itself takes is its own
    business and is left alone.
    """
    misplaced = sorted(
        name
        for name in function_kwargs
        if (name in _SETTING_FIELDS or name in _CALL_FIELDS or name == _DELAY)
        and not accepts_keyword(function, name)
    )
    if not misplaced:
        return None
    name = misplaced[0]
    value = function_kwargs[name]
    if name in _CALL_FIELDS:
        where = f"pass offload=matepoint.OffloadOptions({name}={value!r}) for this call"
    else:
        where = (
            f"it is a device setting: matepoint.configure({name}={value!r}), or "
            f"`with matepoint.options({name}={value!r}):` around the calls"
        )
    return TypeError(
        f"checkpoint() got an unexpected keyword argument {name!r}, which the checkpointed "
        f"function does not take; {where}"
    )


def _check_offload_argument(call: object) -> None:
    if call is None or isinstance(call, (bool, OffloadOptions)):
        return
    raise TypeError(
        "checkpoint() offload= must be an OffloadOptions, True, False or None, "
        f"got {type(call).__name__}"
        + (
            "; device settings are set with matepoint.configure(...) or matepoint.options(...)"
            if isinstance(call, OffloadSettings)
            else ""
        )
    )


def resolve(call: OffloadOptions | bool | None, pipeline: bool = True) -> ResolvedOptions | None:
    """What one checkpoint call does: the settings in force, its ``offload=`` and ``pipeline=``.

    The one place that decides it, for the eager and the compiled path alike. ``None`` and
    ``True`` take the settings alone; ``False``, or options with ``enabled=False``, offload
    nothing (None is returned). The result's ``pipelined`` combines the call's ``pipeline=``,
    the options' ``pipeline`` and the 0.1.x ``matepoint.NOPIPELINE``. A training loop makes the
    same call many times, so the last result is reused while nothing it depends on changes.

    Raises:
        TypeError: For an ``offload=`` that is not an :class:`OffloadOptions`, a bool or None,
            or a ``pipeline=`` that is not a bool.
    """
    global _last
    if pipeline is not True and pipeline is not False:
        raise TypeError(f"checkpoint() pipeline= must be True or False, got {pipeline!r}")
    if call is False:
        return None
    if call is True:
        call = None
    else:
        _check_offload_argument(call)
    settings = _defaults
    legacy_off = legacy_pipeline_disabled()
    last = _last
    if (
        last is not None
        and last[0] is settings
        and last[1] is call
        and last[2] == pipeline
        and last[3] == legacy_off
    ):
        return last[4]
    if call is not None and not call.enabled:
        return None
    fields = dataclasses.asdict(settings)
    if call is not None:
        # The test delay is the transport's now: per call it does nothing (its warning says so).
        fields.update(item for item in call.deprecated_settings if item[0] != _DELAY)
        if call.pipeline is not None:
            fields["pipeline"] = call.pipeline
        if call.min_offload_bytes is not None:
            fields["min_offload_bytes"] = call.min_offload_bytes
    fields["pipelined"] = pipeline and fields["pipeline"] and not legacy_off
    resolved = ResolvedOptions(**fields)
    _last = (settings, call, pipeline, legacy_off, resolved)
    return resolved
