"""``matepoint.checkpoint`` inside a whole-model ``torch.compile``: torch's, offloaded by it.

Note [The compiled path]
    matepoint's eager checkpoint pushes ``saved_tensors_hooks``, which Dynamo cannot trace: a
    whole-model compile would break the graph at every checkpoint. So while Dynamo traces (and
    the installed torch has what it takes, ``matepoint_compat.COMPILED_OFFLOAD``):
    Rule 1. The call is handed to ``torch.utils.checkpoint.checkpoint``, which Dynamo traces as a
            higher-order op, with the function's body annotated as a matepoint region. The step
            stays torch's checkpoint under compile, so gradients are bitwise torch's (same
            graph, same RNG handling), with the copies added.
    Rule 2. The offload is the compiler's. A joint-graph pass marks each value a matepoint region
            reads from outside (its saved inputs, nested and keyword tensors included, one value
            once however many regions read it), and torch's activation offloading copies the
            ones the partitioner saves to the host after their last forward use and back before
            backward needs them. Only there is it known what a compiled graph saves, and
            torch's pass already orders the copies against the graph.
    Rule 3. One engine with the eager path: a region's choices come from
            ``matepoint._options.resolve`` (``offload=``, ``pipeline=``, the settings, the 0.1.x
            ``NOPIPELINE``, its errors), called when Dynamo traces the region (changing the
            settings later does not recompile); which values move is the pack hook's own answer,
            ``matepoint._engine.saving.stay_reason``, asked of the traced values.
    Rule 4. ``pipeline`` chooses torch's transfer stream with prefetched reloads, or synchronous
            copies. With the stream, ``max_inflight_bytes`` bounds the forward copies still
            running (Note [The forward copy window]), and the marked graphs compile with
            inductor's peak-memory reorder off (Note [Inductor's peak-memory reorder]). The
            other device settings (stash, look-ahead count, pool) have no effect: torch
            schedules and allocates the copies.
    Rule 5. A region's choices are in torch's compile cache key through the checkpoint's
            ``context_fn`` (one per set of choices, Note [Context functions looked up by name]),
            so a cached graph is never reused for other choices; not for ``use_reentrant=True``
            (torch's eager checkpoint, Dynamo's fallback when the body graph-breaks, refuses a
            ``context_fn`` there) nor for a call that brings its own ``context_fn``.
    Rule 6. Where transfer-stream copies cannot be loaded from AOTAutograd's cache
            (``matepoint_compat.STREAM_COPIES_CACHEABLE`` false, torch 2.11), a pipelined
            region's ``context_fn`` has no ``cache_hash``, so AOTAutograd bypasses its cache for
            the graph, and a region that cannot carry matepoint's ``context_fn`` copies
            synchronously.
    Rule 7. What differs from eager: a view of a parameter computed in the graph and read by a
            region is a computed value there and may move; the bytes counted are the traced
            sizes.
    Around it: torch's settings are set for the compile only (Note [Compile settings are
    scoped]), ``matepoint.stats()`` counts the copies per graph run (Note [Counting compiled
    copies]), and a 0.1.x keyword warns at trace time, at the line of the call (Note
    [Deprecation warnings under torch.compile]). How it compares with torch's own compiled
    offloading on a GPU: docs/benchmarks.md, "Compile-era peers".

The passes, one module each: ``regions`` (a region's annotation and ``context_fn``; in the joint
graph, the values the regions read from outside and their marks), ``scope`` (Note [Compile
settings are scoped], and what happens to a marked graph after torch's offloading put its copies
in it), ``inductor_order``, ``forward_window`` and ``traffic`` (the Notes of their names). Every
private torch name they use is read from ``matepoint_compat``, behind its release gate. Beside
the whole-model path, ``blocks`` compiles one block at a time with its plan, its inputs
offloaded by the eager engine (Note [A block compiled with its plan]).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._compiled import regions, scope
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
        Rule 1. Dynamo takes a checkpoint's ``context_fn`` only as a function object it can find
                in the program (a global, an attribute), not as one made while tracing nor as
                the result of a trace-time call.
        Rule 2. So the trace-time resolution of a set of choices makes its ``context_fn`` once,
                as an attribute of this class named after a hash of the choices, and returns
                the name; the traced code looks the attribute up by that name, which Dynamo
                reads when it traces the lookup.
        Rule 3. Not a dict: Dynamo reads a dict once per trace, so a key added after that (a
                second set of choices in one model, in a fresh process) raised ``KeyError``,
                which failed a fullgraph compile and otherwise made Dynamo skip the frame
                (nothing offloaded).
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
        if carries_context_fn:  # See Note [Context functions looked up by name], rule 2.
            kwargs["context_fn"] = getattr(_ContextFns, context_fn_name)
        annotation = {
            "min_offload_bytes": min_offload_bytes,
            # Without matepoint's context_fn nothing keeps this graph out of AOTAutograd's
            # cache: see Note [The compiled path], rule 6.
            "pipeline": pipelined and (carries_context_fn or compat.STREAM_COPIES_CACHEABLE),
            "max_inflight_bytes": max_inflight_bytes,
        }

        def region(*call_args: Any, **call_kwargs: Any) -> Any:
            with regions.annotate_offload(annotation):
                return function(*call_args, **call_kwargs)

        return torch_checkpoint.checkpoint(region, *args, use_reentrant=use_reentrant, **kwargs)


@compat.run_at_trace_time
def _resolve(
    offload: OffloadOptions | _OffloadChoice, pipeline: bool
) -> tuple[str, int, bool, int] | None:
    """Resolve a region's choices while Dynamo traces it, with the eager path's ``resolve``.

    Also makes the region's ``context_fn`` (see Note [Context functions looked up by name], rule
    2), named after a hash of the choices, and, where the region offloads, sets torch's settings
    for the compile being traced (Note [Compile settings are scoped], rule 1).

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
    scope.open_compile_scope(_mark_saved_inputs)
    # The transport decides which devices offload (tests make the CPU one).
    key = (
        f"matepoint {compat.__version__} min_offload_bytes={options.min_offload_bytes} "
        f"pipeline={options.pipelined} max_inflight_bytes={options.max_inflight_bytes} "
        f"transport={type(transport()).__qualname__}"
    )
    name = f"context_fn_{hashlib.sha256(key.encode()).hexdigest()}"
    if not hasattr(_ContextFns, name):
        cacheable = compat.STREAM_COPIES_CACHEABLE or not options.pipelined  # rule 6
        setattr(_ContextFns, name, regions.recompute_all_context_fn(key, cacheable=cacheable))
    return name, options.min_offload_bytes, options.pipelined, options.max_inflight_bytes


