"""Every private torch name matepoint's compiled path uses, each behind a named release gate.

The compiled path's passes (``matepoint._compiled``) reach torch's compiler internals only
through this module, by the names in its ``__all__`` (re-exported by ``matepoint_compat``): a
shim is found here, with the release from which it can go. Names that are private by convention
only (node ``meta`` keys, op and node names that torch's passes write) count too: a torch
release that renames them breaks the path here. So does :func:`nbytes_hint`, the one public
torch function whose spelling differs between the releases the path supports.

Gates (from ``matepoint_compat._version``):

- ``COMPILED_OFFLOAD`` (torch 2.11+, with every name below present): the whole compiled path.
  Nothing public replaces these names as of torch 2.13; each says what would let it go.
- ``TORCH_2_12_PLUS``: torch 2.11's stream ops (``record_stream``'s mend, the layout of its
  transfer-stream copies, the cache bypass) can go when 2.12 is the oldest supported torch.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import traceback
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar, cast

import torch
import torch._functorch.config
from torch.fx.node import has_side_effect

from matepoint_compat._version import TORCH_2_11_PLUS, TORCH_2_12_PLUS

__all__ = [
    "ANNOTATION_META",
    "ASYNC_OFFLOAD_OP",
    "ASYNC_WAIT_OP",
    "COMPILED_OFFLOAD",
    "COMPILE_SETTINGS",
    "INDUCTOR_GRAPH_ENTRY",
    "JOINT_PASS_SETTING",
    "OFFLOADING_ENTRY",
    "OFFLOAD_PREFIX",
    "OFFLOAD_SETTING",
    "REGION_META",
    "RELOAD_PREFETCH_SETTING",
    "RELOAD_PREFIX",
    "SEPARATE_STREAM_SETTING",
    "SHOULD_OFFLOAD_META",
    "SINK_WAIT_SETTING",
    "STREAM_COPIES_CACHEABLE",
    "STREAM_COPY_PATTERN",
    "STREAM_SETTINGS",
    "TANGENT_PLACEHOLDER",
    "functorch_config",
    "inductor_order_kept",
    "mend_record_stream",
    "nbytes_hint",
    "on_compile_end",
    "op_name",
    "run_at_trace_time",
    "traced_user_stack",
    "wrap_once",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# -- AOTAutograd's settings (torch._functorch.config) -----------------------------------------
# joint_custom_pass: a callable run on the joint graph just before the partitioner.
# enable_activation_offloading and the activation_offload_* / activation_reload_* flags: the
# partitioner's offloading of values marked SHOULD_OFFLOAD. Gate COMPILED_OFFLOAD; can go when
# torch offers a public per-graph way to mark saved values for offloading.
JOINT_PASS_SETTING = "joint_custom_pass"
OFFLOAD_SETTING = "enable_activation_offloading"
SEPARATE_STREAM_SETTING = "activation_offload_separate_stream"
SINK_WAIT_SETTING = "activation_offload_sink_wait"
RELOAD_PREFETCH_SETTING = "activation_reload_prefetch"
STREAM_SETTINGS = (SEPARATE_STREAM_SETTING, SINK_WAIT_SETTING, RELOAD_PREFETCH_SETTING)
COMPILE_SETTINGS = (JOINT_PASS_SETTING, OFFLOAD_SETTING, *STREAM_SETTINGS)
"""Every ``torch._functorch.config`` setting the compiled path sets (within a compile only)."""
functorch_config: ModuleType = torch._functorch.config
"""``torch._functorch.config``: AOTAutograd's settings (gate ``COMPILED_OFFLOAD``)."""


