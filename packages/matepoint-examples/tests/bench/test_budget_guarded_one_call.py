"""The benchmark's one call runs under the guard a user's one call gets (Note [The budget
guard] in ``matepoint._guard``), on a CPU with a simulated allocator: a step that reached the
allocator's limit makes the guard plan again, and the later steps run the new plan."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._planner.optimizer_states import optimizer_state_bytes
from matepoint_examples.bench import _budget_runner as budget_runner
from matepoint_examples.bench import budget
from matepoint_examples.bench._budget_report import print_report

pytestmark = pytest.mark.skipif(
    not hasattr(torch_checkpoint, "CheckpointPolicy"),
    reason="torch's selective checkpointing arrived in 2.5",
)

NAME = "one-call@test"


class SimulatedAllocator:
    """A device whose every step peaks at ``peak`` and whose allocator reached its limit
    holding ``pieces`` beside it, in the first step read only."""

    def __init__(self, peak: int, pieces: int) -> None:
        self.peak, self.pieces, self.resets = peak, pieces, 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        return self.peak

    def reserved_peak_bytes(self) -> int:
        return self.peak + self.pieces // 2  # read before reached_limit

    def pieces_peak_bytes(self) -> int:
        return self.pieces  # read before reached_limit

    def reached_limit(self) -> bool:
        reached, self.pieces = self.pieces > 0, 0
        return reached

    def unallocated_bytes(self) -> int:
        return self.pieces


def test_a_step_at_the_allocators_limit_replans_the_one_call_and_the_report_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    workload = budget.WORKLOADS["llama-tiny"]
    runner = budget_runner.Runner(workload, device="cpu")
    runner.step("matepoint", matepoint.checkpoint)  # the optimizer's states exist
    memory_plan = budget._plan(workload)
    states = optimizer_state_bytes(runner.optimizer)
    first = budget_runner.plan_one_call(runner, memory_plan["none"].peak_bytes + states, None)
    assert not first.checkpoint  # no checkpoint fits
    strategy = budget_runner.guarded_one_call(runner, NAME, first, None)
    guard = runner.guards[NAME]
    # Its pieces leave room for a step between the least that fits and no checkpoint's.
    assert first.smallest_budget_bytes < first.peak_bytes
    pieces = first.budget_bytes - (first.peak_bytes + first.smallest_budget_bytes) // 2
    guard.memory = SimulatedAllocator(first.peak_bytes + states, pieces)
    with pytest.warns(matepoint.BudgetOvershootWarning, match="to its limit"):
        measured = budget_runner.alternate(runner, {NAME: strategy}, rounds=2, warmup=1)
    assert guard.replans == 1
    second = guard.plan
    assert second.budget_bytes == first.budget_bytes - pieces
    assert second.fits
    assert second.checkpoint
    assert second.peak_bytes <= second.budget_bytes
    assert runner.settings[NAME] == second.settings_changes()
    assert all(seconds is not None for seconds in measured.times[NAME])
    # The steps after the re-plan ran the blocks through the new plan's checkpoint, not the
    # plain one planning installed on the model to trace it.
    assert runner.model.checkpoint_fn is strategy
    # A step below the limit plans nothing more.
    guard.memory = SimulatedAllocator(second.peak_bytes + states, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", matepoint.BudgetOvershootWarning)
        budget_runner.alternate(runner, {NAME: strategy}, rounds=1, warmup=0)
    assert guard.replans == 1
    fields = budget._plan_fields(first, lambda peak: peak + states)
    budget._guarded_fields(fields, guard, lambda peak: peak + states)
    assert fields["replans"] == 1
    assert fields["first_plan"]["checkpoint"] is False
    assert fields["checkpoint"] is True
    assert fields["guard_readings"][0]["reached_limit"] is True
    report = {"workload": "llama-tiny", "rounds": 1, "device": "cpu", "rows": {}}
    print_report({**report, "plans": {NAME: fields}})
    assert f"{NAME}: its guard planned again 1 time(s)" in capsys.readouterr().out


def test_an_out_of_memory_step_replans_the_one_call_before_its_next_step() -> None:
    """A step of the one call that runs out of memory among the allocator's free pieces
    fails alone: its guard plans again before the strategy's next step, which runs."""
    workload = budget.WORKLOADS["llama-tiny"]
    runner = budget_runner.Runner(workload, device="cpu")
    runner.step("matepoint", matepoint.checkpoint)
    memory_plan = budget._plan(workload)
    states = optimizer_state_bytes(runner.optimizer)
    first = budget_runner.plan_one_call(runner, memory_plan["none"].peak_bytes + states, None)
    strategy = budget_runner.guarded_one_call(runner, NAME, first, None)
    guard = runner.guards[NAME]
    pieces = first.budget_bytes - (first.peak_bytes + first.smallest_budget_bytes) // 2
    memory = SimulatedAllocator(first.peak_bytes + states, 0)
    memory.unallocated_bytes = lambda: pieces  # type: ignore[method-assign]
    guard.memory = memory
    failing = [True]

    def run_out(_module: object, _args: object) -> None:
        if failing.pop() if failing else False:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB")

    handle = next(iter(runner.model.blocks)).register_forward_pre_hook(run_out)
    try:
        failed = runner.step(NAME, strategy)
        assert math.isnan(failed.seconds)
        assert guard.plan is first
        with pytest.warns(matepoint.BudgetOvershootWarning, match="ran out of memory with"):
            ran = runner.step(NAME, strategy)
    finally:
        handle.remove()
    assert not math.isnan(ran.seconds)
    assert guard.replans == 1
    assert guard.plan.budget_bytes == first.budget_bytes - pieces
    assert runner.settings[NAME] == guard.plan.settings_changes()
