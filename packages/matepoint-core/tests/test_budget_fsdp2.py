"""``matepoint.plan_budget`` on a model whose blocks FSDP2's ``fully_shard`` wraps.

The model is planned per rank from a plain meta twin (Note [A sharded model's twin] in
``matepoint._planner.sharded_twin``). On one rank (gloo, in this process) a sharded model plans
as the same model unsharded, the correction aside: the same decisions, the peak higher by what
FSDP2 gathers beside the shards. On two ranks (two processes) the peak drops by the shards
another rank holds. Planning leaves the live model as it was and makes nothing off the meta
device.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import matepoint
import matepoint_compat as compat
from matepoint import DeviceModel
from matepoint._planner import live_model, policy, sharded_twin
from matepoint._planner.optimizer_states import optimizer_state_bytes

distributed = torch.distributed
FSDP = compat.fsdp_classes()
pytestmark = [
    pytest.mark.skipif(
        FSDP is None or not distributed.is_gloo_available(),
        reason="needs torch.distributed with gloo and FSDP2's fully_shard",
    ),
    pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5"),
]

# Compute at 1 TFLOP/s and a policy without host time: keeping what is dear pays.
FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)
BLOCKS, WIDTH, HIDDEN, SHAPE = 4, 64, 256, (512, 64)
# One block's gathered parameters: two fp32 weights of WIDTH x HIDDEN.
BLOCK_BYTES = 2 * WIDTH * HIDDEN * 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Stack(nn.Module):
    """Blocks, each through ``matepoint.checkpoint``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = matepoint.checkpoint(block, x)
        return x


def _sharded(model: Stack, **block_options: Any) -> Stack:
    """``model`` with every block (with ``block_options``), then the whole, wrapped by
    ``fully_shard`` on all ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    assert FSDP is not None
    fully_shard = FSDP[1]
    mesh = init_device_mesh("cpu", (distributed.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **block_options)
    fully_shard(model, mesh=mesh)
    return model


def _plan(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor | None = None
) -> matepoint.BudgetPlan:
    batch = torch.randn(*SHAPE) if batch is None else batch
    return matepoint.plan_budget(
        model, batch, optimizer=optimizer, budget="1GiB", device=FREE_POLICY
    )


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone, destroyed afterwards."""
    if distributed.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = distributed.FileStore(str(tmp_path / "store"), 1)
    distributed.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield
    finally:
        distributed.destroy_process_group()


class MadeOffMeta(compat.TorchDispatchMode):
    """Records every op whose result has a storage of its own off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {
            leaf.untyped_storage()._cdata
            for leaf in compat.tree_flatten((args, kwargs))[0]
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta"
        }
        for leaf in compat.tree_flatten(out)[0]:
            # A view of an input (DTensor's to_local) allocates nothing.
            if (
                isinstance(leaf, torch.Tensor)
                and leaf.device.type != "meta"
                and leaf.untyped_storage()._cdata not in inputs
            ):
                self.made.append(str(func))
        return out


def _own_hook(module: nn.Module, args: Any) -> None:
    """A hook of the user's, which the twin keeps."""


@pytest.mark.usefixtures("one_rank")
def test_the_twin_is_the_model_fsdp2_wraps_without_its_state_or_hooks() -> None:
    model = Stack()
    model.blocks[0].up.register_forward_pre_hook(_own_hook)
    twin = live_model.meta_twin(_sharded(model))
    assert type(twin) is Stack
    assert all(type(block) is Block for block in twin.blocks)
    assert list(twin.blocks[0].up._forward_pre_hooks.values()) == [_own_hook]
    for module in twin.modules():
        assert module is twin.blocks[0].up or not module._forward_pre_hooks
        assert not module._forward_hooks
        assert not module._state_dict_pre_hooks
        assert not any(name.startswith("__composable_api_state_key") for name in vars(module))
    for (name, parameter), (_, live) in zip(
        twin.named_parameters(), model.named_parameters(), strict=True
    ):
        assert type(parameter) is nn.Parameter, name
        assert parameter.is_meta
        assert parameter.shape == live.shape
        assert parameter.dtype == live.dtype
        assert parameter.requires_grad


