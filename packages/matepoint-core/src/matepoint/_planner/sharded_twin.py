"""FSDP2 models planned per rank: the plain meta twin of a sharded model, and what a rank holds.

FSDP2 (``fully_shard``) turns every parameter of a group into a ``DTensor`` shard and gives each
module it wraps a class made at run time (``FSDPLinear``) whose deep copy raises. The budget
mode plans such a model from a twin made of the original classes, without FSDP's state and
hooks, then corrects the planned figures from the whole model's to one rank's (Note [A sharded
model's twin]).

Note [A sharded model's twin]
    Rule 1. Each module of a sharded model is twinned as its original class, with none of
        FSDP's state (the ``fully_shard`` state, its process group and mesh) and none of the
        hooks FSDP registered; each ``DTensor`` parameter (and gradient) becomes a meta
        parameter of its whole shape (``DTensor.shape``) and its dtype. The twin's step is the
        unsharded model's step: the same checkpoint calls, the whole parameters in every op.
    Rule 2. The planner counts that model's parameters, and the gradients they hold before the
        step, whole, and the gradients backward makes whole as they are made. One rank holds
        its shards of them (their padded local storage), and, beyond what the planner counts:
        the gathered parameters of every group that keeps them after forward (the outermost
        group, FSDP2's root, always; another where ``reshard_after_forward`` is not True);
        twice the largest group's gathered parameters (the group computing and the next one
        gathered, or its gather buffer); and twice the largest group's gradients again (the
        reduce-scatter's input and the new shard, while the group's whole gradients, which the
        planner counts, are alive).
    Rule 3. The correction is what the planner counts for the sharded parameters and their
        gradients less the shards and rule 2's extra bytes; it may be negative (one rank, or
        few groups). The search plans the twin under the budget plus the correction, and the
        plan returned gives its peak and its smallest budget less it: ``budget_bytes``,
        ``peak_bytes`` and ``smallest_budget_bytes`` are one rank's, and the decisions are
        those of a budget of one rank. ``strategy_plan`` stays the twin's step, whole.
    Rule 4. So a planned peak is at least what a rank holds: every moment's whole parameters
        and gradients cover their shards, and rule 2 adds every buffer FSDP2 holds beside them
        at most. It over-counts: the largest group stands for every group, and the twin
        computes in the parameters' dtype where a ``MixedPrecisionPolicy`` computes in a
        narrower one. A ``param_dtype`` or ``reduce_dtype`` wider than the parameters' is not
        planned: its gathers or gradient buffers are counted in the parameters' dtype.
    Rule 5. A rank's optimizer states are those of its shards: they are counted from the
        local tensors of every ``DTensor`` parameter and state.
    Example: four equal blocks of ``B`` bytes on two ranks, no gradients before the step:
    the planner counts ``4B`` of parameters, a rank holds ``2B`` of shards and at most ``4B``
    beside them, so the correction is ``-2B``: the plan's peak is the twin's plus ``2B``.
    With one rank the correction is ``-4B``; with sixteen blocks on eight ranks ``+10B``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

import matepoint_compat as compat
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up

__all__ = ["is_shard", "is_sharded", "per_rank", "plain_twin", "rank_correction", "rank_view"]

_Optimizer = TypeVar("_Optimizer", bound=torch.optim.Optimizer)


def is_shard(tensor: Tensor) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (FSDP2's parameters and gradients are)."""
    dtensor = compat.dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


def is_sharded(model: nn.Module) -> bool:
    """Whether any module of ``model`` is wrapped by FSDP2's ``fully_shard``."""
    fsdp = compat.fsdp_classes()
    return fsdp is not None and any(isinstance(module, fsdp[0]) for module in model.modules())


def _original_class(module: nn.Module) -> type[nn.Module]:
    """The class FSDP2 wrapped (``Linear`` of ``FSDPLinear``), or the module's own class."""
    fsdp = compat.fsdp_classes()
    cls = type(module)
    if fsdp is None or not isinstance(module, fsdp[0]):
        return cls
    return next(base for base in cls.__mro__[1:] if not issubclass(base, fsdp[0]))


def _hook_function(hook: Any) -> Any:
    """The function under a hook's wrappers (a bound method, a partial, torch's wrapped hook)."""
    while True:
        if isinstance(hook, functools.partial):
            hook = hook.func
        elif hasattr(hook, "__func__"):
            hook = hook.__func__
        elif type(hook).__name__ == "_WrappedHook" and hasattr(hook, "hook"):
            hook = hook.hook
        else:
            return hook


def _fsdp_entry(attribute: str, key: Any, value: Any) -> bool:
    """Whether a dict entry of a module is FSDP2's: a hook it registered (an id, in every
    dict of hooks), or its state or registry entry (by API, in a composable API's dict)."""
    if attribute.startswith(compat.COMPOSABLE_STATE_PREFIX):
        return bool(getattr(key, "__name__", key) == "fully_shard")
    if not isinstance(key, int):
        return False
    module = str(getattr(_hook_function(value), "__module__", ""))
    return module.startswith(compat.FSDP_HOOK_MODULES)


def _without_fsdp(state: dict[str, Any]) -> dict[str, Any]:
    """A module's attributes less FSDP2's state, flags and hooks (Note [A sharded model's
    twin], rule 1); the dicts that held them are new, the rest is the module's own."""
    kept = {name: value for name, value in state.items() if name not in compat.FSDP_MODULE_FLAGS}
    hooks = {
        key
        for name, value in kept.items()
        if isinstance(value, dict)
        for key, item in value.items()
        if isinstance(key, int) and _fsdp_entry(name, key, item)
    }
    for name in [name for name, value in kept.items() if isinstance(value, dict)]:
        value = kept[name]
        entries = [
            key for key, item in value.items() if key in hooks or _fsdp_entry(name, key, item)
        ]
        if not entries:
            continue
        kept[name] = copy.copy(value)
        for key in entries:
            del kept[name][key]
        if not kept[name] and name.startswith(compat.COMPOSABLE_STATE_PREFIX):
            del kept[name]
    return kept


