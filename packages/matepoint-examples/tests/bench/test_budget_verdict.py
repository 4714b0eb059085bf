"""Each budget plan's verdict: which peers fit, the fastest of them, the plan's paired ratio."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from matepoint_examples.bench._budget_report import (
    HOST_BOUND_FRACTION,
    _verdict_line,
    host_fields,
    plot_frontier,
    print_report,
    verdicts,
)

GIB = 1 << 30


def _plans(
    budget_gib: float, predicted_gib: float, name: str = "budget@mid"
) -> dict[str, dict[str, float]]:
    return {
        name: {
            "budget_bytes": budget_gib * GIB,
            "predicted_peak_bytes": predicted_gib * GIB,
        }
    }


def test_a_peer_over_the_budget_is_not_the_one_to_beat() -> None:
    # The peer fastest overall holds more than the budget: the plan is judged against the
    # fastest of those that fit, by its ratio to that peer round by round.
    times = {
        "torch": [1.00, 1.10, 0.90, 1.00],
        "sac-every-matmul": [0.90, 0.99, 0.81, 0.90],
        "none": [0.80, 0.88, 0.72, 0.80],
        "sac-attention-down": [1.02, 1.12, 0.92, 1.02],
        "budget@mid": [0.97, 1.07, 0.87, 0.97],
        "one-call@mid": [0.99, 1.09, 0.89, 0.99],
    }
    peaks = {
        "torch": 9 * GIB,
        "sac-every-matmul": int(14.7 * GIB),
        "none": 20 * GIB,
        "sac-attention-down": 10 * GIB,
        "budget@mid": int(14.2 * GIB),
        "one-call@mid": 9 * GIB,
    }
    verdict = verdicts(_plans(14.45, 14.2), times, peaks, {})["budget@mid"]
    assert verdict["within_budget"]
    assert verdict["predicted_error"] == pytest.approx(0.0, abs=1e-3)
    assert verdict["fitting_peers"] == ["torch", "sac-attention-down"]
    assert verdict["peers_over_budget"] == {
        "sac-every-matmul": peaks["sac-every-matmul"],
        "none": 20 * GIB,
    }
    assert verdict["fastest_peer"] == "torch"
    assert verdict["to_fastest_peer"] == pytest.approx(0.97, abs=0.002)
    assert verdict["standing"] == "ahead"


def test_a_plan_behind_its_peer_or_over_its_budget_says_so() -> None:
    times = {"torch": [1.0, 1.0, 1.0], "budget@mid": [1.05, 1.06, 1.04]}
    peaks = {"torch": 9 * GIB, "budget@mid": 15 * GIB}
    verdict = verdicts(_plans(14.45, 14.0), times, peaks, {})["budget@mid"]
    assert not verdict["within_budget"]
    assert verdict["predicted_error"] == pytest.approx(14 / 15 - 1)
    assert verdict["standing"] == "behind"


def test_a_peer_that_ran_out_of_memory_or_failed_does_not_fit() -> None:
    times = {
        "torch": [None, None],
        "matepoint": [1.0, 1.0],
        "sac-every-matmul": [0.5, 0.5],
        "budget@24GiB": [0.99, 1.01],
    }
    peaks = {
        "torch": -1,
        "matepoint": 16 * GIB,
        "sac-every-matmul": 8 * GIB,
        "budget@24GiB": 22 * GIB,
    }
    errors = {"sac-every-matmul": "a RuntimeError"}
    verdict = verdicts(_plans(24, 22, "budget@24GiB"), times, peaks, errors)["budget@24GiB"]
    assert verdict["fitting_peers"] == ["matepoint"]
    assert verdict["fastest_peer"] == "matepoint"
    assert verdict["standing"] == "tied"
    assert set(verdict["peers_over_budget"]) == {"torch", "sac-every-matmul"}


def test_no_standing_where_no_peer_fits_or_the_plan_did_not_run() -> None:
    peaks = {"torch": 20 * GIB, "budget@mid": -1}
    verdict = verdicts(_plans(14, 13), {"torch": [1.0], "budget@mid": [None]}, peaks, {})
    assert "fastest_peer" not in verdict["budget@mid"]
    assert not verdict["budget@mid"]["within_budget"]
    assert verdict["budget@mid"]["predicted_error"] is None
    # Printed without a peak, not as over the budget (a compile that failed, say).
    line = _verdict_line("budget@mid", verdict["budget@mid"])
    assert "no measured peak (budget 14.00 GiB)" in line
    assert "OVER" not in line


def test_the_printed_report_ends_with_each_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    times = {"torch": [1.0, 1.0], "sac-every-matmul": [0.9, 0.9], "budget@mid": [0.95, 0.97]}
    peaks = {"torch": 9 * GIB, "sac-every-matmul": 15 * GIB, "budget@mid": 14 * GIB}
    plans = _plans(14.45, 14.0)
    plans["budget@mid"]["verdict"] = verdicts(plans, times, peaks, {})["budget@mid"]  # type: ignore[assignment]
    report = {
        "workload": "hf-llama16",
        "rounds": 2,
        "device": "a GPU",
        "plans": plans,
        "rows": {name: {"peak_bytes": peaks[name], "planned_peak_bytes": None} for name in times},
    }
    print_report(report)
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith(
        "budget@mid: peak 14.00 of 14.45 GiB, predicted +0.00%; ahead of torch: 0.960"
    )
    assert last.endswith("(over the budget: sac-every-matmul 15.00 GiB)")


def test_a_panel_whose_torch_checkpoint_ran_out_of_memory_plots_ratios_to_matepoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.axes

    data = Path(__file__).resolve().parents[4] / "docs" / "_data"
    names = ("budget-h200-llama8-verdict.json", "budget-h200-llama64-long-24gib-verdict.json")
    reports = [json.loads((data / name).read_text()) for name in names]
    labels: list[str] = []
    points: list[int] = []
    set_ylabel = matplotlib.axes.Axes.set_ylabel

    def record_label(axis: Any, label: str, *args: Any, **kwargs: Any) -> Any:
        labels.append(label)
        points.append(len(axis.collections))
        return set_ylabel(axis, label, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_ylabel", record_label)
    out = tmp_path / "frontier.png"
    plot_frontier(reports, out)
    assert out.stat().st_size > 0
    assert labels == [
        "step time / torch checkpoint on every block",
        "step time / matepoint on every block",
    ]
    assert points[1] > 0  # matepoint's point and the plan's, with their ranges


def test_a_twin_is_no_peer_and_its_ratio_stands_beside_the_plans(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The twin of the fastest peer ran 2% faster than the peer itself in this (noisy) run.
    times = {
        "torch": [1.00, 1.00, 1.00],
        "sac-every-matmul": [0.90, 0.95, 0.90],
        "sac-every-matmul twin": [0.88, 0.931, 0.882],
        "budget@mid": [0.91, 0.96, 0.91],
    }
    peaks = dict.fromkeys(times, 13 * GIB)
    plans = _plans(14.45, 13.0)
    verdict = verdicts(plans, times, peaks, {})["budget@mid"]
    assert verdict["fitting_peers"] == ["torch", "sac-every-matmul"]
    assert verdict["fastest_peer"] == "sac-every-matmul"
    assert verdict["twin_to_peer"] == pytest.approx(0.98)
    plans["budget@mid"]["verdict"] = verdict  # type: ignore[assignment]
    rows = {name: {"peak_bytes": peaks[name], "planned_peak_bytes": None} for name in times}
    print_report(
        {"workload": "llama16", "rounds": 3, "device": "a GPU", "plans": plans, "rows": rows}
    )
    assert "; its twin: 0.980" in capsys.readouterr().out.splitlines()[-1]


def _host_bound_report(host_share: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plan tied with torch's every-matmul policy, both issuing ``host_share`` of their step."""
    times = {
        "torch": [1.00, 1.02, 0.98],
        "sac-every-matmul": [0.90, 0.95, 0.91],
        "budget@mid": [0.91, 0.94, 0.91],
    }
    host_times = {
        name: [seconds * share for seconds in steps]
        for (name, steps), share in zip(times.items(), (0.6, host_share, host_share), strict=True)
    }
    peaks = dict.fromkeys(times, 13 * GIB)
    plans: dict[str, Any] = _plans(14.45, 13.0)
    verdict = verdicts(plans, times, peaks, {}, host_times)["budget@mid"]
    plans["budget@mid"]["verdict"] = verdict
    rows = {name: {"peak_bytes": peaks[name], "planned_peak_bytes": None} for name in times}
    report = {"workload": "llama16", "rounds": 3, "device": "a GPU", "plans": plans, "rows": rows}
    return verdict, report


