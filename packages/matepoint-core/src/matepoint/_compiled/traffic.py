"""Count what a compiled graph moves to the host and back, each time it runs.

Note [Counting compiled copies]
    The compiled path's copies are ops of torch's compiled graphs: matepoint's engine never sees
    them, yet ``matepoint.stats()`` counts them among its offloads and fetches.
    Rule 1. When the partitioner has put the copies in a matepoint graph, the graph gets one
            count op, first after its inputs: a forward's adds its copies to the host (how many,
            their bytes) to :data:`COMPILED_TRAFFIC`, a backward's its copies back. The counts
            are read from the graph when it is compiled: one Python call per graph run, nothing
            per tensor.
    Rule 2. The bytes are the traced sizes (with dynamic shapes, those of the example the graph
            was traced with), counted when the graph starts: a graph that raises midway has
            counted its copies.
    Rule 3. A graph served by a compile cache carries its count op with it, so the op is
            registered before such a graph can be loaded (every matepoint compile asks for it).
            A CUDA graph replay (``mode="reduce-overhead"``) runs kernels only: its runs are not
            counted.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.node import has_side_effect

import matepoint_compat as compat
from matepoint._compiled.regions import copies_named

__all__ = ["COMPILED_TRAFFIC", "CompiledTrafficCounts", "count_graph_copies", "count_op"]


@dataclass
class CompiledTrafficCounts:
    """What compiled matepoint graphs moved in this process (see Note [Counting compiled copies]).

    Args:
        offloads: Values copied to the host by compiled forwards.
        bytes_offloaded: Their bytes.
        fetches: Values copied back to the device by compiled backwards.
        bytes_fetched: Their bytes.
    """

    offloads: int = 0
    bytes_offloaded: int = 0
    fetches: int = 0
    bytes_fetched: int = 0

    def reset(self) -> None:
        """Set every count back to zero."""
        with _LOCK:
            self.offloads = self.bytes_offloaded = self.fetches = self.bytes_fetched = 0


COMPILED_TRAFFIC = CompiledTrafficCounts()
"""The process's running counts (``matepoint.reset_stats()`` resets them)."""
_LOCK = threading.Lock()


@functools.cache
def count_op() -> Any:
    """``matepoint_compat::count_copies(to_host, tensors, nbytes)``, registered once (see Note
    [Counting compiled copies], rule 3).

    The op keeps the namespace it had when this module was part of ``matepoint_compat``:
    graphs in torch's compile caches call it by that name.
    """

    @torch.library.custom_op("matepoint_compat::count_copies", mutates_args=())
    def count_copies(to_host: bool, tensors: int, nbytes: int) -> None:
        with _LOCK:
            if to_host:
                COMPILED_TRAFFIC.offloads += tensors
                COMPILED_TRAFFIC.bytes_offloaded += nbytes
            else:
                COMPILED_TRAFFIC.fetches += tensors
                COMPILED_TRAFFIC.bytes_fetched += nbytes

    count_copies.register_fake(lambda to_host, tensors, nbytes: None)
    op = torch.ops.matepoint_compat.count_copies.default
    has_side_effect(op)  # it returns nothing: no pass may drop it
    return op


def count_graph_copies(graph_module: torch.fx.GraphModule, *, to_host: bool) -> None:
    """Put the count op into a matepoint graph, after torch's copies: those to the host in a
    forward (``to_host``), those back to the device in a backward (Note [Counting compiled
    copies], rule 1)."""
    prefix = compat.OFFLOAD_PREFIX if to_host else compat.RELOAD_PREFIX
    copies = copies_named(graph_module.graph, prefix)
    if not copies:
        return
    values = [node.meta.get("val") for node in copies]
    nbytes = sum(compat.nbytes_hint(value) for value in values if isinstance(value, torch.Tensor))
    # First, after the inputs: a node with no inputs changes no buffer's lifetime (inductor
    # emits a graph's last pointwise kernel lazily, and freed its inputs early when the count
    # came just before the output).
    first = next(node for node in graph_module.graph.nodes if node.op != "placeholder")
    with graph_module.graph.inserting_before(first):
        graph_module.graph.call_function(count_op(), (to_host, len(copies), nbytes))
    graph_module.recompile()
