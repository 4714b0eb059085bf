"""Offload options: what a call may choose, over settings that belong to each device.

Note [Options and settings]
    Rule 1. A checkpoint call chooses only what may differ from call to call
            (:class:`OffloadOptions`: on or off, pipelined or not, the minimum size to move).
    Rule 2. What shapes a device's shared resources (the pinned pool's cap and policy, the
            stash, the in-flight bound, the look-ahead, wait timing) is one
            :class:`OffloadSettings` for every call, set by :func:`configure` or :func:`options`.
    Rule 3. A call's unset fields take the settings in force when it runs; both resolve once
            into a frozen :class:`ResolvedOptions`, which governs that call's forward and its
            backward, whatever the settings do meanwhile.
    Example: ``configure(prefetch=4)`` between a forward and its backward leaves that backward's
    look-ahead as its forward saw it (rule 3); the next forward's calls use 4.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, Literal

import matepoint_compat as compat
from matepoint._side_stream_delay import set_side_stream_delay, side_stream_delay

__all__ = [
    "OffloadOptions",
    "OffloadSettings",
    "ResolvedOptions",
    "check_misplaced_settings",
    "configure",
    "get_options",
    "options",
    "resolve",
    "resolve_over",
]

PoolExhaustedPolicy = Literal["pageable", "raise"]


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What each field's annotation accepts (a string, under ``from __future__ import annotations``),
# and how an error says it.
_ACCEPTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_count, "an int >= 0"),
    "int | None": (lambda value: value is None or _is_count(value), "an int >= 0"),
    "bool": (lambda value: isinstance(value, bool), "True or False"),
    "bool | None": (lambda value: value is None or isinstance(value, bool), "True, False or None"),
    "PoolExhaustedPolicy": (lambda value: value in ("pageable", "raise"), "'pageable' or 'raise'"),
}


def _check(owner: str, name: str, kind: str, value: object) -> None:
    accepts, allowed = _ACCEPTED[kind]
    if not accepts(value):
        unit = " (a number of bytes, e.g. 1 << 30 for 1 GiB)" if name.endswith("_bytes") else ""
        raise ValueError(f"{owner}.{name} must be {allowed}{unit}, got {value!r}")


def _check_fields(instance: Any) -> None:
    """Check every field of the dataclass ``instance`` whose annotation :data:`_ACCEPTED` knows."""
    for field in dataclasses.fields(instance):
        if field.type in _ACCEPTED:
            _check(type(instance).__name__, field.name, field.type, getattr(instance, field.name))


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

    min_offload_bytes: int = 1 << 20
    pipeline: bool = True
    stash_bytes: int = 0
    prefetch: int = 2
    max_inflight_bytes: int = 2 << 30
    pool_cap_bytes: int | None = None
    on_pool_exhausted: PoolExhaustedPolicy = "pageable"
    measure_waits: bool = True
    compiled_offload: bool = False

    def __post_init__(self) -> None:
        _check_fields(self)


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
# Names that checkpoint() refuses as its own keywords unless the function takes them.
_OFFLOAD_NAMES = _SETTING_FIELDS | _CALL_FIELDS | {compat.DELAY_SETTING}


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
        carried = {**dict(deprecated_settings), **deprecated}
        unknown = sorted(set(carried) - _DEVICE_FIELDS - {compat.DELAY_SETTING})
        if unknown:
            raise TypeError(
                f"unknown offload option(s) {', '.join(unknown)} (given directly or in "
                "deprecated_settings); valid: enabled, pipeline, min_offload_bytes (device "
                f"settings go to matepoint.configure: {', '.join(sorted(_DEVICE_FIELDS))})"
            )
        # The test delay is the transport's now: per call it does nothing (its warning says so).
        checked = tuple(sorted(_checked_values(carried, "OffloadOptions").items()))
        # Field by field through object.__setattr__ (frozen): Dynamo traces that, where it
        # cannot trace an update of __dict__ (torch 2.11, whole-model compile).
        object.__setattr__(self, "enabled", enabled)
        object.__setattr__(self, "pipeline", pipeline)
        object.__setattr__(self, "min_offload_bytes", min_offload_bytes)
        object.__setattr__(self, "deprecated_settings", checked)
        _check_fields(self)
        if deprecated:
            compat.warn_per_call_settings(deprecated)


# Note [Settings layers]
#     Rule 1. The settings in force are the base (what configure() set) with every open
#             options() block laid over it, in the order the blocks were entered.
#     Rule 2. Leaving a block removes its own layer and nothing else, so blocks that overlap in
#             several threads each undo exactly their own fields, in whatever order they leave.
#     Rule 3. configure() changes the base for good and wins over open blocks for the fields it
#             names (they no longer restore those).
#     Rule 4. The settings object is rebuilt only when a layer or the base changes: get_options()
#             returns the same object while nothing changes.
#     Example: A enters options(prefetch=4), B enters options(stash_bytes=0), A leaves: the base
#     with stash_bytes=0 is in force until B leaves (rules 1, 2).
_lock = threading.Lock()
_base = OffloadSettings()
_layers: list[dict[str, Any]] = []
_defaults = _base
# The last resolution and what it was resolved from, reused while neither the settings nor the
# call's choices change. See resolve().
_last: tuple[tuple[object, ...], ResolvedOptions] | None = None


def _rebuild() -> OffloadSettings:
    """Recompute the settings in force from the base and the open layers (under ``_lock``)."""
    global _defaults
    merged = {name: value for layer in _layers for name, value in layer.items()}
    _defaults = dataclasses.replace(_base, **merged) if merged else _base
    return _defaults


def _checked_values(fields: dict[str, Any], owner: str) -> dict[str, Any]:
    """Check the values of ``fields`` as settings; return them without the deprecated test delay.

    Raises:
        ValueError: For a value out of range, naming ``owner``.
    """
    settings = {name: value for name, value in fields.items() if name != compat.DELAY_SETTING}
    try:
        _check("settings", compat.DELAY_SETTING, "int", fields.get(compat.DELAY_SETTING, 0))
        OffloadSettings(**settings)
    except ValueError as error:
        raise ValueError(f"{owner}: {error}") from None
    return settings


def _take_settings(fields: dict[str, Any], owner: str, stacklevel: int) -> dict[str, Any]:
    """Check ``fields`` as settings, set the deprecated test delay if given, return the rest.

    Everything is checked before anything changes; the delay's warning is attributed
    ``stacklevel`` frames up (counted as ``warn_deprecated`` counts).
    """
    unknown = sorted(set(fields) - _SETTING_FIELDS - {compat.DELAY_SETTING})
    if unknown:
        raise TypeError(
            f"unknown offload setting(s) {', '.join(unknown)} for {owner}; "
            f"valid: {', '.join(sorted(_SETTING_FIELDS))}"
        )
    if compat.DELAY_SETTING in fields:
        compat.warn_delay_setting(stacklevel)
    settings = _checked_values(fields, owner)
    if compat.DELAY_SETTING in fields:
        set_side_stream_delay(fields[compat.DELAY_SETTING])
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
    field (that block no longer restores it). See Note [Settings layers], rule 3.

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
    settings = _take_settings(fields, "matepoint.configure", stacklevel=3)
    with _lock:
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
    Note [Settings layers], rule 2). Each checkpoint call resolves its options in forward, so a
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
    previous_delay = side_stream_delay()
    layer = _take_settings(fields, "matepoint.options", stacklevel=4)
    with _lock:
        _layers.append(layer)
        current = _rebuild()
    try:
        yield current
    finally:
        with _lock:
            # By identity: two blocks may set equal fields.
            _layers[:] = [open_layer for open_layer in _layers if open_layer is not layer]
            _rebuild()
        if compat.DELAY_SETTING in fields:
            set_side_stream_delay(previous_delay)


def check_misplaced_settings(kwargs: dict[str, Any], function: Callable[..., object]) -> None:
    """Refuse an offload option or setting passed as a keyword of ``checkpoint`` itself.

    ``checkpoint(fn, x, prefetch=4)`` would reach ``fn`` as a keyword argument and fail there
    with Python's bare "unexpected keyword argument". A name ``function`` itself takes is its own
    business and is left alone.

    Raises:
        TypeError: Saying where the first such name (in sorted order) belongs.
    """
    for name in sorted(_OFFLOAD_NAMES.intersection(kwargs)):
        if compat.accepts_keyword(function, name):
            continue
        given = f"{name}={kwargs[name]!r}"
        where = f"pass offload=matepoint.OffloadOptions({given}) for this call"
        if name not in _CALL_FIELDS:
            where = f"it is a device setting: matepoint.configure({given}), or "
            where += f"`with matepoint.options({given}):` around the calls"
        raise TypeError(
            f"checkpoint() got an unexpected keyword argument {name!r}, which the checkpointed "
            f"function does not take; {where}"
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
    _check_call(call, pipeline)
    if call is False or (isinstance(call, OffloadOptions) and not call.enabled):
        return None
    key = (_defaults, call, pipeline, compat.legacy_pipeline_disabled())
    last = _last
    if last is not None and last[0] == key:
        return last[1]
    resolved = _resolved(_defaults, call, pipeline, key[3])
    _last = (key, resolved)
    return resolved


def resolve_over(
    settings: OffloadSettings, call: OffloadOptions | bool | None, pipeline: bool = True
) -> ResolvedOptions | None:
    """What one checkpoint call would do with ``settings`` in force instead of the process's.

    :func:`resolve` with other settings under the call's choices, uncached: the planner plans a
    step under candidate settings without changing the process's (Note [Settings a search
    plans under] in ``matepoint._planner.memory_plan``).
    """
    _check_call(call, pipeline)
    if call is False or (isinstance(call, OffloadOptions) and not call.enabled):
        return None
    return _resolved(settings, call, pipeline, compat.legacy_pipeline_disabled())


def _check_call(call: object, pipeline: object) -> None:
    """Refuse a ``pipeline=`` or an ``offload=`` of the wrong type, naming what each takes."""
    if pipeline is not True and pipeline is not False:
        raise TypeError(f"checkpoint() pipeline= must be True or False, got {pipeline!r}")
    if call is not None and not isinstance(call, (bool, OffloadOptions)):
        raise TypeError(
            "checkpoint() offload= must be an OffloadOptions, True, False or None, got "
            f"{type(call).__name__}; device settings are set with matepoint.configure(...) or "
            "matepoint.options(...)"
        )


def _resolved(
    settings: OffloadSettings,
    call: OffloadOptions | bool | None,
    pipeline: bool,
    legacy_pipeline_disabled: bool,
) -> ResolvedOptions:
    """The call's choices over ``settings``: the resolution :func:`resolve` caches."""
    fields = dataclasses.asdict(settings)
    if isinstance(call, OffloadOptions):
        fields.update(call.deprecated_settings)
        own = {"pipeline": call.pipeline, "min_offload_bytes": call.min_offload_bytes}
        fields.update((name, value) for name, value in own.items() if value is not None)
    fields["pipelined"] = pipeline and fields["pipeline"] and not legacy_pipeline_disabled
    return ResolvedOptions(**fields)
