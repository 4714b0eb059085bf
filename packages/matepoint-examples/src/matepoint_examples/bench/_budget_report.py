"""The budget benchmark's report: each budget's verdict, the table, and the frontier plot.

The verdict is computed, not read off the table: which eager peers fit a budget is a comparison
of measured peaks against it, and a plan's standing against the fastest of them is a paired
ratio (the plan's step divided by that peer's in the same round), not a difference of two
medians taken against a third strategy.

Beside each strategy's step time stands its host time (what issuing the step cost the host,
``Step.host_seconds`` in ``_budget_runner``): where the two are close the host, not the device,
set the step's pace, and a plan's verdict says so (:data:`HOST_BOUND_FRACTION`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matepoint_examples.bench._paired import per_round_ratios, quartiles
from matepoint_examples.bench._report import ratio_cell

__all__ = [
    "HOST_BOUND_FRACTION",
    "ONE_CALL_PREFIX",
    "TWIN_SUFFIX",
    "host_fields",
    "is_peer",
    "plot_frontier",
    "print_report",
    "verdicts",
]

_GIB = float(1 << 30)
# A strategy's twin: the same strategy run a second time each round, a control of the run's
# noise (the twin's paired ratio to the strategy would be 1 on a quiet host).
TWIN_SUFFIX = " twin"

# A budget plan made by the one call a user makes (matepoint.plan_budget), beside the
# benchmark's own plan at the same budget (its finalists measured).
ONE_CALL_PREFIX = "one-call@"

HOST_BOUND_FRACTION = 0.9
"""A step whose host time is at least this fraction of its step time is host-bound.