# -- graph node metadata and names that torch's passes read and write -------------------------
# Gate COMPILED_OFFLOAD; each can go with the mechanism that uses it (Note [The compiled path]
# in matepoint._compiled).
ANNOTATION_META = "custom"
"""``node.meta`` key where ``torch.fx.traceback.annotate`` puts its dict (2.11+)."""
REGION_META = "ac_graph_id"
"""``node.meta`` key: the checkpoint region a joint-graph node belongs to (2.11+)."""
SHOULD_OFFLOAD_META = "should_offload"
"""``node.meta`` key: asks the partitioner's offloading to move a saved value (2.11+)."""
OFFLOAD_PREFIX = "cpu_offload_"
"""Name torch's offloading gives a value's copy to the host (forward graph)."""
RELOAD_PREFIX = "gpu_reload_"
"""Name torch's offloading gives a value's copy back to the device (backward graph)."""
TANGENT_PLACEHOLDER = "tangents"
"""Part of the name AOTAutograd gives a joint graph's tangent inputs (``tangents_1``, ...)."""
ASYNC_OFFLOAD_OP = "ao::offload"
ASYNC_WAIT_OP = "ao::wait_tensor"
"""torch 2.12+: a transfer-stream copy is ``ao::offload`` then ``ao::wait_tensor``."""
STREAM_COPY_PATTERN = (
    "streams::record_event",
    "streams::fork",
    "streams::wait_event",
    "streams::record_stream",
    "prims::device_put",
    "streams::record_event",
    "streams::join",
    "streams::wait_event",
)
"""torch 2.11's nodes around one transfer-stream copy (``add_forward_offload_stream_ops``).
Can go when 2.12 is the oldest supported torch (gate ``TORCH_2_12_PLUS``)."""


def op_name(node: torch.fx.Node) -> str:
    """The name of the op a graph node calls (``"ao::offload"``), without its overload; ``""``
    for a node that calls none.

    ``OpOverload._schema`` (gate ``COMPILED_OFFLOAD``): torch's offloading passes write the ops
    this compares. Can go when torch offers an op's schema name publicly.
    """
    schema = getattr(node.target, "_schema", None)
    return "" if node.op != "call_function" or schema is None else str(schema.name)


COMPILED_OFFLOAD: bool = (
    TORCH_2_11_PLUS
    and hasattr(torch.fx.traceback, "annotate")
    and all(hasattr(functorch_config, name) for name in COMPILE_SETTINGS)
    and hasattr(torch._dynamo, "assume_constant_result")
    and all(
        importlib.util.find_spec(f"torch.{name}") is not None
        for name in ("_functorch._activation_offloading", "_dynamo.callback")
    )
)
"""Whether a whole-model compile can trace matepoint's checkpoint and offload its inputs.

True from torch 2.11 on (the releases the mechanism is checked on) where all of its pieces
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
index_to_user_object_weakref" (the ``gpu`` test
``test_a_second_process_runs_the_pipelined_graph_with_a_warm_compile_cache``). From torch 2.12
the copies are ops (``ao::offload``, ``ao::reload``) that find their stream when they run, so
the graph is cacheable. Where False, a pipelined matepoint region's ``context_fn`` carries no
``cache_hash``, so AOTAutograd bypasses its cache for that graph (inductor's FX graph cache
still serves it: its key holds the stream and event numbers).
Shim (gate ``TORCH_2_12_PLUS``) can go when 2.12 is the oldest supported torch.
"""


# -- Dynamo ----------------------------------------------------------------------------------


def run_at_trace_time(function: _F) -> _F:
    """Mark ``function`` so that Dynamo calls it for real while tracing and keeps its result.

    ``torch._dynamo.assume_constant_result`` (gate ``COMPILED_OFFLOAD``; can go when Dynamo
    offers a public way to run a function at trace time): Dynamo calls the marked function with
    its (constant) arguments at trace time and puts the result in the graph as a constant; the
    call costs nothing when the graph runs. Outside Dynamo it is a plain call.
    """
    assume_constant_result: Any = torch._dynamo.assume_constant_result
    return cast(_F, assume_constant_result(function))


def traced_user_stack() -> traceback.StackSummary:
    """The Python frames Dynamo is tracing now, outermost first (empty outside a trace).

    ``torch._guards.TracingContext.extract_stack`` (used under gate ``COMPILED_OFFLOAD``; can
    go when Dynamo attributes a warning raised while tracing to the traced line itself).
    """
    from torch._guards import TracingContext

    return TracingContext.extract_stack()


def on_compile_end(callback: Callable[[Any], None]) -> None:
    """Have ``callback`` run when the compile in progress ends (however it ends).

    ``torch._dynamo.callback.callback_handler`` (gate ``COMPILED_OFFLOAD``; can go when torch
    scopes its compile settings to one compile itself): its end callbacks run, with what ended,
    when the outermost compile of a frame ends, after the backend compiled its graphs, also when
    it fails. ``torch._dynamo.reset()`` clears them, so this registers again where needed
    (idempotent).
    """
    from torch._dynamo.callback import callback_handler

    if callback not in callback_handler.end_callbacks:
        callback_handler.register_end_callback(callback)


