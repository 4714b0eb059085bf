"""Blocks compiled each on its own with their plan (Note [A block compiled with its plan]).

torchtitan's pattern: every block compiled with its checkpoint inside. The tests run the CPU
test transport and Dynamo's ``aot_eager`` backend (the traced graph run op by op, no C++
compiler needed): the compiled blocks give torch's gradients under the same policy bitwise, the
block inputs are offloaded by matepoint's engine and counted, what the policy keeps stays, and a
plan the compiled graph cannot honour, a graph break or a non-module block is refused.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from test_budget_one_call import BLOCKS, SHAPE, Block, _stack, planned_stack
from test_budget_one_call import _matches_torch as matches_torch
from torch import nn

import matepoint
import matepoint.integrations as mi
from matepoint._compiled.blocks import CompiledBlockCheckpoint
from matepoint._planner.policy import AVAILABLE, OFFLOAD_AVAILABLE
from matepoint.testing import CPUTestTransport

needs_plans = pytest.mark.skipif(not AVAILABLE, reason="budget plans need torch 2.5")
AOT_EAGER = {"backend": "aot_eager"}
INPUT_BYTES = SHAPE[0] * SHAPE[1] * 4


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _function(wrapper: nn.Module) -> Any:
    """The checkpoint function a wrapper runs (torch's wrapper may hold it in a partial)."""
    function = wrapper.checkpoint_fn
    return function.func if isinstance(function, functools.partial) else function


def _steps_match_torch(model: nn.Module, plan: matepoint.BudgetPlan | None, steps: int = 2) -> None:
    """Steps of ``model`` against its blocks' twins under torch's checkpoint, the plan's policy
    per region, its unchecked regions called as they are: gradients bitwise equal."""
    blocks = [wrapper._checkpoint_wrapped_module for wrapper in model]
    matches_torch(model, blocks, plan, steps=steps)


def test_compiled_blocks_offload_their_inputs_and_give_torchs_gradients(
    cpu_transport: CPUTestTransport,
) -> None:
    model = _stack()
    mi.apply_matepoint_checkpointing(model, lambda m: isinstance(m, Block), compile=AOT_EAGER)
    assert all(isinstance(_function(wrapper), CompiledBlockCheckpoint) for wrapper in model)
    matepoint.reset_stats()
    _steps_match_torch(model, None)
    stats = matepoint.stats()
    # Each block's input, each step, through the engine; nothing else the graphs save.
    assert stats.offloads == 2 * BLOCKS
    assert stats.bytes_offloaded == 2 * BLOCKS * INPUT_BYTES
    assert stats.skipped_parameters == 0  # the weights the graphs save are left uncounted


@needs_plans
def test_a_plan_is_compiled_into_each_block(cpu_transport: CPUTestTransport) -> None:
    model, plan = planned_stack(compile=AOT_EAGER)
    assert plan.settings.compiled_offload  # planned for compiled blocks (rule 3) ...
    assert not matepoint.get_options().compiled_offload  # ... but not set for the process
    assert "offload" not in dict(plan.decisions).values()
    _steps_match_torch(model, plan)


@needs_plans
def test_the_wrapper_compiled_again_compiles_the_block_once(
    cpu_transport: CPUTestTransport,
) -> None:
    """torchtitan compiles each wrapped block: the wrapper is traced into that graph (torch's
    checkpoint with the plan's policy, fullgraph=True), and its own compile is not used."""
    blocks = [Block() for _ in range(2)]
    wrapped = [mi.checkpoint_wrapper(block, compile=AOT_EAGER) for block in blocks]
    compiled = [torch.compile(wrapper, fullgraph=True, backend="aot_eager") for wrapper in wrapped]
    x = torch.randn(*SHAPE, requires_grad=True)
    y = x
    for module in compiled:
        y = module(y)
    y.sum().backward()
    assert x.grad is not None
    assert all(len(_function(wrapper)._compiled) == 0 for wrapper in wrapped)


def test_a_graph_break_in_a_block_is_an_error() -> None:
    class Breaking(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(SHAPE[1], SHAPE[1])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.linear(x).sum().item() > 0:  # data-dependent Python control flow
                return self.linear(x)
            return -self.linear(x)

    wrapper = mi.checkpoint_wrapper(Breaking(), compile=AOT_EAGER)
    with pytest.raises(Exception, match=r"(?i)graph break|unsupported|data-dependent|item"):
        wrapper(torch.randn(*SHAPE, requires_grad=True))


@needs_plans
@pytest.mark.skipif(not OFFLOAD_AVAILABLE, reason="offload values need torch 2.11")
def test_a_plan_that_offloads_through_its_policy_is_refused() -> None:
    model, plan = _stack(), planned_stack()[1]
    offloading = dataclasses.replace(plan, decisions=(("matmul 64x256", "offload"),))
    with pytest.raises(ValueError, match="keeps on the device what the plan offloads"):
        mi.apply_matepoint_checkpointing(
            model, lambda m: isinstance(m, Block), budget_plan=offloading, compile=True
        )


def test_a_block_that_is_no_module_or_a_reentrant_checkpoint_is_refused() -> None:
    function = CompiledBlockCheckpoint(None, 0, compile_options=AOT_EAGER)
    with pytest.raises(TypeError, match="not the block module"):
        function(torch.sin, torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="non-reentrant"):
        CompiledBlockCheckpoint(None, 0, checkpoint_options={"use_reentrant": True})


def test_a_copy_compiles_afresh() -> None:
    wrapper = mi.checkpoint_wrapper(Block(), compile=AOT_EAGER)
    wrapper(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    twin = copy.deepcopy(wrapper)
    assert len(_function(wrapper)._compiled) == 1
    assert isinstance(_function(twin), CompiledBlockCheckpoint)
    assert len(_function(twin)._compiled) == 0
    twin(torch.randn(*SHAPE, requires_grad=True)).sum().backward()


class Scaled(nn.Module):
    """Blocks a model calls through partials: the block with a tensor keyword, and the
    model's method with the block's position (as the examples' GPT does)."""

    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(blocks))

    def mixed(
        self, index: int, x: torch.Tensor, *, scale: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> torch.Tensor:
        factor = scale if isinstance(scale, torch.Tensor) else scale[0] * scale[1]
        return self.blocks[index](x) * factor


# Dynamo reads .grad of the model's tensors while it traces a method of the model (not its
# forward), which torch warns about for the non-leaf block outputs.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_partials_of_a_block_or_of_a_models_method_compile_once_per_block(
    cpu_transport: CPUTestTransport,
) -> None:
    model = Scaled()
    reference = copy.deepcopy(model)
    function = CompiledBlockCheckpoint(None, 0, compile_options=AOT_EAGER)
    matepoint.reset_stats()
    for _ in range(2):  # a new partial each call, as a model's forward makes them
        for each, call in ((model, function), (reference, None)):
            each.zero_grad(set_to_none=True)
            torch.manual_seed(0)
            x = torch.randn(*SHAPE, requires_grad=True)
            # A pair of tensors, as a rotary embedding's: passed each call, not compiled in.
            scale = (torch.full((SHAPE[1],), 0.5), torch.ones(SHAPE[1]))
            for index in range(2):
                step = functools.partial(each.mixed, index, scale=scale)
                if call is None:
                    x = torch_checkpoint.checkpoint(step, x, use_reentrant=False)
                else:
                    x = call(step, x)
            x.sum().backward()
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(got.grad, want.grad)  # type: ignore[arg-type]
    assert len(function._compiled) == 2  # one per position, reused by the second step
    assert matepoint.stats().offloads >= 4  # each block's input, each step
    with pytest.raises(TypeError, match="without tensor positional arguments"):
        function(functools.partial(model.mixed, torch.ones(1)), torch.ones(2))
    with pytest.raises(TypeError, match="must be hashable"):
        function(functools.partial(model.mixed, [0]), torch.ones(2))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_more_positions_than_dynamos_default_limit_compile_with_fullgraph() -> None:
    """Twelve positions of one method share its code: one compiled entry each, past Dynamo's
    default limit of eight, which a fullgraph compile would fail on (rule 6)."""
    model = Scaled(blocks=12)
    function = CompiledBlockCheckpoint(None, 0, compile_options=AOT_EAGER)
    x = torch.randn(*SHAPE, requires_grad=True)
    y = x
    for index in range(12):
        y = function(functools.partial(model.mixed, index, scale=torch.ones(SHAPE[1])), y)
    y.sum().backward()
    assert len(function._compiled) == 12
    assert x.grad is not None


@needs_plans
def test_the_guard_plans_compiled_blocks_again_and_names_the_plan(
    cpu_transport: CPUTestTransport,
) -> None:
    """An overshoot plans again for compiled blocks and compiles the new plan into them; an
    out-of-memory error in a compiled block names the plan (Note [The budget guard])."""
    from test_budget_guard import SimulatedMemory

    model, plan = planned_stack(compile=AOT_EAGER, guard=True)
    guard = matepoint.budget_guard(model)
    assert guard is not None
    guard.memory = memory = SimulatedMemory(plan.peak_bytes)
    for _ in range(2):
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    memory.peak = guard.budget_bytes + 1
    with pytest.warns(matepoint.BudgetOvershootWarning, match="planned again"):
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
    assert guard.replans == 1
    replanned = guard.plan
    memory.peak = replanned.peak_bytes  # the next steps within the new prediction
    assert replanned.settings.compiled_offload
    assert "offload" not in dict(replanned.decisions).values()
    assert all(getattr(w.checkpoint_fn, "func", None) is not None for w in model)
    inner = [w.checkpoint_fn.args[1] for w in model]  # naming_the_plan(guard, function)
    assert all(isinstance(function, CompiledBlockCheckpoint) for function in inner)
    matches_torch(model, [w._checkpoint_wrapped_module for w in model], replanned, steps=1)

    def run_out(*_args: Any, **_kwargs: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    # Dynamo does not see a hook added to a compiled block: the compiled call itself runs out.
    compiled = model[2].checkpoint_fn.args[1]._compiled
    assert compiled
    compiled.update(dict.fromkeys(compiled, run_out))
    with pytest.raises(matepoint.BudgetOutOfMemoryError, match="budget plan of 4 regions"):
        model(torch.randn(*SHAPE, requires_grad=True)).sum().backward()
