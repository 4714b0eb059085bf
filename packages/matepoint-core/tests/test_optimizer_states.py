"""The optimizer's states counted (``matepoint._planner.optimizer_states``) against torch's own.

Each optimizer takes one real step on the CPU; the bytes of the states it made, each tensor
rounded as the CUDA caching allocator rounds it, are what the count must give: from the class
before the step (less the scalar step counters, which an estimate leaves out), from the states
after it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from matepoint._planner.optimizer_states import (
    OPTIMIZER_NAMES,
    optimizer_class,
    optimizer_state_bytes,
)
from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up


class _Model(nn.Module):
    """Odd sizes (so the rounding shows), two dtypes, a 3-d parameter, a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(33, 17)  # 561 + 17 floats: 2244 and 68 bytes
        self.low = nn.Parameter(torch.randn(3, 129, dtype=torch.bfloat16))  # 774 bytes
        self.cube = nn.Parameter(torch.randn(2, 5, 7))
        self.frozen = nn.Parameter(torch.randn(1000), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        y = self.linear(x).sum() + self.low.float().square().sum()
        return y + (self.cube * self.frozen[:70].view(2, 5, 7)).sum()


def _matrices() -> nn.Module:
    """Muon takes matrices only."""
    return nn.Sequential(nn.Linear(33, 17, bias=False), nn.Linear(17, 3, bias=False))


def _optim(name: str) -> type[torch.optim.Optimizer] | None:
    return getattr(torch.optim, name, None)


def _rounded(tensor: Tensor) -> int:
    return round_up(tensor.untyped_storage().nbytes(), ALLOCATION_GRANULARITY)


def _measured(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of every state tensor, and of the scalars among them, each rounded."""
    tensors = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, Tensor)
    ]
    return sum(map(_rounded, tensors)), sum(_rounded(t) for t in tensors if t.dim() == 0)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    inputs = torch.randn(4, 33)
    model(inputs).sum().backward()
    optimizer.step()


CASES: list[tuple[str, dict[str, Any]]] = [
    ("Adam", {}),
    ("Adam", {"amsgrad": True}),
    ("Adam", {"foreach": True}),
    ("AdamW", {}),
    ("AdamW", {"amsgrad": True}),
    ("AdamW", {"fused": True}),
    ("SGD", {}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "foreach": True}),
    ("RMSprop", {}),
    ("RMSprop", {"momentum": 0.9}),
    ("RMSprop", {"momentum": 0.5, "centered": True}),
    ("Adagrad", {}),
    ("Adamax", {}),
    ("NAdam", {}),
    ("RAdam", {}),
    ("Adadelta", {}),
    ("ASGD", {}),
    ("Rprop", {}),
    ("Adafactor", {}),
    ("Muon", {}),
]


@pytest.mark.parametrize(
    ("name", "settings"), CASES, ids=[f"{n}-{'-'.join(s) or 'default'}" for n, s in CASES]
)
def test_the_count_is_what_torch_allocates(name: str, settings: dict[str, Any]) -> None:
    cls = _optim(name)
    if cls is None:
        pytest.skip(f"torch.optim.{name} is not in this torch")
    torch.manual_seed(0)
    model = _matrices() if name == "Muon" else _Model()
    optimizer = cls(model.parameters(), **settings)
    # Adagrad makes its states in its constructor, for the frozen parameter too: counted as
    # they are, steps included.
    made_early = bool(optimizer.state)
    before = optimizer_state_bytes(optimizer)
    by_name = optimizer_state_bytes(name.lower(), model.parameters(), **settings)
    _step(model, optimizer)
    measured, scalars = _measured(optimizer)
    assert measured > scalars or (name == "SGD" and not settings.get("momentum"))
    assert by_name == measured - scalars
    assert before == (measured if made_early else measured - scalars)
    # On the CPU the step counters are on the parameters' device: counted once they exist.
    assert optimizer_state_bytes(optimizer) == measured


def test_adamw_by_hand() -> None:
    # Two states per parameter that requires a gradient, each rounded up to 512 bytes:
    # 561 floats -> 2560, 17 floats -> 512, 387 bf16 -> 1024, 70 floats -> 512.
    per_state = 2560 + 512 + 1024 + 512
    model = _Model()
    assert optimizer_state_bytes("adamw", model.parameters()) == 2 * per_state
    assert optimizer_state_bytes("adamw", model.parameters(), amsgrad=True) == 3 * per_state
    assert optimizer_state_bytes("sgd", model.parameters()) == 0
    assert optimizer_state_bytes("sgd", model.parameters(), momentum=0.9) == per_state
    assert optimizer_state_bytes("none", model.parameters()) == 0
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    assert optimizer_state_bytes("adamw", model.parameters()) == 0


def test_meta_parameters_are_counted_without_memory() -> None:
    with torch.device("meta"):
        model = nn.Linear(4096, 4096, dtype=torch.bfloat16)
    expected = 2 * (4096 * 4096 * 2 + 4096 * 2)  # both already multiples of 512
    assert optimizer_state_bytes("adamw", model.parameters()) == expected
    optimizer = torch.optim.AdamW(model.parameters())
    assert optimizer_state_bytes(optimizer) == expected
    assert not optimizer.state  # nothing made
    # Adagrad makes its states in its constructor: on meta, shapes without memory (its step
    # counters are on the host, so not counted).
    assert optimizer_state_bytes(torch.optim.Adagrad(model.parameters())) == expected // 2


def test_a_parameter_without_states_yet_is_counted_by_class() -> None:
    # An unused parameter gets no gradient and no states in a step; it will once it is used.
    model = _Model()
    unused = nn.Parameter(torch.randn(300))  # 1200 bytes -> 1536
    optimizer = torch.optim.Adam([*model.parameters(), unused])
    _step(model, optimizer)
    assert unused not in optimizer.state
    measured, _ = _measured(optimizer)
    assert optimizer_state_bytes(optimizer) == measured + 2 * 1536


def test_only_states_on_the_parameters_device_count() -> None:
    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters())
    _step(model, optimizer)
    measured, _ = _measured(optimizer)
    weight_state = optimizer.state[model.linear.weight]
    weight_state["exp_avg"] = weight_state["exp_avg"].to("meta")  # elsewhere, e.g. offloaded
    assert optimizer_state_bytes(optimizer) == measured - 2560


def test_groups_with_settings_of_their_own() -> None:
    model = _Model()
    groups = [
        {"params": [model.linear.weight, model.linear.bias], "amsgrad": True},
        {"params": [model.low, model.cube, model.frozen]},
    ]
    optimizer = torch.optim.Adam(groups)
    by_name = optimizer_state_bytes("adam", groups)
    assert by_name == optimizer_state_bytes(optimizer) == 3 * (2560 + 512) + 2 * (1024 + 512)
    _step(model, optimizer)
    measured, scalars = _measured(optimizer)
    assert by_name == measured - scalars


def test_a_subclass_counts_as_its_base_and_an_unknown_class_is_named() -> None:
    class Tuned(torch.optim.AdamW):
        pass

    model = _Model()
    assert optimizer_state_bytes(Tuned(model.parameters())) == optimizer_state_bytes(
        "adamw", model.parameters()
    )
    with pytest.raises(TypeError, match=r"torch\.optim\.lbfgs\.LBFGS before it makes them"):
        optimizer_state_bytes(torch.optim.LBFGS(model.parameters()))

    class Heavy(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for parameter in group["params"]:
                    if parameter.grad is not None:
                        self.state[parameter]["history"] = [parameter.grad.clone()] * 2

    heavy = Heavy(model.parameters())
    with pytest.raises(TypeError, match=r"test_optimizer_states\..*Heavy before it makes"):
        optimizer_state_bytes(heavy)
    _step(model, heavy)
    # After its step its states are counted as they are (one tensor listed twice: once).
    assert optimizer_state_bytes(heavy) == 2560 + 512 + 1024 + 512


def test_bad_arguments() -> None:
    model = _Model()
    with pytest.raises(ValueError, match=r"unknown optimizer 'lion'; known: adam, adamw, sgd"):
        optimizer_state_bytes("lion", model.parameters())
    with pytest.raises(TypeError, match="AdamW takes no setting momentum"):
        optimizer_state_bytes("adamw", model.parameters(), momentum=0.9)
    with pytest.raises(TypeError, match="needs the parameters"):
        optimizer_state_bytes("adamw")
    with pytest.raises(TypeError, match="not a tensor"):
        optimizer_state_bytes("adamw", model.linear.weight)
    with pytest.raises(TypeError, match="pass neither"):
        optimizer_state_bytes(torch.optim.AdamW(model.parameters()), model.parameters())
    # The same parameter twice is counted once, as torch's optimizers hold it once.
    twice = [model.linear.bias, model.linear.bias]
    assert optimizer_state_bytes("adamw", twice) == 2 * 512


def test_names() -> None:
    assert optimizer_class("AdamW") is torch.optim.AdamW
    assert optimizer_class(" sgd ") is torch.optim.SGD
    assert optimizer_class("none") is None
    for name in ("adamw", "adam", "sgd", "none"):
        assert name in OPTIMIZER_NAMES
