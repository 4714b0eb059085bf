"""The budget plan: keep, offload or recompute per kind of op, within a device-memory budget.

The search runs on the meta device through the planner; what it chooses is then run for real on
the CPU test transport, where its selective-checkpoint policy must give torch's gradients and
move exactly the bytes the plan said it would.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import matepoint
import matepoint._planner.policy
import matepoint._planner.search
import matepoint._planner.search_state
import matepoint_compat as compat
from matepoint._planner.op_kinds import op_kind
from matepoint._planner.policy import AVAILABLE, OFFLOAD_AVAILABLE
from matepoint._planner.time_model import DeviceModel, step_seconds
from matepoint.testing import CPUTestTransport, use_transport

if not AVAILABLE:
    pytest.skip("budget plans need torch's selective checkpointing (2.5)", allow_module_level=True)

needs_offload_values = pytest.mark.skipif(
    not OFFLOAD_AVAILABLE, reason="torch has no selective-checkpoint offload values before 2.11"
)

# Compute that takes its time and a policy that costs no host time: these tiny blocks are
# link- and launch-bound on an H200's figures, where no kind would be worth a policy (see the
# test of that below).
FREE_POLICY = DeviceModel(peak_flops=1e12, policy_seconds_per_op=0, host_seconds_per_op=0)

WIDTH, HIDDEN, TOKENS, BLOCKS = 64, 256, 128, 4


# The planner imitates CUDA's attention and RMS norm kernels (what they save differs from the
# CPU's); tests that compare planned with real CPU traffic switch attention off.
ATTENTION = True


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Block(nn.Module):
    """A small pre-norm transformer block: attention projections and a SwiGLU MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.gate = nn.Linear(WIDTH, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(_norm(x)).view(1, TOKENS, 3, 4, WIDTH // 4).unbind(2)
        if ATTENTION:
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
        else:  # elementwise, so the planner runs what the CPU runs (no CUDA kernel stand-in)
            a = (q * k.sigmoid() + v).transpose(1, 2)
        x = x + self.out(a.transpose(1, 2).reshape(1, TOKENS, WIDTH))
        h = _norm(x)
        return x + self.down(F.silu(self.up(h)) * self.gate(h))


class Stack(nn.Module):
    def __init__(
        self,
        context_fn: Callable[[], Any] | None = None,
        block: Callable[[], nn.Module] = Block,
        count: int = BLOCKS,
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(block() for _ in range(count))
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        extra = {} if self.context_fn is None else {"context_fn": self.context_fn}
        for block in self.blocks:
            x = matepoint.checkpoint(block, x, **extra)
        return x


def _plan(blocks: int = BLOCKS) -> matepoint.MemoryPlan:
    with torch.device("meta"):
        stack = Stack(count=blocks)
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    return matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))


# Compute at 1 TFLOP/s, a link that costs nothing and a policy without host time.
FREE_LINK = DeviceModel(
    peak_flops=1e12,
    to_host_bandwidth=1e18,
    to_device_bandwidth=1e18,
    policy_seconds_per_op=0,
    host_seconds_per_op=0,
)


def _between_every_block_and_keeping_all(memory_plan: matepoint.MemoryPlan) -> matepoint.BudgetPlan:
    """The plan for a budget between every block's peak and what keeping everything needs.

    Keeping does not fit there: offloading must carry the rest.
    """
    every_block = memory_plan["matepoint"].peak_bytes
    roomy = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_LINK)
    return memory_plan.fastest_under((every_block + roomy.peak_bytes) // 2, device=FREE_LINK)


def _steps_match_torch(
    planned: nn.Module,
    reference: nn.Module,
    shape: tuple[int, ...],
    steps: int = 1,
    **settings: Any,
) -> Any:
    """Run steps of ``planned`` (its blocks through ``matepoint.checkpoint``) on the CPU test
    transport, its copies done at once, and of ``reference``'s blocks through torch's checkpoint,
    from the same weights and inputs; assert the gradients are equal; return matepoint's stats."""
    reference.load_state_dict(planned.state_dict())
    for _ in range(steps):
        x = torch.randn(*shape, requires_grad=True)
        x_reference = x.detach().clone().requires_grad_()
        with (
            use_transport(CPUTestTransport(completion="immediate")),
            matepoint.options(**settings),
        ):
            planned(x).sum().backward()
            stats = matepoint.stats()
        expected = x_reference
        for block in reference.blocks:  # type: ignore[union-attr]
            expected = torch.utils.checkpoint.checkpoint(block, expected, use_reentrant=False)
        expected.sum().backward()
        assert torch.equal(x.grad, x_reference.grad)  # type: ignore[arg-type]
    for mine, theirs in zip(planned.parameters(), reference.parameters(), strict=True):
        assert torch.equal(mine.grad, theirs.grad)  # type: ignore[arg-type]
    return stats


def test_op_kinds_name_matrix_products_by_shape_and_attention() -> None:
    a, b = torch.empty(8, 64, device="meta"), torch.empty(64, 192, device="meta")
    assert op_kind(torch.ops.aten.mm.default, (a, b)) == "matmul 64x192"
    assert op_kind(torch.ops.aten.addmm.default, (torch.empty(192), a, b)) == "matmul 64x192"
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert op_kind(flash, (a, a, a)) == "attention"
    assert op_kind(torch.ops.aten.add.Tensor, (a, a)) == "other"


def test_a_roomy_budget_keeps_what_is_dear_to_recompute_and_the_step_gets_faster() -> None:
    memory_plan = _plan()
    every_block = memory_plan["matepoint"]
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    assert budget.fits
    assert budget.peak_bytes <= budget.budget_bytes
    assert budget.step_seconds < budget.every_block_seconds
    assert budget.strategy_plan.backward_flops < every_block.backward_flops
    kept = {kind for kind, decision in budget.decisions if decision == "keep"}
    assert kept, budget
    ranking = [kind.flops_per_byte for kind in budget.kinds]
    assert ranking == sorted(ranking, reverse=True)
    assert "planned peak" in str(budget)


def test_a_peak_near_the_budget_is_printed_with_a_word_on_fragmentation() -> None:
    memory_plan = _plan()
    roomy = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    assert roomy.peak_bytes <= 0.9 * roomy.budget_bytes
    assert "fragmentation" not in str(roomy)
    tight = memory_plan.fastest_under(memory_plan["matepoint"].peak_bytes + 1)
    assert tight.fits
    assert "expandable_segments:True" in str(tight)


def test_a_kind_backward_never_recomputes_is_profiled_but_never_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The down projection runs after everything backward reads from a block: not worth a try."""
    tried: list[dict[str, str]] = []
    context_fn = matepoint._planner.policy.context_fn_of

    def logged(decisions: dict[str, Any], *args: Any) -> Any:
        tried.append(decisions)
        return context_fn(decisions, *args)

    monkeypatch.setattr(matepoint._planner.search_state, "context_fn_of", logged)
    memory_plan = _plan()
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    recomputed = {kind.kind: kind.recomputed for kind in budget.kinds}
    down = f"matmul {HIDDEN}x{WIDTH}"
    assert recomputed.pop(down) == 0
    assert set(recomputed.values()) == {BLOCKS}  # the rest, once per block
    assert tried
    assert not any(down in decisions for decisions in tried)
    assert down not in dict(budget.decisions)


def test_a_budget_below_every_block_says_so_and_names_the_smallest_that_fits() -> None:
    memory_plan = _plan()
    floor = memory_plan["matepoint"].peak_bytes
    budget = memory_plan.fastest_under(floor // 2)
    assert not budget.fits
    assert budget.decisions == ()
    assert floor // 2 < budget.smallest_budget_bytes <= floor
    assert "does NOT fit" in str(budget)
    assert "smallest budget that fits" in str(budget)


def test_a_slow_link_never_offloads() -> None:
    memory_plan = _plan()
    every_block = memory_plan["matepoint"].peak_bytes
    slow = DeviceModel(
        peak_flops=1e12, to_host_bandwidth=1e3, to_device_bandwidth=1e3, host_seconds_per_op=0
    )
    budget = memory_plan.fastest_under(every_block, device=slow)
    assert budget.fits
    assert "offload" not in dict(budget.decisions).values()
    # The budget holds the block inputs too: nothing crosses (Note [The budget search]).
    assert budget.strategy_plan.bytes_to_host == 0


def test_the_checkpoint_inputs_stay_on_the_device_when_the_budget_holds_them() -> None:
    """Sixteen thin blocks whose inputs outweigh their weights: torch's checkpoint holds them.

    Each block widens to 64 inside, so the step without a checkpoint does not fit there."""
    with torch.device("meta"):
        stack = Stack(block=lambda: nn.Sequential(nn.Linear(16, 64), nn.Linear(64, 16)), count=16)
        x = torch.randn(4096, 16, requires_grad=True)
    memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    # A link too slow for the widened outputs, so no policy offloads them.
    slow_link = dataclasses.replace(FREE_POLICY, to_host_bandwidth=1e9, to_device_bandwidth=1e9)
    torch_peak, offloaded_peak = (
        memory_plan["torch"].peak_bytes,
        memory_plan["matepoint"].peak_bytes,
    )
    assert offloaded_peak < torch_peak
    roomy = memory_plan.fastest_under(torch_peak, device=slow_link)
    assert roomy.fits
    assert roomy.strategy_plan.bytes_to_host == 0
    assert roomy.settings_changes()["min_offload_bytes"] > 4096 * 16 * 4
    tight = memory_plan.fastest_under(offloaded_peak, device=slow_link)
    assert tight.fits
    # Every block it checkpoints has its input offloaded; the last ones it may leave unchecked
    # (Note [The budget search], rule 10) move nothing.
    checked = tight.regions - tight.unchecked_last
    every_input = memory_plan["matepoint"].bytes_to_host
    assert tight.strategy_plan.bytes_to_host == every_input * checked // tight.regions > 0
    assert tight.settings_changes()["min_offload_bytes"] == 0


@needs_offload_values
def test_offloading_is_chosen_when_the_link_is_free_and_keeping_does_not_fit() -> None:
    memory_plan = _plan()
    budget = _between_every_block_and_keeping_all(memory_plan)
    assert budget.fits
    assert "offload" in dict(budget.decisions).values(), budget
    assert budget.strategy_plan.bytes_to_host > memory_plan["matepoint"].bytes_to_host


@pytest.mark.skipif(
    not matepoint._planner.policy.OFFLOAD_AVAILABLE, reason="offload values arrived in 2.11"
)
def test_a_plan_for_the_compiled_path_offloads_nothing_through_its_policy() -> None:
    """Note [The budget search], rule 11: under a whole-model compile torch keeps what a
    policy offloads, so the same budget is planned with keeps and recomputes only."""
    eager = _between_every_block_and_keeping_all(_plan())
    assert "offload" in dict(eager.decisions).values()
    with torch.device("meta"):
        stack = Stack(count=BLOCKS)
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    settings = matepoint.OffloadSettings(min_offload_bytes=0, compiled_offload=True)
    compiled = matepoint.plan(stack, x, options=settings).fastest_under(
        eager.budget_bytes, device=FREE_LINK
    )
    assert "offload" not in dict(compiled.decisions).values(), compiled
    assert compiled.settings.compiled_offload
    assert compiled.peak_bytes <= compiled.budget_bytes or not compiled.fits


def test_the_host_budget_and_ranks_per_node_limit_offloading() -> None:
    memory_plan = _plan()
    every_block = memory_plan["matepoint"]
    host = every_block.pinned_bytes * 2
    budget = memory_plan.fastest_under(
        every_block.peak_bytes, host_budget_bytes=host, ranks_per_node=2, device=FREE_LINK
    )
    assert budget.fits
    assert budget.pinned_bytes_per_node == budget.strategy_plan.pinned_bytes * 2 <= host
    assert "offload" not in dict(budget.decisions).values()
    with pytest.raises(ValueError, match="ranks_per_node"):
        memory_plan.fastest_under(every_block.peak_bytes, ranks_per_node=0)


def test_the_step_time_hides_copies_under_compute_and_counts_the_rest() -> None:
    plan = dataclasses.make_dataclass(
        "Planned",
        ["forward_flops", "backward_flops", "bytes_to_host", "bytes_to_device"],
    )
    device = DeviceModel(peak_flops=1.0, to_host_bandwidth=1.0, to_device_bandwidth=1.0)
    assert step_seconds(plan(10, 20, 5, 15), device, prefetch=2) == 30
    assert step_seconds(plan(10, 20, 15, 25), device, prefetch=2) == 40
    assert step_seconds(plan(10, 20, 5, 15), device, prefetch=0) == 45
    # The host's time overlaps the device's and counts only beyond it.
    host = dataclasses.replace(device, policy_seconds_per_op=0.5, host_seconds_per_op=1.0)
    assert step_seconds(plan(10, 20, 5, 15), host, prefetch=2, policy_ops=0, host_ops=20) == 30
    assert step_seconds(plan(10, 20, 5, 15), host, prefetch=2, policy_ops=4, host_ops=20) == 32
    assert step_seconds(plan(10, 20, 5, 15), host, prefetch=2, policy_ops=4, host_ops=40) == 42


@needs_offload_values
def test_the_chosen_plan_runs_for_real_with_torchs_gradients_and_the_planned_traffic(
    fresh_stats: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copies that complete at once: the planner's one assumption (Note [Planner fidelity])."""
    monkeypatch.setattr(__import__(__name__), "ATTENTION", False)
    memory_plan = _plan()
    budget = _between_every_block_and_keeping_all(memory_plan)
    decisions = dict(budget.decisions)
    assert "offload" in decisions.values()

    torch.manual_seed(0)
    stats = _steps_match_torch(
        Stack(budget.context_fn()), Stack(), (1, TOKENS, WIDTH), **budget.settings_changes()
    )
    counters = budget.strategy_plan.counters
    real = dataclasses.asdict(stats)
    assert {name: real[name] for name in counters} == counters


@needs_offload_values
def test_a_kind_repeated_in_a_region_is_decided_per_occurrence(fresh_stats: None) -> None:
    """The MLP's up and gate projections share a shape: offloading the first leaves the second."""
    memory_plan = _plan()
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    up, gate = f"matmul {WIDTH}x{HIDDEN} #1", f"matmul {WIDTH}x{HIDDEN} #2"
    classes = {kind.kind for kind in budget.kinds}
    assert {up, gate} <= classes
    assert f"matmul {WIDTH}x{HIDDEN}" not in classes
    first_only = dataclasses.replace(budget, decisions=((up, "offload"),))

    policy = first_only.policy()
    forward, recompute = SimpleNamespace(is_recompute=False), SimpleNamespace(is_recompute=True)
    mm = torch.ops.aten.mm.default
    args = (torch.empty(8, WIDTH, device="meta"), torch.empty(WIDTH, HIDDEN, device="meta"))
    values = [policy(ctx, mm, *args) for ctx in (forward, recompute, forward, recompute)]
    policies = torch.utils.checkpoint.CheckpointPolicy
    offload, recomputed = policies.MUST_CPU_OFFLOAD, policies.PREFER_RECOMPUTE
    assert values == [offload, offload, recomputed, recomputed]
    # Ops named "other" by the op alone are answered before any counting; a plan that
    # offloads nothing leaves its contexts to torch, one that offloads does not.
    add = torch.ops.aten.add.Tensor
    assert [policy(forward, add, *args) for _ in range(2)] == [recomputed] * 2
    kept = dataclasses.replace(budget, decisions=((up, "keep"),))
    for plan, wrapped in ((first_only, True), (kept, False)):
        contexts = torch.utils.checkpoint.create_selective_checkpoint_contexts(plan.policy())
        assert (compat.offloading_selective_contexts(contexts, print) is not contexts) is wrapped

    torch.manual_seed(0)
    stats = _steps_match_torch(
        Stack(first_only.context_fn()), Stack(), (1, TOKENS, WIDTH), min_offload_bytes=0
    )
    # One up projection's output per block crossed, not the gate's.
    assert stats.bytes_offloaded_by_policy == BLOCKS * TOKENS * HIDDEN * 4


class Thin(nn.Module):
    """A block whose up-projection's output outweighs its weights (and its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64, bias=False)
        self.down = nn.Linear(64, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


def test_a_kind_that_does_not_fit_everywhere_is_kept_in_the_last_regions(
    fresh_stats: None,
) -> None:
    """Between every block's peak and keeping the up-projections everywhere, with no host room
    to offload them: they are kept in the last blocks only (Note [A plan's regions])."""
    with torch.device("meta"):
        stack = Stack(block=Thin, count=8)
        x = torch.randn(4096, 16, requires_grad=True)
    memory_plan = matepoint.plan(stack, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    slow_compute = dataclasses.replace(FREE_LINK, peak_flops=1e9)
    host = memory_plan["matepoint"].pinned_bytes  # room for the block inputs only
    everywhere = memory_plan.fastest_under(
        memory_plan["none"].peak_bytes * 2, device=slow_compute, host_budget_bytes=host
    )
    assert dict(everywhere.decisions) == {"matmul 16x64": "keep"}
    assert everywhere.kept_in_last == ()
    budget_bytes = (memory_plan["matepoint"].peak_bytes + everywhere.peak_bytes) // 2
    budget = memory_plan.fastest_under(budget_bytes, device=slow_compute, host_budget_bytes=host)
    assert budget.fits
    assert budget.peak_bytes <= budget_bytes
    assert budget.regions == 8
    ((name, last),) = budget.kept_in_last
    assert name == "matmul 16x64"
    assert 0 < last < 8
    assert "matmul 16x64" not in dict(budget.decisions)
    assert budget.step_seconds < budget.every_block_seconds
    assert f"keep in the last {last} of 8 regions" in str(budget)

    mm = torch.ops.aten.mm.default
    args = (torch.empty(8, 16, device="meta"), torch.empty(16, 64, device="meta"))
    forward = SimpleNamespace(is_recompute=False)
    saved = torch.utils.checkpoint.CheckpointPolicy.MUST_SAVE
    kept = [budget.policy(region)(forward, mm, *args) == saved for region in range(8)]
    assert kept == [False] * (8 - last) + [True] * last

    # For real, two steps: the context_fn numbers the regions of each step from 0 again.
    context_fn = budget.context_fn()
    assert context_fn is not None
    served: list[Any] = []

    def counting_context_fn() -> Any:
        served.append(context_fn())
        return served[-1]

    torch.manual_seed(0)
    _steps_match_torch(
        Stack(counting_context_fn, Thin, 8),
        Stack(None, Thin, 8),
        (4096, 16),
        steps=2,
        **budget.settings_changes(),
    )
    assert len(served) == 16


def test_the_integrations_apply_a_budget_plan_in_one_call() -> None:
    import matepoint.integrations as mi

    memory_plan = _plan()
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    before = matepoint.get_options()
    try:
        function = mi.matepoint_checkpoint_fn(budget_plan=budget)
        assert function.keywords["context_fn"] is not None
        assert matepoint.get_options().prefetch == budget.prefetch
        with pytest.raises(TypeError, match="context_fn"):
            mi.matepoint_checkpoint_fn(budget_plan=budget, context_fn=lambda: None)
    finally:
        matepoint.configure(**dataclasses.asdict(before))


@pytest.mark.skipif(not compat.COMPILED_OFFLOAD, reason="matepoint's compiled path needs 2.11")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_a_budget_plan_runs_under_a_whole_model_compile_with_the_compiled_path() -> None:
    """Dynamo takes a checkpoint's ``context_fn`` only as a function: the plan's is one."""
    memory_plan = _plan()
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2, device=FREE_POLICY)
    assert "keep" in dict(budget.decisions).values()
    torch.manual_seed(0)
    planned, reference = Stack(context_fn=budget.context_fn()), Stack()
    reference.load_state_dict(planned.state_dict())
    x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    torch._dynamo.reset()
    try:
        with (
            use_transport(CPUTestTransport(completion="immediate")),
            matepoint.options(**{**budget.settings_changes(), "compiled_offload": True}),
        ):
            torch.compile(planned, backend="aot_eager", fullgraph=True)(x).sum().backward()
    finally:
        torch._dynamo.reset()
    expected = x_reference
    for block in reference.blocks:
        expected = torch.utils.checkpoint.checkpoint(block, expected, use_reentrant=False)
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x_reference.grad)
    for mine, theirs in zip(planned.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad)


def test_a_policy_that_costs_more_host_time_than_it_saves_is_not_chosen() -> None:
    memory_plan = _plan()
    roomy = memory_plan["none"].peak_bytes * 2
    assert dict(memory_plan.fastest_under(roomy, device=FREE_POLICY).decisions)
    costly = dataclasses.replace(FREE_POLICY, policy_seconds_per_op=1.0)
    # Below no checkpoint's peak, which would fit and need no policy either.
    budget = memory_plan.fastest_under(memory_plan["none"].peak_bytes - 1, device=costly)
    assert budget.fits
    assert budget.decisions == ()
    assert budget.context_fn() is torch.utils.checkpoint.noop_context_fn
    # No policy's host time is in the estimate: it is the every-block step's, less the
    # recomputation of the last regions left unchecked (Note [The budget search], rule 10).
    assert budget.unchecked_last > 0
    assert budget.step_seconds < budget.every_block_seconds
    assert budget.step_seconds < 1.0


@pytest.mark.parametrize("policy_cost", [0.0, 1.0], ids=["model-takes-policy", "model-declines"])
@pytest.mark.parametrize("policy_faster", [True, False], ids=["policy-faster", "plain-faster"])
def test_measured_finalists_decide_whatever_the_time_model_says(
    policy_cost: float, policy_faster: bool
) -> None:
    """Note [Measured finalists]: the policy plan and the best plan without one are measured."""
    memory_plan = _plan()
    roomy = memory_plan["none"].peak_bytes * 2
    device = dataclasses.replace(FREE_POLICY, policy_seconds_per_op=policy_cost)
    given: list[tuple[matepoint.BudgetPlan, ...]] = []

    def measure(plans: Any) -> list[float]:
        given.append(tuple(plans))
        return [0.5, 0.7, 0.9] if policy_faster else [0.7, 0.5, 0.9]

    budget = memory_plan.fastest_under(roomy, device=device, measure=measure)
    # The step without a checkpoint fits this budget: it is the third finalist (rule 2).
    [(with_policy, without, unchecked)] = given
    assert not unchecked.checkpoint
    assert unchecked.fits
    assert with_policy.decisions
    assert with_policy.context_fn() is not torch.utils.checkpoint.noop_context_fn
    assert without.decisions == ()
    assert without.context_fn() is torch.utils.checkpoint.noop_context_fn
    assert with_policy.fits
    assert without.fits
    assert dataclasses.replace(budget, measured_seconds=()) == (
        with_policy if policy_faster else without
    )
    assert budget.measured_seconds == (0.5, 0.7, 0.9)
    assert "measured 500.0 ms against 700.0 ms, 900.0 ms for the other finalists" in str(budget)


def test_the_step_without_a_checkpoint_is_a_finalist_where_it_fits() -> None:
    """Note [Measured finalists], rule 2: measured fastest, the step without any checkpoint is
    the plan; where it does not fit, it is no finalist."""
    memory_plan = _plan()
    roomy = memory_plan["none"].peak_bytes * 2
    budget = memory_plan.fastest_under(roomy, device=FREE_POLICY, measure=lambda _: [0.7, 0.6, 0.5])
    assert not budget.checkpoint
    assert budget.measured_seconds == (0.5, 0.7, 0.6)
    given: list[matepoint.BudgetPlan] = []
    tight = (memory_plan["none"].peak_bytes + memory_plan["matepoint"].peak_bytes) // 2
    memory_plan.fastest_under(
        tight,
        device=FREE_POLICY,
        measure=lambda plans: given.extend(plans) or [0.5] * len(plans),
    )
    # The policy plan, the plain step, and the plain step with its last regions unchecked.
    assert [plan.checkpoint for plan in given] == [True] * 3
    assert [plan.unchecked_last > 0 for plan in given] == [False, False, True]


@pytest.mark.parametrize("out_of_memory", [0, 1], ids=["policy-plan", "plain-plan"])
def test_a_finalist_that_could_not_run_is_never_chosen(out_of_memory: int) -> None:
    memory_plan = _plan()
    times = [0.5, 0.5, float("inf")]  # the step without a checkpoint could not run either
    times[out_of_memory] = float("inf")
    budget = memory_plan.fastest_under(
        memory_plan["none"].peak_bytes * 2, device=FREE_POLICY, measure=lambda _: times
    )
    assert bool(budget.decisions) == (out_of_memory == 1)
    assert budget.measured_seconds == (0.5, float("inf"), float("inf"))


def test_nothing_is_measured_when_the_search_found_no_policy_to_try() -> None:
    memory_plan = _plan()

    def measure(plans: Any) -> list[float]:
        raise AssertionError(f"measured {len(plans)} plan(s)")

    floor = memory_plan["matepoint"].peak_bytes
    budget = memory_plan.fastest_under(floor // 2, measure=measure)
    assert not budget.fits
    assert budget.measured_seconds == ()


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ([1.0], "must return one positive step time"),
        ([1.0, 0.0], "must return one positive step time"),
        ([1.0, float("nan")], "must return one positive step time"),
        ([1.0, -2.0], "must return one positive step time"),
        ([float("inf")] * 3, "could run none of the 3 plans"),
    ],
)
def test_a_measure_that_returns_no_time_per_plan_is_named(
    returned: list[float], message: str
) -> None:
    memory_plan = _plan()
    with pytest.raises(ValueError, match=f"measure= {message}"):
        memory_plan.fastest_under(
            memory_plan["none"].peak_bytes * 2, device=FREE_POLICY, measure=lambda _: returned
        )


def test_calibration_is_cached_per_device_and_torch_and_refreshed_on_request(
    tmp_path: Any,
) -> None:
    from matepoint._planner.time_model import cached_model

    path = tmp_path / "models.json"
    calls: list[int] = []

    def measure() -> DeviceModel:
        calls.append(1)
        return DeviceModel(peak_flops=7e14, to_host_bandwidth=5e10, policy_seconds_per_op=3e-6)

    first = cached_model(path, "H200 | torch 2.11", measure)
    assert cached_model(path, "H200 | torch 2.11", measure) == first
    assert len(calls) == 1
    cached_model(path, "H100 | torch 2.11", measure)
    assert len(calls) == 2
    assert set(json.loads(path.read_text())) == {"H200 | torch 2.11", "H100 | torch 2.11"}
    cached_model(path, "H200 | torch 2.11", measure, refresh=True)
    assert len(calls) == 3
    path.write_text("not json")
    assert cached_model(path, "H200 | torch 2.11", measure) == first
    assert len(calls) == 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_calibrating_without_a_gpu_says_so() -> None:
    with pytest.raises(ValueError, match="DeviceModel"):
        matepoint.calibrate()
    with pytest.raises(ValueError, match="CUDA"):
        matepoint.calibrate("cpu")


@pytest.mark.parametrize("content", ["[]", '{"H200 | torch 2.11": {"warp_drive": 1}}', "{"])
def test_a_calibration_cache_of_another_shape_is_measured_over(tmp_path: Any, content: str) -> None:
    from matepoint._planner.time_model import cached_model

    path = tmp_path / "models.json"
    path.write_text(content)
    measured = DeviceModel(peak_flops=7e14)
    assert cached_model(path, "H200 | torch 2.11", lambda: measured) == measured
    assert json.loads(path.read_text())["H200 | torch 2.11"]["peak_flops"] == 7e14