def plain_twin(model: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """The twin of a sharded model: its original classes without FSDP2 (Note [A sharded
    model's twin], rule 1), built through ``memo``, which holds the parameters' twins."""
    shells: list[tuple[nn.Module, nn.Module]] = []
    for module in model.modules():
        if id(module) not in memo:
            shell = object.__new__(_original_class(module))
            memo[id(module)] = shell
            shells.append((module, shell))
    for module, shell in shells:
        shell.__dict__.update(copy.deepcopy(_without_fsdp(vars(module)), memo))
    twin: nn.Module = memo[id(model)]
    return twin


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a ``DTensor``, sharing its storage; reads no value."""
    with torch.no_grad():
        local: Tensor = tensor.to_local()  # type: ignore[attr-defined]
    return local


def _gathered_bytes(parameter: Tensor) -> int:
    """A shard's bytes once gathered: its padded shard times the ranks it is split over."""
    placements = parameter.placements  # type: ignore[attr-defined]
    mesh = parameter.device_mesh  # type: ignore[attr-defined]
    ranks = math.prod(mesh.size(dim) for dim, place in enumerate(placements) if place.is_shard())
    shard = _local(parameter).untyped_storage().nbytes()
    whole = parameter.numel() * parameter.element_size()
    return round_up(max(whole, shard * ranks), ALLOCATION_GRANULARITY)


@dataclasses.dataclass
class _Group:
    """One ``fully_shard`` group: its gathered bytes, and whether forward keeps them."""

    gathered_bytes: int = 0
    kept: bool = False


def _groups(model: nn.Module) -> list[_Group]:
    """Every ``fully_shard`` group's gathered bytes, each parameter in the group of its
    innermost wrapped module; the outermost groups (FSDP2's roots) kept after forward."""
    fsdp = compat.fsdp_classes()
    if fsdp is None:
        return []
    module_class, fully_shard = fsdp
    groups: dict[int, _Group] = defaultdict(_Group)
    seen: set[int] = set()

    def visit(module: nn.Module, owner: Any) -> None:
        if isinstance(module, module_class):
            state = fully_shard.state(module)
            groups[id(state)].kept |= owner is None or compat.keeps_gathered_after_forward(state)
            owner = state
        for parameter in module.parameters(recurse=False):
            if owner is not None and is_shard(parameter) and id(parameter) not in seen:
                seen.add(id(parameter))
                groups[id(owner)].gathered_bytes += _gathered_bytes(parameter)
        for child in module.children():
            visit(child, owner)

    visit(model, None)
    return list(groups.values())


def _unique_parameters(model: nn.Module) -> Iterator[Tensor]:
    seen: set[int] = set()
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            yield parameter


def rank_correction(model: nn.Module) -> int:
    """Bytes the twin's planned step counts beyond what one rank of ``model`` holds at most
    (Note [A sharded model's twin], rules 2 and 3); 0 for a model without shards, negative
    where a rank holds more than the twin."""
    counted = 0
    shards: dict[int, int] = {}  # per storage: FSDP2's gradient shards share one per group
    for parameter in _unique_parameters(model):
        for tensor in (parameter, parameter.grad):
            if tensor is not None and is_shard(tensor):
                counted += round_up(tensor.numel() * tensor.element_size(), ALLOCATION_GRANULARITY)
                storage = _local(tensor).untyped_storage()
                shards[storage._cdata] = round_up(storage.nbytes(), ALLOCATION_GRANULARITY)
    groups = _groups(model)
    largest = max((group.gathered_bytes for group in groups), default=0)
    beside = sum(group.gathered_bytes for group in groups if group.kept) + 4 * largest
    return counted - sum(shards.values()) - beside


def per_rank(plan: BudgetPlan, correction: int) -> BudgetPlan:
    """``plan``, planned under the budget plus ``correction``, with its budget, peak and
    smallest budget one rank's (Note [A sharded model's twin], rule 3)."""
    if not correction:
        return plan
    return dataclasses.replace(
        plan,
        budget_bytes=plan.budget_bytes - correction,
        peak_bytes=plan.peak_bytes - correction,
        smallest_budget_bytes=plan.smallest_budget_bytes - correction,
    )


def rank_view(optimizer: _Optimizer) -> _Optimizer:
    """The optimizer as one rank holds it: each ``DTensor`` parameter and state its local
    shard (Note [A sharded model's twin], rule 5); it only reads, and is never stepped."""
    locals_by_id: dict[int, Tensor] = {}

    def local(value: Any) -> Any:
        if not (isinstance(value, Tensor) and is_shard(value)):
            return value
        if id(value) not in locals_by_id:
            # A new tensor over the shard's storage: the live one's flags stay as they are.
            shard = _local(value).detach().requires_grad_(value.requires_grad)
            locals_by_id[id(value)] = shard
        return locals_by_id[id(value)]

    view: _Optimizer = object.__new__(type(optimizer))
    view.param_groups = [
        {**group, "params": [local(parameter) for parameter in group["params"]]}
        for group in optimizer.param_groups
    ]
    states: defaultdict[Tensor, Any] = defaultdict(dict)
    for parameter, state in optimizer.state.items():
        states[local(parameter)] = {name: local(value) for name, value in state.items()}
    view.state = states
    return view