@pytest.mark.usefixtures("one_rank")
def test_on_one_rank_a_sharded_model_plans_as_the_same_model_unsharded() -> None:
    plain, model = Stack(), _sharded(Stack())
    plain_plan = _plan(plain, torch.optim.AdamW(plain.parameters()))
    optimizer = torch.optim.AdamW(model.parameters())
    parameters = [(parameter, parameter.detach().clone()) for parameter in model.parameters()]
    batch, recorder = torch.randn(*SHAPE), MadeOffMeta()
    with recorder:
        plan = _plan(model, optimizer, batch)
    assert recorder.made == []
    assert [parameter for parameter, _ in parameters] == list(model.parameters())
    for parameter, value in parameters:
        assert torch.equal(parameter.to_local(), value.to_local())
        assert parameter.grad is None
    assert not optimizer.state
    # The same step, under the same budget: its shards are the whole parameters.
    assert plan.budget_bytes == plain_plan.budget_bytes
    assert plan.decisions == plain_plan.decisions
    assert plan.regions == BLOCKS
    assert plan.settings == plain_plan.settings
    assert plan.fits
    # FSDP2 gathers a block's parameters beside its shards: twice the largest block for the
    # gathers, twice for the gradient buffers (See Note [A sharded model's twin], rule 2).
    assert plan.peak_bytes == plain_plan.peak_bytes + 4 * BLOCK_BYTES
    assert plan.strategy_plan.peak_bytes == plain_plan.peak_bytes


@pytest.mark.usefixtures("one_rank")
def test_gradients_and_optimizer_states_of_shards_count_as_one_rank_holds_them() -> None:
    plain, model = Stack(), _sharded(Stack())
    plain_optimizer = torch.optim.AdamW(plain.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    for each, its_optimizer in ((plain, plain_optimizer), (model, optimizer)):
        each(torch.randn(*SHAPE)).sum().backward()
        its_optimizer.step()
    assert all(
        sharded_twin.is_shard(value)
        for value in optimizer.state[model.blocks[0].up.weight].values()
        if value.dim()
    )
    assert optimizer_state_bytes(sharded_twin.rank_view(optimizer)) == optimizer_state_bytes(
        plain_optimizer
    )
    plain_plan, plan = _plan(plain, plain_optimizer), _plan(model, optimizer)
    assert plan.budget_bytes == plain_plan.budget_bytes
    assert plan.decisions == plain_plan.decisions
    assert plan.peak_bytes == plain_plan.peak_bytes + 4 * BLOCK_BYTES


@pytest.mark.usefixtures("one_rank")
def test_blocks_that_stay_gathered_after_forward_count_whole_beside_their_shards() -> None:
    # See Note [A sharded model's twin], rule 2: one rank's shards are the whole parameters,
    # and FSDP2 holds twice the largest block's gathered parameters and gradients beside them.
    assert sharded_twin.rank_correction(_sharded(Stack())) == -4 * BLOCK_BYTES
    # Every block's gathered parameters too, from forward to their backward.
    kept = _sharded(Stack(), reshard_after_forward=False)
    assert sharded_twin.rank_correction(kept) == -(BLOCKS + 4) * BLOCK_BYTES


def _two_ranks(rank: int, folder: str) -> None:
    """One of two ranks: plan the sharded model and write what it planned."""
    store = distributed.FileStore(str(Path(folder) / "store"), 2)
    distributed.init_process_group("gloo", rank=rank, world_size=2, store=store)
    try:
        model = _sharded(Stack())
        optimizer = torch.optim.AdamW(model.parameters())
        plan = _plan(model, optimizer)
        shards = sum(parameter.to_local().nbytes for parameter in model.parameters())
        figures = {
            "peak": plan.peak_bytes,
            "budget": plan.budget_bytes,
            "decisions": [list(pair) for pair in plan.decisions],
            "shards": shards,
        }
        (Path(folder) / f"rank{rank}.json").write_text(json.dumps(figures))
    finally:
        distributed.destroy_process_group()


@pytest.mark.usefixtures("one_rank")
def test_on_two_ranks_the_planned_peak_drops_by_the_shards_of_the_other(tmp_path: Path) -> None:
    model = _sharded(Stack())
    one = _plan(model, torch.optim.AdamW(model.parameters()))
    whole = sum(parameter.nbytes for parameter in Stack().parameters())
    folder = tmp_path / "ranks"
    folder.mkdir()
    torch.multiprocessing.spawn(_two_ranks, args=(str(folder),), nprocs=2)
    for rank in range(2):
        two = json.loads((folder / f"rank{rank}.json").read_text())
        assert two["shards"] == whole // 2
        assert two["peak"] == one.peak_bytes - whole // 2
        # AdamW's two states per parameter, of half the parameters.
        assert two["budget"] == (1 << 30) - 2 * whole // 2
        assert [tuple(pair) for pair in two["decisions"]] == list(one.decisions)


def test_another_tensor_subclass_is_still_refused_by_name() -> None:
    class Quantized(torch.Tensor):
        pass

    model = nn.Linear(4, 4)
    model.weight = nn.Parameter(torch.Tensor._make_subclass(Quantized, torch.zeros(4, 4)))
    with pytest.raises(TypeError, match=r"weight.*Quantized.*DTensor"):
        live_model.meta_twin(model)
