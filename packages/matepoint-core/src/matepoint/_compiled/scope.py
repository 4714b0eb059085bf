"""The torch settings a matepoint compile needs, set for that compile only, and what matepoint
does to its graphs right after torch's offloading put the copies in them.

Note [Compile settings are scoped]
    torch's compiled offloading is driven by process-wide settings of AOTAutograd
    (``torch._functorch.config``: the joint-graph pass, offloading on, and how the copies run),
    read after Dynamo's trace, while the traced graph compiles.
    Rule 1. matepoint sets them when Dynamo traces a matepoint region (:func:`open_compile_scope`,
            from the trace-time resolution of the region's choices), under one ``config.patch``
            that is undone when that compile ends (Dynamo's end-of-compile callback, which runs
            also when the compile fails): after a compiled step every setting is what it was.
    Rule 2. The joint pass sets the copy settings of the graph it marks
            (:func:`compiled_offload_config`) inside the same patch, so they are undone with it.
    Rule 3. At most one scope is open: Dynamo compiles one frame at a time (its compile lock).
    Rule 4. What stays for the rest of the process, by design: the two wrappers of torch
            functions, which act only on graphs matepoint marked (``enable_activation_offloading``
            and inductor's ``_compile_fx_inner``), the count op's registration, and on torch 2.11
            the mend of ``streams::record_stream`` (``matepoint_compat.mend_record_stream``).

After the copies: torch's partitioner calls ``enable_activation_offloading`` (looked up in its
module at each call) right after the joint-graph pass; a wrapper installed once per process runs
it, then, for a graph matepoint's pass marked (and only for that one: the request is taken and
cleared, :func:`compiled_offload_config`), has inductor keep the graphs' order (Note [Inductor's
peak-memory reorder]), bounds the forward waits of copies on the transfer stream (Note [The
forward copy window]) and puts in the count ops (Note [Counting compiled copies]). The wrapper
changes nothing for other graphs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

import matepoint_compat as compat
from matepoint._compiled import forward_window
from matepoint._compiled.inductor_order import keep_order
from matepoint._compiled.traffic import count_graph_copies, count_op

__all__ = ["close_compile_scope", "compiled_offload_config", "open_compile_scope"]

_JointPass = Callable[[torch.fx.GraphModule, Any], torch.fx.GraphModule]


_open_scope: contextlib.ExitStack | None = None


def open_compile_scope(own: _JointPass) -> None:
    """Set the settings the compile in progress needs, until it ends (Note [Compile settings are
    scoped], rules 1 and 3).

    ``own`` runs on every joint graph of this compile, after any pass the user set; offloading is
    on (it acts only on marked nodes, so graphs without matepoint regions compile as before).
    Idempotent within one compile. Call it only while Dynamo traces.
    """
    global _open_scope
    if _open_scope is not None:
        return
    config = compat.functorch_config
    # Every setting the compile may change, to be restored as it is now when the scope closes.
    settings = {name: getattr(config, name) for name in compat.COMPILE_SETTINGS}
    previous = settings[compat.JOINT_PASS_SETTING]

    def joint_pass(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        """The one found in torch's settings first (None when unset), then matepoint's."""
        if callable(previous):
            graph = previous(graph, joint_inputs)
        return own(graph, joint_inputs)

    settings |= {compat.JOINT_PASS_SETTING: joint_pass, compat.OFFLOAD_SETTING: True}
    _open_scope = contextlib.ExitStack()
    _open_scope.enter_context(config.patch(settings))
    count_op()  # See Note [Counting compiled copies], rule 3.
    compat.on_compile_end(close_compile_scope)


def close_compile_scope(compile_end: object = None) -> None:
    """Restore the settings :func:`open_compile_scope` set (nothing if none is open).

    Also Dynamo's end-of-compile callback, which passes what ended (``compile_end``, unused).
    """
    global _open_scope
    scope, _open_scope = _open_scope, None
    if scope is not None:
        scope.close()


def compiled_offload_config(*, pipelined: bool, max_inflight_bytes: int = 0) -> None:
    """Choose how the partitioner moves the marked values, and matepoint's treatment of the
    graph whose joint pass is running now.

    ``pipelined``: copies on torch's transfer stream into pinned memory, backward's reloads moved
    earlier by estimated transfer time (``activation_offload_separate_stream``,
    ``activation_reload_prefetch``); otherwise synchronous ``device_put`` copies on the compute
    stream. ``activation_offload_sink_wait`` stays off: it moves every forward wait to the end of
    the graph, which keeps every offloaded value on the device until forward ends (its own
    docstring says so for whole-model compile), so peak memory would not drop. Instead, with
    ``max_inflight_bytes`` above 0, each forward wait moves only as far as that bound allows
    (Note [The forward copy window]); at 0 the compute stream waits for each copy right after
    starting it. Called from matepoint's joint pass, inside the compile's scope (Note [Compile
    settings are scoped], rule 2), which restores the settings when the compile ends; they act
    only on marked values. On torch 2.11, choosing the transfer stream first mends its
    ``record_stream`` op (``matepoint_compat.mend_record_stream``).

    The partitioner of the same graph calls torch's ``enable_activation_offloading`` right after
    the joint pass; that call (wrapped here, once per process) takes this request and clears it,
    so it never reaches another graph. Every marked graph gets inductor's order kept and the
    count ops; the forward copy window only with ``pipelined`` (bound ``0``: torch's placement,
    with 2.11's copies made safe).

    Args:
        pipelined: Copy on the transfer stream (else synchronously on the compute stream).
        max_inflight_bytes: With ``pipelined``, the forward copy window's bound in bytes.
    """
    config = compat.functorch_config
    if pipelined:
        compat.mend_record_stream()
    setattr(config, compat.SEPARATE_STREAM_SETTING, pipelined)
    setattr(config, compat.SINK_WAIT_SETTING, False)
    setattr(config, compat.RELOAD_PREFETCH_SETTING, pipelined)
    compat.wrap_once(compat.OFFLOADING_ENTRY, _wrap)
    _REQUEST.copies = (pipelined, max_inflight_bytes)


class _Request(threading.local):
    """What matepoint's joint pass asked for the forward graph being partitioned now, if anything.

    Per thread: a graph's joint pass and its partitioner run in the thread that compiles it.
    """

    copies: tuple[bool, int] | None = None
    """``(pipelined, max_inflight_bytes)`` of :func:`compiled_offload_config`; None where
    matepoint's joint pass marked nothing in this graph."""


_REQUEST = _Request()


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def enable_activation_offloading(
        fwd_module: torch.fx.GraphModule,
        bwd_module: torch.fx.GraphModule,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        request, _REQUEST.copies = _REQUEST.copies, None
        original(fwd_module, bwd_module, *args, **kwargs)
        if request is None:
            return
        pipelined, max_inflight_bytes = request
        keep_order(fwd_module, bwd_module)
        if pipelined:
            # Looked up at each call: tests wrap it.
            forward_window.bound_forward_waits(fwd_module.graph, max_inflight_bytes)
            fwd_module.graph.lint()
            fwd_module.recompile()
        count_graph_copies(fwd_module, to_host=True)
        count_graph_copies(bwd_module, to_host=False)

    return enable_activation_offloading
