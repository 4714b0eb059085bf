"""The guard against the caching allocator's free pieces (Note [The budget guard], rule 6).

A step whose peak is within the budget can still drive the allocator to what the device gives
the process: it holds free pieces of its segments beside the peak. The device is simulated
(``guard.memory``): a read step that reached the limit, or an out-of-memory error that found
pieces, makes the guard plan again at the budget less them, and the next step gives gradients
bitwise equal (fp32, CPU test transport) to torch's checkpoint under the new plan's policy.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
from test_budget_guard import SimulatedMemory, _guarded, _step_matches_torch
from test_budget_one_call import SHAPE, needs_plans

import matepoint
from matepoint._device_memory import AllocatorMemory, CudaMemory
from matepoint.testing import CPUTestTransport


class SimulatedAllocator(SimulatedMemory):
    """A device whose allocator held ``pieces`` in free pieces of its segments and at most
    ``held`` (by default the peak and half the pieces: the pieces' peak and the allocated peak
    fall at different moments), and reached its limit where the test says."""

    def __init__(
        self, peak: int, pieces: int = 0, limit: bool = False, held: int | None = None
    ) -> None:
        super().__init__(peak)
        self.pieces, self.limit, self.held = pieces, limit, held

    def reserved_peak_bytes(self) -> int:
        return self.peak + self.pieces // 2 if self.held is None else self.held

    def pieces_peak_bytes(self) -> int:
        return self.pieces

    def reached_limit(self) -> bool:
        return self.limit

    def unallocated_bytes(self) -> int:
        return self.pieces


def test_the_simulated_allocator_is_an_allocator_memory_and_a_peak_alone_is_not() -> None:
    assert isinstance(SimulatedAllocator(1), AllocatorMemory)
    assert not isinstance(SimulatedMemory(1), AllocatorMemory)


@needs_plans
def test_a_step_at_the_allocators_limit_plans_again_less_its_free_pieces(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    first = guard.plan
    # The budget less the pieces is below the first plan's peak, above the least that fits:
    # another step is planned, and it fits.
    assert first.smallest_budget_bytes < first.peak_bytes
    pieces = guard.budget_bytes - (first.peak_bytes + first.smallest_budget_bytes) // 2
    guard.memory = memory = SimulatedAllocator(first.peak_bytes, pieces, limit=True)
    _step_matches_torch(model, blocks, first, seed=0)
    with pytest.warns(matepoint.BudgetOvershootWarning, match="to its limit") as caught:
        _step_matches_torch(model, blocks, first, seed=1)
    message = str(caught[0].message)
    assert f"({first.peak_bytes + pieces // 2} bytes)" in message  # what the allocator held
    assert f"up to {pieces / (1 << 30):.2f} GiB ({pieces} bytes) of it in free pieces" in message
    assert re.search(r"; planned again at [^:]* in \d+\.\d s: the budget plan", message)
    reading = guard.readings[-1]
    assert reading.over_budget is False
    assert (reading.reserved_bytes, reading.reached_limit) == (first.peak_bytes + pieces // 2, True)
    assert reading.near_failure
    assert reading.pieces_bytes == pieces
    assert guard.replans == 1
    second = guard.plan
    assert second.budget_bytes == guard.budget_bytes - pieces < first.budget_bytes
    assert second.fits
    assert second.peak_bytes <= second.budget_bytes < first.peak_bytes
    assert second.decisions != first.decisions
    # The next steps run under the new plan; a step below the limit plans nothing.
    memory.peak, memory.limit = second.peak_bytes, False
    with warnings.catch_warnings():
        warnings.simplefilter("error", matepoint.BudgetOvershootWarning)
        for seed in (2, 3):
            _step_matches_torch(model, blocks, second, seed)
    assert guard.replans == 1


@needs_plans
@pytest.mark.parametrize(
    ("limit", "held_beyond"),
    [(False, 0), (True, 1)],
    ids=["below the limit", "at the limit, peak and pieces within what it held"],
)
def test_pieces_away_from_failure_plan_nothing(
    cpu_transport: CPUTestTransport, limit: bool, held_beyond: int
) -> None:
    model, blocks, guard = _guarded()
    plan = guard.plan
    pieces = guard.budget_bytes
    held = plan.peak_bytes + pieces + held_beyond if limit else None
    guard.memory = SimulatedAllocator(plan.peak_bytes, pieces, limit=limit, held=held)
    with warnings.catch_warnings():
        warnings.simplefilter("error", matepoint.BudgetOvershootWarning)
        for seed in range(guard.steps + 1):
            _step_matches_torch(model, blocks, plan, seed)
    assert guard.plan is plan
    assert [reading.pieces_bytes for reading in guard.readings] == [pieces] * guard.steps
    assert not any(reading.near_failure for reading in guard.readings)


@needs_plans
def test_an_out_of_memory_error_among_free_pieces_plans_again_before_the_next_step(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    first = guard.plan
    pieces = guard.budget_bytes - first.peak_bytes + first.peak_bytes // 16
    guard.memory = memory = SimulatedAllocator(first.peak_bytes, pieces)
    failing = {"forward": True}

    def run_out(_module: Any, _args: Any) -> None:
        if failing["forward"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 896.00 MiB")

    blocks[2].register_forward_pre_hook(run_out)
    with pytest.raises(matepoint.BudgetOutOfMemoryError), guard.step():
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    assert guard.plan is first  # planned again before the next step, not inside the error
    failing["forward"] = False
    memory.pieces = 0
    ran_under: list[matepoint.BudgetPlan] = []

    def guarded_step() -> None:
        with guard.step():
            ran_under.append(guard.plan)
            _step_matches_torch(model, blocks, guard.plan, seed=0)

    with pytest.warns(matepoint.BudgetOvershootWarning, match="ran out of memory with") as caught:
        guarded_step()
    assert f"({pieces} bytes) held by the caching allocator" in str(caught[0].message)
    (second,) = ran_under
    assert second is not first
    assert second.budget_bytes == guard.budget_bytes - pieces
    assert guard.replans == 1


@needs_plans
def test_an_out_of_memory_error_outside_step_plans_again_at_the_next_forward(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    first = guard.plan
    pieces = guard.budget_bytes // 4
    guard.memory = SimulatedAllocator(first.peak_bytes, pieces)
    failing = {"forward": True}

    def run_out(_module: Any, _args: Any) -> None:
        if failing["forward"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    blocks[1].register_forward_pre_hook(run_out)
    with pytest.raises(matepoint.BudgetOutOfMemoryError):
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    failing["forward"] = False
    with pytest.warns(matepoint.BudgetOvershootWarning, match="ran out of memory with"):
        _step_matches_torch(model, blocks, first, seed=0)  # the forward plans again first
    assert guard.plan.budget_bytes == guard.budget_bytes - pieces
    # ``_step_matches_torch`` compared against the plan in force after the forward.
    _step_matches_torch(model, blocks, guard.plan, seed=1)


@needs_plans
def test_the_limit_counts_against_max_replans(cpu_transport: CPUTestTransport) -> None:
    model, blocks, guard = _guarded()
    guard.max_replans = 0
    first = guard.plan
    guard.memory = SimulatedAllocator(first.peak_bytes, guard.budget_bytes // 4, limit=True)
    _step_matches_torch(model, blocks, first, seed=0)
    with pytest.warns(matepoint.BudgetOvershootWarning, match="not planned again"):
        _step_matches_torch(model, blocks, first, seed=1)
    assert guard.plan is first


def test_cuda_memory_reads_the_allocators_limit_since_its_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``CudaMemory`` on a simulated CUDA allocator: its retries and failures since the reset
    are the limit; held less allocated, the free pieces."""
    stats = {"num_alloc_retries": 3, "num_ooms": 1, "inactive_split_bytes.all.peak": 2}
    figures = {"reserved": 10, "allocated": 7, "max_reserved": 12, "max_allocated": 9}
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "memory_stats", lambda device=None: dict(stats))
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: figures["reserved"])
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: figures["allocated"])
    monkeypatch.setattr(cuda, "max_memory_reserved", lambda device=None: figures["max_reserved"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: figures["max_allocated"])
    memory = CudaMemory()
    assert isinstance(memory, AllocatorMemory)
    memory.reset_peak()
    assert not memory.reached_limit()  # the earlier retries were before the reset
    assert (memory.peak_bytes(), memory.reserved_peak_bytes()) == (9, 12)
    assert memory.unallocated_bytes() == 3
    assert memory.pieces_peak_bytes() == 2
    stats["num_alloc_retries"] += 1
    assert memory.reached_limit()
    memory.reset_peak()
    stats["num_ooms"] += 1
    assert memory.reached_limit()
    figures["allocated"] = 11
    assert memory.unallocated_bytes() == 0


def test_near_failure_tells_the_step_that_failed_next_from_one_that_trains() -> None:
    """Readings of llama64-long under a 24 GiB cap on an H100 (docs/budget.md): the plan at
    ``budget="auto"``, whose next step ran out of memory, and the plan made again at the
    budget less its pieces, which trained on every later step; both reached the limit."""
    budget = 23_192_823_398
    failed_next = matepoint.GuardReading(
        21_998_937_088, 21_848_925_184, budget, 25_696_403_456, 4_831_503_360, True
    )
    trained = matepoint.GuardReading(
        17_095_986_176, 16_939_746_304, budget, 25_545_408_512, 4_644_330_496, True
    )
    assert failed_next.near_failure
    assert not trained.near_failure


@needs_plans
@pytest.mark.parametrize("evaluation", ["no_grad", "inference_mode", "eval"])
def test_an_evaluation_forward_leaves_the_plan_again_to_the_next_training_step(
    cpu_transport: CPUTestTransport, evaluation: str
) -> None:
    model, blocks, guard = _guarded()
    first = guard.plan
    pieces = guard.budget_bytes // 4
    guard.memory = SimulatedAllocator(first.peak_bytes, pieces)

    def run_out(_module: Any, _args: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    handle = blocks[1].register_forward_pre_hook(run_out)
    with pytest.raises(matepoint.BudgetOutOfMemoryError):
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error", matepoint.BudgetOvershootWarning)
        if evaluation == "eval":
            model.eval()
            model(torch.randn(*SHAPE))
            model.train()
        else:
            context = torch.no_grad() if evaluation == "no_grad" else torch.inference_mode()
            with context:
                model(torch.randn(*SHAPE))
    assert guard.plan is first
    with pytest.warns(matepoint.BudgetOvershootWarning, match="ran out of memory with"):
        _step_matches_torch(model, blocks, first, seed=0)
    assert guard.plan.budget_bytes == guard.budget_bytes - pieces


@needs_plans
def test_the_guard_plans_again_inside_inference_mode(cpu_transport: CPUTestTransport) -> None:
    """A plan made again where the caller is in inference mode is the plan made outside it."""
    _model, _blocks, guard = _guarded()
    target = guard.budget_bytes - guard.budget_bytes // 4
    outside = guard._replan(target)
    with torch.inference_mode():
        inside = guard._replan(target)
    assert (inside.decisions, inside.peak_bytes, inside.settings) == (
        outside.decisions,
        outside.peak_bytes,
        outside.settings,
    )
