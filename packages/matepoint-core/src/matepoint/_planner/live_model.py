"""The budget mode in one call: plan the fastest step that fits, from the live model.

:func:`plan_budget` takes the model a user trains, one example batch and the optimizer, and
plans on the meta device: a meta twin of the model (Note [The meta twin]), the budget less the
optimizer's states (``matepoint._planner.optimizer_states``), the ranks that share the node's
host RAM, then ``matepoint.plan`` and the budget search on the twin.

Note [The meta twin]
    Rule 1. The twin is a deep copy of the model whose parameters, gradients and buffers (and
        tensors a module holds as plain attributes) are made on the meta device from their
        shapes alone, before the copy: the copy finds them made and never reads or copies the
        live tensors, so planning allocates no device memory and changes nothing of the model.
    Rule 2. The twin has the model's structure, hooks and checkpoint calls, so its planned
        step makes the live step's checkpoint calls, in the same order (the plan's regions,
        Note [A plan's regions] in ``matepoint._planner.policy``). It is put in training mode:
        a training step is what is planned.
    Rule 3. A model wrapped by FSDP2's ``fully_shard`` is twinned as the model it wraps, its
        ``DTensor`` shards as whole meta parameters, and planned per rank (Note [A sharded
        model's twin] in ``matepoint._planner.sharded_twin``). Any other tensor subclass has no
        meta twin made from its shape alone: planning refuses it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

import matepoint_compat as compat
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.memory_plan import plan
from matepoint._planner.optimizer_states import optimizer_state_bytes, optimizer_step_bytes
from matepoint._planner.policy import AVAILABLE
from matepoint._planner.sharded_twin import (
    is_shard,
    is_sharded,
    per_rank,
    plain_twin,
    rank_correction,
    rank_view,
)
from matepoint._planner.step import _loss_of
from matepoint._planner.time_model import DeviceModel
from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up

__all__ = [
    "AUTO_MARGIN",
    "budget_bytes_of",
    "meta_twin",
    "plan_budget",
    "plan_prepared",
    "rank_optimizer",
    "ranks_per_node",
    "size_in_bytes",
    "with_optimizer_step",
]

# The share of what a CUDA device can give the process that budget="auto" leaves out. A plan
# bounds allocated memory; the default caching allocator also reserves what its fixed segments
# leave unused (fragmentation), which only reserved memory shows: a plan planned within 5% of a
# 24 GiB cap ran out of memory under the default allocator in every step (docs/budget.md). A
# tenth of the device leaves that room, and the optimizer step's own temporaries some too.
AUTO_MARGIN = 0.10

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"\s*([-+]?[0-9.]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)
_FORMAT = 'bytes (an int), a string such as "40GiB" or "12.5GB", or "auto"'


def size_in_bytes(text: str, bare_unit: int = 1) -> float:
    """``text`` ("40GiB", "12.5GB", "8e9") as bytes, unchecked; NaN where it is no size.

    A number without a unit counts ``bare_unit`` bytes. The value may be negative, zero or
    infinite: callers say which sizes they take (the budget here, the planning command's flags).
    """
    match = _SIZE.fullmatch(text)
    unit = (_UNITS.get(match[2].lower()) if match[2] else bare_unit) if match else None
    try:
        return float(match[1]) * unit if match and unit else math.nan
    except ValueError:  # "1.2.3"
        return math.nan


def budget_bytes_of(budget: object, device: torch.device) -> int:
    """``budget`` as whole bytes: a number of bytes, a string with a unit, or ``"auto"``.

    ``"auto"`` is what the CUDA ``device`` can give this process (its free memory and what
    the process already holds there, at most the cap ``torch.cuda.set_per_process_memory_fraction``
    set) less :data:`AUTO_MARGIN` of it.

    Raises:
        TypeError: For a budget that is neither a number nor a string.
        ValueError: For a zero, negative, infinite or malformed budget; for ``"auto"`` off CUDA.
    """
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        return _auto_bytes(device)
    if isinstance(budget, str):
        value = size_in_bytes(budget)
        if math.isnan(value):
            raise ValueError(f"budget {budget!r} is malformed; give {_FORMAT}")
    elif isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(f"budget takes {_FORMAT}, got {type(budget).__name__}")
    else:
        value = float(budget)
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"budget must be a positive, finite size: {budget!r}; give {_FORMAT}")
    return int(value)


def _auto_bytes(device: torch.device) -> int:
    """What a CUDA device can give this process, less the allocator's margin (AUTO_MARGIN)."""
    if device.type != "cuda":
        raise ValueError(
            f'budget="auto" reads a CUDA device\'s free memory, but the model is on '
            f'{device.type}; give the budget as bytes or a string such as "40GiB"'
        )
    free, _total = torch.cuda.mem_get_info(device)
    # What the process's caching allocator holds counts as used in mem_get_info, but the
    # planned step (parameters and gradients included) may use it.
    available = free + torch.cuda.memory_reserved(device)
    # A cap set with torch.cuda.set_per_process_memory_fraction bounds what the allocator may
    # hold, free memory beside it or not.
    cap = compat.per_process_memory_cap(device)
    if cap is not None:
        available = min(available, cap)
    return int(available * (1 - AUTO_MARGIN))


def ranks_per_node() -> int:
    """Processes per node: ``LOCAL_WORLD_SIZE`` (set by torchrun), else the world size, where
    ``torch.distributed`` is initialised; 1 where it is not."""
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) > 0 else distributed.get_world_size()


