"""The device bytes an optimizer's states take, and what its step allocates while it runs.

A training step holds the optimizer's states on the device from the first step on, through
forward and backward, beside everything the planner sees. A budget for the planned step is the
device's budget less these bytes. The optimizer's step then needs, for a moment, its own
temporaries on top of the parameters, the gradients and the states: a step's peak is the larger
of the forward and backward peak plus the states, and parameters, gradients, states and those
temporaries together.

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

Note [The optimizer step's temporaries]
    Rule 1. Each parameter group runs one of three implementations, chosen as torch chooses:
    ``fused=True`` runs fused kernels; ``foreach=True`` runs the ``_foreach_*`` loop; with
    both unset, Adafactor and Muon aside, the ``foreach`` loop runs where every parameter is
    on a GPU-like device (CUDA, XPU, MTIA) and the group is not ``differentiable``; anything
    else runs the single-tensor loop, one parameter at a time. A parameter on the meta device
    counts as on a GPU: the planner's meta twin stands for a CUDA model. ``device_type``
    overrides the parameters' devices.
    Rule 2. A fused step makes no per-parameter temporaries: 0 bytes.
    Rule 3. The ``foreach`` loop works on one bucket at a time: a group's parameters of one
    device and dtype, in one list. Each out-of-place ``torch._foreach_*`` result is a tensor
    per parameter of the bucket, so a temporary is the bucket's size, shaped and typed like
    its parameters. A temporary lives until its Python name is deleted or bound to something
    else, so one bound late in a bucket is still alive while the next bucket makes its own.
    Adam and AdamW: the negated (``maximize``) or decayed (``weight_decay`` of Adam, not of
    AdamW) gradients, deleted before the square roots of the second moments are made; those
    are kept until the next bucket's replace them. SGD: one copy of the gradients with
    ``maximize`` or ``weight_decay`` (nesterov adds the momentum into it, or into the
    gradients themselves, in place), dropped when the next bucket starts. Where a group
    holds several buckets their order is taken as the one that costs most (sizes ascending,
    so the two largest are adjacent): exact for one or two buckets.
    Rule 4. The single-tensor loop makes the same temporaries one parameter at a time, in the
    group's order, with one more where an expression makes two: Adam's
    ``exp_avg_sq.sqrt() / bias_correction2_sqrt`` holds the root and the quotient together.
    Its names carry from one parameter to the next as in Rule 3: the last denominator (and
    the last copy of a gradient) stays alive while the next parameter makes its own.
    Rule 5. The other classes are not traced rule by rule; they get a bound, above what each
    makes with every setting their tests try (``maximize``, ``weight_decay``, momentum): three
    tensors per parameter of the group, all at once, for the ``foreach`` loop; four tensors
    the size of the group's largest parameter for the single-tensor loop. Muon (single-tensor
    only, its Newton-Schulz iterations in bf16): per matrix, one tensor in its dtype and six
    bf16 ones of its size.
    Rule 6. Groups step one after another, and a group's temporaries go when its call
    returns: the step's bytes are the largest group's. Only parameters that require a
    gradient count (a step skips those without one). Each tensor rounds up as the states do
    (Rule 4 of Note [Counting optimizer states]); scalars (the step counters, capturable's
    bias corrections) are left out, as there.
    Example: AdamW with ``foreach`` (the default on a GPU) on a bf16 4096x4096 weight and a
    4096 bias: one square root per parameter, 32 MiB + 8 KiB; with ``foreach=False`` the
    weight's root and quotient, 64 MiB; with ``fused=True``, 0.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up, tensors_in

__all__ = [
    "OPTIMIZER_NAMES",
    "optimizer_class",
    "optimizer_state_bytes",
    "optimizer_step_bytes",
]

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
    per parameter while it runs) are not states: :func:`optimizer_step_bytes` counts them.

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
        cls, groups = _named("optimizer_state_bytes", optimizer, parameters, settings)
        if cls is None:
            return 0
        every = cls in _MADE_AT_CONSTRUCTION
        return sum(
            _estimate(cls, parameter, group)
            for group in groups
            for parameter in group["params"]
            if parameter.requires_grad or every
        )
    _refuse_arguments(parameters, settings)
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


def _named(
    function: str,
    name: str,
    parameters: Iterable[Tensor] | Iterable[dict[str, Any]] | None,
    settings: Mapping[str, Any],
) -> tuple[type[torch.optim.Optimizer] | None, list[dict[str, Any]]]:
    """An optimizer given by its name: its class (None for ``"none"``) and the parameter groups
    it would make, each with the class's defaults and ``settings`` beneath its own."""
    cls = optimizer_class(name)
    if parameters is None:
        raise TypeError(f"{function}({name!r}) needs the parameters")
    groups = _groups(parameters)
    if cls is None:
        return None, groups
    defaults = _defaults(cls, settings)
    return cls, [{**defaults, **group} for group in groups]


