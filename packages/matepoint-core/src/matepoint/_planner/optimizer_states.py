"""The device bytes an optimizer's states take: counted from its class, or from its states.

A training step holds the optimizer's states on the device from the first step on, through
forward and backward, beside everything the planner sees. A budget for the planned step is the
device's budget less these bytes.

Note [Counting optimizer states]
    Rule 1. Before its first step an optimizer has no states (Adagrad aside: Rule 3); they are
    counted from its class and each parameter group's settings:
    Adam and AdamW keep two tensors per parameter (three with ``amsgrad``), SGD one with
    momentum and none without, and so on (``_STATES``). Each is shaped and typed like its
    parameter, so it is ``numel * element_size`` bytes, also for a parameter on the meta device.
    A subclass counts as its nearest counted base; any other class is refused, by name, until
    its states exist.
    Rule 2. A parameter whose states exist is counted from them: every tensor in
    ``optimizer.state[p]`` on the parameter's device. A parameter frozen after its states were
    made still holds them, so it counts too.
    Rule 3. Only parameters that require a gradient get states; the others count nothing
    (Rule 2 aside). Adagrad makes its states in its constructor, for every parameter it is
    given, frozen or not: counted by name, all its parameters count.
    Rule 4. Each state tensor is an allocation of its own, rounded up as the CUDA caching
    allocator rounds it (``ALLOCATION_GRANULARITY``).
    Rule 5. Scalars (the ``step`` counters, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``)
    count where they exist on the device (Rule 2) and are left out of an estimate: torch keeps
    most of them on the host unless ``capturable`` or ``fused`` is set, where each is one
    rounded block (512 bytes per parameter tensor), and where it keeps them has changed
    between releases. ``foreach`` and ``fused`` change no state's size.
    Example: AdamW on a bf16 4096x4096 weight and a 4096 bias, before its first step:
    2 * (32 MiB + 8 KiB) = 64.02 MiB; after it, on a GPU, the same (the steps are on the host).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up, tensors_in

__all__ = ["OPTIMIZER_NAMES", "optimizer_class", "optimizer_state_bytes"]

# One parameter's state tensors, as element counts, given the parameter and its group's settings.
StateRule = Callable[[Tensor, Mapping[str, Any]], tuple[int, ...]]


def _like(count: int) -> StateRule:
    return lambda parameter, _group: (parameter.numel(),) * count


def _sgd(parameter: Tensor, group: Mapping[str, Any]) -> tuple[int, ...]:
    return (parameter.numel(),) if group.get("momentum", 0) != 0 else ()


def _adam(parameter: Tensor, group: Mapping[str, Any]) -> tuple[int, ...]:
    return (parameter.numel(),) * (3 if group.get("amsgrad", False) else 2)


def _rmsprop(parameter: Tensor, group: Mapping[str, Any]) -> tuple[int, ...]:
    count = 1 + int(group.get("momentum", 0) > 0) + int(bool(group.get("centered", False)))
    return (parameter.numel(),) * count


def _adafactor(parameter: Tensor, _group: Mapping[str, Any]) -> tuple[int, ...]:
    # A matrix keeps its variance factored: a row and a column, each with the other dim at 1.
    if parameter.dim() <= 1:
        return (parameter.numel(),)
    shape = parameter.shape
    rest = math.prod(shape[:-2])
    return (rest * shape[-2], rest * shape[-1])


# The optimizers counted before their first step, by class name in torch.optim (some classes
# are missing from older torch: Adafactor before 2.5, Muon before 2.9).
_RULES_BY_NAME: dict[str, StateRule] = {
    "Adam": _adam,
    "AdamW": _adam,
    "SGD": _sgd,
    "RMSprop": _rmsprop,
    "Adagrad": _like(1),
    "Adamax": _like(2),
    "NAdam": _like(2),
    "RAdam": _like(2),
    "Adadelta": _like(2),
    "ASGD": _like(1),
    "Rprop": _like(2),
    "Adafactor": _adafactor,
    "Muon": _like(1),
}
_STATES: dict[type[torch.optim.Optimizer], StateRule] = {
    getattr(torch.optim, name): rule
    for name, rule in _RULES_BY_NAME.items()
    if hasattr(torch.optim, name)
}
# Classes that make their states in the constructor, for every parameter (Rule 3).
_MADE_AT_CONSTRUCTION = frozenset(cls for cls in _STATES if cls.__name__ == "Adagrad")
# Names for optimizer_state_bytes(name, parameters): the class names, lower case, and "none".
OPTIMIZER_NAMES: tuple[str, ...] = (*(cls.__name__.lower() for cls in _STATES), "none")


def optimizer_class(name: str) -> type[torch.optim.Optimizer] | None:
    """The ``torch.optim`` class a name stands for (``"adamw"``: AdamW), None for ``"none"``.

    Raises:
        ValueError: For a name not in :data:`OPTIMIZER_NAMES`.
    """
    key = name.strip().lower()
    if key == "none":
        return None
    for cls in _STATES:
        if cls.__name__.lower() == key:
            return cls
    raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZER_NAMES)}")


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer | str,
    parameters: Iterable[Tensor] | Iterable[dict[str, Any]] | None = None,
    **settings: Any,
) -> int:
    """Device bytes an optimizer's states take, from its class or from its states.

    Counts per parameter: from its states where they exist, else from the optimizer's class and
    the parameter group's settings (see Note [Counting optimizer states]). Nothing is allocated,
    so the parameters may be on the meta device. The count is what the states hold between
    steps; the optimizer step's own temporaries (a ``foreach`` AdamW step makes one more tensor
    per parameter while it runs) are not states and are not counted.

    Args:
        optimizer: An optimizer instance, or the lower-case name of a ``torch.optim`` class
            (``"adamw"``, ``"adam"``, ``"sgd"``, ``"rmsprop"``, ...; :data:`OPTIMIZER_NAMES`),
            or ``"none"`` (0 bytes).
        parameters: With a name, what the optimizer would be given: tensors, or parameter
            groups (dicts with ``"params"`` and settings of their own), as ``torch.optim``
            takes them. Not with an instance, which has its own.
        **settings: With a name, the optimizer's settings that change its states
            (``amsgrad=True``, ``momentum=0.9``, ``centered=True``); any argument of the
            class's constructor is accepted, the rest are its defaults.

    Returns:
        The bytes, each state tensor rounded up to the CUDA caching allocator's 512 bytes.

    Raises:
        TypeError: For an optimizer whose class it cannot count (naming the class) and that
            has parameters without states yet; for ``parameters`` or ``settings`` given with
            an instance, or a setting the class does not take; for ``parameters`` missing
            with a name, or given as a single tensor.
        ValueError: For an unknown name.

    Example::

        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(4096, 4096, dtype=torch.bfloat16)
        >>> optimizer_state_bytes("adamw", model.parameters()) / 2**20
        64.015625
    """
    if isinstance(optimizer, str):
        cls = optimizer_class(optimizer)
        if parameters is None:
            raise TypeError(f"optimizer_state_bytes({optimizer!r}) needs the parameters")
        groups = _groups(parameters)
        if cls is None:
            return 0
        defaults = _defaults(cls, settings)
        every = cls in _MADE_AT_CONSTRUCTION
        return sum(
            _estimate(cls, parameter, {**defaults, **group})
            for group in groups
            for parameter in group["params"]
            if parameter.requires_grad or every
        )
    if parameters is not None or settings:
        raise TypeError(
            "an optimizer instance counts its own parameters and settings: pass neither"
        )
    total = 0
    seen: set[tuple[str, int]] = set()
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if state:
                total += _allocated(state, parameter.device, seen)
            elif parameter.requires_grad:
                total += _estimate(type(optimizer), parameter, group)
    return total


def _groups(parameters: Iterable[Tensor] | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """torch.optim's parameter groups from what its constructor takes; each tensor once."""
    if isinstance(parameters, Tensor):
        raise TypeError("parameters must be an iterable of tensors or dicts, not a tensor")
    items: list[Any] = list(parameters)
    groups = (
        [dict(item) for item in items]
        if items and isinstance(items[0], dict)
        else [{"params": items}]
    )
    seen: set[int] = set()
    for group in groups:
        params = group["params"]
        unique = []
        for parameter in [params] if isinstance(params, Tensor) else params:
            if id(parameter) not in seen:
                seen.add(id(parameter))
                unique.append(parameter)
        group["params"] = unique
    return groups