def _meta_like(tensor: Tensor) -> Tensor:
    """A meta tensor of ``tensor``'s shape, strides and dtype; the live one is not read."""
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="meta")


def _refuse_subclass(name: str, tensor: Tensor) -> None:
    """See Note [The meta twin], rule 3."""
    if type(tensor) not in (Tensor, nn.Parameter) and not is_shard(tensor):
        raise TypeError(
            f"cannot plan {name}: it is a {type(tensor).__name__}, neither a plain tensor nor "
            "a DTensor (FSDP2's fully_shard makes those, and they are planned per rank); plan "
            "the model without it, with the same blocks wrapped"
        )


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device that never touches its tensors (Note [The meta
    twin]); the model is left as it is."""
    memo: dict[int, Any] = {}
    for name, parameter in model.named_parameters():
        _refuse_subclass(f"parameter {name}", parameter)
        twin = nn.Parameter(_meta_like(parameter), requires_grad=parameter.requires_grad)
        if parameter.grad is not None:
            twin.grad = _meta_like(parameter.grad)
        memo[id(parameter)] = twin
    for name, buffer in model.named_buffers():
        _refuse_subclass(f"buffer {name}", buffer)
        memo[id(buffer)] = _meta_like(buffer)
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, Tensor) and id(value) not in memo:
                memo[id(value)] = _meta_like(value)
    if is_sharded(model):
        return plain_twin(model, memo)  # See Note [The meta twin], rule 3.
    return copy.deepcopy(model, memo)


def _meta_batch(batch: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The batch on the meta device, as positional and keyword arguments of the model."""
    leaves, spec = compat.tree_flatten(batch)
    # One tensor given twice (a transformers batch's input_ids as its labels) is one tensor on
    # the meta device too: the step holds it once.
    twins: dict[int, Tensor] = {}
    meta = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if id(leaf) not in twins:
                twins[id(leaf)] = _meta_like(leaf).requires_grad_(leaf.requires_grad)
            leaf = twins[id(leaf)]
        meta.append(leaf)
    batch = compat.tree_unflatten(meta, spec)
    if isinstance(batch, Tensor):
        return (batch,), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    raise TypeError(
        "example_batch takes a tensor, a tuple of the model's positional arguments or a dict "
        f"of its keyword arguments, got {type(batch).__name__}"
    )


def _device_of(model: nn.Module, batch: Any) -> torch.device:
    """Where the model trains: its first parameter's device, else the batch's first tensor's."""
    for tensor in [*model.parameters(), *compat.tree_flatten(batch)[0]]:
        if isinstance(tensor, Tensor):
            return tensor.device
    return torch.device("cpu")


def _loss_or_sum(output: Any) -> Tensor:
    """The output's ``loss`` (a transformers model's, given labels), else the planner's."""
    loss = getattr(output, "loss", None)
    return loss if isinstance(loss, Tensor) else _loss_of(output, None)


