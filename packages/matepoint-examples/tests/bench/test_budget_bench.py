"""The budget benchmark's pieces that need no GPU: its peers' policies and its refusal on a CPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


def test_the_selective_peers_save_exactly_their_kinds() -> None:
    policy = budget.selective_policy(frozenset({"attention", "matmul 64x128"}))
    a, b = torch.empty(8, 64), torch.empty(64, 128)
    save = torch_checkpoint.CheckpointPolicy.MUST_SAVE
    recompute = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.aten.mm.default, a, b) == save
    assert policy(None, torch.ops.aten.mm.default, b, b.t()) == recompute
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert policy(None, flash, a, a, a) == save


def test_the_peers_of_a_workload_are_named_and_runnable_on_a_cpu() -> None:
    functions = budget.checkpoint_fns(budget.WORKLOADS["llama-tiny"])
    assert set(functions) == {
        "torch",
        "matepoint",
        "none",
        "sac-attention-down",
        "sac-every-matmul",
    }
    assert tuple(functions) == budget.EAGER_STRATEGIES  # --twin's choices
    x = torch.randn(2, 3, requires_grad=True)
    for function in functions.values():
        assert torch.equal(function(torch.sin, x), torch.sin(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert budget.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out


def test_budget_sizes_and_names_resolve_against_the_measured_peaks() -> None:
    assert budget.parse_bytes("24GiB") == 24 << 30
    assert budget.parse_bytes("1.5GB") == 1_500_000_000
    assert budget.parse_bytes("512MiB") == 512 << 20
    assert budget.parse_bytes("4096") == 4096
    peaks = {"torch": 100, "none": 300}
    cpu = torch.device("cpu")
    assert budget._budgets(["torch", "mid", "1KiB"], peaks, cpu) == {
        "budget@torch": 100,
        "budget@mid": 200,
        "budget@1KiB": 1024,
    }
    # torch's checkpoint ran out of memory under a cap: only the fixed budget is left.
    assert budget._budgets(["torch", "mid", "1KiB"], {"torch": -1, "none": -1}, cpu) == {
        "budget@1KiB": 1024
    }
    # "auto" reads a CUDA device: off one it is refused before anything runs.
    with pytest.raises(ValueError, match="CUDA"):
        budget._budgets(["auto"], peaks, cpu)


@pytest.mark.parametrize("text", ["0", "-5GiB", "inf", "ten", "10 parsecs"])
def test_a_size_flag_that_is_no_size_is_a_usage_error(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="no size"):
        budget.parse_bytes(text)


@pytest.mark.parametrize("name", ["llama-tiny", "nanochat12", "hf-llama16"])
def test_the_one_call_takes_each_workloads_batch_and_loss(name: str) -> None:
    """plan_budget on the live model (built on the meta device here, a GPU's in the benchmark)
    makes the plan the benchmark's own search makes without measuring, at the same budget less
    the optimizer's states it counts itself."""
    if name.startswith("hf"):
        pytest.importorskip("transformers")
    workload = budget.WORKLOADS[name]
    runner = budget_runner.Runner(workload, device="meta")
    memory_plan = budget._plan(workload)
    states = optimizer_state_bytes(runner.optimizer)
    # Off the halfway point by a MiB: there half the blocks unchecked, their inputs held, peak
    # at exactly the budget, and the twin's extra block below would decide the plan.
    halfway = (memory_plan["torch"].peak_bytes + memory_plan["none"].peak_bytes) // 2
    total = halfway + (1 << 20) + states
    one_call = budget_runner.plan_one_call(runner, total, None)
    assert one_call.budget_bytes == total - states
    searched = memory_plan.fastest_under(total - states)
    # The twin of a transformers model holds one small tensor more than the model built on
    # the meta device (a 512-byte block at its baseline); nothing else differs.
    assert one_call.peak_bytes == pytest.approx(searched.peak_bytes, abs=4096)
    assert (
        one_call.checkpoint,
        one_call.decisions,
        one_call.kept_in_last,
        one_call.unchecked_last,
    ) == (searched.checkpoint, searched.decisions, searched.kept_in_last, searched.unchecked_last)


def test_a_plan_that_checkpoints_nothing_runs_the_blocks_as_they_are() -> None:
    memory_plan = budget._plan(budget.WORKLOADS["llama-tiny"])
    plan = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 4)
    assert not plan.checkpoint
    assert budget.plan_checkpoint_fn(plan) is budget_runner.no_checkpoint


