"""The optimizer step's temporaries (``optimizer_step_bytes``) against what torch's step makes.

Each optimizer takes a first step on the CPU (its states are made), then a second under a
dispatch mode that sees every tensor an operator returns and, through a weak reference to its
storage, when it is freed: the peak of the bytes alive that were not there before the step
(parameters, gradients, states), each rounded as the CUDA caching allocator rounds it, is what
the count must give. The CPU runs the same Python loops as a GPU (``foreach=True`` forced, its
``_foreach_*`` operators returning one tensor per parameter, as CUDA's do), so the temporaries
are the same; the scalars it makes are left out of both (Rule 6 of Note [The optimizer step's
temporaries]).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from matepoint._planner.optimizer_states import optimizer_step_bytes
from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up, tensors_in


class _TemporaryBytes(TorchDispatchMode):
    """The peak of the bytes alive that operators made, less scalars and what ``kept`` holds."""

    def __init__(self, kept: set[int]) -> None:
        super().__init__()
        self.kept = kept
        self.live = 0
        self.peak = 0
        self._watched: dict[int, weakref.ref[Any]] = {}

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tensors_in(out):
            storage = tensor.untyped_storage()
            key = id(storage)
            if tensor.dim() == 0 or storage.data_ptr() in self.kept or key in self._watched:
                continue
            nbytes = round_up(storage.nbytes(), ALLOCATION_GRANULARITY)
            self._watched[key] = weakref.ref(storage, self._on_free(key, nbytes))
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        return out

    def _on_free(self, key: int, nbytes: int) -> Callable[[Any], None]:
        def freed(_reference: Any) -> None:
            self._watched.pop(key, None)
            self.live -= nbytes

        return freed


def _kept(optimizer: torch.optim.Optimizer) -> set[int]:
    """The addresses of every parameter, gradient and state tensor."""
    tensors: list[Tensor] = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            tensors += [parameter, *([] if parameter.grad is None else [parameter.grad])]
            tensors += tensors_in(dict(optimizer.state.get(parameter, {})))
    return {tensor.untyped_storage().data_ptr() for tensor in tensors}


def _measured(optimizer: torch.optim.Optimizer, model: nn.Module) -> int:
    """The peak bytes of the temporaries of the optimizer's second step."""
    for _ in range(2):
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.grad = torch.randn_like(parameter)
        mode = _TemporaryBytes(_kept(optimizer))
        with mode:
            optimizer.step()
    return mode.peak


def _model(dtypes: tuple[torch.dtype, ...]) -> nn.Module:
    """Odd sizes (so the rounding shows), the small before the large (so what one parameter
    leaves alive meets the next's), dtypes taken in turn, and a frozen parameter."""
    torch.manual_seed(0)
    shapes = [(33,), (300, 7), (1000,), (2000, 3), (100,), (5, 9)]
    model = nn.ParameterList(
        nn.Parameter(torch.randn(shape, dtype=dtypes[i % len(dtypes)]))
        for i, shape in enumerate(shapes)
    )
    model.append(nn.Parameter(torch.randn(4000), requires_grad=False))
    return model


def _matrices() -> nn.Module:
    """Muon takes matrices only: a wide one, a tall one, a square bf16 one."""
    torch.manual_seed(0)
    return nn.ParameterList(
        [
            nn.Parameter(torch.randn(16, 40)),
            nn.Parameter(torch.randn(40, 16)),
            nn.Parameter(torch.randn(24, 24, dtype=torch.bfloat16)),
        ]
    )


DTYPES = {
    "fp32": (torch.float32,),
    "bf16": (torch.bfloat16,),
    "mixed": (torch.float32, torch.bfloat16),  # two buckets for foreach
}

TRACED: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {}),
    ("Adam", {"weight_decay": 0.1}),
    ("Adam", {"maximize": True}),
    ("Adam", {"maximize": True, "weight_decay": 0.1}),
    ("Adam", {"amsgrad": True, "weight_decay": 0.1}),
    ("Adam", {"weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("AdamW", {}),
    ("AdamW", {"maximize": True, "amsgrad": True}),
    ("SGD", {}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "nesterov": True}),
    ("SGD", {"weight_decay": 0.1}),
    ("SGD", {"maximize": True}),
    ("SGD", {"momentum": 0.9, "maximize": True}),
    ("SGD", {"momentum": 0.9, "weight_decay": 0.1}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True}),
]