Issuing a step ends before the step does, even when the host sets the pace: the device still
runs the work of the last calls (the optimizer step's) after the host returns from them, so a
host-bound step's ratio sits a little below 1, and on a CPU, where both are wall times, at 1.
A step whose device ran on for more than a tenth of the step after the host was done was not
waiting for the host most of the time, so below this fraction nothing is said.
"""


def _host_to_step(
    seconds: Sequence[float | None], host_seconds: Sequence[float | None]
) -> list[float]:
    """Each round's host time over its step time (the rounds where both were measured)."""
    return [
        host / step
        for step, host in zip(seconds, host_seconds, strict=False)
        if step is not None and host is not None and step > 0
    ]


def host_fields(
    seconds: Sequence[float | None], host_seconds: Sequence[float | None]
) -> dict[str, float]:
    """A strategy's median step and host time, and its host time over its step time.

    Args:
        seconds: Its step time in each round (``None`` where it did not run).
        host_seconds: Its host time in the same rounds.

    Returns:
        ``step_time_s`` and ``host_time_s`` (medians of the rounds that ran), and
        ``host_to_step`` with ``host_to_step_q1`` and ``host_to_step_q3``: the median and
        quartiles of the per-round ratios, each host time over its own step's time (empty
        where no round ran; no host fields where no host time was recorded).
    """
    fields: dict[str, float] = {}
    steps = [value for value in seconds if value is not None]
    hosts = [value for value in host_seconds if value is not None]
    if steps:
        fields["step_time_s"] = statistics.median(steps)
    if hosts:
        fields["host_time_s"] = statistics.median(hosts)
    ratios = _host_to_step(seconds, host_seconds)
    if ratios:
        q1, median, q3 = quartiles(ratios)
        fields.update(host_to_step=median, host_to_step_q1=q1, host_to_step_q3=q3)
    return fields


def is_peer(name: str) -> bool:
    """Whether strategy ``name`` is an eager peer of the plans (not a plan, compiled or a twin)."""
    plans = ("budget@", ONE_CALL_PREFIX, "compiled")
    return not name.startswith(plans) and not name.endswith(TWIN_SUFFIX)


def verdicts(
    plans: Mapping[str, Mapping[str, Any]],
    times: Mapping[str, Sequence[float | None]],
    peaks: Mapping[str, int],
    errors: Mapping[str, str],
    host_times: Mapping[str, Sequence[float | None]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Judge each budget plan: its peak against budget and prediction, its step against peers.

    The peers are the eager strategies that fit the plan's budget; the one to beat is the
    fastest of them, the plan compared with it round by round. With host times, each plan's
    step is also judged host-bound or not (:data:`HOST_BOUND_FRACTION`).

    Args:
        plans: Per budget plan's name, at least ``budget_bytes`` and ``predicted_peak_bytes``.
        times: Per strategy, its step time in each round (``None`` where it did not run).
        peaks: Per strategy, its measured peak (negative where it ran out of memory).
        errors: The strategies that failed, with why.
        host_times: Per strategy, its host time in each round, round for round with
            ``times``. Default: none (no host fields in the verdicts).

    Returns:
        Per plan: ``measured_peak_bytes``, ``within_budget``, ``predicted_error`` (predicted over
        measured, less one), the peers that fit and those that do not (with their peaks), the
        fastest peer that fits (the one the plan's median per-round ratio is largest against)
        and the plan's per-round ratio to it (``to_fastest_peer`` and its quartiles; ``standing``:
        ``ahead`` where the whole interquartile range is below 1, ``behind`` where it is above,
        ``tied`` otherwise). A plan that did not run in every round gets no standing. Where
        that peer's twin ran every round, its ratio to the peer (``twin_to_peer`` and its
        quartiles) beside the plan's: how far apart the same strategy measures in this run.
        With ``host_times``: ``host_to_step`` (the plan's median per-round host time over its
        step time), ``host_bound`` (that median at least :data:`HOST_BOUND_FRACTION`) and,
        where there is a fastest peer, ``fastest_peer_host_to_step`` (the same, for it). A
        one-call plan (``one-call@X``) also gets its paired ratio to ``budget@X``, the plan made
        with measured finalists at its budget (``to_measured_plan`` and its quartiles).
    """

    def host_to_step(name: str) -> float | None:
        if host_times is None:
            return None
        ratios = _host_to_step(times.get(name, []), host_times.get(name, []))
        return statistics.median(ratios) if ratios else None

    def ran_every_round(name: str) -> bool:
        return name not in errors and bool(times.get(name)) and None not in times[name]

    results: dict[str, dict[str, Any]] = {}
    for name, plan in plans.items():
        budget = int(plan["budget_bytes"])
        peak = peaks.get(name, -1)
        result: dict[str, Any] = {
            "budget_bytes": budget,
            "measured_peak_bytes": peak,
            "within_budget": 0 <= peak <= budget and name not in errors,
            "predicted_error": plan["predicted_peak_bytes"] / peak - 1 if peak > 0 else None,
        }
        fitting: list[str] = []
        too_large: dict[str, int] = {}
        for peer in filter(is_peer, times):
            peer_peak = peaks.get(peer, -1)
            if ran_every_round(peer) and 0 <= peer_peak <= budget:
                fitting.append(peer)
            else:
                too_large[peer] = peer_peak
        result.update(fitting_peers=fitting, peers_over_budget=too_large)
        if fitting and ran_every_round(name):
            # The fastest peer is the one the plan's paired ratio is largest against.
            against = {peer: quartiles(per_round_ratios(times, peer)[name]) for peer in fitting}
            fastest = max(fitting, key=lambda peer: against[peer][1])
            q1, median, q3 = against[fastest]
            standing = "ahead" if q3 < 1.0 else ("behind" if q1 > 1.0 else "tied")
            result.update(
                fastest_peer=fastest,
                to_fastest_peer=median,
                to_fastest_peer_q1=q1,
                to_fastest_peer_q3=q3,
                standing=standing,
            )
            twin = fastest + TWIN_SUFFIX
            if ran_every_round(twin):
                q1, median, q3 = quartiles(per_round_ratios(times, fastest)[twin])
                result.update(twin_to_peer=median, twin_to_peer_q1=q1, twin_to_peer_q3=q3)
            if host_to_step(fastest) is not None:
                result["fastest_peer_host_to_step"] = host_to_step(fastest)
        measured_plan = "budget@" + name.removeprefix(ONE_CALL_PREFIX)
        paired = ran_every_round(name) and ran_every_round(measured_plan)
        if name.startswith(ONE_CALL_PREFIX) and paired:
            q1, median, q3 = quartiles(per_round_ratios(times, measured_plan)[name])
            result.update(to_measured_plan=median, to_measured_plan_q1=q1, to_measured_plan_q3=q3)
        ratio = host_to_step(name)
        if ratio is not None:
            result.update(host_to_step=ratio, host_bound=ratio >= HOST_BOUND_FRACTION)
        results[name] = result
    return results


def _verdict_line(name: str, verdict: Mapping[str, Any]) -> str:
    peak = verdict["measured_peak_bytes"]
    budget = verdict["budget_bytes"] / _GIB
    if peak < 0:  # it failed or ran out of memory: no peak to judge
        memory = f"no measured peak (budget {budget:.2f} GiB)"
    elif not verdict["within_budget"]:
        memory = f"OVER the budget of {budget:.2f} GiB (peak {peak / _GIB:.2f})"
    else:
        memory = f"peak {peak / _GIB:.2f} of {budget:.2f} GiB"
    if verdict["predicted_error"] is not None:
        memory += f", predicted {verdict['predicted_error']:+.2%}"
    over = ", ".join(
        f"{peer} {'out of memory' if size < 0 else f'{size / _GIB:.2f} GiB'}"
        for peer, size in verdict["peers_over_budget"].items()
    )
    if "fastest_peer" not in verdict:
        standing = "no peer that fits" if not verdict["fitting_peers"] else "did not run"
    else:
        cell = ratio_cell(
            verdict["to_fastest_peer"],
            verdict["to_fastest_peer_q1"],
            verdict["to_fastest_peer_q3"],
        )
        standing = f"{verdict['standing']} of {verdict['fastest_peer']}: {cell}"
        if "twin_to_peer" in verdict:
            twin = ratio_cell(
                verdict["twin_to_peer"], verdict["twin_to_peer_q1"], verdict["twin_to_peer_q3"]
            )
            standing += f"; its twin: {twin}"
    if "to_measured_plan" in verdict:
        cell = ratio_cell(
            verdict["to_measured_plan"],
            verdict["to_measured_plan_q1"],
            verdict["to_measured_plan_q3"],
        )
        standing += f"; to the plan with measured finalists: {cell}"
    if verdict.get("host_bound"):
        standing += f"; host-bound: host {verdict['host_to_step']:.2f} of its step"
        if "fastest_peer_host_to_step" in verdict:
            standing += f" ({verdict['fastest_peer']}'s {verdict['fastest_peer_host_to_step']:.2f})"
    return f"{name}: {memory}; {standing}" + (f" (over the budget: {over})" if over else "")


def print_report(report: Mapping[str, Any]) -> None:
    """Print a report's table and each budget plan's verdict.

    Per strategy: its step ratios, its median step and host time (ms) and its host time over its
    step time (``-`` in a report saved before host times were kept), its peak and the predicted.
    """
    print(f"{report['workload']}: {report['rounds']} rounds on {report['device']}")
    print(
        f"{'strategy':<20}{'step / torch':>24}{'step / matepoint':>24}"
        f"{'step ms':>9}{'host ms':>9}{'host/step':>10}{'peak GiB':>10}{'predicted':>11}"
    )
    predicted = {name: plan["predicted_peak_bytes"] for name, plan in report["plans"].items()}

    def ratio(row: Mapping[str, Any], label: str) -> str:
        return ratio_cell(row.get(label), row.get(f"{label}_q1"), row.get(f"{label}_q3"))

    def milliseconds(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1e3:.1f}"

    for name, row in report["rows"].items():
        planned = predicted.get(name, row["planned_peak_bytes"])
        peak = row["peak_bytes"]
        print(
            f"{name:<20}{ratio(row, 'ratio'):>24}{ratio(row, 'to_matepoint'):>24}"
            f"{milliseconds(row.get('step_time_s')):>9}{milliseconds(row.get('host_time_s')):>9}"
            f"{ratio_cell(row.get('host_to_step')):>10}"
            f"{'-' if peak is None or peak < 0 else f'{peak / _GIB:.2f}':>10}"
            f"{'-' if planned is None else f'{planned / _GIB:.2f}':>11}"
        )
    for name, row in report["rows"].items():
        if "error" in row:
            print(f"{name} failed: {row['error']}")
    for name, plan in report["plans"].items():
        if "verdict" in plan:
            print(_verdict_line(name, plan["verdict"]))
        if plan.get("replans"):
            first = plan["first_plan"]["predicted_peak_bytes"] / _GIB
            print(
                f"  {name}: its guard planned again {plan['replans']} time(s), from a plan "
                f"predicted at {first:.2f} GiB to one at {plan['predicted_peak_bytes'] / _GIB:.2f}"
            )


def plot_frontier(reports: Sequence[dict[str, Any]], path: Path) -> None:
    """Step ratio against measured peak, one panel per report: the frontier of each workload.

    Each strategy keeps its colour and marker in every panel (stars: budget plans, squares:
    torch compiled), with the interquartile range as a vertical bar and one legend for all;
    dotted lines are the budgets, a red line the device-memory cap. A panel whose torch
    checkpoint did not run gives step ratios to matepoint's instead.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for report in reports for name in report["rows"]))
    colours = {name: plt.get_cmap("tab10")(index % 10) for index, name in enumerate(names)}
    figure, axes = plt.subplots(1, len(reports), figsize=(5.5 * len(reports), 4.5), squeeze=False)
    handles: dict[str, Any] = {}
    for axis, report in zip(axes[0], reports, strict=True):
        # Where torch's checkpoint did not run (out of memory under a cap), matepoint's is the
        # reference, as in the printed table.
        rows = report["rows"].values()
        key = "ratio" if any("ratio" in row for row in rows) else "to_matepoint"
        for name, row in report["rows"].items():
            peak = row.get("peak_bytes")
            if key not in row or peak is None or peak < 0 or name.endswith(TWIN_SUFFIX):
                continue
            planned = name.startswith("budget@")
            marker = "*" if planned else ("s" if name.startswith("compiled") else "o")
            x, y = peak / _GIB, row[key]
            axis.vlines(x, row[f"{key}_q1"], row[f"{key}_q3"], color=colours[name], linewidth=1)
            handles[name] = axis.scatter(
                x, y, marker=marker, s=140 if planned else 45, color=colours[name], zorder=3
            )
        for plan in report["plans"].values():
            axis.axvline(plan["budget_bytes"] / _GIB, color="grey", linestyle=":", linewidth=0.8)
        cap = report.get("device_memory_cap_bytes")
        if cap:
            axis.axvline(cap / _GIB, color="red", linewidth=0.8)
        axis.set_title(f"{report['workload']} ({report['device']}, torch {report['torch']})")
        axis.set_xlabel("measured peak device memory (GiB)")
        reference = "torch checkpoint" if key == "ratio" else "matepoint"
        axis.set_ylabel(f"step time / {reference} on every block")
        axis.grid(alpha=0.3)
    figure.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 5)
    )
    figure.tight_layout(rect=(0, 0.12, 1, 1))
    figure.savefig(path, dpi=120)
