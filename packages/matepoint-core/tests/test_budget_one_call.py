"""The budget mode in one call: ``matepoint.plan_budget`` and ``budget=`` on the integrations.

Each plan is made from the live model on a meta twin; the tests check that planning leaves the
model as it was and makes no tensor off the meta device, that the budget is read and the
optimizer's states subtracted, and that the applied plan gives gradients bitwise equal (fp32,
CPU test transport) to torch's checkpoint under the same policy per region.
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from test_integrations import _tiny_llama
from torch import nn

import matepoint
import matepoint.integrations as mi
import matepoint.integrations._functions as integration_functions
import matepoint_compat as compat
from matepoint import DeviceModel
from matepoint._planner import live_model, policy
from matepoint._planner.optimizer_states import optimizer_state_bytes, optimizer_step_bytes
from matepoint._planner.trace import ALLOCATION_GRANULARITY, round_up
from matepoint.testing import CPUTestTransport

needs_plans = pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5")

# Compute at 1 TFLOP/s and a policy without host time: keeping what is dear pays.
FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)
# Compute so slow that the tiny transformers model's FLOPs outweigh any host time.
SLOW_COMPUTE = DeviceModel(peak_flops=1e6, policy_seconds_per_op=0)
BLOCKS, SHAPE = 4, (512, 64)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 256, bias=False)
        self.down = nn.Linear(256, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class OwnCalls(nn.Module):
    """A model whose forward calls ``matepoint.checkpoint`` itself, block ``i`` with
    ``context_fns[i]`` (torch's noop until a plan is applied)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.context_fns = [torch_checkpoint.noop_context_fn] * BLOCKS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, context_fn in zip(self.blocks, self.context_fns, strict=True):
            x = matepoint.checkpoint(block, x, context_fn=context_fn)
        return x


def _stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(BLOCKS)])


def planned_stack(
    budget: int | str = "1GiB", device: DeviceModel = FREE_POLICY, **options: Any
) -> tuple[nn.Sequential, matepoint.BudgetPlan]:
    """A stack with its blocks wrapped by the one call at ``budget``, no optimizer, and the plan
    (``options``: the integration's other keywords, ``guard=False`` among them by default)."""
    model = _stack()
    plan = mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget=budget,
        example_batch=torch.randn(*SHAPE),
        optimizer=None,
        device=device,
        **{"guard": False, **options},
    )
    assert plan is not None
    return model, plan


class NonMetaTensors(compat.TorchDispatchMode):
    """Records every tensor an op makes off the meta device, with its bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for leaf in compat.tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                self.made.append((str(func), leaf.nbytes))
        return out


class CheckpointCalls:
    """Counts matepoint's checkpoint calls made through the integrations."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = integration_functions.checkpoint

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(integration_functions, "checkpoint", counted)


def _snapshot(model: nn.Module) -> list[tuple[str, torch.Tensor, int, torch.Tensor | None]]:
    state = [*model.named_parameters(), *model.named_buffers()]
    return [
        (name, tensor.detach().clone(), tensor.data_ptr(), getattr(tensor, "grad", None))
        for name, tensor in state
    ]


def _assert_unchanged(model: nn.Module, before: list[Any]) -> None:
    after = _snapshot(model)  # in the same order (a wrapper adds a prefix to the names)
    assert len(after) == len(before)
    for (_, value, pointer, grad), (_, now, now_pointer, now_grad) in zip(
        before, after, strict=True
    ):
        assert torch.equal(value, now)
        assert pointer == now_pointer
        assert grad is now_grad
        assert now.device.type == "cpu"


