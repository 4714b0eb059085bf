"""What matepoint's compiled path takes from torch.compile's internals, behind release gates.

matepoint's eager checkpoint works through ``saved_tensors_hooks``, which Dynamo cannot trace. A
whole-model compile instead gets torch's own checkpoint with its body annotated, and matepoint's
passes over the compiled graphs (``matepoint._compiled``, Note [The compiled path] there) have
torch's compiled activation offloading move the saved inputs. Those passes are matepoint's own;
what they read of torch's private surface is here:

- ``_torch_names``: every private torch name the passes use, behind its release gate, and the
  gates ``COMPILED_OFFLOAD`` (the whole path, torch 2.11+) and ``STREAM_COPIES_CACHEABLE``.
- :func:`compile_tracing`: whether the compiled path is to be taken now.

All of it is checked on torch 2.11, 2.12 and 2.13; on older releases matepoint keeps its eager
path under compile (a graph break per checkpoint).
"""

# No __all__ here: what the package offers matepoint_compat is _torch_names' __all__ (the star
# import re-exports exactly those) and compile_tracing; torch's module is imported under a
# private name so that it is not offered too.
# ruff: noqa: F403, F405
from torch import compiler as _torch_compiler

from matepoint_compat._compile._torch_names import *


def compile_tracing() -> bool:
    """Return whether Dynamo is tracing now and matepoint can take its compiled path.

    ``torch.compiler.is_compiling`` reads one flag (2.3+); Dynamo folds it to a constant, so the
    branch costs nothing in a compiled graph and one call in eager mode. The gate is read from
    this package, so switching ``matepoint_compat._compile.COMPILED_OFFLOAD`` off switches the
    path off.
    """
    return COMPILED_OFFLOAD and _torch_compiler.is_compiling()


def allow_recompiles(count: int) -> None:
    """Let Dynamo keep at least ``count`` compiled entries of one code object.

    Blocks compiled one by one that run the same code (a model's method with each block's
    position bound) take one entry each; past Dynamo's limit a ``fullgraph=True`` compile fails.
    The limit is ``torch._dynamo.config.recompile_limit`` from torch 2.7 and
    ``cache_size_limit`` before (the old name can go when 2.7 is the oldest supported torch);
    it is only ever raised.
    """
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    if getattr(dynamo_config, name) < count:
        setattr(dynamo_config, name, count)
