"""A plan's selective-checkpoint modes run only around the module calls that run its decided ops.

See Note [Scoped selective-checkpoint modes] (``matepoint._planner.scoped_modes``). Every step
is checked against torch's checkpoint with the same policy over the whole region: gradients
bitwise equal (dropout in the blocks, so the RNG must replay), and the same count of each
matrix product and attention run over forward and backward, which differs the moment a kept op
is recomputed or a recomputed one kept. The ops torch's caching mode sees show the scoping: all
of a region's on its first call, only those of its windows after it.
"""

from __future__ import annotations

import collections
import copy
import threading
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
from matepoint._planner import policy, scoped_modes
from matepoint.testing import CPUTestTransport

pytestmark = pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5")

BLOCKS, SEQUENCE, WIDTH, HEADS = 3, 8, 16, 2
# The kinds of a block (Note [Op kinds]): its QKV, output, gate and up (one shape, told apart by
# order) and down projections, and attention.
QKV, OUT, UP, DOWN = "matmul 16x48", "matmul 16x16", "matmul 16x64", "matmul 64x16"
COUNTED = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention_for_cpu")


class Block(nn.Module):
    """A pre-norm transformer block: attention inline in its forward, dropout in three places;
    the gate projection is skipped while ``gated`` is off."""

    gated = True

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.gate = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 4 * WIDTH, bias=False)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q, k, v = self.qkv(self.norm(x)).view(batch, SEQUENCE, 3, HEADS, -1).unbind(2)
        q, k = q * 0.5 + k.sin(), k.cos() * q  # elementwise work between the decided ops
        p = 0.1 if self.training else 0.0
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p, is_causal=True
        )
        x = x + F.dropout(self.out(a.transpose(1, 2).reshape(batch, SEQUENCE, WIDTH)), p=p)
        h = F.silu(self.gate(x) if self.gated else x.repeat(1, 1, 4)) * self.up(x)
        return x + F.dropout(self.down(F.gelu(h).tanh()), p=p)


PLANS: dict[str, dict[str, Any]] = {
    "keeps": {"decisions": {"attention": "keep", QKV: "keep", UP: "keep"}, "kept_in_last": {}},
    "keeps the second of a kind": {"decisions": {f"{UP} #2": "keep"}, "kept_in_last": {}},
    "keeps the projections": {
        "decisions": {QKV: "keep", OUT: "keep", f"{UP} #1": "keep", DOWN: "keep"},
        "kept_in_last": {},
    },
    "keeps last": {"decisions": {OUT: "recompute"}, "kept_in_last": {"attention": 1, QKV: 2}},
}


class Executed(TorchDispatchMode):
    """Counts the matrix products and attention kernels run, forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name in COUNTED:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def caching_mode_ops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The ops torch's caching mode sees, counted into the list's one item."""
    seen = [0]
    original = torch_checkpoint._CachingTorchDispatchMode.__torch_dispatch__

    def counted(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen[0] += 1
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(torch_checkpoint._CachingTorchDispatchMode, "__torch_dispatch__", counted)
    return seen


def _whole_region(plan: dict[str, Any], region: int) -> Callable[[], Any]:
    """torch's contexts around the plan's policy over the whole region: the reference."""

    def context_fn() -> Any:
        return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
            policy.policy_of(plan["decisions"], plan["kept_in_last"], BLOCKS, region)
        )

    return context_fn


def _step(
    blocks: list[nn.Module],
    context_fns: list[Callable[[], Any]],
    x: torch.Tensor,
    engine: str = "torch",
) -> collections.Counter[str]:
    """One training step of the stack, seeded; returns the kernels it ran."""
    torch.manual_seed(7)
    with Executed() as executed:
        y = x * 1.0
        for block, context_fn in zip(blocks, context_fns, strict=True):
            if engine == "torch":
                y = torch_checkpoint.checkpoint(
                    block, y, use_reentrant=False, context_fn=context_fn
                )
            else:
                y = matepoint.checkpoint(block, y, context_fn=context_fn)
        y.square().sum().backward()
    return executed.counts


def _assert_same_gradients(
    x: torch.Tensor, reference_x: torch.Tensor, blocks: list[nn.Module], reference: Any
) -> None:
    assert torch.equal(x.grad, reference_x.grad)  # type: ignore[arg-type]
    for mine, theirs in zip(blocks, reference, strict=True):
        for got, want in zip(mine.parameters(), theirs.parameters(), strict=True):
            assert got.grad is not None
            assert torch.equal(got.grad, want.grad)


