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

# No __all__ here: what the package offers matepoint_compat is each submodule's __all__ (the
# star imports re-export exactly those) and compile_tracing; torch's module is imported under a
# private name so that it is not offered too.
# ruff: noqa: F403, F405
from torch import compiler as _torch_compiler

from matepoint_compat._compile._forward_window import *
from matepoint_compat._compile._inductor_order import *
from matepoint_compat._compile._regions import *
from matepoint_compat._compile._scope import *
from matepoint_compat._compile._torch_names import *
from matepoint_compat._compile._traffic import *


def compile_tracing() -> bool:
    """Return whether Dynamo is tracing now and matepoint can take its compiled path.

    ``torch.compiler.is_compiling`` reads one flag (2.3+); Dynamo folds it to a constant, so the
    branch costs nothing in a compiled graph and one call in eager mode. The gate is read from
    this package, so switching ``matepoint_compat._compile.COMPILED_OFFLOAD`` off switches the
    path off.
    """
    return COMPILED_OFFLOAD and _torch_compiler.is_compiling()
