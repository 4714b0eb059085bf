"""A matepoint region in a compiled graph: its annotation, its inputs, and their marks.

Dynamo traces ``matepoint.checkpoint`` as torch's checkpoint with the body annotated
(:func:`annotate_offload`); in the joint graph, :func:`region_inputs` finds the values those
regions read from outside, and :func:`mark_for_offload` asks the partitioner's offloading to
move one if it is saved. See Note [The compiled path] in ``matepoint._compiled``, rule 2.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat

__all__ = [
    "annotate_offload",
    "copies_named",
    "forward_nodes",
    "mark_for_offload",
    "offloaded_nodes",
    "producers_outside_regions",
    "recompute_all_context_fn",
    "region_inputs",
]

_ANNOTATION_KEY = "matepoint"


def annotate_offload(annotation: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Tag every node traced inside the ``with`` block as part of a matepoint region.

    Args:
        annotation: Plain constants (ints, bools, None): the region's offload choices, which
            :func:`region_inputs` hands back to the pass.
    """
    return torch.fx.traceback.annotate({_ANNOTATION_KEY: annotation})


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_contexts(cache_hash: str) -> tuple[Any, Any]:
    # cache_hash only identifies the partial that carries it.
    create_contexts: Any = torch_checkpoint.create_selective_checkpoint_contexts
    return cast(tuple[Any, Any], create_contexts(_recompute_everything))


def recompute_all_context_fn(
    cache_hash: str, *, cacheable: bool = True
) -> Callable[[], tuple[Any, Any]]:
    """A checkpoint ``context_fn`` that compiles exactly like none, with a cache identity.

    torch 2.11+ compiles a checkpoint given no ``context_fn`` as selective checkpointing with a
    policy that recomputes every op (``torch._higher_order_ops.wrap``); passing that same policy
    explicitly yields the same graph. AOTAutograd adds a ``context_fn``'s ``cache_hash`` to its
    cache key, so a compiled graph is cached per matepoint choice that shaped it. It is a
    ``functools.partial`` of a module-level function: Dynamo takes a ``context_fn`` only as a
    function or a partial, and the cache pickles it. torch logs once per process that a
    ``context_fn`` was passed under compile.

    Args:
        cache_hash: What identifies the choices this region was compiled with.
        cacheable: False to keep every graph holding this region out of AOTAutograd's cache:
            the ``context_fn`` then has no ``cache_hash``, and AOTAutograd bypasses its cache
            for a checkpoint's ``context_fn`` without one (see ``STREAM_COPIES_CACHEABLE``).

    Returns:
        A function for ``torch.utils.checkpoint.checkpoint(..., context_fn=...)``, to be looked
        up (not created) in traced code.
    """
    context_fn = functools.partial(_recompute_all_contexts, cache_hash)
    if cacheable:
        context_fn.cache_hash = cache_hash  # type: ignore[attr-defined]
    return context_fn


def forward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that do not depend on a tangent (its forward part)."""
    backward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        tangent = node.op == "placeholder" and compat.TANGENT_PLACEHOLDER in str(node.target)
        if tangent or not backward.isdisjoint(node.all_input_nodes):
            backward.add(node)
    return set(graph.nodes) - backward


def region_inputs(
    graph: torch.fx.GraphModule,
) -> Iterator[tuple[torch.fx.Node, torch.Tensor, list[dict[str, Any]]]]:
    """Yield the forward values that matepoint regions of a joint graph read from outside.

    A value is a region input when a forward node of an annotated checkpoint region uses it and
    the value itself was computed outside that region (before it, or in an earlier region). Only
    computed values (``call_function`` nodes) are yielded: graph inputs (parameters, buffers, the
    model's own inputs) belong to the caller. Whether the partitioner saves a value is decided
    later; a marked value that is not saved is left alone.

    Yields:
        ``(node, example value, annotations)``: the value's fake tensor and the annotation of
        every matepoint region that reads it.
    """
    forward = forward_nodes(graph.graph)
    for node in graph.graph.nodes:
        value = node.meta.get("val")
        if node.op != "call_function" or node not in forward or not isinstance(value, torch.Tensor):
            continue
        # A user outside every region has none: it is left out.
        region = node.meta.get(compat.REGION_META)
        annotations = [
            user.meta[compat.ANNOTATION_META][_ANNOTATION_KEY]
            for user in node.users
            if user in forward
            and user.meta.get(compat.REGION_META, region) != region
            and _ANNOTATION_KEY in user.meta.get(compat.ANNOTATION_META, {})
        ]
        if annotations:
            yield node, value, annotations


def producers_outside_regions(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, torch.Tensor]]:
    """Yield the computed values a region input is made from outside every checkpoint region.

    The partitioner may save one of them in place of the input and recompute the rest in
    backward (a GPT's normed embedding ``x0``, read by every block, is saved as the embedding):
    marking them too moves whichever it saves. The walk goes back only through nodes computed
    outside the regions: a region node it reaches is yielded but not walked through, and graph
    inputs (parameters, the model's inputs) are not yielded.
    """
    pending = [] if compat.REGION_META in node.meta else list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while pending:
        current = pending.pop()
        if current in seen or current.op != "call_function":
            continue
        seen.add(current)
        value = current.meta.get("val")
        if isinstance(value, torch.Tensor):
            yield current, value
        if compat.REGION_META not in current.meta:
            pending.extend(current.all_input_nodes)


def mark_for_offload(node: torch.fx.Node) -> None:
    """Ask the partitioner's activation offloading to move this value if it is saved."""
    node.meta[compat.SHOULD_OFFLOAD_META] = True


def copies_named(graph: torch.fx.Graph, prefix: str) -> list[torch.fx.Node]:
    """The nodes of a partitioned graph that torch's offloading named with ``prefix``: its copies
    (``OFFLOAD_PREFIX``: to the host; ``RELOAD_PREFIX``: back to the device)."""
    return [
        node for node in graph.nodes if node.op == "call_function" and node.name.startswith(prefix)
    ]


def offloaded_nodes(graph: torch.fx.GraphModule) -> list[str]:
    """Names of the values a partitioned forward graph sends to the host (for tests and reports).

    The partitioner names the host copy of value ``v`` ``cpu_offload_v``: the ``device_put`` of
    the synchronous path, the ``ao.wait_tensor`` of the asynchronous one.
    """
    return [node.name for node in copies_named(graph.graph, compat.OFFLOAD_PREFIX)]