@pytest.mark.parametrize("name", ["llama-tiny", "nanochat12"])
def test_each_workload_plans_on_the_meta_device(name: str) -> None:
    memory_plan = budget._plan(budget.WORKLOADS[name])
    assert 0 < memory_plan["matepoint"].peak_bytes <= memory_plan["none"].peak_bytes


def test_the_hugging_face_workload_plans_through_matepoints_integration() -> None:
    pytest.importorskip("transformers")
    workload = budget.WORKLOADS["hf-llama16"]
    memory_plan = budget._plan(workload)
    # The layers' checkpoints are matepoint's: torch's checkpoint and none plan differently.
    assert memory_plan["torch"].peak_bytes < memory_plan["none"].peak_bytes
    # A search plans the step again, transformers' packed-sequence search answered each time.
    budget_plan = memory_plan.fastest_under(memory_plan["torch"].peak_bytes)
    assert budget_plan.fits


def test_the_frontier_is_drawn_from_saved_reports(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = Path(__file__).resolve().parents[4] / "docs" / "_data" / "budget-h200-llama8.json"
    report = tmp_path / "report.json"
    report.write_text(data.read_text())
    out = tmp_path / "frontier.png"
    assert budget.main(["--plot", str(out), str(report)]) == 0
    assert out.stat().st_size > 0
    assert "budget@torch" in json.loads(data.read_text())["rows"]


def test_matepoint_bench_runs_the_budget_benchmark(tmp_path: Path) -> None:
    from matepoint_examples.bench import cli

    data = Path(__file__).resolve().parents[4] / "docs" / "_data" / "budget-h200-llama8.json"
    out = tmp_path / "frontier.png"
    assert cli.main(["budget", "--plot", str(out), str(data)]) == 0
    assert out.stat().st_size > 0


def test_where_torch_runs_out_of_memory_the_table_gives_the_ratio_to_matepoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gib = 1 << 30
    report = {
        "workload": "llama64-long",
        "rounds": 2,
        "device": "a GPU",
        "plans": {"budget@24GiB": {"predicted_peak_bytes": 22 * gib}},
        "rows": {
            "torch": {"peak_bytes": -1, "planned_peak_bytes": 29 * gib},
            "matepoint": {
                "peak_bytes": 16 * gib,
                "planned_peak_bytes": 16 * gib,
                **dict.fromkeys(("to_matepoint", "to_matepoint_q1", "to_matepoint_q3"), 1.0),
            },
            "budget@24GiB": {
                "peak_bytes": 22 * gib,
                "planned_peak_bytes": None,
                "to_matepoint": 0.95,
                "to_matepoint_q1": 0.94,
                "to_matepoint_q3": 0.96,
            },
        },
    }
    print_report(report)
    lines = capsys.readouterr().out.splitlines()
    assert "step / matepoint" in lines[1]
    torch_row, plan_row = lines[2].split(), lines[4].split()
    assert torch_row[:3] == ["torch", "-", "-"]
    # A report saved before host times were kept: no step time, host time or ratio.
    assert plan_row == [
        "budget@24GiB",
        "-",
        "0.950",
        "[0.940-0.960]",
        "-",
        "-",
        "-",
        "22.00",
        "22.00",
    ]


def test_the_finalists_are_measured_alternately_and_one_out_of_memory_is_infinite() -> None:
    memory_plan = budget._plan(budget.WORKLOADS["llama-tiny"])
    roomy = memory_plan["none"].peak_bytes * 2
    free_policy = matepoint.DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)
    given: list[Sequence[matepoint.BudgetPlan]] = []

    def capture(plans: Sequence[matepoint.BudgetPlan]) -> list[float]:
        given.append(plans)
        return [1.0, 2.0, 3.0][: len(plans)]

    memory_plan.fastest_under(roomy, device=free_policy, measure=capture)
    finalists = given[0][:2]

    class Runner:
        """Steps of 0.2 s and 0.3 s, the host twice as slow in the last round; or the second
        finalist runs out of memory (NaN, as ``Runner.step`` says)."""

        def __init__(self, out_of_memory: bool) -> None:
            self.settings: dict[str, dict[str, Any]] = {}
            self.steps: list[str] = []
            self.out_of_memory = out_of_memory

        def step(self, name: str, checkpoint_fn: Any) -> budget_runner.Step:
            self.steps.append(name)
            if name == "finalist 1" and self.out_of_memory:
                return budget_runner.Step(math.nan, -1, math.nan)
            slow = 2 if len(self.steps) > 4 else 1
            seconds = (0.2 if name == "finalist 0" else 0.3) * slow
            return budget_runner.Step(seconds, 1, seconds / 2)

    runner = Runner(out_of_memory=False)
    measure = budget_runner.measure_finalists(runner, rounds=2)  # type: ignore[arg-type]
    # Paired: the last round's slow host moves both times, not their ratio.
    assert measure(finalists) == pytest.approx([0.3, 0.45])
    # A warm-up round, then two, each finalist once per round, the order alternating.
    first, second = "finalist 0", "finalist 1"
    assert runner.steps == [first, second, second, first, first, second]
    runner = Runner(out_of_memory=True)
    measure = budget_runner.measure_finalists(runner, rounds=2)  # type: ignore[arg-type]
    assert measure(finalists) == [pytest.approx(0.3), math.inf]
    assert runner.settings["finalist 0"] == finalists[0].settings_changes()