def _matches_torch(
    model: nn.Module,
    blocks: list[nn.Module],
    plan: matepoint.BudgetPlan | None,
    *,
    steps: int = 2,
) -> None:
    """Steps of ``model`` (its plan applied) against ``blocks``' twins, block ``i`` through
    torch's checkpoint with region ``i``'s policy, or called as it is where the plan leaves
    region ``i`` unchecked (plain checkpoints without a plan): gradients bitwise equal."""
    reference = copy.deepcopy(blocks)
    settings = {} if plan is None else plan.settings_changes()
    for step in range(steps):
        for module in (model, *reference):
            module.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        x = torch.randn(*SHAPE, requires_grad=True)
        with matepoint.options(**settings):
            model(x).sum().backward()
        x_reference = x.detach().clone().requires_grad_()
        y = x_reference
        for index, block in enumerate(reference):
            if plan is not None and not plan.checkpoints_region(index):
                y = block(y)
                continue
            context = {} if plan is None else {"context_fn": plan.context_fn(index)}
            y = torch_checkpoint.checkpoint(block, y, use_reentrant=False, **context)
        y.sum().backward()
        assert torch.equal(x.grad, x_reference.grad)  # type: ignore[arg-type]
        mine = [p for block in blocks for p in block.parameters()]
        theirs = [p for block in reference for p in block.parameters()]
        for got, want in zip(mine, theirs, strict=True):
            assert got.grad is not None
            assert torch.equal(got.grad, want.grad)


# --- the budget ----------------------------------------------------------------------------------

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ("40GiB", 40 << 30),
        ("12.5GB", 12_500_000_000),
        (" 3 MiB ", 3 << 20),
        ("1e9", 10**9),
        ("2kib", 2048),
        (1000, 1000),
        (1.5e9, 1_500_000_000),
    ],
)
def test_a_budget_is_bytes_or_a_size_with_a_unit(budget: Any, expected: int) -> None:
    assert live_model.budget_bytes_of(budget, CPU) == expected


@pytest.mark.parametrize(
    "budget", ["0", "0GiB", "-5GiB", "inf", "nan", "10 parsecs", "", "GiB", 0, -1, float("nan")]
)
def test_a_zero_negative_infinite_or_malformed_budget_is_refused_with_the_format(
    budget: Any,
) -> None:
    with pytest.raises(ValueError, match='"40GiB"'):
        live_model.budget_bytes_of(budget, CPU)


@pytest.mark.parametrize("budget", [True, None, [1], b"1GiB"])
def test_a_budget_of_another_type_is_a_type_error(budget: Any) -> None:
    with pytest.raises(TypeError, match="budget takes"):
        live_model.budget_bytes_of(budget, CPU)


def test_auto_is_a_clear_error_off_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        live_model.budget_bytes_of("auto", CPU)


def test_auto_is_what_the_device_can_give_less_the_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 << 30)
    monkeypatch.setattr(
        torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0, raising=False
    )
    got = live_model.budget_bytes_of("AUTO", torch.device("cuda", 0))
    assert got == int((12 << 30) * (1 - live_model.AUTO_MARGIN))


@pytest.mark.parametrize(("fraction", "expected"), [(0.1, 8 << 30), (0.5, 12 << 30)])
def test_auto_stays_under_the_per_process_memory_fraction(
    monkeypatch: pytest.MonkeyPatch, fraction: float, expected: int
) -> None:
    # torch.cuda.set_per_process_memory_fraction(0.1) on an 80 GiB device caps the allocator at
    # 8 GiB, though 12 GiB are free or already held: "auto" plans to the smaller.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (10 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 << 30)
    monkeypatch.setattr(
        torch.cuda, "get_per_process_memory_fraction", lambda device: fraction, raising=False
    )
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 << 30)
    )
    got = live_model.budget_bytes_of("auto", torch.device("cuda", 0))
    assert got == int(expected * (1 - live_model.AUTO_MARGIN))
    # A device without its number is the current one: torch reads a numbered device's only.
    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_per_process_memory_fraction",
        lambda device: asked.append(device) or fraction,
        raising=False,
    )
    assert live_model.budget_bytes_of("auto", torch.device("cuda")) == got
    assert asked == [0]
    # A torch without the reading (2.4, 2.5) cannot tell the cap: free memory it is.
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction")
    free = live_model.budget_bytes_of("auto", torch.device("cuda", 0))
    assert free == int((12 << 30) * (1 - live_model.AUTO_MARGIN))


def test_ranks_per_node_come_from_torch_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    assert live_model.ranks_per_node() == 1  # not initialised
    distributed = torch.distributed
    monkeypatch.setattr(distributed, "is_available", lambda: True)
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "get_world_size", lambda *args: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert live_model.ranks_per_node() == 16
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert live_model.ranks_per_node() == 8