def _stack() -> tuple[list[nn.Module], list[nn.Module], torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    blocks: list[nn.Module] = [Block() for _ in range(BLOCKS)]
    x = torch.randn(2, SEQUENCE, WIDTH, requires_grad=True)
    return blocks, copy.deepcopy(blocks), x, x.detach().clone().requires_grad_()


@pytest.mark.parametrize("name", list(PLANS))
@pytest.mark.parametrize("engine", ["torch", "matepoint"])
def test_scoped_steps_match_torchs_whole_region_modes(
    name: str, engine: str, cpu_transport: CPUTestTransport, caching_mode_ops: list[int]
) -> None:
    plan = PLANS[name]
    blocks, reference, x, reference_x = _stack()
    context_fns = [
        policy.context_fn_of(plan["decisions"], plan["kept_in_last"], BLOCKS, region)
        for region in range(BLOCKS)
    ]
    seen_per_step = []
    for _ in range(3):  # the first call records, the later ones are scoped
        caching_mode_ops[0] = 0
        counts = _step(blocks, context_fns, x, engine)  # type: ignore[arg-type]
        seen_per_step.append(caching_mode_ops[0])
        wanted = _step(reference, [_whole_region(plan, r) for r in range(BLOCKS)], reference_x)
        assert counts == wanted
        _assert_same_gradients(x, reference_x, blocks, reference)
    recorded, scoped, again = seen_per_step
    assert scoped == again
    assert 0 < scoped < recorded / 2


@pytest.mark.parametrize("fresh_context_fns", [False, True])
def test_a_decided_op_in_one_module_puts_the_modes_around_it_alone(
    fresh_context_fns: bool, caching_mode_ops: list[int]
) -> None:
    """Only the output projection is kept: the modes see its call and nothing else, whether
    the context_fn is made once per block or anew for every call (what is learnt is kept per
    block)."""
    plan = {"decisions": {OUT: "keep"}, "kept_in_last": {}}
    blocks, reference, x, reference_x = _stack()
    made = [policy.context_fn_of(plan["decisions"], {}, BLOCKS, r) for r in range(BLOCKS)]
    for step in range(3):
        context_fns = (
            [policy.context_fn_of(plan["decisions"], {}, BLOCKS, r) for r in range(BLOCKS)]
            if fresh_context_fns
            else made
        )
        caching_mode_ops[0] = 0
        counts = _step(blocks, context_fns, x)  # type: ignore[arg-type]
        seen = caching_mode_ops[0]
        wanted = _step(reference, [_whole_region(plan, r) for r in range(BLOCKS)], reference_x)
        assert counts == wanted
        _assert_same_gradients(x, reference_x, blocks, reference)
        if step:
            # A linear layer on a batch of sequences: a view, the transposed weight, addmm,
            # the view back; the modes see nothing of the rest of the block.
            assert seen <= 4 * BLOCKS, seen


def test_a_block_that_changes_gets_the_whole_region_modes_back(caching_mode_ops: list[int]) -> None:
    """Without its gate projection a block's policy sees another count of a scoped kind (its
    up projection becomes the kind's first): the block keeps the whole-region modes from the
    next call on (Note [Scoped selective-checkpoint modes], rule 7)."""
    plan = {"decisions": {f"{UP} #2": "keep", "attention": "keep"}, "kept_in_last": {}}
    blocks, reference, x, reference_x = _stack()
    context_fns = [policy.context_fn_of(plan["decisions"], {}, BLOCKS, r) for r in range(BLOCKS)]
    seen_per_step = []
    for step in range(4):
        for block in (*blocks, *reference):
            block.gated = step != 2  # type: ignore[assignment]
        caching_mode_ops[0] = 0
        counts = _step(blocks, context_fns, x)  # type: ignore[arg-type]
        seen_per_step.append(caching_mode_ops[0])
        wanted = _step(reference, [_whole_region(plan, r) for r in range(BLOCKS)], reference_x)
        assert counts == wanted
        _assert_same_gradients(x, reference_x, blocks, reference)
    recorded, scoped, changed, whole = seen_per_step
    assert scoped < recorded / 2
    assert changed < recorded / 2
    assert whole == recorded


class Inline(nn.Module):
    """A matrix product at the very start of its forward, before its one submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.dropout((x @ self.weight).tanh(), p=0.1) * 2).cos() + 1


def test_a_window_opening_at_the_first_modules_second_call(caching_mode_ops: list[int]) -> None:
    """A region that runs its first module twice: the second call's pre-hook opens a window,
    numbered after the first call's, which opened the region's first window."""
    plan = {"decisions": {f"{OUT} #1": "keep", f"{OUT} #3": "keep"}, "kept_in_last": {}}
    torch.manual_seed(0)
    inline = Inline()
    reference = copy.deepcopy(inline)
    x = torch.randn(2, SEQUENCE, WIDTH, requires_grad=True)
    reference_x = x.detach().clone().requires_grad_()
    context_fn = policy.context_fn_of(plan["decisions"], {}, 1, 0)
    assert context_fn is not None
    seen_per_step = []
    for _ in range(3):
        caching_mode_ops[0] = 0
        counts = _step([lambda y: inline(inline(y).sin())], [context_fn], x)  # type: ignore[list-item]
        seen_per_step.append(caching_mode_ops[0])
        whole = [_whole_region(plan, 0)]
        wanted = _step([lambda y: reference(reference(y).sin())], whole, reference_x)  # type: ignore[list-item]
        assert counts == wanted
        _assert_same_gradients(x, reference_x, [inline], [reference])
    recorded, scoped, again = seen_per_step
    assert scoped == again
    assert scoped < recorded - 4  # the sine and the cosines and adds after each projection


def test_a_second_backward_through_a_scoped_region_raises_as_torchs_does() -> None:
    plan = PLANS["keeps"]
    torch.manual_seed(0)
    block = Block()
    context_fn = policy.context_fn_of(plan["decisions"], {}, 1, 0)
    for _ in range(2):  # the first call records; the second is scoped
        x = torch.randn(2, SEQUENCE, WIDTH, requires_grad=True)
        y = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        y.sum().backward()


def test_threads_running_one_block_at_once_each_get_torchs_gradients() -> None:
    """Hooks on a shared block act on the thread that registered them only."""
    plan = PLANS["keeps the projections"]
    torch.manual_seed(0)
    block = Block()
    inputs = [torch.randn(2, SEQUENCE, WIDTH) for _ in range(4)]

    def gradients(x: torch.Tensor, context_fn: Callable[[], Any]) -> tuple[torch.Tensor, ...]:
        x = x.clone().requires_grad_()
        y = torch_checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
        return torch.autograd.grad(y.square().sum(), (x, *block.parameters()))

    whole = _whole_region(plan, 0)
    with torch.random.fork_rng():
        block.eval()  # no dropout: the threads' draws would interleave
        wanted = [gradients(x, whole) for x in inputs]
        context_fn = policy.context_fn_of(plan["decisions"], {}, 1, 0)
        assert context_fn is not None
        gradients(inputs[0], context_fn)  # records the windows
        results: dict[int, tuple[torch.Tensor, ...]] = {}

        def run(index: int) -> None:
            for _ in range(5):
                results[index] = gradients(inputs[index], context_fn)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for index, expected in enumerate(wanted):
        assert all(map(torch.equal, results[index], expected))


def test_offloaded_outputs_go_to_the_host_in_scoped_steps(
    cpu_transport: CPUTestTransport, caching_mode_ops: list[int]
) -> None:
    if not policy.OFFLOAD_AVAILABLE:
        pytest.skip("a plan that offloads needs torch 2.11")
    plan = {"decisions": {QKV: "offload", "attention": "keep"}, "kept_in_last": {}}
    blocks, reference, x, reference_x = _stack()
    context_fns = [policy.context_fn_of(plan["decisions"], {}, BLOCKS, r) for r in range(BLOCKS)]
    offloads, seen_per_step = [], []
    for _ in range(3):
        matepoint.reset_stats()
        caching_mode_ops[0] = 0
        counts = _step(blocks, context_fns, x, "matepoint")  # type: ignore[arg-type]
        offloads.append(matepoint.stats().policy_offloads)
        seen_per_step.append(caching_mode_ops[0])
        reference_plan = {"decisions": {QKV: "keep", "attention": "keep"}, "kept_in_last": {}}
        wanted = _step(
            reference, [_whole_region(reference_plan, r) for r in range(BLOCKS)], reference_x
        )
        assert counts == wanted
        _assert_same_gradients(x, reference_x, blocks, reference)
    assert offloads == [BLOCKS] * 3
    recorded, scoped, again = seen_per_step
    assert scoped == again
    assert scoped < recorded / 2


def test_under_a_tracer_the_modes_cover_the_whole_region() -> None:
    pair = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)
    context_fn = policy.context_fn_of(PLANS["keeps"]["decisions"], {}, 1, 0)
    assert context_fn is not None
    assert isinstance(context_fn(), scoped_modes.ScopedModes)
    with FakeTensorMode():
        assert tuple(map(type, context_fn())) == pair