def _ids(cases: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{name}-{'-'.join(settings) or 'default'}" for name, settings in cases]


def _takes(cls: type[torch.optim.Optimizer], settings: dict[str, Any]) -> bool:
    return set(settings) <= set(inspect.signature(cls.__init__).parameters)


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single"])
@pytest.mark.parametrize(("name", "settings"), TRACED, ids=_ids(TRACED))
def test_traced_classes_count_what_the_step_makes(
    name: str, settings: dict[str, Any], foreach: bool
) -> None:
    cls = getattr(torch.optim, name)
    if not _takes(cls, settings):
        pytest.skip(f"{name} takes no {settings} in this torch")
    for dtypes in DTYPES.values():
        model = _model(dtypes)
        optimizer = cls(model.parameters(), lr=0.01, foreach=foreach, **settings)
        predicted = optimizer_step_bytes(optimizer)
        by_name = optimizer_step_bytes(
            name.lower(), model.parameters(), foreach=foreach, **settings
        )
        measured = _measured(optimizer, model)
        assert predicted == by_name == measured, dtypes
        # Every Adam step makes something (its square roots); SGD only with a copy of the
        # gradients or, one parameter at a time, nesterov's sum.
        copies = settings.get("maximize") or settings.get("weight_decay")
        makes = name != "SGD" or copies or (not foreach and "nesterov" in settings)
        assert (measured > 0) == bool(makes)


FUSED = [TRACED[3], TRACED[7], TRACED[-1]]


@pytest.mark.parametrize(("name", "settings"), FUSED, ids=_ids(FUSED))
def test_fused_steps_make_nothing(name: str, settings: dict[str, Any]) -> None:
    model = _model(DTYPES["mixed"])
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01, fused=True, **settings)
    assert optimizer_step_bytes(optimizer) == _measured(optimizer, model) == 0
    # The same settings on the foreach loop do make temporaries: the measure sees them.
    optimizer = getattr(torch.optim, name)(model.parameters(), lr=0.01, foreach=True, **settings)
    assert optimizer_step_bytes(optimizer) == _measured(optimizer, model) > 0


def test_adamw_by_hand() -> None:
    # fp32 then bf16 parameters, each rounded up to 512 bytes: the fp32 bucket 132 -> 512,
    # 1600 -> 2048; the bf16 bucket 8400 -> 8704, 2000 -> 2048.
    first = [torch.zeros(33, requires_grad=True), torch.zeros(400, requires_grad=True)]
    second = [torch.zeros(4200, dtype=torch.bfloat16, requires_grad=True)]
    second.append(torch.zeros(1000, dtype=torch.bfloat16, requires_grad=True))
    parameters = first + second
    # foreach: one square root per parameter; the first bucket's stay while the second's
    # are made.
    assert optimizer_step_bytes("adamw", parameters, foreach=True) == 2560 + 10752
    # One parameter at a time: the largest's root and quotient; the 400 floats' denominator
    # is alive beside them.
    assert optimizer_step_bytes("adamw", parameters, foreach=False) == 2048 + 2 * 8704
    assert optimizer_step_bytes("adamw", parameters, fused=True) == 0
    assert optimizer_step_bytes("sgd", parameters, foreach=True) == 0
    assert optimizer_step_bytes("sgd", parameters, foreach=True, maximize=True) == 10752
    assert optimizer_step_bytes("none", parameters) == 0