# --- the live model ------------------------------------------------------------------------------


@needs_plans
def test_planning_leaves_the_model_as_it_was_and_makes_nothing_off_meta() -> None:
    model = OwnCalls()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(*SHAPE)).sum().backward()  # gradients exist: the twin has them too
    optimizer.step()
    states = [copy.deepcopy(optimizer.state_dict())]
    before = _snapshot(model)
    x = torch.randn(*SHAPE)
    recorder = NonMetaTensors()
    with recorder:
        plan = matepoint.plan_budget(
            model, x, optimizer=optimizer, budget="1GiB", device=FREE_POLICY
        )
    assert recorder.made == []
    assert plan.regions == BLOCKS
    _assert_unchanged(model, before)
    after = optimizer.state_dict()
    for key, value in states[0]["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, after["state"][key][name])
    # The recorder sees a copy of the live tensors, which the twin never makes.
    with recorder:
        copy.deepcopy(model)
    assert sum(size for _, size in recorder.made) >= sum(p.nbytes for p in model.parameters())


@needs_plans
def test_the_budget_left_is_the_budget_less_the_optimizer_states() -> None:
    model = OwnCalls()
    for optimizer in (
        torch.optim.AdamW(model.parameters()),
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        torch.optim.SGD(model.parameters(), lr=0.1),
    ):
        plan = matepoint.plan_budget(model, torch.randn(*SHAPE), optimizer=optimizer, budget="1GiB")
        assert plan.budget_bytes == (1 << 30) - optimizer_state_bytes(optimizer)
    adamw = torch.optim.AdamW(model.parameters())
    assert optimizer_state_bytes(adamw) == 2 * sum(p.nbytes for p in model.parameters())
    # After its first step, from the states it holds.
    model(torch.randn(*SHAPE)).sum().backward()
    adamw.step()
    assert adamw.state
    plan = matepoint.plan_budget(model, torch.randn(*SHAPE), optimizer=adamw, budget=1 << 30)
    assert plan.budget_bytes == (1 << 30) - optimizer_state_bytes(adamw)
    none = matepoint.plan_budget(model, torch.randn(*SHAPE), optimizer=None, budget=1 << 30)
    assert none.budget_bytes == 1 << 30
    with pytest.raises(ValueError, match="whole budget"):
        matepoint.plan_budget(model, torch.randn(*SHAPE), optimizer=adamw, budget=1024)


@needs_plans
def test_the_optimizer_step_counts_and_a_budget_under_it_fits_nothing() -> None:
    # Wide layers and one row of input: the parameters, not the activations, make the step's
    # peak. On the meta device (planned as a GPU's) AdamW's default is its foreach loop.
    def plan_of(budget: int | str) -> matepoint.BudgetPlan:
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(2)])
        return mi.apply_matepoint_checkpointing(
            model,
            lambda module: isinstance(module, nn.Linear),
            budget=budget,
            example_batch=torch.randn(1, 4096, device="meta"),
            optimizer=torch.optim.AdamW(model.parameters()),
        )

    with torch.device("meta"):
        weights = [nn.Parameter(torch.empty(4096, 4096)) for _ in range(2)]
    adamw = torch.optim.AdamW(weights)
    held = 2 * sum(round_up(p.nbytes, ALLOCATION_GRANULARITY) for p in weights)
    step = held + optimizer_step_bytes(adamw)
    roomy = plan_of(budget="10GiB")
    assert roomy.fits
    assert roomy.optimizer_step_bytes == step
    # Forward and backward fit in their planned peak; the optimizer step's temporaries beside
    # the parameters and gradients do not: nothing fits, whatever the batch.
    assert roomy.peak_bytes < step
    states = optimizer_state_bytes(adamw)
    plan = plan_of(budget=roomy.peak_bytes + states)
    assert not plan.fits
    assert plan.batch_fraction == 0
    assert plan.smallest_budget_bytes == step
    assert "the optimizer step alone exceeds the budget" in str(plan)