def test_a_plan_whose_host_time_is_its_step_time_is_called_host_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    verdict, report = _host_bound_report(0.98)
    assert verdict["standing"] == "tied"
    assert verdict["host_bound"]
    assert verdict["host_to_step"] == pytest.approx(0.98)
    assert verdict["fastest_peer"] == "sac-every-matmul"
    assert verdict["fastest_peer_host_to_step"] == pytest.approx(0.98)
    print_report(report)
    assert (
        capsys.readouterr()
        .out.splitlines()[-1]
        .endswith("; host-bound: host 0.98 of its step (sac-every-matmul's 0.98)")
    )


@pytest.mark.parametrize("host_share", [0.5, HOST_BOUND_FRACTION - 0.01])
def test_a_plan_whose_device_outlasts_its_host_gets_no_host_note(
    host_share: float, capsys: pytest.CaptureFixture[str]
) -> None:
    verdict, report = _host_bound_report(host_share)
    assert not verdict["host_bound"]
    assert verdict["host_to_step"] == pytest.approx(host_share)
    print_report(report)
    assert "host-bound" not in capsys.readouterr().out


def test_without_host_times_a_verdict_says_nothing_of_the_host() -> None:
    times = {"torch": [1.0, 1.0], "budget@mid": [0.95, 0.97]}
    peaks = dict.fromkeys(times, 9 * GIB)
    verdict = verdicts(_plans(14.45, 9.0), times, peaks, {})["budget@mid"]
    assert "host_bound" not in verdict
    assert "host_to_step" not in verdict
    assert "fastest_peer_host_to_step" not in verdict