def _refuse_arguments(parameters: object, settings: Mapping[str, Any]) -> None:
    """An optimizer instance brings its own parameters and settings."""
    if parameters is not None or settings:
        raise TypeError(
            "an optimizer instance counts its own parameters and settings: pass neither"
        )


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


# One assignment in an optimizer step's loop, for one unit (a parameter, or a bucket of them):
# the Python name bound, the unit-sized tensors it then holds, and those alive only while its
# value is computed. See Note [The optimizer step's temporaries], Rules 3 and 4.
Assignment = tuple[str, int, int]
# A class's assignments per unit, given its group's settings and whether the foreach loop runs.
StepRule = Callable[[Mapping[str, Any], bool], tuple[Assignment, ...]]


def _adam_step(decoupled: bool) -> StepRule:
    def rule(group: Mapping[str, Any], foreach: bool) -> tuple[Assignment, ...]:
        maximize = bool(group.get("maximize", False))
        coupled = group.get("weight_decay", 0) != 0 and not (
            decoupled or group.get("decoupled_weight_decay", False)
        )
        if foreach:
            # One copy: with both, the decay is added into the negated gradients in place.
            copied = (("grads", 1, 0),) if maximize or coupled else ()
            return (*copied, ("grads", 0, 0), ("sqrt", 1, 0))
        decayed = (("grad", 1, 0),) if coupled else ()
        return (("grad", int(maximize), 0), *decayed, ("denominator", 1, 1))

    return rule


def _sgd_step(group: Mapping[str, Any], foreach: bool) -> tuple[Assignment, ...]:
    maximize = bool(group.get("maximize", False))
    decay = group.get("weight_decay", 0) != 0
    momentum = group.get("momentum", 0) != 0
    nesterov = bool(group.get("nesterov", False))
    if foreach:
        copied = (("grads", 1, 0),) if maximize or decay else ()
        replaced = (("grads", 0, 0),) if momentum and not nesterov else ()
        return (("grads", 0, 0), *copied, *replaced)
    decayed = (("grad", 1, 0),) if decay else ()
    moved = (("grad", int(nesterov), 0),) if momentum else ()
    return (("grad", int(maximize), 0), *decayed, *moved)


# The classes whose steps are traced (Rules 3 and 4); the others in _RULES_BY_NAME are bounded
# (Rule 5). AdamW is its own class before torch 2.6 and a subclass of Adam after.
_STEP_RULES_BY_NAME: dict[str, StepRule] = {
    "Adam": _adam_step(decoupled=False),
    "AdamW": _adam_step(decoupled=True),
    "SGD": _sgd_step,
}
# Rule 5's bounds: unit-sized tensors for the foreach loop (all of a group's at once), and
# tensors the size of the largest parameter for the single-tensor loop.
_FOREACH_BOUND = 3
_SINGLE_TENSOR_BOUND = 4
# Muon's bound per matrix: one tensor in its dtype and this many bf16 ones (Rule 5).
_MUON_BF16_TENSORS = 6
# Classes whose step never picks the foreach loop by itself (Rule 1).
_NO_DEFAULT_FOREACH = frozenset({"Adafactor", "Muon"})
_FOREACH_DEVICE_TYPES = frozenset({"cuda", "xpu", "mtia"})


