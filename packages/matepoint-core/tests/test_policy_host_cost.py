"""A plan's policy answers from tables made per region, and a region that recomputes every op
runs without torch's selective-checkpoint modes (issue 39: the host's cost per op).

The policy's answers are checked against the naming it replaced (a class name made per op,
``occurrence_class``) on the ops of a block; its caches per op against two plans in one process
and against matrix products told apart by their shapes. The regions without modes are checked
for gradients bitwise equal to torch's checkpoint with the plan's policy in every region
(Note [A plan's regions], rule 5).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import matepoint
import matepoint_compat as compat
from matepoint._planner import policy
from matepoint._planner.op_kinds import occurrence_class, op_kind
from matepoint.testing import CPUTestTransport

pytestmark = pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5")

BLOCKS, ROWS, WIDTH = 4, 8, 16


class Block(nn.Module):
    """Two up projections of one shape (a SwiGLU's gate and up), a down one, a dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.gate(x)) * self.up(x)
        return x + F.dropout(self.down(hidden), p=0.1)


class Ops(TorchDispatchMode):
    """Records every op of a forward with its arguments: what a policy is asked about."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Any, tuple[Any, ...]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls.append((func, args))
        return func(*args, **(kwargs or {}))


def _ops_of_a_block() -> list[tuple[Any, tuple[Any, ...]]]:
    torch.manual_seed(0)
    block = Block()
    with Ops() as ops:
        block(torch.randn(ROWS, WIDTH, requires_grad=True))
    return ops.calls


def _reference_policy(chosen: dict[str, str]) -> Callable[..., str]:
    """The answers by name: a class name made per op, its occurrence's decision, else its
    kind's, else recompute; the ops of each kind counted in forward and recomputation apart."""
    seen: collections.Counter[tuple[bool, str]] = collections.Counter()

    def answer(is_recompute: bool, func: Any, args: tuple[Any, ...]) -> str:
        kind = op_kind(func, args)
        seen[is_recompute, kind] += 1
        return chosen.get(
            occurrence_class(kind, seen[is_recompute, kind]), chosen.get(kind, "recompute")
        )

    return answer


_UP = "matmul 16x64"
_DOWN = "matmul 64x16"
_PLANS: list[dict[str, Any]] = [
    {"decisions": {_UP: "keep"}, "kept_in_last": {}},
    {"decisions": {f"{_UP} #2": "keep", _DOWN: "keep"}, "kept_in_last": {}},
    {"decisions": {_UP: "keep", f"{_UP} #1": "recompute"}, "kept_in_last": {}},
    {"decisions": {"other": "keep", f"{_UP} #01": "keep"}, "kept_in_last": {}},
    {"decisions": {"other #3": "keep", _DOWN: "recompute"}, "kept_in_last": {}},
    {"decisions": {}, "kept_in_last": {_DOWN: 1}},
    {"decisions": {f"{_UP} #1": "keep"}, "kept_in_last": {f"{_UP} #2": 2}},
]


@pytest.mark.parametrize("plan", _PLANS)
@pytest.mark.parametrize("region", range(BLOCKS))
def test_the_policy_answers_as_the_class_names_did(plan: dict[str, Any], region: int) -> None:
    values = {value: name for name, value in policy._POLICY_VALUES.items()}
    kept = [name for name, last in plan["kept_in_last"].items() if region >= BLOCKS - last]
    reference = _reference_policy({**plan["decisions"], **dict.fromkeys(kept, "keep")})
    ours = policy.policy_of(plan["decisions"], plan["kept_in_last"], BLOCKS, region)
    calls = _ops_of_a_block()
    for is_recompute in (False, True):  # a 2.4-era recomputation asks again, counted apart
        context = torch_checkpoint.SelectiveCheckpointContext(is_recompute=is_recompute)
        for func, args in calls:
            assert values[ours(context, func, *args)] == reference(is_recompute, func, args)


def test_two_plans_in_one_process_keep_their_own_answers() -> None:
    save = torch_checkpoint.CheckpointPolicy.MUST_SAVE
    recompute = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    keeps = policy.policy_of({_UP: "keep"}, {}, 1, 0)
    recomputes = policy.policy_of({_UP: "recompute", _DOWN: "keep"}, {}, 1, 0)
    context = torch_checkpoint.SelectiveCheckpointContext(is_recompute=False)
    up = (torch.empty(ROWS, WIDTH), torch.empty(WIDTH, 4 * WIDTH))
    down = (torch.empty(ROWS, 4 * WIDTH), torch.empty(4 * WIDTH, WIDTH))
    mm = torch.ops.aten.mm.default
    # Interleaved on the same op: each answers from its own decisions.
    assert [keeps(context, mm, *up), recomputes(context, mm, *up)] == [save, recompute]
    assert [keeps(context, mm, *down), recomputes(context, mm, *down)] == [recompute, save]
    assert [keeps(context, mm, *up), recomputes(context, mm, *up)] == [save, recompute]


def test_an_op_is_still_named_by_its_arguments_shapes_once_cached() -> None:
    mm, addmm = torch.ops.aten.mm.default, torch.ops.aten.addmm.default
    a, b = torch.empty(ROWS, WIDTH), torch.empty(WIDTH, 4 * WIDTH)
    h, c = torch.empty(ROWS, 4 * WIDTH), torch.empty(4 * WIDTH, WIDTH)
    for _ in range(2):  # the second round answers from the cache per op
        assert op_kind(mm, (a, b)) == _UP
        assert op_kind(mm, (h, c)) == _DOWN
        assert op_kind(addmm, (torch.empty(WIDTH), h, c)) == _DOWN
        assert op_kind(mm, (a, 2.0)) == "other"
        assert op_kind(torch.ops.aten.add.Tensor, (a, a)) == "other"


def _policy_everywhere(plan: dict[str, Any], region: int) -> Callable[[], Any]:
    """torch's contexts around the plan's policy of ``region``, whatever the policy does."""

    def context_fn() -> Any:
        return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            policy.policy_of(plan["decisions"], plan["kept_in_last"], BLOCKS, region)
        )

    return context_fn