@needs_plans
def test_the_one_call_gives_torchs_gradients_under_the_same_policy(
    cpu_transport: CPUTestTransport,
) -> None:
    model = OwnCalls()
    optimizer = torch.optim.AdamW(model.parameters())
    plan = matepoint.plan_budget(
        model, torch.randn(*SHAPE), optimizer=optimizer, budget="1GiB", device=FREE_POLICY
    )
    assert plan.fits
    assert dict(plan.decisions), plan  # it keeps something: the policy is exercised
    model.context_fns = [plan.context_fn(index) for index in range(BLOCKS)]
    _matches_torch(model, list(model.blocks), plan)


@needs_plans
def test_a_model_without_checkpoint_calls_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no matepoint\.checkpoint call"):
        matepoint.plan_budget(_stack(), torch.randn(*SHAPE), optimizer=None, budget="1GiB")


def test_a_sharded_parameter_is_refused_by_name() -> None:
    class Shard(torch.Tensor):
        pass

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.Tensor._make_subclass(Shard, torch.zeros(4, 4)))
    with pytest.raises(TypeError, match=r"weight.*Shard.*fully_shard"):
        live_model.meta_twin(model)


def test_before_torch_2_5_the_one_call_says_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(live_model, "AVAILABLE", False)
    with pytest.raises(RuntimeError, match=r"torch 2\.5"):
        matepoint.plan_budget(OwnCalls(), torch.randn(*SHAPE), optimizer=None, budget="1GiB")


# --- budget= on the integrations -----------------------------------------------------------------


@needs_plans
def test_apply_with_a_budget_plans_and_applies_one_region_per_block(
    cpu_transport: CPUTestTransport,
) -> None:
    model = _stack()
    before = _snapshot(model)
    plan = mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget="1GiB",
        example_batch=torch.randn(*SHAPE),
        optimizer=torch.optim.AdamW(model.parameters()),
        device=FREE_POLICY,
    )
    assert plan is not None
    assert plan.regions == BLOCKS
    assert dict(plan.decisions)
    assert matepoint.get_options().min_offload_bytes == plan.min_offload_bytes
    # Planning read nothing of the live tensors (the wrappers keep torch's names).
    _assert_unchanged(model, before)
    blocks = [wrapper._checkpoint_wrapped_module for wrapper in model]
    _matches_torch(model, blocks, plan)


@needs_plans
def test_a_plan_without_checkpoint_runs_the_blocks_as_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Room for the step without any checkpoint, which recomputes nothing and pays no policy:
    # the integrations then run every block as it is, through any of them.
    calls = CheckpointCalls(monkeypatch)
    model, reference = _stack(), _stack()
    plan = mi.apply_matepoint_checkpointing(
        model,
        lambda m: isinstance(m, Block),
        budget="1GiB",
        example_batch=torch.randn(*SHAPE),
        optimizer=torch.optim.AdamW(model.parameters()),
    )
    assert not plan.checkpoint
    calls.count = 0  # the twin's planned step ran matepoint's checkpoint
    batch = torch.randn(*SHAPE)
    model(batch).sum().backward()
    reference(batch).sum().backward()
    assert calls.count == 0
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert ours.grad is not None
        assert theirs.grad is not None
        assert torch.equal(ours.grad, theirs.grad)
    # The function the integrations install passes the block's own keywords on.
    function = mi.matepoint_checkpoint_fn(plan, region=0)
    assert function(lambda x, scale: x * scale, torch.ones(2), scale=3.0).tolist() == [3.0, 3.0]
    assert function(torch.sin, torch.zeros(1), use_reentrant=False, preserve_rng_state=True) == 0


@needs_plans
def test_checkpoint_wrapper_with_a_budget_plans_the_module_alone(
    cpu_transport: CPUTestTransport,
) -> None:
    block = Block()
    x = torch.randn(*SHAPE)
    wrapped = mi.checkpoint_wrapper(
        block, budget="1GiB", example_batch=x, optimizer=None, device=FREE_POLICY
    )
    plan = matepoint.plan_budget(wrapped, x, optimizer=None, budget="1GiB", device=FREE_POLICY)
    assert plan.regions == 1
    _matches_torch(wrapped, [block], plan)


