"""Keep inductor from moving a matepoint graph's copies to the host to the end of its forward.

Note [Inductor's peak-memory reorder]
    After fusion, inductor reorders a graph's kernels to lower its estimated peak memory
    (``torch._inductor.config.reorder_for_peak_memory``, on by default). The estimate counts
    every buffer alike, a pinned host buffer as much as a device one, and knows nothing of the
    copies' purpose: a forward copy to the host allocates a host buffer the size of the value it
    copies, kept until backward, so the estimate is lowest with every copy as late as possible.
    On torch 2.11 the stream ops around a copy carry no data dependencies, so nothing holds the
    copy between them. Seen in inductor's generated forward on an H200 (torch 2.11, 3 blocks of
    the benchmark's deep48): every ``fork``, ``wait_event`` and ``join`` in place, and every
    copy (with its ``record_stream``) after the last kernel, on the compute stream; with
    synchronous copies, the same. The copies then run after the forward's compute, serially,
    and every copied value stays on the device until the forward ends: on deep48 (48 blocks)
    the forward took 1.38 of eager torch's against 1.00 for the compiled baseline, and with 12
    blocks the step's peak device memory was 4.05 GiB, above eager torch's checkpoint (3.72).
    With the reorder off, each copy sits between its ``fork`` and ``join`` right after its last
    use, as the partitioner and the forward copy window placed it: forward 1.01, step 0.956 of
    eager torch's against 0.947 for the compiled baseline, peak 3.49 GiB.

    So the graphs that matepoint's joint pass marked for offloading (forward and backward) are
    compiled with the reorder off: :func:`keep_order` marks their nodes while the partitioner
    runs, and inductor's per-graph entry point (``torch._inductor.compile_fx._compile_fx_inner``,
    looked up in its module at each call) compiles a marked graph under
    ``config.patch(reorder_for_peak_memory=False)``. The setting is part of inductor's FX graph
    cache key, so a cached graph is never one compiled the other way. Other graphs, torch's own
    offloading among them, compile as before. torch 2.12+ moves values with ``ao::offload`` ops
    that take them as arguments; whether the reorder also delays those on a GPU is not measured
    (the estimate is the same), so the mend applies there too, and can go once inductor's
    estimate leaves host buffers out.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from matepoint_compat._compile import _torch_names

__all__ = ["INDUCTOR_ORDER_COUNTS", "InductorOrderCounts"]

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
        with _torch_names.inductor_order_kept():
            return original(graph_module, *args, **kwargs)

    return compile_graph


def keep_order(*graph_modules: torch.fx.GraphModule) -> None:
    """Have inductor compile these graphs in their own order; see Note [Inductor's peak-memory
    reorder].

    Marks every node (a node's ``meta`` survives the passes that copy or rewrite a graph before
    inductor lowers it), so a graph with any of them compiles with the reorder off. Inductor's
    per-graph compile is wrapped for that once per process.

    Args:
        graph_modules: The forward and backward graphs of a matepoint-marked compile, as the
            partitioner hands them to torch's activation offloading.
    """
    _torch_names.wrap_once(_torch_names.INDUCTOR_GRAPH_ENTRY, _wrap)
    INDUCTOR_ORDER_COUNTS.marked += len(graph_modules)
    for graph_module in graph_modules:
        for node in graph_module.graph.nodes:
            node.meta[_MARK] = True
