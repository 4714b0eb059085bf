"""``matepoint.checkpoint`` inside a whole-model ``torch.compile``: torch's, offloaded by it.

Note [The compiled path]
    matepoint's eager checkpoint pushes ``saved_tensors_hooks``, which Dynamo cannot trace: a
    whole-model compile would break the graph at every checkpoint. While Dynamo traces (and the
    installed torch has what it takes, ``matepoint_compat.COMPILED_OFFLOAD``), the call is handed
    to ``torch.utils.checkpoint.checkpoint``, which Dynamo recognises and traces as a
    higher-order op, with the function's body annotated as a matepoint region. The offload is
    then the compiler's: a joint-graph pass, installed while tracing, marks each value a
    matepoint region reads from outside (its saved inputs, nested and keyword tensors included,
    one value once however many regions read it), and torch's activation offloading
    (``torch._functorch._activation_offloading``) copies the ones the partitioner saves to the
    host after their last forward use and back before backward needs them.

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

    What carries over from matepoint's options: ``min_offload_bytes`` and the keep rules (what
    stays on the device in eager mode stays there here too); ``pipeline`` chooses torch's
    transfer stream and prefetched reloads, or synchronous copies; with the stream,
    ``max_inflight_bytes`` bounds the forward copies still running when a new one starts, as in
    eager mode (Note [The forward copy window] in ``matepoint_compat._forward_window``: torch
    alone makes the compute stream wait for each copy right after starting it), and inductor
    compiles the marked graphs with its peak-memory reorder off, which otherwise moves every
    forward copy after the forward's last kernel (Note [Inductor's peak-memory reorder] in
    ``matepoint_compat._inductor_order``). The other
    device settings (stash, look-ahead count, pool) have no effect: torch schedules and
    allocates the copies. A region's choices are resolved when Dynamo traces it (changing the
    settings later does not recompile) and go into torch's compile cache key through the
    checkpoint's ``context_fn`` (``matepoint_compat.recompute_all_context_fn``), so a cached
    graph is never reused for other choices; not for ``use_reentrant=True`` (torch's eager
    checkpoint, which Dynamo falls back to when the body graph-breaks, refuses a ``context_fn``
    there) nor when the call brings its own ``context_fn``. ``matepoint.stats()`` does not
    count these copies.

    The cache and torch 2.11: its transfer-stream copies cannot be loaded from AOTAutograd's
    cache (``matepoint_compat.STREAM_COPIES_CACHEABLE``: the stream and events are registered
    by the partitioner, which a cached graph skips, and the graph's first stream op fails). So
    there a pipelined region's ``context_fn`` has no ``cache_hash``, which makes AOTAutograd
    bypass its cache for the graph (inductor's own cache still serves its kernels), and a
    region that cannot carry matepoint's ``context_fn`` (reentrant, or the call's own) copies
    synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._legacy import pipeline_disabled as legacy_pipeline_disabled
from matepoint._options import OffloadOptions, get_options
from matepoint._registry import transport
from matepoint._saving import _stays_on_device

__all__ = ["checkpoint"]

# cache_hash -> the context_fn that carries it. Dynamo takes a context_fn only as a function
# object it can look up (here, by the constant key _resolve returns), not one made while tracing.
_CONTEXT_FNS: dict[str, Callable[[], tuple[Any, Any]]] = {}


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
    call_min_offload_bytes: int | None = None
    call_pipeline: bool | None = None
    if isinstance(offload, OffloadOptions):
        if offload.enabled:
            call_min_offload_bytes = offload.min_offload_bytes
            call_pipeline = offload.pipeline
        else:
            offload = False
    elif offload is not None and offload is not True and offload is not False:
        raise TypeError(
            "checkpoint() offload= must be an OffloadOptions, True, False or None, "
            f"got {type(offload).__name__}"
        )
    if offload is False:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)
    reentrant = True if use_reentrant is None else bool(use_reentrant)
    # Raises for keywords the installed torch lacks, as the eager path does.
    with compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=reentrant):
        key, min_offload_bytes, pipelined, max_inflight_bytes = _resolve(
            call_min_offload_bytes, call_pipeline, pipeline
        )
        if not reentrant and "context_fn" not in kwargs:
            kwargs["context_fn"] = _CONTEXT_FNS[key]
        elif pipelined and not compat.STREAM_COPIES_CACHEABLE:
            # Without matepoint's context_fn nothing keeps this graph out of AOTAutograd's
            # cache, where torch 2.11's transfer-stream copies break (see the Note): copy
            # synchronously instead.
            pipelined = False
        annotation = {
            "min_offload_bytes": min_offload_bytes,
            "pipeline": pipelined,
            "max_inflight_bytes": max_inflight_bytes,
        }

        def region(*call_args: Any, **call_kwargs: Any) -> Any:
            with compat.annotate_offload(annotation):
                return function(*call_args, **call_kwargs)

        return torch_checkpoint.checkpoint(region, *args, use_reentrant=use_reentrant, **kwargs)


@compat.run_at_trace_time
def _resolve(
    call_min_offload_bytes: int | None, call_pipeline: bool | None, pipeline: bool
) -> tuple[str, int, bool, int]:
    """Resolve a region's choices, as the eager path would, while Dynamo traces it.

    Installs the joint-graph pass (see Note [The compiled path]) and the region's context_fn.

    Returns:
        The context_fn's key, the minimum size to move, whether to pipeline, and the forward
        copy window's bound (the device's ``max_inflight_bytes``).
    """
    settings = get_options()
    min_offload_bytes = (
        settings.min_offload_bytes if call_min_offload_bytes is None else call_min_offload_bytes
    )
    chosen_pipeline = settings.pipeline if call_pipeline is None else call_pipeline
    pipelined = pipeline and chosen_pipeline and not legacy_pipeline_disabled()
    compat.install_joint_pass(_mark_saved_inputs)
    # The transport decides which devices offload (tests make the CPU one).
    key = (
        f"matepoint {compat.__version__} min_offload_bytes={min_offload_bytes} "
        f"pipeline={pipelined} max_inflight_bytes={settings.max_inflight_bytes} "
        f"transport={type(transport()).__qualname__}"
    )
    if key not in _CONTEXT_FNS:
        cacheable = compat.STREAM_COPIES_CACHEABLE or not pipelined
        _CONTEXT_FNS[key] = compat.recompute_all_context_fn(key, cacheable=cacheable)
    return key, min_offload_bytes, pipelined, settings.max_inflight_bytes


def _offloads(value: torch.Tensor, min_offload_bytes: int) -> bool:
    """Whether eager matepoint would move this saved input (the same keep rules)."""
    if _stays_on_device(value):
        return False
    if compat.nbytes_hint(value) < max(min_offload_bytes, 1):
        return False
    return transport().channel_key(value) is not None


def _mark_saved_inputs(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """The joint-graph pass: mark what the matepoint regions of this graph read from outside."""
    del joint_inputs
    pipelined = True
    max_inflight_bytes: int | None = None
    marked = False
    for node, value, regions in compat.region_inputs(graph):
        wanted = [region for region in regions if _offloads(value, region["min_offload_bytes"])]
        if not wanted:
            continue
        smallest = min(region["min_offload_bytes"] for region in wanted)
        for marked_node, marked_value in [(node, value), *compat.producers_outside_regions(node)]:
            if marked_node is node or _offloads(marked_value, smallest):
                compat.mark_for_offload(marked_node)
        marked = True
        bounds = [region["max_inflight_bytes"] for region in wanted]
        if max_inflight_bytes is not None:
            bounds.append(max_inflight_bytes)
        max_inflight_bytes = min(bounds)
        # A CPU "device" (the test transport) has no streams to overlap on.
        pipelined = (
            pipelined
            and all(region["pipeline"] for region in wanted)
            and value.device.type != "cpu"
        )
    if marked:
        compat.compiled_offload_config(
            pipelined=pipelined, max_inflight_bytes=max_inflight_bytes or 0
        )
    return graph
