"""Planning from several threads at once: the same answers as one thread, the model untouched.

A planned step accumulates gradients into the shared meta model's ``.grad`` and puts the old
ones back at its end; steps planned at once on one model used to see each other's gradients
(wrong peaks) or corrupt memory. See Note [Planned steps one at a time] in
``matepoint._planner.step``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import matepoint
from matepoint._planner.policy import AVAILABLE
from matepoint._planner.time_model import DeviceModel

THREADS, ROUNDS, BLOCKS, WIDTH, TOKENS = 4, 3, 4, 64, 256

# A policy without host time and compute that takes its time: the search keeps some kinds, so
# each search plans a dozen steps.
FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = matepoint.checkpoint(block, x)
        return x


def _model_and_input() -> tuple[Stack, torch.Tensor]:
    """A meta model, half of whose parameters hold a gradient from an earlier micro-batch."""
    with torch.device("meta"):
        stack = Stack()
        x = torch.randn(TOKENS, WIDTH, requires_grad=True)
    for block in stack.blocks:
        block.up.weight.grad = torch.empty_like(block.up.weight)
    return stack, x


def _grads(model: nn.Module) -> list[torch.Tensor | None]:
    return [parameter.grad for parameter in model.parameters()]


def _in_threads(work: Callable[[], Any]) -> list[Any]:
    """Run ``work`` ``ROUNDS`` times on each of ``THREADS`` threads started together."""
    start = threading.Barrier(THREADS)
    results: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        start.wait()
        try:
            for _ in range(ROUNDS):
                results.append(work())
        except BaseException as error:  # reported on the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert len(results) == THREADS * ROUNDS
    return results


def test_replanning_one_plan_from_threads_answers_as_one_thread_does() -> None:
    stack, x = _model_and_input()
    grads = _grads(stack)
    planned_under = matepoint.OffloadSettings(min_offload_bytes=0)
    memory_plan = matepoint.plan(stack, x, options=planned_under)
    settings = [planned_under, matepoint.OffloadSettings(min_offload_bytes=0, stash_bytes=0)]

    def replans() -> list[matepoint.StrategyPlan]:
        return [memory_plan.replan(each)[0] for each in settings]

    alone = replans()
    assert alone[0] == memory_plan["matepoint"]
    assert all(result == alone for result in _in_threads(replans))
    assert all(now is before for now, before in zip(_grads(stack), grads, strict=True))


def test_planning_one_model_from_threads_answers_as_one_thread_does() -> None:
    stack, x = _model_and_input()
    grads = _grads(stack)

    def planned() -> dict[str, matepoint.StrategyPlan]:
        memory_plan = matepoint.plan(stack, x)
        return {strategy: memory_plan[strategy] for strategy in ("none", "torch", "matepoint")}

    alone = planned()
    assert all(result == alone for result in _in_threads(planned))
    assert all(now is before for now, before in zip(_grads(stack), grads, strict=True))


@pytest.mark.skipif(not AVAILABLE, reason="budget plans need torch's selective checkpointing (2.5)")
def test_budget_searches_on_one_plan_from_threads_answer_as_one_thread_does() -> None:
    stack, x = _model_and_input()
    grads = _grads(stack)
    memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    budgets = [memory_plan["none"].peak_bytes * 2, memory_plan["matepoint"].peak_bytes + 1]

    def searches() -> list[tuple[matepoint.BudgetPlan, matepoint.StrategyPlan]]:
        found = [memory_plan.fastest_under(budget, device=FREE_POLICY) for budget in budgets]
        return [(budget, budget.strategy_plan) for budget in found]

    alone = searches()
    assert any(decision == "keep" for _, decision in alone[0][0].decisions), alone[0][0]
    assert all(result == alone for result in _in_threads(searches))
    assert all(now is before for now, before in zip(_grads(stack), grads, strict=True))
