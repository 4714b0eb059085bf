"""The guard on a budget plan's first real steps (Note [The budget guard] in ``matepoint._guard``).

The device's peak is simulated (``guard.memory``): an overshoot warns and applies a plan made at
a smaller budget, under which the next step gives gradients bitwise equal (fp32, CPU test
transport) to torch's checkpoint under the new plan's policy; no overshoot plans nothing; an
out-of-memory error in a guarded step is re-raised naming the plan, and training goes on.
"""

from __future__ import annotations

import copy
import gc
import pickle
import warnings
import weakref
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from test_budget_one_call import BLOCKS, FREE_POLICY, SHAPE, SLOW_COMPUTE, Block, needs_plans
from test_integrations import _tiny_llama
from torch import nn

import matepoint
import matepoint.integrations as mi
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport


class SimulatedMemory:
    """A device whose peak is what the test says; counts the resets."""

    def __init__(self, peak: int) -> None:
        self.peak = peak
        self.resets = 0

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        return self.peak


def _guarded(budget: Any = "1GiB") -> tuple[nn.Sequential, list[nn.Module], matepoint.BudgetGuard]:
    """A stack with its plan applied by the one call, and the guard it attached."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [Block() for _ in range(BLOCKS)]
    model = nn.Sequential(*blocks)
    mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget=budget,
        example_batch=torch.randn(*SHAPE),
        optimizer=None,
        device=FREE_POLICY,
    )
    guard = matepoint.budget_guard(model)
    assert guard is not None
    return model, blocks, guard


def _step_matches_torch(
    model: nn.Module, blocks: list[nn.Module], plan: matepoint.BudgetPlan, seed: int
) -> None:
    """One step of ``model`` against ``blocks``' twins through torch's checkpoint with the
    plan's policy per region, taken after the model's step has run (its forward may re-plan)."""
    reference = copy.deepcopy(blocks)
    for module in (model, *reference):
        module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    x = torch.randn(*SHAPE, requires_grad=True)
    model(x).sum().backward()
    plan = matepoint.budget_guard(model).plan if matepoint.budget_guard(model) else plan
    assert matepoint.get_options().min_offload_bytes == plan.min_offload_bytes
    y = x_reference = x.detach().clone().requires_grad_()
    for index, block in enumerate(reference):
        y = torch_checkpoint.checkpoint(
            block, y, use_reentrant=False, context_fn=plan.context_fn(index)
        )
    y.sum().backward()
    assert torch.equal(x.grad, x_reference.grad)  # type: ignore[arg-type]
    mine = [p for block in blocks for p in block.parameters()]
    theirs = [p for block in reference for p in block.parameters()]
    for got, want in zip(mine, theirs, strict=True):
        assert got.grad is not None
        assert torch.equal(got.grad, want.grad)


def test_the_out_of_memory_error_is_torchs_and_matepoints() -> None:
    error = matepoint.BudgetOutOfMemoryError("out", plan=None, budget_bytes=2, predicted_bytes=1)
    assert isinstance(error, matepoint.MatepointError)
    assert isinstance(error, torch.cuda.OutOfMemoryError)
    assert (error.budget_bytes, error.predicted_bytes) == (2, 1)


@needs_plans
def test_a_simulated_overshoot_warns_and_applies_a_plan_at_a_smaller_budget(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    first = guard.plan
    # The first step, within its prediction: read at the second step's forward.
    guard.memory = memory = SimulatedMemory(first.peak_bytes)
    _step_matches_torch(model, blocks, first, seed=0)
    assert memory.resets == 1
    # The second step peaks a byte over the budget: the third forward reads it, plans
    # again and runs under the new plan.
    _step_matches_torch(model, blocks, first, seed=1)
    memory.peak = guard.budget_bytes + 1
    with pytest.warns(matepoint.BudgetOvershootWarning, match="over the budget") as caught:
        _step_matches_torch(model, blocks, first, seed=2)
    assert memory.resets == 3
    message = str(caught[0].message)
    for figure in (guard.budget_bytes + 1, first.peak_bytes, guard.budget_bytes):
        assert f"({figure} bytes)" in message
    assert "a gap of" in message
    assert guard.replans == 1
    second = guard.plan
    gap = guard.readings[-1].gap_bytes
    assert gap == guard.budget_bytes + 1 - first.peak_bytes
    assert second.budget_bytes == guard.budget_bytes - gap < first.budget_bytes
    assert second.peak_bytes <= second.budget_bytes
    assert second.decisions != first.decisions
    # The next step runs under the new plan too, which the guard reads against its own peak.
    memory.peak = second.peak_bytes
    _step_matches_torch(model, blocks, second, seed=3)
    assert [reading.over_budget for reading in guard.readings] == [False, True, False]
    assert guard.readings[-1].predicted_bytes == second.peak_bytes


@needs_plans
def test_no_overshoot_plans_nothing_and_stops_reading_after_the_first_steps(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    plan = guard.plan
    guard.memory = memory = SimulatedMemory(plan.peak_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", matepoint.BudgetOvershootWarning)
        for seed in range(guard.steps + 3):
            _step_matches_torch(model, blocks, plan, seed)
    assert guard.replans == 0
    assert guard.plan is plan
    assert len(guard.readings) == guard.steps
    assert not guard.watching
    assert memory.resets == guard.steps
    # An evaluation forward reads nothing, even where the guard would read a step.
    guard.steps += 1
    with torch.no_grad():
        model(torch.randn(*SHAPE))
    model.eval()
    model(torch.randn(*SHAPE))
    assert len(guard.readings) == guard.steps - 1
    assert memory.resets == guard.steps - 1


@needs_plans
def test_an_out_of_memory_error_names_the_plan_and_training_goes_on(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    plan = guard.plan
    guard.memory = SimulatedMemory(plan.peak_bytes)
    failing = {"backward": True}

    def run_out(_grad: torch.Tensor) -> None:
        if failing["backward"]:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def out_of_memory_in_backward(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        output.register_hook(run_out)

    blocks[1].register_forward_hook(out_of_memory_in_backward)
    with pytest.raises(matepoint.BudgetOutOfMemoryError) as caught, guard.step():
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    error = caught.value
    assert isinstance(error, torch.cuda.OutOfMemoryError)
    assert isinstance(error.__cause__, torch.cuda.OutOfMemoryError)
    assert error.plan is plan
    assert error.budget_bytes == guard.budget_bytes
    assert error.predicted_bytes == plan.peak_bytes
    assert f"predicted peak {plan.peak_bytes / (1 << 30):.2f} GiB ({plan.peak_bytes} bytes)" in (
        str(error)
    )
    assert "Tried to allocate 2.00 GiB" in str(error)
    # The later blocks' gradients were accumulated before the error; none is left.
    assert all(p.grad is None for p in model.parameters())
    failing["backward"] = False
    for seed in range(2):
        with guard.step():
            _step_matches_torch(model, blocks, plan, seed)


@needs_plans
def test_an_out_of_memory_error_in_forward_leaves_the_next_step_right(
    cpu_transport: CPUTestTransport,
) -> None:
    model, blocks, guard = _guarded()
    plan = guard.plan

    def run_out(*_args: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    handle = blocks[2].register_forward_pre_hook(run_out)
    planned = pytest.raises(matepoint.BudgetOutOfMemoryError, match="budget plan of 4 regions")
    with planned, guard.step():
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    handle.remove()
    for seed in range(2):
        _step_matches_torch(model, blocks, plan, seed)


@needs_plans
def test_guard_false_attaches_none_and_a_cpu_model_reads_nothing() -> None:
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)])
    mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget="1GiB",
        example_batch=torch.randn(*SHAPE),
        optimizer=None,
        device=FREE_POLICY,
        guard=False,
    )
    assert matepoint.budget_guard(model) is None
    # Nor do its blocks name a plan (Note [The budget guard], rule 5).
    _out_of_memory_in(model[1]._checkpoint_wrapped_module, "forward")
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    assert not isinstance(caught.value, matepoint.BudgetOutOfMemoryError)
    _model, _blocks, guard = _guarded()
    assert guard.memory is None
    assert not guard.watching
    assert guard.check() is None
    guard.remove()
    assert matepoint.budget_guard(_model) is None


def _overshoot(guard: matepoint.BudgetGuard, step: Any) -> matepoint.BudgetPlan:
    """Run ``step`` three times, the second a byte over the budget (read at the third's
    forward, which plans again); return the new plan."""
    first = guard.plan
    guard.memory = memory = SimulatedMemory(first.peak_bytes)
    step()
    step()
    memory.peak = guard.budget_bytes + 1
    with pytest.warns(matepoint.BudgetOvershootWarning, match="planned again"):
        step()
    assert guard.replans == 1
    assert guard.plan.budget_bytes < first.budget_bytes
    memory.peak = guard.plan.peak_bytes + guard.states_bytes
    return guard.plan


@needs_plans
def test_a_transformers_model_plans_again_layer_by_layer(cpu_transport: CPUTestTransport) -> None:
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mi.enable_hf_gradient_checkpointing(
        model,
        budget="1GiB",
        example_batch={"input_ids": ids, "labels": ids},
        optimizer=optimizer,
        device=SLOW_COMPUTE,
    )
    guard = matepoint.budget_guard(model)
    assert guard is not None
    assert guard.states_bytes > 0  # SGD's momentum, counted before its first step
    assert guard.budget_bytes == guard.plan.budget_bytes + guard.states_bytes
    model.train()
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    before = [layer._gradient_checkpointing_func for layer in layers]

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    plan = _overshoot(guard, step)
    assert plan.regions == len(layers) == 3
    # Each layer has a new function of its own (its region of the new plan).
    after = [layer._gradient_checkpointing_func for layer in layers]
    assert len({id(function) for function in after}) == 3
    assert not {id(function) for function in after} & {id(function) for function in before}
    assert matepoint.get_options().min_offload_bytes == plan.min_offload_bytes
    step()


@needs_plans
def test_checkpoint_wrapper_plans_the_module_again(cpu_transport: CPUTestTransport) -> None:
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(*SHAPE)
    wrapper = mi.checkpoint_wrapper(
        block, budget="1GiB", example_batch=x, optimizer=None, device=FREE_POLICY
    )
    guard = matepoint.budget_guard(wrapper)
    assert guard is not None
    reference = copy.deepcopy(block)

    def step() -> None:
        wrapper(x.requires_grad_()).sum().backward()

    plan = _overshoot(guard, step)
    block.zero_grad(set_to_none=True)
    wrapper(x).sum().backward()
    torch_checkpoint.checkpoint(
        reference, x.detach(), use_reentrant=False, context_fn=plan.context_fn(0)
    ).sum().backward()
    for got, want in zip(block.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got.grad, want.grad)


class OwnCalls(nn.Module):
    """A model whose forward calls ``matepoint.checkpoint`` itself, block ``i`` with
    ``context_fns[i]``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.context_fns = [torch_checkpoint.noop_context_fn] * BLOCKS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, context_fn in zip(self.blocks, self.context_fns, strict=True):
            x = matepoint.checkpoint(block, x, context_fn=context_fn)
        return x


