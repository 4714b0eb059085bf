"""What matepoint needs from torch.compile to offload checkpoint inputs inside a compiled graph.

matepoint's eager checkpoint works through ``saved_tensors_hooks``, which Dynamo cannot trace. A
whole-model compile instead gets torch's own checkpoint (which Dynamo traces as a higher-order
op) with its body annotated, and a joint-graph pass marks the saved inputs of annotated regions
for torch's compiled activation offloading, which moves them to the host after their last use in
forward and back before backward needs them. Every private torch symbol this takes is here:

- ``torch.fx.traceback.annotate`` copies a dict into ``node.meta["custom"]`` of every node traced
  inside it, through Dynamo and AOTAutograd; it is how the pass tells a matepoint region's nodes.
- ``torch._functorch.config.joint_custom_pass`` runs a callable on the joint forward/backward
  graph just before the partitioner; ``node.meta["should_offload"]`` on a saved forward value
  asks the partitioner's offloading (``enable_activation_offloading``,
  ``torch._functorch._activation_offloading``) to move it.
- Nodes of a checkpoint region carry ``meta["ac_graph_id"]`` (one id per region) in the joint
  graph; torch 2.11 and later tag vanilla checkpoints through the same path as selective ones.
- ``torch._dynamo.assume_constant_result`` makes Dynamo call a function for real while tracing,
  which is when the pass has to be installed (before AOTAutograd reads the config).
- AOTAutograd's cache key sees neither annotations nor matepoint's settings, only the graph and
  the ``cache_hash`` of a checkpoint's ``context_fn``: a ``context_fn`` equivalent to torch's
  vanilla one carries matepoint's choices into the key.
- ``torch._dynamo.variables.streams`` defines the stream ops the transfer-stream offload puts in
  a graph; torch 2.11's ``record_stream`` needs the fix of :func:`_mend_stream_ops`.
- torch 2.11's transfer-stream offload registers its stream and events with Dynamo while the
  partitioner runs; a graph AOTAutograd loads from its cache skips the partitioner, so it must
  never be cached there (``STREAM_COPIES_CACHEABLE``).

All of it is checked on torch 2.11, 2.12 and 2.13; on older releases matepoint keeps its eager
path under compile (a graph break per checkpoint). Gate ``COMPILED_OFFLOAD``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

from matepoint_compat._version import TORCH_2_11_PLUS, TORCH_2_12_PLUS

__all__ = [
    "COMPILED_OFFLOAD",
    "STREAM_COPIES_CACHEABLE",
    "annotate_offload",
    "compile_tracing",
    "compiled_offload_config",
    "forward_nodes",
    "install_joint_pass",
    "mark_for_offload",
    "nbytes_hint",
    "offloaded_nodes",
    "producers_outside_regions",
    "recompute_all_context_fn",
    "region_inputs",
    "run_at_trace_time",
]

_F = TypeVar("_F", bound=Callable[..., Any])

_ANNOTATION_KEY = "matepoint"
_CONFIG_FLAGS = (
    "enable_activation_offloading",
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)


def _functorch_config() -> Any:
    import torch._functorch.config as config

    return config


def _has_compiled_offload() -> bool:
    if not TORCH_2_11_PLUS:
        return False
    fx_traceback: Any = torch.fx.traceback
    config = _functorch_config()
    return (
        hasattr(fx_traceback, "annotate")
        and hasattr(config, "joint_custom_pass")
        and all(hasattr(config, flag) for flag in _CONFIG_FLAGS)
        and importlib.util.find_spec("torch._functorch._activation_offloading") is not None
        and hasattr(torch._dynamo, "assume_constant_result")
    )


COMPILED_OFFLOAD: bool = _has_compiled_offload()
"""Whether a whole-model compile can trace matepoint's checkpoint and offload its inputs.

True from torch 2.11 on (the releases the mechanism above is checked on) where all of its pieces
exist. Where False, ``matepoint.checkpoint`` runs eagerly under compile, as before: Dynamo
graph-breaks at each call. The gate can become a plain version gate when the oldest supported
torch has all of it.
"""


STREAM_COPIES_CACHEABLE: bool = TORCH_2_12_PLUS
"""Whether a compiled graph whose copies run on torch's transfer stream may be cached.