def _moves(value: torch.Tensor, min_offload_bytes: int) -> bool:
    """Whether eager matepoint would move this saved input: the pack hook's own rules (Note [The
    compiled path], rule 3)."""
    channel_key, nbytes = transport().channel_key, compat.nbytes_hint(value)
    return stay_reason(value, min_offload_bytes, channel_key, traced_nbytes=nbytes) is None


def _mark_saved_inputs(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """The joint-graph pass: mark what the matepoint regions of this graph read from outside
    (Note [The compiled path], rule 2)."""
    chosen: list[dict[str, Any]] = []  # the regions whose inputs move
    on_cpu = False  # a CPU "device" (the test transport) has no streams to overlap on
    for node, value, readers in regions.region_inputs(graph):
        wanted = [region for region in readers if _moves(value, region["min_offload_bytes"])]
        if not wanted:
            continue
        regions.mark_for_offload(node)
        smallest = min(region["min_offload_bytes"] for region in wanted)
        for producer, produced in regions.producers_outside_regions(node):
            if _moves(produced, smallest):
                regions.mark_for_offload(producer)
        chosen += wanted
        on_cpu = on_cpu or value.device.type == "cpu"
    if chosen:
        scope.compiled_offload_config(
            pipelined=not on_cpu and all(region["pipeline"] for region in chosen),
            max_inflight_bytes=min(region["max_inflight_bytes"] for region in chosen),
        )
    return graph