def test_host_fields_pair_each_rounds_host_time_with_its_own_step() -> None:
    # The second round did not run; the host/step ratio is taken round by round.
    fields = host_fields([0.10, None, 0.20, 0.30], [0.05, None, 0.18, 0.30])
    assert fields["step_time_s"] == pytest.approx(0.20)
    assert fields["host_time_s"] == pytest.approx(0.18)
    assert fields["host_to_step"] == pytest.approx(0.9)
    assert fields["host_to_step_q1"] == pytest.approx(0.7)
    assert fields["host_to_step_q3"] == pytest.approx(0.95)
    assert host_fields([None, None], [None, None]) == {}
    assert host_fields([0.1], []) == {"step_time_s": pytest.approx(0.1)}


def test_a_one_call_plan_is_judged_and_paired_with_the_measured_plan() -> None:
    # The one call's plan is no peer of the plans; beside its standing it gets its paired
    # ratio to the plan made with measured finalists at its budget.
    times = {
        "torch": [1.00, 1.10, 0.90, 1.00],
        "none": [0.80, 0.88, 0.72, 0.80],
        "budget@mid": [0.90, 0.99, 0.81, 0.90],
        "one-call@mid": [0.909, 1.0, 0.818, 0.909],
    }
    peaks = {"torch": 9 * GIB, "none": 20 * GIB, "budget@mid": 12 * GIB, "one-call@mid": 12 * GIB}
    plans = {**_plans(14, 12), **_plans(14, 12, name="one-call@mid")}
    judged = verdicts(plans, times, peaks, {})
    assert judged["one-call@mid"]["fitting_peers"] == ["torch"]
    assert judged["one-call@mid"]["to_measured_plan"] == pytest.approx(1.01, abs=1e-3)
    assert "to_measured_plan" not in judged["budget@mid"]