def plan_budget(
    model: nn.Module,
    example_batch: Any,
    *,
    optimizer: torch.optim.Optimizer | None,
    budget: int | float | str = "auto",
    loss_fn: Callable[[Any], Tensor] | None = None,
    host_budget_bytes: int | None = None,
    device: DeviceModel | None = None,
) -> BudgetPlan:
    """Plan the fastest training step of ``model`` that fits a device-memory budget.

    One call on what a user has: the live model (its checkpoint calls already in place, its
    own ``matepoint.checkpoint`` calls or an integration's wrappers), one example batch and the
    optimizer. It plans on the meta device from a meta twin of the model (Note [The meta twin]
    in ``matepoint._planner.live_model``), so it allocates no device memory and changes
    nothing of the model; it subtracts the optimizer's states from the budget, takes the ranks
    per node from ``torch.distributed``, and runs :meth:`matepoint.MemoryPlan.fastest_under`;
    a plan fits only where the optimizer step (its states, the parameters, the gradients and
    its temporaries: ``BudgetPlan.optimizer_step_bytes``) fits too.
    A model wrapped by FSDP2 (``fully_shard``) is planned per rank: its twin is the unsharded
    model, and the planned figures are corrected to one rank's shards and what FSDP2 gathers
    beside them, counted at most, so that the plan never holds less than a rank does (Note [A
    sharded model's twin] in ``matepoint._planner.sharded_twin``).

    Apply it with ``matepoint.integrations.matepoint_checkpoint_fn(plan, region=i)`` as block
    ``i``'s checkpoint function (settings, policy, and the block called as it is where
    ``plan.checkpoints_region(i)`` is False), or let the integrations plan it (``budget=``).

    Args:
        model: The model as it trains; its parameters may be on any device, and its blocks
            may be wrapped by FSDP2's ``fully_shard``.
        example_batch: One batch: a tensor, a tuple of the model's positional arguments or a
            dict of its keyword arguments (``{"input_ids": ids, "labels": ids}``). Only its
            shapes and dtypes are read.
        optimizer: The optimizer whose states share the device: counted from the states it
            holds, or by its class before its first step
            (``matepoint._planner.optimizer_states``); None counts none.
        budget: Device memory the whole step may use, the optimizer's states included: bytes,
            a string such as ``"40GiB"`` or ``"12.5GB"``, or ``"auto"``, what the model's
            CUDA device can give this process (within its per-process memory fraction) less
            :data:`AUTO_MARGIN` of it for the caching allocator's fragmentation.
            Default: ``"auto"``.
        loss_fn: Turns the model's output into the loss. Default: the output's ``loss`` where
            it has one (a transformers model given labels), else the output if a scalar, else
            the sum of its elements.
        host_budget_bytes: Pinned host RAM a node may use, or None for no limit.
            Default: ``None``.
        device: The time model's rates (:func:`matepoint.calibrate`). Default: an H200's.

    Returns:
        The plan; its ``budget_bytes`` is the budget less the optimizer's states. For an FSDP2
        model its ``budget_bytes``, ``peak_bytes`` and ``smallest_budget_bytes`` are one
        rank's (its shards, their optimizer states, and FSDP2's gathered parameters and
        gradient buffers at most), and its ``strategy_plan`` is the unsharded twin's step.

    Raises:
        RuntimeError: Before torch 2.5, which has no selective checkpointing.
        TypeError: For a budget or batch of the wrong type; for a parameter of a tensor
            subclass other than FSDP2's ``DTensor``; for an optimizer whose states cannot be
            counted before its first step.
        ValueError: For a zero, negative or malformed budget, ``"auto"`` off CUDA,
            optimizer states (with FSDP2's buffers) that take the whole budget, or a model
            whose step makes no ``matepoint.checkpoint`` call.

    Example:
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        >>> plan = matepoint.plan_budget(  # doctest: +SKIP
        ...     model, torch.randn(8, 64), optimizer=torch.optim.AdamW(model.parameters()),
        ...     budget="40GiB")
    """
    return plan_prepared(
        model,
        example_batch,
        optimizer=optimizer,
        budget=budget,
        loss_fn=loss_fn,
        host_budget_bytes=host_budget_bytes,
        device=device,
    )


