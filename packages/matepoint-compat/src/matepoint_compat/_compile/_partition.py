"""What matepoint does to its graphs right after torch's offloading put the copies in them.

torch's partitioner calls ``enable_activation_offloading`` (looked up in its module at each
call) right after the joint-graph pass; a wrapper installed once per process runs it, then, for
a graph matepoint's pass marked (and only for that one: the request is taken and cleared), has
inductor keep the graphs' order (Note [Inductor's peak-memory reorder]), bounds the forward
waits (Note [The forward copy window]) and puts in the count ops (Note [Counting compiled
copies]). The wrapper changes nothing for other graphs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from matepoint_compat._compile import _forward_window
from matepoint_compat._compile._forward_window import FORWARD_WINDOW_COUNTS, find_copies
from matepoint_compat._compile._inductor_order import keep_order
from matepoint_compat._compile._torch_names import OFFLOADING_ENTRY, wrap_once
from matepoint_compat._compile._traffic import count_graph_copies

__all__ = ["set_forward_window"]


class _Pending(threading.local):
    """What matepoint asked for the forward graph being partitioned now, if anything.

    Per thread: a graph's joint pass and its partitioner run in the thread that compiles it.
    """

    max_inflight_bytes: int | None = None
    matepoint_graph: bool = False
    """Whether matepoint's joint pass marked values of this graph (with or without a window)."""


_PENDING = _Pending()


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def enable_activation_offloading(
        fwd_module: torch.fx.GraphModule, *args: Any, **kwargs: Any
    ) -> None:
        window, _PENDING.max_inflight_bytes = _PENDING.max_inflight_bytes, None
        matepoint_graph, _PENDING.matepoint_graph = _PENDING.matepoint_graph, False
        original(fwd_module, *args, **kwargs)
        if not matepoint_graph:
            return
        backward = args[0] if args else kwargs.get("bwd_module")
        keep_order(fwd_module, *([backward] if backward is not None else []))
        if window is not None:
            FORWARD_WINDOW_COUNTS.graphs += 1
            with contextlib.suppress(_forward_window.UnexpectedShape):  # warned of below
                FORWARD_WINDOW_COUNTS.copies += len(find_copies(list(fwd_module.graph.nodes)))
            # Looked up at each call: tests wrap it.
            FORWARD_WINDOW_COUNTS.waits_moved += _forward_window.bound_forward_waits(
                fwd_module.graph, window
            )
            fwd_module.graph.lint()
            fwd_module.recompile()
        count_graph_copies(fwd_module, backward)

    return enable_activation_offloading


def set_forward_window(max_inflight_bytes: int | None) -> None:
    """Ask for matepoint's treatment of the graph whose joint pass is running now.

    Called from matepoint's joint-graph pass, which runs right before the partitioner of the same
    graph calls torch's ``enable_activation_offloading``; that call (wrapped here, once per
    process) takes the request and clears it, so it never reaches another graph. Every marked
    graph gets inductor's order kept and the count ops; the window only where asked.

    Args:
        max_inflight_bytes: The forward copy window's bound (``0``: torch's placement, with
            2.11's copies made safe), or ``None`` to leave torch's placement as it is
            (synchronous copies).
    """
    wrap_once(OFFLOADING_ENTRY, _wrap)
    _PENDING.max_inflight_bytes = max_inflight_bytes
    _PENDING.matepoint_graph = True