_KEEPS_LAST = {"decisions": {}, "kept_in_last": {f"{_UP} #2": 1, _DOWN: 2}}


def test_a_region_that_recomputes_everything_gets_no_modes_outside_a_tracer() -> None:
    pair = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)
    context_fns = [policy.context_fn_of(**_KEEPS_LAST, regions=BLOCKS, region=r) for r in range(4)]
    assert all(context_fn is not None for context_fn in context_fns)
    # A region with modes holds torch's pair, scoped (Note [Scoped selective-checkpoint modes]).
    kinds = [
        tuple(map(type, getattr(contexts, "modes", contexts)))
        for contexts in (context_fn() for context_fn in context_fns if context_fn)
    ]
    assert [kind == pair for kind in kinds] == [False, False, True, True]
    assert not compat.tracing_ops()
    with FakeTensorMode():
        assert compat.tracing_ops()
        assert all(
            tuple(map(type, context_fn())) == pair for context_fn in context_fns if context_fn
        )
    counted = policy.context_fn_of(**_KEEPS_LAST, regions=BLOCKS)
    assert counted is not None
    assert [
        tuple(map(type, getattr(contexts, "modes", contexts))) == pair
        for contexts in (counted() for _ in range(2 * BLOCKS))
    ] == [
        False,
        False,
        True,
        True,
    ] * 2


@pytest.mark.parametrize("engine", ["torch", "matepoint"])
def test_regions_without_modes_give_torchs_gradients_bitwise(
    engine: str, cpu_transport: CPUTestTransport
) -> None:
    torch.manual_seed(0)
    blocks = [Block() for _ in range(BLOCKS)]
    reference = copy.deepcopy(blocks)
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(ROWS, WIDTH, requires_grad=True)
        x_reference = x.detach().clone().requires_grad_()
        torch.manual_seed(100 + step)
        y = x * 1.0
        for region, block in enumerate(blocks):
            context_fn = policy.context_fn_of(**_KEEPS_LAST, regions=BLOCKS, region=region)
            if engine == "torch":
                y = torch_checkpoint.checkpoint(
                    block, y, use_reentrant=False, context_fn=context_fn
                )
            else:
                y = matepoint.checkpoint(block, y, context_fn=context_fn)
        y.square().sum().backward()
        torch.manual_seed(100 + step)
        y = x_reference * 1.0
        for region, block in enumerate(reference):
            y = torch_checkpoint.checkpoint(
                block, y, use_reentrant=False, context_fn=_policy_everywhere(_KEEPS_LAST, region)
            )
        y.square().sum().backward()
        assert torch.equal(x.grad, x_reference.grad)  # type: ignore[arg-type]
        for mine, theirs in zip(blocks, reference, strict=True):
            for got, want in zip(mine.parameters(), theirs.parameters(), strict=True):
                assert got.grad is not None
                assert torch.equal(got.grad, want.grad)


class Projections(nn.Module):
    """An up and a down projection, nothing random: a compiled step matches an eager one."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def test_under_compile_every_region_keeps_torchs_modes() -> None:
    pair = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)
    made: list[bool] = []

    def recording(region: int) -> Callable[[], Any]:
        inner = policy.context_fn_of(**_KEEPS_LAST, regions=BLOCKS, region=region)
        assert inner is not None

        def context_fn() -> Any:
            contexts = inner()
            made.append(tuple(map(type, contexts)) == pair)
            return contexts

        return context_fn

    torch.manual_seed(0)
    blocks = nn.ModuleList(Projections() for _ in range(BLOCKS))
    reference = copy.deepcopy(blocks)
    context_fns = [recording(region) for region in range(BLOCKS)]

    def step(x: torch.Tensor) -> torch.Tensor:
        for block, context_fn in zip(blocks, context_fns, strict=True):
            x = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        return x

    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    try:
        torch.compile(step, backend="aot_eager", fullgraph=True)(x).sum().backward()
    finally:
        torch._dynamo.reset()
    assert made
    assert all(made)  # the regions that recompute everything too, while traced
    y = x_reference
    for block in reference:
        y = torch_checkpoint.checkpoint(block, y, use_reentrant=False)
    y.sum().backward()
    torch.testing.assert_close(x.grad, x_reference.grad)
    for got, want in zip(blocks.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)