@needs_plans
def test_a_guard_of_ones_own_calls_checks_each_step(cpu_transport: CPUTestTransport) -> None:
    model = OwnCalls()
    x = torch.randn(*SHAPE)

    def replan(budget: int) -> matepoint.BudgetPlan:
        planned = copy.copy(model)
        planned.context_fns = [torch_checkpoint.noop_context_fn] * BLOCKS
        return matepoint.plan_budget(planned, x, optimizer=None, budget=budget, device=FREE_POLICY)

    def apply(plan: matepoint.BudgetPlan) -> None:
        matepoint.configure(**plan.settings_changes())
        model.context_fns = [plan.context_fn(i) for i in range(BLOCKS)]

    first = replan(1 << 30)
    apply(first)
    memory = SimulatedMemory(first.peak_bytes)
    guard = matepoint.BudgetGuard(first, replan=replan, apply=apply, model=model, memory=memory)
    assert matepoint.budget_guard(model) is None  # not attached: the steps call it
    for _ in range(2):
        with guard.step():
            model(x.requires_grad_()).sum().backward()
    assert [reading.over_budget for reading in guard.readings] == [False, False]
    memory.peak = guard.budget_bytes + 1
    with pytest.warns(matepoint.BudgetOvershootWarning), guard.step():
        model(x).sum().backward()
    assert guard.replans == 1
    assert model.context_fns[0] is not first.context_fn(0)
    assert guard.plan.budget_bytes < first.budget_bytes