def plan_prepared(
    model: nn.Module,
    example_batch: Any,
    *,
    optimizer: torch.optim.Optimizer | None,
    budget: int | float | str,
    loss_fn: Callable[[Any], Tensor] | None,
    host_budget_bytes: int | None,
    device: DeviceModel | None,
    prepare: Callable[[nn.Module], nn.Module | None] | None = None,
) -> BudgetPlan:
    """:func:`plan_budget`, with ``prepare`` applied to the twin before planning (an
    integration wraps its blocks there); it returns the module to plan, or None for the twin."""
    if not AVAILABLE:
        raise RuntimeError(
            "budget plans need torch 2.5 or later (torch's selective checkpointing); "
            f"this is torch {torch.__version__}"
        )
    total = budget_bytes_of(budget, _device_of(model, example_batch))
    sharded = any(is_shard(parameter) for parameter in model.parameters())
    counted = rank_optimizer(model, optimizer)
    states = 0 if counted is None else optimizer_state_bytes(counted)
    if states >= total:
        raise ValueError(
            f"the optimizer's states take {states} bytes, the whole budget of {total}: "
            "nothing is left for the step"
        )
    # See Note [A sharded model's twin], rule 3: 0 for a model without DTensor parameters.
    correction = rank_correction(model) if sharded else 0
    if total - states + correction < 1:
        raise ValueError(
            f"the optimizer's states ({states} bytes) and what FSDP2 gathers beside one rank's "
            f"shards ({-correction} bytes at most) take the whole budget of {total}: nothing "
            "is left for the step"
        )
    # A training step is planned, also where the caller is in inference mode (an evaluation
    # forward whose guard plans again): tensors made there could not be saved for backward.
    with torch.inference_mode(False):
        args, kwargs = _meta_batch(example_batch)
        twin = meta_twin(model).train()
        if prepare is not None:
            twin = prepare(twin) or twin
        memory_plan = plan(
            twin, *args, loss_fn=loss_fn or _loss_or_sum, strategies=("matepoint", "none"), **kwargs
        )
        if not memory_plan.saves:
            raise ValueError(
                f"{type(model).__name__}'s step makes no matepoint.checkpoint call, so a plan "
                "has nothing to decide: checkpoint its blocks first (matepoint.checkpoint in "
                "its forward, or matepoint.integrations), or pass budget= to an integration"
            )
        chosen = memory_plan.fastest_under(
            total - states + correction,
            host_budget_bytes=host_budget_bytes,
            ranks_per_node=ranks_per_node(),
            device=device,
        )
    return with_optimizer_step(per_rank(chosen, correction), model, counted)


def rank_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> torch.optim.Optimizer | None:
    """``optimizer`` as one rank holds it: over the local shards of an FSDP2 model (Note [A
    sharded model's twin] in ``matepoint._planner.sharded_twin``), else as it is."""
    if optimizer is None or not any(is_shard(parameter) for parameter in model.parameters()):
        return optimizer
    return rank_view(optimizer)


def _held_bytes(tensor: Tensor) -> int:
    """One rank's bytes of ``tensor`` (a DTensor's local shard), as the allocator rounds them."""
    local = tensor.to_local() if is_shard(tensor) else tensor  # type: ignore[attr-defined]
    return round_up(local.numel() * local.element_size(), ALLOCATION_GRANULARITY)


def with_optimizer_step(
    budget_plan: BudgetPlan, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> BudgetPlan:
    """``budget_plan`` with the optimizer step counted: it fits only where that step does.

    The optimizer step holds, beside its states, every parameter, the gradients of those that
    train and its own temporaries (:func:`optimizer_step_bytes`), whatever forward and backward
    did: a budget below that runs out of memory in ``optimizer.step()``, so no plan fits it.
    """
    if optimizer is None:
        return budget_plan
    parameters = list(model.parameters())
    held = sum(_held_bytes(parameter) for parameter in parameters) + sum(
        _held_bytes(parameter) for parameter in parameters if parameter.requires_grad
    )
    step_bytes = held + optimizer_step_bytes(optimizer)
    if step_bytes <= budget_plan.budget_bytes:
        return dataclasses.replace(budget_plan, optimizer_step_bytes=step_bytes)
    return dataclasses.replace(
        budget_plan,
        optimizer_step_bytes=step_bytes,
        fits=False,
        smallest_budget_bytes=max(budget_plan.smallest_budget_bytes, step_bytes),
        batch_fraction=0.0,
    )