torch 2.11's transfer-stream offload (``activation_offload_separate_stream``) creates its stream
and events while the partitioner runs (``new_stream``, ``new_event``: Dynamo's table of objects a
graph looks up by index at run time). A graph that AOTAutograd's cache hands to another process
never runs the partitioner there, so its first stream op fails with "Index not registered in
index_to_user_object_weakref" (seen on an H200 with torch 2.11: the second process of a run
with a warm cache). From torch 2.12 the copies are ops (``ao::offload``, ``ao::reload``) that
find their stream when they run, so the graph is cacheable. Where False, a pipelined matepoint
region's ``context_fn`` carries no ``cache_hash`` (:func:`recompute_all_context_fn`), so
AOTAutograd bypasses its cache for that graph (inductor's FX graph cache still serves it: its
key holds the stream and event numbers). Shim (gate ``TORCH_2_12_PLUS``) can go when 2.12 is
the oldest supported torch.
"""


def _record_stream_fake(tensor: torch.Tensor, stream_index: int) -> None:
    del tensor, stream_index  # the op returns nothing and changes no tensor metadata


def _mend_stream_ops() -> None:
    """Make torch 2.11's ``streams::record_stream`` compile, as torch 2.12 does.

    torch 2.11 registers the op ``streams::record_stream(tensor, stream_index)`` (which tells
    the caching allocator that a tensor is in use on another stream) with a fake implementation
    of three other parameters, so inductor fails when it meets the op in a graph; and it does not
    mark the op as having a side effect, so a graph pass may drop it as unused. Its
    transfer-stream offload inserts the op before every copy, so neither torch's nor
    matepoint's compiled offload can copy on the transfer stream there. This registers the fake
    implementation and the side effect torch 2.12 has, for the rest of the process (checked on
    an H200 with torch 2.11: gradients equal to torch's checkpoint under compile). Idempotent;
    nothing to do from 2.12 on.
    Shim (gate ``TORCH_2_12_PLUS``) can go when 2.12 is the oldest supported torch.
    """
    if TORCH_2_12_PLUS or not COMPILED_OFFLOAD:
        return
    from torch._dynamo.variables import streams
    from torch.fx.node import has_side_effect

    record_stream: Any = streams.record_stream
    record_stream.register_fake(_record_stream_fake)
    has_side_effect(torch.ops.streams.record_stream.default)


def compile_tracing() -> bool:
    """Return whether Dynamo is tracing now and matepoint can take its compiled path.

    ``torch.compiler.is_compiling`` reads one flag (2.3+); Dynamo folds it to a constant, so the
    branch costs nothing in a compiled graph and one call in eager mode.
    """
    return COMPILED_OFFLOAD and torch.compiler.is_compiling()


def run_at_trace_time(function: _F) -> _F:
    """Mark ``function`` so that Dynamo calls it for real while tracing and keeps its result.

    Dynamo calls a function marked with ``torch._dynamo.assume_constant_result`` with the
    (constant) arguments it is given, at trace time, and puts the result in the graph as a
    constant; the call costs nothing when the graph runs. Outside Dynamo it is a plain call.
    """
    assume_constant_result: Any = torch._dynamo.assume_constant_result
    marked: _F = assume_constant_result(function)
    return marked


def annotate_offload(annotation: dict[str, Any]) -> contextlib.AbstractContextManager[None]:
    """Tag every node traced inside the ``with`` block as part of a matepoint region.

    Args:
        annotation: Plain constants (ints, bools, None): the region's offload choices, which
            :func:`region_inputs` hands back to the pass.
    """
    annotate: Callable[[dict[str, Any]], contextlib.AbstractContextManager[None]]
    annotate = torch.fx.traceback.annotate
    return annotate({_ANNOTATION_KEY: annotation})


def _recompute_everything(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_contexts(cache_hash: str) -> tuple[Any, Any]:
    del cache_hash  # it only identifies the partial that carries it
    create_contexts: Any = torch_checkpoint.create_selective_checkpoint_contexts
    contexts: tuple[Any, Any] = create_contexts(_recompute_everything)
    return contexts


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


_JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


class _ChainedJointPass:
    """The joint pass installed in torch's config: the one found there first, then matepoint's."""

    def __init__(self, previous: _JointPass | None, own: _JointPass) -> None:
        self.previous = previous
        self.own = own

    def __call__(self, graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        if self.previous is not None:
            graph = self.previous(graph, joint_inputs)
        return self.own(graph, joint_inputs)


def install_joint_pass(own: _JointPass) -> None:
    """Make sure ``own`` runs on every joint graph compiled from now on, after any user pass.

    Turns on ``enable_activation_offloading``: it only acts on nodes marked for offload, so
    graphs without matepoint regions (and without marks of the user's own) compile as before.
    Idempotent; if the user replaced ``joint_custom_pass`` since, their pass runs first.
    """
    config = _functorch_config()
    current = config.joint_custom_pass
    if not (isinstance(current, _ChainedJointPass) and current.own is own):
        config.joint_custom_pass = _ChainedJointPass(current if callable(current) else None, own)
    config.enable_activation_offloading = True


def compiled_offload_config(*, pipelined: bool, max_inflight_bytes: int = 0) -> None:
    """Choose how the partitioner moves the marked values, for the graph being compiled.

    ``pipelined``: copies on torch's transfer stream into pinned memory, backward's reloads moved
    earlier by estimated transfer time (``activation_offload_separate_stream``,
    ``activation_reload_prefetch``); otherwise synchronous ``device_put`` copies on the compute
    stream. ``activation_offload_sink_wait`` stays off: it moves every forward wait to the end of
    the graph, which keeps every offloaded value on the device until forward ends (its own
    docstring says so for whole-model compile), so peak memory would not drop. Instead, with
    ``max_inflight_bytes`` above 0, each forward wait moves only as far as that bound allows
    (Note [The forward copy window] in ``matepoint_compat._forward_window``); at 0 the compute
    stream waits for each copy right after starting it. These are process-wide torch settings,
    read by the partitioner right after the joint pass; they act only on marked values. On torch
    2.11, choosing the transfer stream first mends its ``record_stream`` op
    (:func:`_mend_stream_ops`).

    Args:
        pipelined: Copy on the transfer stream (else synchronously on the compute stream).
        max_inflight_bytes: With ``pipelined``, the forward copy window's bound in bytes.
    """
    from matepoint_compat._forward_window import set_forward_window

    config = _functorch_config()
    if pipelined:
        _mend_stream_ops()
    config.activation_offload_separate_stream = pipelined
    config.activation_offload_sink_wait = False
    config.activation_reload_prefetch = pipelined
    set_forward_window(max_inflight_bytes if pipelined else None)


def _is_tangent(node: torch.fx.Node) -> bool:
    return node.op == "placeholder" and "tangents" in str(node.target)


def forward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that do not depend on a tangent (its forward part)."""
    backward: set[torch.fx.Node] = set()
    forward: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if _is_tangent(node) or any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
        else:
            forward.add(node)
    return forward


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
        if node.op != "call_function" or node not in forward:
            continue
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        region = node.meta.get("ac_graph_id")
        annotations = []
        for user in node.users:
            if user not in forward or "ac_graph_id" not in user.meta:
                continue
            annotation = user.meta.get("custom", {}).get(_ANNOTATION_KEY)
            if annotation is not None and user.meta["ac_graph_id"] != region:
                annotations.append(annotation)
        if annotations:
            yield node, value, annotations


def nbytes_hint(value: torch.Tensor) -> int:
    """Bytes of a traced value; with dynamic shapes, those of the example it was traced with.

    ``torch.fx.experimental.symbolic_shapes.optimization_hint`` reads a symbolic size's example
    value without adding a guard (a size test must not specialize the graph).
    """
    nbytes: Any = value.numel() * value.element_size()  # a SymInt with dynamic shapes
    if isinstance(nbytes, int):
        return nbytes
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(nbytes, fallback=1 << 62))


def producers_outside_regions(node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, torch.Tensor]]:
    """Yield the computed values a region input is made from outside every checkpoint region.

    The partitioner may save one of them in place of the input and recompute the rest in
    backward (a GPT's normed embedding ``x0``, read by every block, is saved as the embedding):
    marking them too moves whichever it saves. The walk goes back only through nodes computed
    outside the regions: a region node it reaches is yielded but not walked through, and graph
    inputs (parameters, the model's inputs) are not yielded.
    """
    if "ac_graph_id" in node.meta:
        return
    pending = list(node.all_input_nodes)
    seen: set[torch.fx.Node] = set()
    while pending:
        current = pending.pop()
        if current in seen or current.op != "call_function":
            continue
        seen.add(current)
        value = current.meta.get("val")
        if isinstance(value, torch.Tensor):
            yield current, value
        if "ac_graph_id" not in current.meta:
            pending.extend(current.all_input_nodes)


def mark_for_offload(node: torch.fx.Node) -> None:
    """Ask the partitioner's activation offloading to move this value if it is saved."""
    node.meta["should_offload"] = True


def offloaded_nodes(graph: torch.fx.GraphModule) -> list[str]:
    """Names of the values a partitioned forward graph sends to the host (for tests and reports).

    The partitioner names the host copy of value ``v`` ``cpu_offload_v``: the ``device_put`` of
    the synchronous path, the ``ao.wait_tensor`` of the asynchronous one.
    """
    return [
        node.name
        for node in graph.graph.nodes
        if node.op == "call_function" and node.name.startswith("cpu_offload_")
    ]