def optimizer_step_bytes(
    optimizer: torch.optim.Optimizer | str,
    parameters: Iterable[Tensor] | Iterable[dict[str, Any]] | None = None,
    *,
    device_type: str | None = None,
    **settings: Any,
) -> int:
    """Device bytes an optimizer's step allocates while it runs, beyond what it updates.

    The step's own temporaries (see Note [The optimizer step's temporaries]): a budget that
    holds the parameters, gradients and states but not these runs out of memory inside
    ``optimizer.step()``, after forward and backward fit. Counted from the optimizer's class
    and each group's settings, never by running it, so the parameters may be on the meta
    device.

    Args:
        optimizer: An optimizer instance, or the lower-case name of a ``torch.optim`` class,
            or ``"none"`` (0 bytes), as for :func:`optimizer_state_bytes`.
        parameters: With a name, what the optimizer would be given: tensors, or parameter
            groups. Not with an instance.
        device_type: The device type the parameters will step on (``"cuda"``, ``"cpu"``),
            which picks torch's default implementation (Rule 1). Default: each parameter's
            own, the meta device counting as ``"cuda"``.
        **settings: With a name, the optimizer's settings (``foreach=False``,
            ``fused=True``, ``maximize=True``, ``weight_decay=0.1``, ...).

    Returns:
        The bytes at the step's peak, above its parameters, gradients and states; each
        tensor rounded up to the CUDA caching allocator's 512 bytes.

    Raises:
        TypeError: For a class it cannot count (naming the class), and as
            :func:`optimizer_state_bytes` for the arguments.
        ValueError: For an unknown name.

    Example::

        >>> with torch.device("meta"):
        ...     model = torch.nn.Linear(4096, 4096, dtype=torch.bfloat16)
        >>> optimizer_step_bytes("adamw", model.parameters()) / 2**20
        32.0078125
        >>> optimizer_step_bytes("adamw", model.parameters(), foreach=False) / 2**20
        64.0
    """
    if isinstance(optimizer, str):
        named, groups = _named("optimizer_step_bytes", optimizer, parameters, settings)
        if named is None:
            return 0
        cls = named
    else:
        _refuse_arguments(parameters, settings)
        cls, groups = type(optimizer), optimizer.param_groups
    name = _step_class_name(cls)
    return max(
        (_group_step_bytes(name, group, device_type) for group in groups),
        default=0,
    )


def _step_class_name(cls: type[torch.optim.Optimizer]) -> str:
    """The name of ``cls`` or of its nearest base whose step is counted."""
    for base in cls.__mro__:
        if base in _STATES:
            return base.__name__
    counted = ", ".join(sorted(known.__name__ for known in _STATES))
    raise TypeError(
        f"cannot count the step temporaries of {cls.__module__}.{cls.__qualname__}; "
        f"counted by class: {counted}"
    )


def _implementation(
    name: str, group: Mapping[str, Any], parameters: list[Tensor], device_type: str | None
) -> str:
    """``"fused"``, ``"foreach"`` or ``"single"``: the loop torch runs for a group (Rule 1)."""
    if group.get("fused"):
        return "fused"
    foreach = group.get("foreach")
    if foreach is not None or group.get("fused") is not None:
        return "foreach" if foreach and name != "Muon" else "single"
    if name in _NO_DEFAULT_FOREACH or group.get("differentiable", False):
        return "single"
    types = {device_type} if device_type else {_planned_type(p.device) for p in parameters}
    return "foreach" if types <= _FOREACH_DEVICE_TYPES else "single"


def _planned_type(device: torch.device) -> str:
    """A parameter's device type, the meta device's being CUDA's (Rule 1)."""
    return "cuda" if device.type == "meta" else device.type


def _group_step_bytes(name: str, group: Mapping[str, Any], device_type: str | None) -> int:
    """One parameter group's step temporaries at their peak (Rules 2 to 6)."""
    parameters = [p for p in group["params"] if p.requires_grad]
    implementation = _implementation(name, group, parameters, device_type)
    if not parameters or implementation == "fused":
        return 0
    sizes = [_tensor_bytes(p.numel(), p.element_size()) for p in parameters]
    if name == "Muon":
        bf16 = [_MUON_BF16_TENSORS * _tensor_bytes(p.numel(), 2) for p in parameters]
        return max(size + extra for size, extra in zip(sizes, bf16, strict=True))
    foreach = implementation == "foreach"
    rule = _STEP_RULES_BY_NAME.get(name)
    if rule is None:
        return _FOREACH_BOUND * sum(sizes) if foreach else _SINGLE_TENSOR_BOUND * max(sizes)
    if foreach:
        buckets: dict[tuple[torch.device, torch.dtype], int] = {}
        for parameter, size in zip(parameters, sizes, strict=True):
            key = (parameter.device, parameter.dtype)
            buckets[key] = buckets.get(key, 0) + size
        sizes = sorted(buckets.values())
    return _peak(rule(group, foreach), sizes)


def _tensor_bytes(count: int, itemsize: int) -> int:
    return round_up(count * itemsize, ALLOCATION_GRANULARITY)


def _peak(assignments: tuple[Assignment, ...], sizes: list[int]) -> int:
    """The most bytes alive while ``assignments`` run once per unit of ``sizes``, in order.

    A name's old value is freed only once its new one is made (Rules 3 and 4).
    """
    held: dict[str, int] = {}
    live = peak = 0
    for size in sizes:
        for variable, count, transient in assignments:
            peak = max(peak, live + (count + transient) * size)
            live += count * size - held.get(variable, 0)
            held[variable] = count * size
    return peak