def _defaults(cls: type[torch.optim.Optimizer], settings: Mapping[str, Any]) -> dict[str, Any]:
    """The class's constructor defaults, overridden by ``settings``."""
    signature = inspect.signature(cls.__init__)
    unknown = sorted(set(settings) - set(signature.parameters) - {"self", "params"})
    if unknown:
        raise TypeError(f"{cls.__name__} takes no setting {', '.join(unknown)}")
    defaults = {
        name: parameter.default
        for name, parameter in signature.parameters.items()
        if parameter.default is not inspect.Parameter.empty
    }
    return {**defaults, **settings}


def _rule(cls: type[torch.optim.Optimizer]) -> StateRule:
    """The state rule of ``cls`` or of its nearest counted base class."""
    for base in cls.__mro__:
        if base in _STATES:
            return _STATES[base]
    counted = ", ".join(sorted(known.__name__ for known in _STATES))
    raise TypeError(
        f"cannot count the states of {cls.__module__}.{cls.__qualname__} before it makes them "
        f"(after its first step they are counted as they are); counted by class: {counted}"
    )


def _estimate(cls: type[torch.optim.Optimizer], parameter: Tensor, group: Mapping[str, Any]) -> int:
    """One parameter's state bytes before they exist (Rules 1, 4 and 5)."""
    itemsize = parameter.element_size()
    return sum(
        round_up(count * itemsize, ALLOCATION_GRANULARITY) for count in _rule(cls)(parameter, group)
    )


def _allocated(state: Mapping[str, Any], device: torch.device, seen: set[tuple[str, int]]) -> int:
    """One parameter's existing state bytes on ``device`` (Rules 2, 4 and 5).

    A storage is counted once, however many state tensors view it (``seen`` holds those
    counted); on the meta device, where storages have no address, once per tensor object.
    """
    total = 0
    for tensor in tensors_in(dict(state)):
        if tensor.device != device or tensor.layout != torch.strided:
            continue
        storage = tensor.untyped_storage()
        key = ("storage", storage.data_ptr()) if storage.data_ptr() else ("tensor", id(tensor))
        if key not in seen:
            seen.add(key)
            total += round_up(storage.nbytes(), ALLOCATION_GRANULARITY)
    return total
