"""Everything matepoint's compiled path needs from torch.compile, as one unit.

matepoint's eager checkpoint works through ``saved_tensors_hooks``, which Dynamo cannot trace. A
whole-model compile instead gets torch's own checkpoint (which Dynamo traces as a higher-order
op) with its body annotated, and a joint-graph pass marks the saved inputs of annotated regions
for torch's compiled activation offloading, which moves them to the host after their last use in
forward and back before backward needs them (Note [The compiled path] in ``matepoint._compiled``
says why and what carries over). The modules:

- ``_torch_names``: every private torch name the path uses, behind its release gate, and the
  gates ``COMPILED_OFFLOAD`` (the whole path, torch 2.11+) and ``STREAM_COPIES_CACHEABLE``.
- ``_regions``: a region's annotation and ``context_fn``; in the joint graph, the values the
  regions read from outside and their marks for offloading.
- ``_scope``: the AOTAutograd settings of a matepoint compile, set for that compile only
  (Note [Compile settings are scoped]), and what happens to a marked graph after torch's
  offloading put its copies in it: ``_inductor_order`` (Note [Inductor's peak-memory reorder]),
  ``_forward_window`` (Note [The forward copy window]) and ``_traffic`` (Note [Counting compiled
  copies]).

All of it is checked on torch 2.11, 2.12 and 2.13; on older releases matepoint keeps its eager
path under compile (a graph break per checkpoint).
"""

# Each submodule's __all__ lists what it offers the package; the list below is what the package
# offers matepoint_compat.
# ruff: noqa: F403, F405
import torch

from matepoint_compat._compile._forward_window import *
from matepoint_compat._compile._inductor_order import *
from matepoint_compat._compile._regions import *
from matepoint_compat._compile._scope import *
from matepoint_compat._compile._torch_names import *
from matepoint_compat._compile._traffic import *

__all__ = [
    "COMPILED_OFFLOAD",
    "COMPILED_TRAFFIC",
    "FORWARD_WINDOW_COUNTS",
    "INDUCTOR_ORDER_COUNTS",
    "STREAM_COPIES_CACHEABLE",
    "CompiledTrafficCounts",
    "ForwardWindowCounts",
    "InductorOrderCounts",
    "annotate_offload",
    "bound_forward_waits",
    "close_compile_scope",
    "compile_tracing",
    "compiled_offload_config",
    "forward_nodes",
    "mark_for_offload",
    "nbytes_hint",
    "offloaded_nodes",
    "open_compile_scope",
    "producers_outside_regions",
    "recompute_all_context_fn",
    "region_inputs",
    "run_at_trace_time",
    "set_forward_window",
]


def compile_tracing() -> bool:
    """Return whether Dynamo is tracing now and matepoint can take its compiled path.

    ``torch.compiler.is_compiling`` reads one flag (2.3+); Dynamo folds it to a constant, so the
    branch costs nothing in a compiled graph and one call in eager mode. The gate is read from
    this package, so switching ``matepoint_compat._compile.COMPILED_OFFLOAD`` off switches the
    path off.
    """
    return COMPILED_OFFLOAD and torch.compiler.is_compiling()
