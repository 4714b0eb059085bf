"""The budget benchmark's host time per step, measured on a CPU: recorded, reported, judged.

On a CPU both the step time and the host time are wall times and the host issues the whole
step, so every strategy's host time is its step time, short only of the synchronize that ends
the step (a no-op there): each step is host-bound, as a plan's verdict must then say.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint_examples.bench import _budget_runner as budget_runner
from matepoint_examples.bench import budget
from matepoint_examples.bench._budget_report import HOST_BOUND_FRACTION, print_report, verdicts

pytestmark = pytest.mark.skipif(
    not hasattr(torch_checkpoint, "CheckpointPolicy"),
    reason="torch's selective checkpointing arrived in 2.5",
)

ROUNDS = 3
PLAN = "budget@1GiB"


@pytest.fixture(scope="module")
def measured() -> budget_runner.Alternated:
    """Every eager strategy and a budget plan with a policy, alternated on a CPU."""
    workload = budget.WORKLOADS["llama-tiny"]
    memory_plan = budget._plan(workload)
    free_policy = matepoint.DeviceModel(peak_flops=1e12, policy_seconds_per_op=0)
    plan = memory_plan.fastest_under(
        memory_plan["none"].peak_bytes * 2,
        device=free_policy,
        measure=lambda plans: [1.0, 2.0, 3.0][: len(plans)],
    )
    # A policy: the selective step, the one a fast host shows.
    assert plan.context_fn() is not torch_checkpoint.noop_context_fn
    runner = budget_runner.Runner(workload, device="cpu")
    strategies: dict[str, Any] = dict(budget.checkpoint_fns(workload))
    strategies[PLAN] = budget.plan_checkpoint_fn(plan)
    runner.settings[PLAN] = plan.settings_changes()
    return budget_runner.alternate(runner, strategies, rounds=ROUNDS, warmup=1)


def test_every_strategy_has_a_host_time_each_round_within_its_step(
    measured: budget_runner.Alternated,
) -> None:
    assert set(measured.host_times) == {*budget.EAGER_STRATEGIES, PLAN}
    for name, hosts in measured.host_times.items():
        steps = measured.times[name]
        assert len(hosts) == len(steps) == ROUNDS, name
        for host, step in zip(hosts, steps, strict=True):
            assert host is not None, name
            assert step is not None, name
            # Read before the step's end on the same clock: never after it.
            assert 0 < host <= step, name
        assert measured.peaks[name] == 0  # a CPU has no allocator peak; 0 is not "out of memory"


def test_the_rows_keep_host_times_beside_step_times_in_the_json(
    measured: budget_runner.Alternated,
) -> None:
    rows = json.loads(json.dumps(budget._rows(measured, {}, {"torch": 1 << 20})))
    for name, row in rows.items():
        assert row["seconds"] == measured.times[name]  # the key reports had before
        assert row["host_seconds"] == measured.host_times[name]
        assert 0 < row["host_time_s"] <= row["step_time_s"]
        assert row["host_to_step_q1"] <= row["host_to_step"] <= row["host_to_step_q3"] <= 1.0
        # On a CPU the host issues the whole step: its time is the step's.
        assert row["host_to_step"] >= HOST_BOUND_FRACTION, name
    assert rows["torch"]["planned_peak_bytes"] == 1 << 20
    assert rows[PLAN]["planned_peak_bytes"] is None


def test_the_table_shows_each_host_time_and_the_plans_verdict_calls_it_host_bound(
    measured: budget_runner.Alternated, capsys: pytest.CaptureFixture[str]
) -> None:
    plans: dict[str, dict[str, Any]] = {
        PLAN: {"budget_bytes": 1 << 30, "predicted_peak_bytes": 1 << 20}
    }
    judged = verdicts(plans, measured.times, measured.peaks, {}, measured.host_times)
    plans[PLAN]["verdict"] = judged[PLAN]
    rows = budget._rows(measured, {}, {})
    report = {"workload": "llama-tiny", "rounds": ROUNDS, "device": "cpu", "plans": plans}
    print_report({**report, "rows": rows})
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-5:] == ["ms", "host/step", "peak", "GiB", "predicted"]
    for name, row in rows.items():
        [line] = [line for line in lines if line.startswith(f"{name} ")]
        # strategy, step / torch [range], step / matepoint [range], step ms, host ms, host/step
        cells = line.removeprefix(name).split()
        assert cells[4:7] == [
            f"{row['step_time_s'] * 1e3:.1f}",
            f"{row['host_time_s'] * 1e3:.1f}",
            f"{row['host_to_step']:.3f}",
        ], name
    assert judged[PLAN]["host_bound"]
    assert f"host-bound: host {judged[PLAN]['host_to_step']:.2f} of its step" in lines[-1]
    assert lines[-1].startswith(f"{PLAN}: ")


def test_a_cpu_runner_reports_its_optimizers_states_and_step_peak() -> None:
    runner = budget_runner.Runner(budget.WORKLOADS["llama-tiny"], device=torch.device("cpu"))
    step = runner.step("none", None)
    assert 0 < step.host_seconds <= step.seconds
    assert step.peak_bytes == 0
    parameters = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert runner.state_bytes() >= 2 * parameters  # AdamW: two states per parameter
    assert runner.optimizer_step_peak() == 0
