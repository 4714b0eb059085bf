"""The budget search charges a plan's policy the ops torch's scoped modes will see, no more.

Note [The budget search], rule 2, in ``matepoint._planner.search``: a region runs torch's
selective-checkpoint modes only in the windows around the module calls that run the kinds its
policy keeps or offloads (Note [Scoped selective-checkpoint modes] in
``matepoint._planner.scoped_modes``). Each charge is checked against the ops torch's caching
mode (forward) and cached mode (recomputation) really dispatch when the plan's policy runs on
the CPU, once the blocks have learnt their windows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
from matepoint._planner import policy, scoped_modes, search_state
from matepoint._planner import search as _budget
from matepoint._planner.time_model import DeviceModel
from matepoint.testing import CPUTestTransport, use_transport

pytestmark = pytest.mark.skipif(not policy.AVAILABLE, reason="budget plans need torch 2.5")

WIDTH, HIDDEN, TOKENS, BLOCKS = 32, 128, 16, 4
# The kinds of a block (Note [Op kinds]): its QKV, output, up and gate (one shape, told apart by
# order) and down projections.
QKV, OUT, UP, DOWN = "matmul 32x96", "matmul 32x32", "matmul 32x128", "matmul 128x32"
FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0, host_seconds_per_op=0)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """A pre-norm block of linear layers with elementwise work between them, so that the meta
    device plans the ops the CPU runs (no attention kernel stand-in)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.gate = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(_norm(x)).view(1, TOKENS, 3, 4, WIDTH // 4).unbind(2)
        mixed = (q * k.sigmoid() + v).reshape(1, TOKENS, WIDTH)
        x = x + self.out(mixed)
        h = _norm(x)
        return x + self.down(F.silu(self.up(h)) * self.gate(h))


class Stack(nn.Module):
    """Blocks through ``matepoint.checkpoint``, block ``n`` with ``context_fns[n]``, if any."""

    def __init__(
        self,
        context_fns: list[Callable[[], Any] | None] | None = None,
        block: Callable[[], nn.Module] = Block,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(BLOCKS))
        self.context_fns = context_fns or [None] * BLOCKS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, context_fn in zip(self.blocks, self.context_fns, strict=True):
            extra = {} if context_fn is None else {"context_fn": context_fn}
            x = matepoint.checkpoint(block, x, **extra)
        return x


@pytest.fixture(scope="module")
def search() -> Any:
    """The search's profile of the stack, planned on the meta device."""
    return _profiled(Block)


def _profiled(block: Callable[[], nn.Module]) -> Any:
    """The search's profile of a stack of ``block``, planned on the meta device."""
    with torch.device("meta"):
        stack = Stack(block=block)
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    budget = search_state.Budget(memory_plan["none"].peak_bytes * 2, None, 1)
    replan = memory_plan._search_replan
    return _budget._profiled(replan, memory_plan.effective_options, budget, FREE_POLICY)


def _modes_dispatch(
    monkeypatch: pytest.MonkeyPatch,
    decisions: dict[str, Any],
    kept_in_last: dict[str, int],
    block: Callable[[], nn.Module] = Block,
) -> int:
    """The ops torch's two modes dispatch in a step of the plan on the CPU, forward and
    recomputation, after a first step in which every block learns its windows."""
    counted = [0]
    modes = (torch_checkpoint._CachingTorchDispatchMode, torch_checkpoint._CachedTorchDispatchMode)
    for mode in modes:
        original = mode.__torch_dispatch__

        def counting(self: Any, *arguments: Any, original: Any = original) -> Any:
            counted[0] += 1
            return original(self, *arguments)

        monkeypatch.setattr(mode, "__torch_dispatch__", counting)
    torch.manual_seed(0)
    context_fns = [policy.context_fn_of(decisions, kept_in_last, BLOCKS, n) for n in range(BLOCKS)]
    stack = Stack(context_fns, block)  # type: ignore[arg-type]
    for _ in range(2):
        counted[0] = 0
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
        with use_transport(CPUTestTransport(completion="immediate")):
            stack(x).square().sum().backward()
    return counted[0]


def test_a_plan_deciding_other_pays_every_op_the_modes_see(
    search: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan that decides ``"other"`` (ops everywhere) runs the modes over the whole region,
    forward and recomputation as far as torch's early stop runs it."""
    whole = search.policy_ops_of({"other": "keep"}, {})
    assert whole == _modes_dispatch(monkeypatch, {"other": "keep"}, {})
    profile = search.profile
    assert whole == sum(sum(region.ops) + sum(region.recomputed) for region in profile.stretches)


@pytest.mark.parametrize("kept", [OUT, QKV, f"{UP} #2", DOWN])
def test_a_plan_keeping_one_projection_pays_for_its_windows_alone(
    search: Any, monkeypatch: pytest.MonkeyPatch, kept: str
) -> None:
    """One linear layer kept: the modes see its own call (the gate and up projections share
    a kind, so keeping the second opens a window around each), far from the whole region."""
    charged = search.policy_ops_of({kept: "keep"}, {})
    assert charged == _modes_dispatch(monkeypatch, {kept: "keep"}, {})
    assert 0 < charged * 4 < search.policy_ops_of({"other": "keep"}, {})


@pytest.mark.parametrize(
    ("decisions", "kept_in_last"),
    [
        ({}, {OUT: 1}),
        ({OUT: "recompute"}, {QKV: 3, DOWN: 1}),
        ({f"{UP} #1": "keep"}, {OUT: 2}),
    ],
)
def test_kinds_kept_in_the_last_regions_are_paid_there_alone(
    search: Any,
    monkeypatch: pytest.MonkeyPatch,
    decisions: dict[str, Any],
    kept_in_last: dict[str, int],
) -> None:
    """The regions before the last that keep nothing run no modes (Note [A plan's regions],
    rule 5); those that keep pay for their own kinds' windows."""
    charged = search.policy_ops_of(decisions, kept_in_last)
    assert charged == _modes_dispatch(monkeypatch, decisions, kept_in_last)
    if not decisions:
        last = search.profile.policy_ops(BLOCKS - 1, frozenset({"matmul 32x32"}))
        assert charged == last == search.policy_ops_of({OUT: "keep"}, {}) // BLOCKS


def test_a_plan_without_a_policy_and_a_compiled_plan_pay_nothing(search: Any) -> None:
    assert search.policy_ops_of({}, {}) == 0
    assert search.policy_ops_of({OUT: "recompute"}, {}) == 0
    compiled = search_state.Search(**{**search.__dict__, "profile": None, "tried": []})
    assert compiled.policy_ops_of({"other": "keep"}, {}) == 0


def test_windows_merge_across_stretches_without_ops_and_a_stopped_pass_counts_its_own() -> None:
    """The windows' rule the modes learn by and the search charges by (Note [Scoped
    selective-checkpoint modes], rule 4): stretches with scoped ops, merged where only empty
    ones part them; the ops before the first module event are always seen (rule 3)."""
    assert scoped_modes.window_runs({2, 4, 7}, {3}) == [[2, 4], [7, 7]]
    assert scoped_modes.window_runs({4, 2}, set()) == [[2, 2], [4, 4]]
    ops = [1, 10, 2, 0, 3, 10, 10, 4]
    runs = scoped_modes.window_runs({2, 4, 7}, {3})
    assert scoped_modes.ops_in_windows(ops, runs) == 1 + 2 + 0 + 3 + 4
    assert scoped_modes.ops_in_windows(ops[:5], runs) == 1 + 2 + 0 + 3  # stopped early
    assert scoped_modes.ops_in_windows([], runs) == 0


class Detaching(nn.Module):
    """Two kept projections parted by a detach alone, an op torch's modes run without asking
    the policy: the recording merges their windows into one, which sees the detach too."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH, bias=False)
        self.second = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(_norm(x))
        h.detach()
        return x + self.second(h).sigmoid()


def test_windows_parted_only_by_ops_torch_passes_on_are_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    search = _profiled(Detaching)
    decisions = {OUT: "keep"}
    charged = search.policy_ops_of(decisions, {})
    assert charged == _modes_dispatch(monkeypatch, decisions, {}, Detaching)
    detaches = [region.ops[3] for region in search.profile.stretches]
    assert detaches == [1] * BLOCKS  # the stretch after the first projection: the detach