def test_the_default_implementation_follows_the_device() -> None:
    with torch.device("meta"):
        planned = nn.Linear(4096, 4096, dtype=torch.bfloat16)
    root = 4096 * 4096 * 2 + 4096 * 2  # one square root per parameter, all multiples of 512
    assert optimizer_step_bytes("adamw", planned.parameters()) == root
    assert optimizer_step_bytes(torch.optim.AdamW(planned.parameters())) == root
    single = optimizer_step_bytes("adamw", planned.parameters(), device_type="cpu")
    assert single == optimizer_step_bytes("adamw", planned.parameters(), foreach=False)
    assert single == 2 * 4096 * 4096 * 2
    # On the CPU torch runs the single-tensor loop by default; on a GPU, foreach.
    model = _model(DTYPES["fp32"])
    optimizer = torch.optim.Adam(model.parameters())
    assert optimizer_step_bytes(optimizer) == _measured(optimizer, model)
    on_cpu = optimizer_step_bytes("adam", model.parameters())
    assert on_cpu == optimizer_step_bytes("adam", model.parameters(), foreach=False)
    on_gpu = optimizer_step_bytes("adam", model.parameters(), device_type="cuda")
    assert on_gpu == optimizer_step_bytes("adam", model.parameters(), foreach=True) != on_cpu
    # fused=False with foreach unset picks the single-tensor loop, as torch does.
    assert optimizer_step_bytes("adam", planned.parameters(), fused=False) == single
    # Differentiable steps and Adafactor never default to foreach.
    differentiable = optimizer_step_bytes("adam", planned.parameters(), differentiable=True)
    assert differentiable == single


OTHERS: list[tuple[str, dict[str, Any]]] = [
    ("RMSprop", {"maximize": True, "weight_decay": 0.1, "momentum": 0.9, "centered": True}),
    ("RMSprop", {}),
    ("Adagrad", {"maximize": True, "weight_decay": 0.1}),
    ("Adamax", {"maximize": True, "weight_decay": 0.1}),
    ("NAdam", {"maximize": True, "weight_decay": 0.1, "decoupled_weight_decay": True}),
    ("NAdam", {"weight_decay": 0.1}),
    ("RAdam", {"maximize": True, "weight_decay": 0.1}),
    ("Adadelta", {"maximize": True, "weight_decay": 0.1}),
    ("ASGD", {"maximize": True, "weight_decay": 0.1}),
    ("Rprop", {"maximize": True}),
    ("Adafactor", {"maximize": True, "weight_decay": 0.1}),
    ("Muon", {}),
    ("Muon", {"nesterov": False}),
]


@pytest.mark.parametrize(("name", "settings"), OTHERS, ids=_ids(OTHERS))
def test_other_classes_are_bounded(name: str, settings: dict[str, Any]) -> None:
    cls = getattr(torch.optim, name, None)
    if cls is None or not _takes(cls, settings):
        pytest.skip(f"torch.optim.{name} with {settings} is not in this torch")
    muon = name == "Muon"
    for foreach in (False,) if muon else (True, False):
        for dtypes in (DTYPES["mixed"],) if muon else DTYPES.values():
            model = _matrices() if muon else _model(dtypes)
            chosen = {} if muon else {"foreach": foreach}  # Muon has no foreach
            optimizer = cls(model.parameters(), lr=0.01, **chosen, **settings)
            predicted = optimizer_step_bytes(optimizer)
            measured = _measured(optimizer, model)
            assert measured <= predicted, (foreach, dtypes)


def test_groups_step_one_after_another() -> None:
    model = _model(DTYPES["mixed"])
    parameters = list(model.parameters())
    groups = [
        {"params": parameters[:2], "foreach": False},
        {"params": parameters[2:], "maximize": True},
    ]
    optimizer = torch.optim.Adam(groups, foreach=True)
    each = [optimizer_step_bytes("adam", [group], foreach=True) for group in groups]
    assert optimizer_step_bytes(optimizer) == max(each) == _measured(optimizer, model)


def test_a_subclass_counts_as_its_base_and_an_unknown_class_is_named() -> None:
    class Tuned(torch.optim.AdamW):
        pass

    model = _model(DTYPES["fp32"])
    assert optimizer_step_bytes(Tuned(model.parameters())) == optimizer_step_bytes(
        "adamw", model.parameters()
    )
    with pytest.raises(TypeError, match=r"torch\.optim\.lbfgs\.LBFGS"):
        optimizer_step_bytes(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match="pass neither"):
        optimizer_step_bytes(torch.optim.SGD(model.parameters()), foreach=True)
    with pytest.raises(TypeError, match="needs the parameters"):
        optimizer_step_bytes("sgd")
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_step_bytes("lamb", model.parameters())
