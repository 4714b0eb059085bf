"""What a user meets of a budget plan: its arguments, its printout and its ``context_fn``.

The search's choices are tested in ``test_budget.py``; these tests are about the surface around
them: bad input is refused before any step is planned, ``print(plan)`` works for any step and
names what changes it, and ``context_fn=plan.context_fn()`` always works.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
from matepoint._planner.policy import AVAILABLE
from matepoint._planner.time_model import DeviceModel

if not AVAILABLE:
    pytest.skip("budget plans need torch's selective checkpointing (2.5)", allow_module_level=True)

FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0, host_seconds_per_op=0)


def _elementwise(x: torch.Tensor) -> torch.Tensor:
    """Four checkpointed regions of elementwise ops: no matrix product, small inputs."""
    for _ in range(4):
        x = matepoint.checkpoint(torch.sin, x, use_reentrant=False)
    return x


def _elementwise_plan() -> matepoint.MemoryPlan:
    with torch.device("meta"):
        x = torch.randn(64, 64, requires_grad=True)
    return matepoint.plan(_elementwise, x)


@pytest.fixture(scope="module")
def memory_plan() -> matepoint.MemoryPlan:
    return _elementwise_plan()


# --- defect 14: bad input is refused by name, before any step is planned -------------------------


@pytest.mark.parametrize("budget", [math.nan, math.inf, -math.inf, 0, 0.0, -5, -5e9, 0.5])
def test_a_budget_that_is_no_positive_finite_size_is_refused(
    memory_plan: matepoint.MemoryPlan, budget: float
) -> None:
    with pytest.raises(ValueError, match="budget_bytes"):
        memory_plan.fastest_under(budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", ["10GiB", None, True, [1 << 30]])
def test_a_budget_that_is_no_number_is_a_type_error(
    memory_plan: matepoint.MemoryPlan, budget: Any
) -> None:
    with pytest.raises(TypeError, match="budget_bytes"):
        memory_plan.fastest_under(budget)


@pytest.mark.parametrize(
    ("host_budget", "error"),
    [
        (-1, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (True, TypeError),
        ("64GB", TypeError),
    ],
)
def test_a_host_budget_must_be_none_or_a_size(
    memory_plan: matepoint.MemoryPlan, host_budget: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="host_budget_bytes"):
        memory_plan.fastest_under(1 << 30, host_budget_bytes=host_budget)


@pytest.mark.parametrize(
    ("ranks", "error"),
    [(0, ValueError), (-2, ValueError), (True, TypeError), (1.5, TypeError), ("8", TypeError)],
)
def test_ranks_per_node_must_be_a_whole_number_of_one_or_more(
    memory_plan: matepoint.MemoryPlan, ranks: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="ranks_per_node"):
        memory_plan.fastest_under(1 << 30, ranks_per_node=ranks)


@pytest.mark.parametrize("device", ["cuda", torch.device("cuda"), torch.device("cpu"), 0])
def test_a_device_that_is_no_device_model_says_what_device_takes(
    memory_plan: matepoint.MemoryPlan, device: Any
) -> None:
    with pytest.raises(TypeError, match=r"device= takes a DeviceModel.*matepoint\.calibrate\(\)"):
        memory_plan.fastest_under(1 << 30, device=device)


def test_a_measure_that_is_not_callable_is_refused(memory_plan: matepoint.MemoryPlan) -> None:
    with pytest.raises(TypeError, match="measure="):
        memory_plan.fastest_under(1 << 30, measure=[1.0, 2.0])  # type: ignore[arg-type]


def test_sizes_given_as_floats_are_planned_as_whole_bytes(
    memory_plan: matepoint.MemoryPlan,
) -> None:
    budget = memory_plan.fastest_under(float(1 << 30), host_budget_bytes=0.0, device=FREE_POLICY)
    assert budget.fits
    assert budget.budget_bytes == 1 << 30
    assert type(budget.budget_bytes) is int


# --- defect 12: a step the time model sees nothing of prints -------------------------------------


def test_a_step_without_matrix_products_or_link_traffic_prints(
    memory_plan: matepoint.MemoryPlan,
) -> None:
    no_host = DeviceModel(host_seconds_per_op=0)
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=no_host)
    assert budget.every_block_seconds == 0
    text = str(budget)
    assert "estimated step 0.0 ms" in text
    assert "no matrix products or link traffic" in text


def test_a_plan_estimated_at_no_time_against_every_block_prints(
    memory_plan: matepoint.MemoryPlan,
) -> None:
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2)
    charged = dataclasses.replace(budget, step_seconds=1e-3)
    assert "estimated step 1.0 ms" in str(charged)


# --- defect 13: context_fn() is always a context_fn ----------------------------------------------


def _deciding_nothing(memory_plan: matepoint.MemoryPlan) -> matepoint.BudgetPlan:
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2)
    assert budget.decisions == ()
    assert budget.kept_in_last == ()
    return budget


def test_a_plan_that_decides_nothing_gives_torchs_noop_context_fn(
    memory_plan: matepoint.MemoryPlan,
) -> None:
    assert _deciding_nothing(memory_plan).context_fn() is torch_checkpoint.noop_context_fn


@pytest.mark.parametrize("checkpoint", ["matepoint", "torch"])
def test_the_documented_context_fn_pattern_runs_when_the_plan_decides_nothing(
    memory_plan: matepoint.MemoryPlan, checkpoint: str
) -> None:
    budget = _deciding_nothing(memory_plan)
    run = matepoint.checkpoint if checkpoint == "matepoint" else torch_checkpoint.checkpoint
    x = torch.randn(64, 64, requires_grad=True)
    h = x
    for _ in range(4):
        h = run(torch.sin, h, use_reentrant=False, context_fn=budget.context_fn())
    h.sum().backward()
    x_reference = x.detach().clone().requires_grad_()
    h_reference = x_reference
    for _ in range(4):
        h_reference = torch.sin(h_reference)
    h_reference.sum().backward()
    assert torch.equal(h, h_reference)
    assert torch.equal(x.grad, x_reference.grad)  # type: ignore[arg-type]


# --- deliver item 2: print(plan) names the inputs held on the device -----------------------------


class _Thin(nn.Module):
    """Sixteen thin blocks whose inputs outweigh their weights (as in ``test_budget.py``),
    each widening to 64 inside, so that the step without a checkpoint peaks higher."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16)) for _ in range(16)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = matepoint.checkpoint(block, x)
        return x


def test_print_names_the_checkpoint_inputs_held_on_the_device() -> None:
    with torch.device("meta"):
        stack = _Thin()
        x = torch.randn(4096, 16, requires_grad=True)
    memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    # A link too slow for the widened outputs, so no policy offloads them.
    slow_link = dataclasses.replace(FREE_POLICY, to_host_bandwidth=1e9, to_device_bandwidth=1e9)
    roomy = memory_plan.fastest_under(memory_plan["torch"].peak_bytes, device=slow_link)
    assert roomy.strategy_plan.bytes_to_host == 0
    held = roomy.settings_changes()["min_offload_bytes"]
    assert held > 4096 * 16 * 4
    assert (
        f"checkpoint inputs held on the device (min_offload_bytes={held}): no link traffic for them"
    ) in str(roomy)
    tight = memory_plan.fastest_under(memory_plan["matepoint"].peak_bytes, device=slow_link)
    assert tight.strategy_plan.bytes_to_host > 0
    assert "held on the device" not in str(tight)
    assert "checkpoint inputs offloaded (min_offload_bytes=0)" in str(tight)
