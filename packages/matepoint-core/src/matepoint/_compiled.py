"""``matepoint.checkpoint`` inside a whole-model ``torch.compile``: torch's, offloaded by it.

Note [The compiled path]
    matepoint's eager checkpoint pushes ``saved_tensors_hooks``, which Dynamo cannot trace: a
    whole-model compile would break the graph at every checkpoint. While Dynamo traces (and the
    installed torch has what it takes, ``matepoint_compat.COMPILED_OFFLOAD``), the call is handed
    to ``torch.utils.checkpoint.checkpoint``, which Dynamo recognises and traces as a
    higher-order op, with the function's body annotated as a matepoint region. The offload is
    then the compiler's: a joint-graph pass marks each value a matepoint region reads from
    outside (its saved inputs, nested and keyword tensors included, one value once however many
    regions read it), and torch's activation offloading
    (``torch._functorch._activation_offloading``) copies the ones the partitioner saves to the
    host after their last forward use and back before backward needs them. Everything it takes
    from torch is in ``matepoint_compat._compile``, every private torch name in its
    ``_torch_names`` module behind a release gate.

    Why this route and not matepoint's own copies as custom ops: the partitioner decides which
    values a compiled graph saves (the region inputs, after its own recomputation choices), so
    only a pass at that point sees what is really kept; torch's pass already orders the copies
    against the graph (after the last use in forward, reloads prefetched by estimated transfer
    time), and the compiled step stays exactly torch's checkpoint under compile, so gradients
    are bitwise those of torch's (same graph, same RNG handling) with the copies added. Measured
    on an H200 (docs/benchmarks.md, compile-era peers): faster than torch's compiled offloading
    as torch 2.11 ships it, with the same device memory held after forward, because this path
    also copies on the transfer stream there (``matepoint_compat`` mends the op torch 2.11 cannot
    compile).

    One engine with the eager path: a region's choices come from the eager path's
    ``matepoint._options.resolve`` (its ``offload=`` and ``pipeline=``, the settings, the 0.1.x
    ``NOPIPELINE``; its errors), called when Dynamo traces the region (changing the settings
    later does not recompile); which values move is the pack hook's own answer,
    ``matepoint._engine.saving.stay_reason`` (the keep rules, the transport's device, a dense
    layout), asked of the traced values. ``pipeline`` chooses torch's transfer stream and prefetched
    reloads, or synchronous copies; with the stream, ``max_inflight_bytes`` bounds the forward
    copies still running when a new one starts, as in eager mode (Note [The forward copy
    window]: torch alone makes the compute stream wait for each copy right after starting it),
    and inductor compiles the marked graphs with its peak-memory reorder off, which otherwise
    moves every forward copy after the forward's last kernel (Note [Inductor's peak-memory
    reorder]). The other device settings (stash, look-ahead count, pool) have no effect: torch
    schedules and allocates the copies. ``matepoint.stats()`` counts the copies per graph run
    (Note [Counting compiled copies]). A 0.1.x keyword warns at trace time, at the line of the
    call (Note [Deprecation warnings under torch.compile]).

    torch's settings: the AOTAutograd settings the path needs (the joint pass, offloading on,
    how the copies run) are set when Dynamo traces a matepoint region and restored when that
    compile ends (Note [Compile settings are scoped]).

    The cache: a region's choices go into torch's compile cache key through the checkpoint's
    ``context_fn`` (``matepoint_compat.recompute_all_context_fn``, one per set of choices, see
    Note [Context functions looked up by name]), so a cached graph is never reused for other
    choices; not for ``use_reentrant=True`` (torch's eager checkpoint, which Dynamo falls back
    to when the body graph-breaks, refuses a ``context_fn`` there) nor when the call brings its
    own ``context_fn``. torch 2.11's transfer-stream copies cannot be loaded from AOTAutograd's
    cache (``matepoint_compat.STREAM_COPIES_CACHEABLE``: the stream and events are registered
    by the partitioner, which a cached graph skips, and the graph's first stream op fails). So
    there a pipelined region's ``context_fn`` has no ``cache_hash``, which makes AOTAutograd
    bypass its cache for the graph (inductor's own cache still serves its kernels), and a
    region that cannot carry matepoint's ``context_fn`` (reentrant, or the call's own) copies
    synchronously.

    What differs from eager: a view of a parameter computed in the graph and read by a region
    is a computed value there and may move (the eager path keeps it: it frees nothing); the
    bytes counted are the traced sizes.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._engine.active_transport import transport
from matepoint._engine.saving import stay_reason
from matepoint._options import OffloadOptions, resolve

__all__ = ["checkpoint"]

# A checkpoint's offload= as traced code hands it to _resolve: None or a bool as it is, an
# OffloadOptions as (field, value) pairs (Dynamo passes only constants to a trace-time function,
# and an OffloadOptions built inside the compiled code is not one).
_OffloadChoice = bool | None | tuple[tuple[str, Any], ...]
_OFFLOAD_FIELDS = tuple(field.name for field in dataclasses.fields(OffloadOptions))


class _ContextFns:
    """The ``context_fn`` of each set of choices traced so far, one class attribute each.

    Note [Context functions looked up by name]
        Dynamo takes a checkpoint's ``context_fn`` only as a function object it can find in the
        program (a global, an attribute), not as one made while tracing nor as the result of a
        trace-time call. Looked up in a dict, it failed: Dynamo reads a dict once per trace, so
        a key that the trace-time resolution added after that (a second set of choices in one
        model, in a fresh process) raised ``KeyError``, which failed a fullgraph compile and
        otherwise made Dynamo skip the frame (nothing offloaded). An attribute looked up by a
        name that is new for new choices is read when the lookup is traced.
    """


def _describe(offload: OffloadOptions | bool | None) -> _OffloadChoice:
    if isinstance(offload, OffloadOptions):
        return tuple((name, getattr(offload, name)) for name in _OFFLOAD_FIELDS)
    return offload


def checkpoint(
    function: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    use_reentrant: bool | None,
    pipeline: bool,
    offload: OffloadOptions | bool | None,
) -> Any:
    """``matepoint.checkpoint`` while Dynamo traces; see Note [The compiled path].

    Traceable without a graph break: only constants are inspected, and torch's checkpoint gets
    the user's arguments unchanged (``use_reentrant`` included, so a reentrant call does what
    torch's does under compile), plus, unless the call brings its own, a ``context_fn``
    equivalent to none.
    """
    given: tuple[object, object] = (offload, pipeline)  # as the caller passed them, unchecked
    if not isinstance(given[0], (bool, OffloadOptions, type(None))) or type(given[1]) is not bool:
        resolve(offload, pipeline)  # raises the eager path's TypeError (traced: Dynamo stops)
    choices = _resolve(_describe(offload), pipeline)
    if choices is None:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
    context_fn_name, min_offload_bytes, pipelined, max_inflight_bytes = choices
    reentrant = use_reentrant is not False
    # Raises for keywords the installed torch lacks, as the eager path does.
    with compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=reentrant):
        carries_context_fn = not reentrant and "context_fn" not in kwargs
        if carries_context_fn:  # See Note [Context functions looked up by name].
            kwargs["context_fn"] = getattr(_ContextFns, context_fn_name)
        annotation = {
            "min_offload_bytes": min_offload_bytes,
            # Without matepoint's context_fn nothing keeps this graph out of AOTAutograd's
            # cache, where torch 2.11's transfer-stream copies break (see the Note): there it
            # copies synchronously instead.
            "pipeline": pipelined and (carries_context_fn or compat.STREAM_COPIES_CACHEABLE),
            "max_inflight_bytes": max_inflight_bytes,
        }

        def region(*call_args: Any, **call_kwargs: Any) -> Any:
            with compat.annotate_offload(annotation):
                return function(*call_args, **call_kwargs)

        return torch_checkpoint.checkpoint(region, *args, use_reentrant=use_reentrant, **kwargs)


@compat.run_at_trace_time
def _resolve(
    offload: OffloadOptions | _OffloadChoice, pipeline: bool
) -> tuple[str, int, bool, int] | None:
    """Resolve a region's choices while Dynamo traces it, with the eager path's ``resolve``.

    Also makes the region's ``context_fn`` (see Note [Context functions looked up by name]),
    named after a hash of the choices, and, where the region offloads, sets torch's settings
    for the compile being traced (Note [Compile settings are scoped]).

    Returns:
        None if the call offloads nothing; else the ``context_fn``'s name on
        :class:`_ContextFns`, the minimum size to move, whether to pipeline, and the forward
        copy window's bound (the device's ``max_inflight_bytes``).
    """
    if isinstance(offload, tuple):
        offload = OffloadOptions(**dict(offload))
    options = resolve(offload, pipeline)
    if options is None:
        return None
    compat.open_compile_scope(_mark_saved_inputs)
    # The transport decides which devices offload (tests make the CPU one).
    key = (
        f"matepoint {compat.__version__} min_offload_bytes={options.min_offload_bytes} "
        f"pipeline={options.pipelined} max_inflight_bytes={options.max_inflight_bytes} "
        f"transport={type(transport()).__qualname__}"
    )
    name = f"context_fn_{hashlib.sha256(key.encode()).hexdigest()}"
    if not hasattr(_ContextFns, name):
        cacheable = compat.STREAM_COPIES_CACHEABLE or not options.pipelined
        setattr(_ContextFns, name, compat.recompute_all_context_fn(key, cacheable=cacheable))
    return name, options.min_offload_bytes, options.pipelined, options.max_inflight_bytes


def _moves(value: torch.Tensor, min_offload_bytes: int) -> bool:
    """Whether eager matepoint would move this saved input: the pack hook's own rules."""
    channel_key, nbytes = transport().channel_key, compat.nbytes_hint(value)
    return stay_reason(value, min_offload_bytes, channel_key, traced_nbytes=nbytes) is None


def _mark_saved_inputs(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """The joint-graph pass: mark what the matepoint regions of this graph read from outside."""
    chosen: list[dict[str, Any]] = []  # the regions whose inputs move
    on_cpu = False  # a CPU "device" (the test transport) has no streams to overlap on
    for node, value, regions in compat.region_inputs(graph):
        wanted = [region for region in regions if _moves(value, region["min_offload_bytes"])]
        if not wanted:
            continue
        compat.mark_for_offload(node)
        smallest = min(region["min_offload_bytes"] for region in wanted)
        for producer, produced in compat.producers_outside_regions(node):
            if _moves(produced, smallest):
                compat.mark_for_offload(producer)
        chosen += wanted
        on_cpu = on_cpu or value.device.type == "cpu"
    if chosen:
        compat.compiled_offload_config(
            pipelined=not on_cpu and all(region["pipeline"] for region in chosen),
            max_inflight_bytes=min(region["max_inflight_bytes"] for region in chosen),
        )
    return graph