@needs_plans
def test_the_guard_dies_with_its_model_and_keeps_no_batch() -> None:
    model, _blocks, guard = _guarded()
    guard_ref, model_ref = weakref.ref(guard), weakref.ref(model)
    batch = guard._replan.args[2]  # type: ignore[attr-defined]
    assert batch.device.type == "meta"  # only its shape: no device memory kept alive
    del model, _blocks, guard
    gc.collect()
    assert model_ref() is None
    assert guard_ref() is None


@needs_plans
def test_a_copy_of_a_guarded_model_carries_no_guard() -> None:
    model, _blocks, guard = _guarded()
    (hook,) = model._forward_pre_hooks.values()
    # Its hook pickles (torch.save of the whole model) as one that guards nothing.
    assert pickle.loads(pickle.dumps(hook)).guard is None
    twin = copy.deepcopy(model)
    assert matepoint.budget_guard(twin) is None
    guard.memory = memory = SimulatedMemory(1 << 40)  # any reading would warn
    for _ in range(2):
        twin(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    assert memory.resets == 0
    assert matepoint.budget_guard(model) is guard


@needs_plans
def test_a_plan_without_checkpoint_is_planned_again_with_checkpoints_on_an_overshoot(
    cpu_transport: CPUTestTransport,
) -> None:
    """The step without any checkpoint was chosen (the blocks run as they are); over the
    budget, the guard plans the model again with its blocks checkpointed, and applies that."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = [Block() for _ in range(BLOCKS)]
    model = nn.Sequential(*blocks)
    first = mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget="1GiB",
        example_batch=torch.randn(*SHAPE),
        optimizer=None,
    )
    assert not first.checkpoint
    guard = matepoint.budget_guard(model)
    assert guard is not None
    guard.memory = memory = SimulatedMemory(first.peak_bytes)
    model(torch.randn(*SHAPE)).sum().backward()
    # A byte over: planned again at a byte below the step without checkpoints.
    memory.peak = guard.budget_bytes + 1
    with pytest.warns(matepoint.BudgetOvershootWarning, match="over the budget"):
        model(torch.randn(*SHAPE)).sum().backward()
    assert guard.replans == 1
    assert guard.plan.checkpoint
    assert guard.plan.regions == BLOCKS


# --- Note [The budget guard], rule 5: the blocks name the plan outside step() ------------------


def _out_of_memory_in(block: nn.Module, when: str) -> Any:
    """Make ``block`` run out of memory in its forward or in its recomputation."""

    def run_out(*_args: Any) -> None:
        if (when == "recomputation") == compat.in_backward():
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB")

    return block.register_forward_pre_hook(run_out)


@needs_plans
@pytest.mark.parametrize("when", ["forward", "recomputation"])
def test_a_block_names_the_plan_outside_step_and_training_goes_on(
    cpu_transport: CPUTestTransport, when: str
) -> None:
    model, blocks, guard = _guarded()
    plan = guard.plan
    model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()  # gradients to clear
    handle = _out_of_memory_in(blocks[1], when)
    with pytest.raises(
        matepoint.BudgetOutOfMemoryError, match="budget plan of 4 regions"
    ) as caught:
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    handle.remove()
    assert caught.value.plan is plan
    assert "Tried to allocate 3.00 GiB" in str(caught.value)
    assert isinstance(caught.value.__cause__, torch.cuda.OutOfMemoryError)
    grads = [p.grad for p in model.parameters()]
    if when == "forward":  # cleared at once
        assert all(grad is None for grad in grads)
    else:  # backward had accumulated into the later blocks: cleared before the next forward
        assert any(grad is not None for grad in grads)
        model.eval()
        with torch.no_grad():
            model(torch.randn(*SHAPE))
        model.train()
        assert all(p.grad is None for p in model.parameters())
    for seed in range(2):
        _step_matches_torch(model, blocks, plan, seed)


@needs_plans
def test_an_out_of_memory_error_outside_the_blocks_keeps_torchs_error_outside_step() -> None:
    """Only step() sees the whole step: backward's own error, outside any block's recomputation,
    is torch's."""
    model, blocks, _guard = _guarded()

    def run_out(_grad: torch.Tensor) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    def out_of_memory_in_backward(_module: nn.Module, _args: Any, output: torch.Tensor) -> None:
        output.register_hook(run_out)

    blocks[1].register_forward_hook(out_of_memory_in_backward)
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    assert not isinstance(caught.value, matepoint.BudgetOutOfMemoryError)
