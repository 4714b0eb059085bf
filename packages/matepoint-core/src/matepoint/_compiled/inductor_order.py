"""Keep inductor from moving a matepoint graph's copies to the host to the end of its forward.

Note [Inductor's peak-memory reorder]
    After fusion, inductor reorders a graph's kernels to lower its estimated peak memory
    (``torch._inductor.config.reorder_for_peak_memory``, on by default).
    Rule 1. That estimate must not place matepoint's copies. It counts the host buffer a forward
            copy fills like device memory, so it is lowest with every copy last; and torch
            2.11's stream ops carry no data dependency that would hold a copy in place. On a
            GPU it moved every forward copy (with its ``record_stream``) after the forward's
            last kernel, serially on the compute stream, which kept every copied value on the
            device until the forward ended (docs/benchmarks.md, "The forward").
    Rule 2. So the graphs matepoint's joint pass marked, forward and backward, compile with the
            reorder off: :func:`keep_order` marks their nodes while the partitioner runs, and
            inductor's per-graph entry point (``_compile_fx_inner``, looked up in its module at
            each call) compiles a marked graph under ``reorder_for_peak_memory=False``. Each
            copy then stays where the partitioner and the forward copy window put it.
    Rule 3. Every other graph compiles as before, torch's own offloading included.
    Rule 4. The setting is part of inductor's FX graph cache key, so a cached graph was compiled
            the same way.
    Rule 5. torch 2.12+'s ``ao::offload`` takes the value as an argument, but the estimate is the
            same, so rule 2 holds there too; it can go once inductor's estimate leaves host
            buffers out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import matepoint_compat as compat

__all__ = ["INDUCTOR_ORDER_COUNTS", "InductorOrderCounts", "keep_order"]

_MARK = "matepoint_keep_order"


@dataclass
class InductorOrderCounts:
    """Graphs compiled with inductor's peak-memory reorder off (for reports and tests).

    Args:
        marked: Graphs the partitioner handed over with matepoint's copies (forward and
            backward count apart).
        compiled: Marked graphs inductor compiled with the reorder off (a graph served by
            inductor's cache counts too: it was compiled that way).
    """

    marked: int = 0
    compiled: int = 0


INDUCTOR_ORDER_COUNTS = InductorOrderCounts()
"""The process's running counts (reset by assigning fresh values to the fields)."""


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def compile_graph(graph_module: Any, *args: Any, **kwargs: Any) -> Any:
        nodes = getattr(graph_module, "graph", torch.fx.Graph()).nodes
        if not any(_MARK in node.meta for node in nodes):
            return original(graph_module, *args, **kwargs)
        INDUCTOR_ORDER_COUNTS.compiled += 1
        with compat.inductor_order_kept():
            return original(graph_module, *args, **kwargs)

    return compile_graph


def keep_order(*graph_modules: torch.fx.GraphModule) -> None:
    """Have inductor compile these graphs in their own order; see Note [Inductor's peak-memory
    reorder], rule 2.

    Marks every node (a node's ``meta`` survives the passes that copy or rewrite a graph before
    inductor lowers it), so a graph with any of them compiles with the reorder off. Inductor's
    per-graph compile is wrapped for that once per process.

    Args:
        graph_modules: The forward and backward graphs of a matepoint-marked compile, as the
            partitioner hands them to torch's activation offloading.
    """
    compat.wrap_once(compat.INDUCTOR_GRAPH_ENTRY, _wrap)
    INDUCTOR_ORDER_COUNTS.marked += len(graph_modules)
    for graph_module in graph_modules:
        for node in graph_module.graph.nodes:
            node.meta[_MARK] = True