def test_a_budget_needs_the_batch_and_the_optimizer() -> None:
    with pytest.raises(TypeError, match="example_batch"):
        mi.apply_matepoint_checkpointing(_stack(), budget="1GiB", optimizer=None)
    with pytest.raises(TypeError, match="optimizer="):
        mi.apply_matepoint_checkpointing(_stack(), budget="1GiB", example_batch=torch.ones(1))
    with pytest.raises(TypeError, match="not both"):
        mi.checkpoint_wrapper(
            Block(), budget="1GiB", budget_plan=object(), example_batch=1, optimizer=None
        )


# --- a transformers model ------------------------------------------------------------------------


@needs_plans
def test_a_transformers_model_plans_in_one_call_and_matches_torch(
    cpu_transport: CPUTestTransport,
) -> None:
    model = _tiny_llama()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    before = _snapshot(model)
    recorder = NonMetaTensors()
    with recorder:
        plan = mi.enable_hf_gradient_checkpointing(
            model,
            budget="1GiB",
            example_batch=batch,
            optimizer=torch.optim.AdamW(model.parameters()),
            device=SLOW_COMPUTE,
        )
    assert plan is not None
    assert dict(plan.decisions), plan  # it keeps something: the policy is exercised
    assert recorder.made == []
    _assert_unchanged(model, before)
    assert plan.regions == 3
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    # Each layer has a function of its own (its region), the model's own module none of theirs.
    functions = [layer._gradient_checkpointing_func for layer in layers]
    assert len({id(function) for function in functions}) == len(layers) == 3
    # Torch's checkpoint, layer i under region i's policy.
    if callable(enable := getattr(reference, "activation_checkpointing_enable", None)):
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # transformers before 5
        reference.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    reference_layers = [m for m in reference.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    for index, layer in enumerate(reference_layers):
        context = {"context_fn": plan.context_fn(index)}
        if plan.context_fn(index) is torch_checkpoint.noop_context_fn:
            context = {}
        layer._gradient_checkpointing_func = functools.partial(
            torch_checkpoint.checkpoint, use_reentrant=False, **context
        )
    for each in (model, reference):
        each.train()
        with matepoint.options(**plan.settings_changes()):
            each(input_ids=ids, labels=ids).loss.backward()
    for (name, got), want in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert got.grad is not None, name
        assert torch.equal(got.grad, want.grad), name


class Reversed(nn.Module):
    """Calls its blocks last to first: block i is not the step's i-th checkpoint call."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            x = block(x)
        return x


@needs_plans
def test_apply_with_a_budget_refuses_blocks_called_out_of_module_order() -> None:
    model = Reversed()
    with pytest.raises(ValueError, match=r"in the order \[3, 2, 1, 0\]"):
        mi.apply_matepoint_checkpointing(
            model,
            lambda m: isinstance(m, Block),
            budget="1GiB",
            example_batch=torch.randn(*SHAPE),
            optimizer=None,
        )
    assert all(isinstance(block, Block) for block in model.blocks)  # nothing wrapped


@needs_plans
def test_the_one_call_from_threads_answers_as_one_thread_does() -> None:
    """Each call plans its own meta twin; four threads on one live model and optimizer get the
    plan one thread gets, and the model is left as it was."""
    model = OwnCalls()
    optimizer = torch.optim.AdamW(model.parameters())
    before = _snapshot(model)

    def one_call(_: int) -> matepoint.BudgetPlan:
        return matepoint.plan_budget(
            model, torch.randn(*SHAPE), optimizer=optimizer, budget="1GiB", device=FREE_POLICY
        )

    alone = one_call(0)
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        plans = list(pool.map(one_call, range(4)))
    for plan in plans:
        assert (plan.decisions, plan.kept_in_last, plan.checkpoint) == (
            alone.decisions,
            alone.kept_in_last,
            alone.checkpoint,
        )
        assert plan.peak_bytes == alone.peak_bytes
        assert plan.optimizer_step_bytes == alone.optimizer_step_bytes
    _assert_unchanged(model, before)