# -- the partitioner's offloading and inductor ------------------------------------------------


OFFLOADING_ENTRY = (
    "torch._functorch._activation_offloading.activation_offloading.enable_activation_offloading"
)
"""What the partitioner calls, looked up in its module at each call, right after the joint pass
(gate ``COMPILED_OFFLOAD``; can go with the joint pass)."""
INDUCTOR_GRAPH_ENTRY = "torch._inductor.compile_fx._compile_fx_inner"
"""What inductor compiles each graph with, looked up in its module at each call (gate
``COMPILED_OFFLOAD``; can go once inductor's peak-memory estimate leaves host buffers out, Note
[Inductor's peak-memory reorder])."""


def wrap_once(entry: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the torch function ``entry`` names by ``wrap(function)``, for the process's rest.

    Idempotent: the wrapper is marked, and a function so marked is left as it is.
    """
    module_name, _, name = entry.rpartition(".")
    module = importlib.import_module(module_name)
    function = getattr(module, name)
    if not getattr(function, "matepoint_wrapper", False):
        wrapped = wrap(function)
        wrapped.matepoint_wrapper = True  # type: ignore[attr-defined]
        setattr(module, name, wrapped)


def inductor_order_kept() -> contextlib.AbstractContextManager[None]:
    """``torch._inductor.config.patch(reorder_for_peak_memory=False)`` (gate
    ``COMPILED_OFFLOAD``; goes with ``INDUCTOR_GRAPH_ENTRY``)."""
    import torch._inductor.config as inductor_config

    kept: Any = inductor_config.patch(reorder_for_peak_memory=False)
    return cast(contextlib.AbstractContextManager[None], kept)


@functools.cache
def mend_record_stream() -> None:
    """Make torch 2.11's ``streams::record_stream`` compile, as torch 2.12 does.

    torch 2.11 registers the op ``streams::record_stream(tensor, stream_index)`` (which tells
    the caching allocator that a tensor is in use on another stream; in
    ``torch._dynamo.variables.streams``) with a fake implementation of three other parameters,
    so inductor fails when it meets the op in a graph; and it does not mark the op as having a
    side effect, so a graph pass may drop it as unused. Its transfer-stream offload inserts the
    op before every copy, so neither torch's nor matepoint's compiled offload can copy on the
    transfer stream there. This registers the fake implementation (the op returns nothing and
    changes no tensor metadata) and the side effect torch 2.12 has, for the rest of the process
    (the ``gpu`` test ``test_inductor_on_cuda_offloads_and_matches_torch`` checks the gradients).
    Once per process; nothing to do from 2.12 on, nor where the compiled path is off.
    Shim (gate ``TORCH_2_12_PLUS``) can go when 2.12 is the oldest supported torch.
    """
    if TORCH_2_12_PLUS or not COMPILED_OFFLOAD:
        return
    from torch._dynamo.variables import streams

    record_stream: Any = streams.record_stream
    record_stream.register_fake(lambda tensor, stream_index: None)
    has_side_effect(torch.ops.streams.record_stream.default)


# -- symbolic sizes --------------------------------------------------------------------------


def nbytes_hint(value: torch.Tensor) -> int:
    """Bytes of a traced value; with dynamic shapes, those of the example it was traced with.

    A symbolic size's example is read without adding a guard (a size test must not specialize
    the graph), with ``optimization_hint`` of ``torch.fx.experimental.symbolic_shapes``, or its
    older spelling ``hint_int`` where torch lacks it (2.11 does; 2.13 has it). Shim: the
    fallback can go when the oldest supported torch has ``optimization_hint``.
    """
    nbytes: Any = value.numel() * value.element_size()  # a SymInt with dynamic shapes
    if isinstance(nbytes, int):
        return nbytes
    from torch.fx.experimental import symbolic_shapes

    names: Any = symbolic_shapes
    hint = getattr(names, "optimization_hint", None) or names.hint_int
    return int(hint(nbytes, fallback=1 << 62))