def test_the_engine_variants_run_the_plans_policy_on_both_engines() -> None:
    """A plan's policy under torch's checkpoint and under matepoint's offloading nothing: the
    plan's gradients on a CPU, each variant with its own region count."""
    memory_plan = budget._plan(budget.WORKLOADS["llama-tiny"])
    free_policy = matepoint.DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)
    plan = memory_plan.fastest_under(
        memory_plan["none"].peak_bytes * 2,
        device=free_policy,
        measure=lambda plans: [1.0, 2.0, 3.0][: len(plans)],
    )
    assert plan.context_fn() is not torch_checkpoint.noop_context_fn
    variants = budget.engine_variants("budget@mid", plan)
    assert list(variants) == ["budget@mid on torch", "budget@mid offload off"]
    workload = budget.WORKLOADS["llama-tiny"]
    gradients = {}
    for name, checkpoint_fn in {"plan": budget.plan_checkpoint_fn(plan), **variants}.items():
        torch.manual_seed(0)
        model, inputs = workload.build()
        workload.set_checkpoint(model, checkpoint_fn)
        workload.loss(model, inputs).backward()
        gradients[name] = [p.grad for p in model.parameters()]
    for name in variants:
        assert all(map(torch.equal, gradients[name], gradients["plan"])), name
    everything_recomputed = dataclasses.replace(plan, decisions=(), kept_in_last=())
    assert budget.engine_variants("budget@mid", everything_recomputed) == {}


def test_the_plan_compiled_block_by_block_gives_each_block_its_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Block i of every step runs region i's compiled function; its settings drop the
    whole-model compiled path the plan was searched under, and a failed compile is reported."""
    from types import SimpleNamespace

    from matepoint_examples.bench import _budget_strategies as strategies_module

    made: list[int] = []

    class Recorded:
        def __init__(self, plan: Any, region: int) -> None:
            made.append(region)
            self.region = region

        def __call__(self, block: Any, x: Any) -> tuple[int, Any]:
            return self.region, block

    monkeypatch.setattr(strategies_module, "CompiledBlockCheckpoint", Recorded)
    settings = matepoint.OffloadSettings(compiled_offload=True)
    plan = SimpleNamespace(regions=3, settings_changes=lambda: dataclasses.asdict(settings))
    runner = SimpleNamespace(settings={}, may_fail=set())
    strategies: dict[str, Any] = {}
    label = strategies_module.add_compiled_blocks(runner, strategies, "budget@mid", plan)  # type: ignore[arg-type]
    assert label == "compiled-blocks-plan@mid"
    assert made == [0, 1, 2]
    function = strategies[label]
    assert [function(f"block {i % 3}", None) for i in range(6)] == [
        (i % 3, f"block {i % 3}") for i in range(6)
    ]
    assert runner.settings[label]["compiled_offload"] is False
    assert label in runner.may_fail


@pytest.mark.parametrize("unchecked_last", [0, 1], ids=["no-policy", "last-unchecked"])
def test_a_plan_without_a_policy_runs_under_a_whole_model_compile(unchecked_last: int) -> None:
    """The plan's checkpoint functions under the compiled path: a region without a policy gets
    no context_fn (Dynamo refuses torch's noop as one), and the unchecked regions' functions
    are made before the compile traces them."""
    workload = budget.WORKLOADS["llama-tiny"]
    torch.manual_seed(0)
    model, inputs = workload.build()
    memory_plan = budget._plan(workload)
    plan = memory_plan.fastest_under(memory_plan["none"].peak_bytes * 2)
    plan = dataclasses.replace(plan, checkpoint=True, decisions=(), unchecked_last=unchecked_last)
    workload.set_checkpoint(model, budget_runner.plan_checkpoint_fn(plan))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    with matepoint.options(**{**plan.settings_changes(), "compiled_offload": True}):
        for _ in range(2):
            loss = workload.loss(compiled, inputs)
            loss.backward()
    torch._dynamo.reset()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())
