"""FSDP2 and DTensor as the installed torch spells them, for planning a sharded model.

The planner's twin of an FSDP2 model (``matepoint._planner.sharded_twin``) needs FSDP2's classes,
``DTensor``, the names of the state and hooks ``fully_shard`` adds to a module, and one reading of
FSDP2's private state (whether a group stays gathered after forward). All of it is here, with
the release each spelling can go from.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "COMPOSABLE_STATE_PREFIX",
    "FSDP_HOOK_MODULES",
    "FSDP_MODULE_FLAGS",
    "dtensor_class",
    "fsdp_classes",
    "keeps_gathered_after_forward",
]

# Module attributes FSDP2 sets that the twin leaves out (the flags it sets for Dynamo).
FSDP_MODULE_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params")
# The prefix of the attribute names where torch's composable APIs (fully_shard) keep their state.
COMPOSABLE_STATE_PREFIX = "__composable_api_state_key"
# Where FSDP2's hooks are defined, from torch 2.6 and before.
FSDP_HOOK_MODULES = ("torch.distributed.fsdp", "torch.distributed._composable.fsdp")


@functools.cache
def dtensor_class() -> type[Tensor] | None:
    """``DTensor``, or None where this torch has no ``torch.distributed``."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5; delete with support for torch 2.4
        try:
            from torch.distributed._tensor import (  # type: ignore[attr-defined,unused-ignore]
                DTensor,
            )
        except ImportError:
            return None
    return DTensor


@functools.cache
def fsdp_classes() -> tuple[type[Any], Any] | None:
    """FSDP2's module class and ``fully_shard``, or None where this torch has neither."""
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # torch < 2.6; delete with support for torch 2.5
        try:
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined,unused-ignore]
                FSDPModule,
                fully_shard,
            )
        except ImportError:
            return None
    return FSDPModule, fully_shard


def keeps_gathered_after_forward(state: Any) -> bool:
    """Whether a ``fully_shard`` state keeps its group gathered after forward; True where
    this torch's state cannot say, which counts more (Note [A sharded model's twin], rule 4,
    in ``matepoint._planner.sharded_twin``).

    FSDP2 has no public reading of ``reshard_after_forward`` (on 2.4 to 2.15): its parameter
    groups' private meshes, read with defaults, tell it; the reading can go when torch offers
    a public one. Its parameter groups' meshes
    tell it (no mesh after forward: kept; another mesh: kept in part).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.6 kept one group
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    marker = object()
    return not all(
        getattr(group, "post_forward_mesh_info", marker) == getattr(group, "mesh_info", None)
        for group in groups
    )
