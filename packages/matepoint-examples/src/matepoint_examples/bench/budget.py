"""Budget plans on a GPU: measured peak and step against the plan, and against the peers.

Run ``matepoint-bench budget --workload llama8`` (or ``python -m
matepoint_examples.bench.budget``). One process builds one model (a Llama-style stack, nanochat12,
or a Hugging Face Llama) and one AdamW optimizer, measures torch's checkpoint and no checkpoint
once, plans a budget step on the meta device for each budget (``--budgets``: torch checkpoint's
measured peak, halfway to no checkpoint's, ``auto`` or a fixed size such as ``24GiB``;
``--device-memory 24GiB`` caps the process there with
``torch.cuda.set_per_process_memory_fraction``) with the search's two finalists measured on the
GPU (Note [Measured finalists] in ``matepoint._planner.search``). Beside each, as
``one-call@...``, runs the plan a user gets from the one call, ``matepoint.plan_budget`` on the
live model with its optimizer and the same budget, no step measured; its verdict also gives its
paired ratio to the measured plan. Then it runs every strategy alternately, step by step (see
``matepoint_examples.bench._paired`` for why), and reports per strategy the median per-round step
ratio to torch's checkpoint [interquartile range], its median step time and host time (what issuing
a step costs the host, before the synchronize that ends it) with their ratio, the measured peak,
and for the budget plans the predicted peak; a plan whose host time is close to its step time is
called host-bound in its verdict. A strategy that runs out of memory is reported without a ratio.
``--compiled`` adds torch's compiled ``activation_memory_budget`` at each budget, for reference,
and the budget's plan made with ``compiled_offload`` in force (its policy offloads nothing) run
under matepoint's compiled path (``compiled-plan@X``, the whole model compiled) and, but for a
transformers model, compiled block by block (``compiled-blocks-plan@X``: each block compiled
with its checkpoint and region's policy, its inputs offloaded by matepoint). ``--twin
sac-every-matmul`` runs that peer a second time each round, as a control: where it is a plan's
fastest peer, the verdict gives the twin's ratio to it beside the plan's (on a host-bound step
the same strategy's two medians can differ by a few percent). ``--engines`` runs each budget
plan's policy also under torch's checkpoint and under matepoint's with ``offload=False``
(``engine_variants``). ``--plot frontier.png report.json ...`` draws step ratio
against peak memory from saved reports, without a GPU.

Note [Calibrating the planned peak]
    The planner plans forward and backward of the stack. A training step also holds the
    optimizer's states through forward and backward, and the optimizer step has a peak of its
    own (AdamW's foreach temporaries), which for a checkpointed step is the step's peak. Both
    are measured here, independent of the strategy: the states' bytes, and the peak of an
    optimizer step alone. A plan's budget for forward and backward is the measured budget less
    the states; its predicted peak is the larger of its planned peak plus the states and the
    optimizer step's peak. (Calibrating by torch checkpoint's measured minus planned peak
    instead over-predicted every step whose peak is in backward by the optimizer step's
    temporaries: 2 GiB on llama8.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import matepoint
from matepoint._planner.live_model import budget_bytes_of, size_in_bytes
from matepoint._planner.optimizer_states import optimizer_state_bytes
from matepoint_examples.bench._budget_report import (
    ONE_CALL_PREFIX,
    TWIN_SUFFIX,
    host_fields,
    plot_frontier,
    print_report,
    verdicts,
)
from matepoint_examples.bench._budget_runner import (
    Alternated,
    Runner,
    alternate,
    guarded_one_call,
    measure_finalists,
    plan_checkpoint_fn,
    plan_one_call,
)
from matepoint_examples.bench._budget_strategies import (
    EAGER_STRATEGIES,
    add_compiled,
    add_compiled_blocks,
    checkpoint_fns,
    engine_variants,
    selective_policy,
)
from matepoint_examples.bench._budget_workloads import WORKLOADS, BudgetWorkload, CheckpointFn
from matepoint_examples.bench._paired import per_round_ratios, quartiles

__all__ = [
    "WORKLOADS",
    "BudgetWorkload",
    "main",
    "parse_bytes",
    "plot_frontier",
    "selective_policy",
]


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"1.5GB"``, ``"512MiB"`` or a plain number of bytes (``argparse`` type).

    Raises:
        argparse.ArgumentTypeError: For what is not a positive, finite size.
    """
    value = size_in_bytes(text)
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is no size: give bytes or e.g. 24GiB, 1.5GB")
    return int(value)


def _choice(plan: matepoint.BudgetPlan) -> tuple[Any, ...]:
    """What a plan does: its decisions, where it keeps, and its settings."""
    return plan.decisions, plan.kept_in_last, plan.unchecked_last, plan.settings_changes()


def _plan(workload: BudgetWorkload) -> matepoint.MemoryPlan:
    torch.manual_seed(0)
    with torch.device("meta"):
        model, inputs = workload.build()
    if not workload.hf:
        workload.set_checkpoint(model, functools.partial(matepoint.checkpoint, use_reentrant=False))

    def step(*args: Tensor) -> Tensor:
        # The plan runs the step again for each search: the context goes with it.
        with workload.planning():
            return workload.loss(model, args)

    return matepoint.plan(step, *inputs)


def _budgets(
    names: Sequence[str], peaks: dict[str, int], device: torch.device
) -> dict[str, int | str]:
    """``torch`` / ``mid`` / ``auto`` / a size -> the budget (skipping what ran out of memory).

    ``auto`` stays a word: the one call reads it itself (``matepoint.plan_budget``).
    """
    budgets: dict[str, int | str] = {}
    for name in names:
        if name == "torch" and peaks["torch"] > 0:
            budgets["budget@torch"] = peaks["torch"]
        elif name == "mid" and min(peaks.values()) > 0:
            budgets["budget@mid"] = (peaks["torch"] + peaks["none"]) // 2
        elif name == "auto":
            budget_bytes_of(name, device)  # a clear error off CUDA, before anything runs
            budgets["budget@auto"] = "auto"
        elif name not in ("torch", "mid"):
            budgets[f"budget@{name}"] = parse_bytes(name)
    return budgets


def _guarded_fields(
    fields: dict[str, Any], guard: matepoint.BudgetGuard, predicted: Callable[[int], int]
) -> None:
    """A guarded plan's report: its guard's readings and, where it planned again, the plan it
    ended with (the one its later steps ran) in place of the first."""
    fields["guard_readings"] = [dataclasses.asdict(reading) for reading in guard.readings]
    fields["replans"] = guard.replans
    if guard.replans:
        last = _plan_fields(guard.plan, predicted)
        fields["first_plan"] = {key: fields[key] for key in last}
        fields.update(last)


def _plan_fields(plan: matepoint.BudgetPlan, predicted: Callable[[int], int]) -> dict[str, Any]:
    """What a report keeps of a plan: its choice, predictions and estimate."""
    return {
        "checkpoint": plan.checkpoint,
        "decisions": dict(plan.decisions),
        "kept_in_last": dict(plan.kept_in_last),
        "unchecked_last": plan.unchecked_last,
        "settings": plan.settings_changes(),
        "predicted_peak_bytes": predicted(plan.peak_bytes),
        "smallest_budget_bytes": predicted(plan.smallest_budget_bytes),
        "estimated_step_ratio": plan.step_seconds / plan.every_block_seconds,
    }


def _rows(
    measured: Alternated, errors: Mapping[str, str], planned_peaks: Mapping[str, int]
) -> dict[str, dict[str, Any]]:
    """The report's row of each strategy, in the order ``measured`` has them.

    A row holds the strategy's measured peak, its paired ratios to torch's checkpoint
    (``ratio``) and to matepoint on every block (``to_matepoint``) with their quartiles, its
    error if it failed, its planned peak (``planned_peaks``, else None), its per-round
    ``seconds`` and ``host_seconds``, and their medians and ratio (:func:`host_fields`).
    """
    # Beside the ratio to torch's checkpoint, the ratio to matepoint on every block: the one
    # reference that fits wherever anything does (under a device-memory cap torch's may not).
    references = {
        "ratio": per_round_ratios(measured.times),
        "to_matepoint": per_round_ratios(measured.times, "matepoint"),
    }
    rows = {}
    for name, seconds in measured.times.items():
        row: dict[str, Any] = {"peak_bytes": measured.peaks.get(name)}
        for label, ratios in references.items():
            if ratios.get(name):
                q1, median, q3 = quartiles(ratios[name])
                row.update({label: median, f"{label}_q1": q1, f"{label}_q3": q3})
        if name in errors:
            row["error"] = errors[name]
        row["planned_peak_bytes"] = planned_peaks.get(name)
        row["seconds"] = seconds
        row["host_seconds"] = measured.host_times[name]
        row.update(host_fields(seconds, measured.host_times[name]))
        rows[name] = row
    return rows


def run(
    workload_name: str,
    rounds: int,
    warmup: int,
    budget_names: Sequence[str] = ("torch", "mid"),
    compiled: bool = False,
    twin: str | None = None,
    engines: bool = False,
    finalist_rounds: int = 20,
) -> dict[str, Any]:
    """Measure every strategy and the budget plans of ``workload_name``; return the report.

    ``twin`` names an eager strategy to run a second time each round (``TWIN_SUFFIX``);
    ``engines`` adds each budget plan's policy run by other engines (:func:`engine_variants`);
    ``finalist_rounds`` is how many rounds the search's finalists are measured over.
    """
    workload = WORKLOADS[workload_name]
    runner = Runner(workload)
    strategies: dict[str, CheckpointFn | None] = dict(checkpoint_fns(workload))
    if twin is not None:
        strategies[twin + TWIN_SUFFIX] = strategies[twin]
    measured_peaks: dict[str, int] = {}
    # The optimizer's states exist after its first step: a step of matepoint's, which fits
    # wherever anything does (torch's checkpoint may not, under a device-memory cap).
    runner.step("matepoint", strategies["matepoint"])
    for name in ("torch", "none"):
        for _ in range(2):
            measured_peaks[name] = runner.step(name, strategies[name])[1]
    memory_plan = _plan(workload)
    # See Note [Calibrating the planned peak].
    states = runner.state_bytes()
    optimizer_peak = runner.optimizer_step_peak()

    def predicted(planned_peak: int) -> int:
        return max(planned_peak + states, optimizer_peak)

    # The time model's rates, measured on this device (cached per device and torch).
    device_model = matepoint.calibrate(refresh=True)
    print(device_model, flush=True)
    budgets = _budgets(budget_names, measured_peaks, runner.device)
    plans: dict[str, dict[str, Any]] = {}
    for name, budget in budgets.items():
        total = budget if isinstance(budget, int) else budget_bytes_of(budget, runner.device)
        budget_plan = memory_plan.fastest_under(
            total - states, device=device_model, measure=measure_finalists(runner, finalist_rounds)
        )
        plans[name] = {
            "budget_bytes": total,
            "fits": budget_plan.fits,
            "measured_finalist_seconds": list(budget_plan.measured_seconds),
            **_plan_fields(budget_plan, predicted),
        }
        print(budget_plan, flush=True)
        strategies[name] = plan_checkpoint_fn(budget_plan)
        runner.settings[name] = budget_plan.settings_changes()
        if engines:
            strategies.update(engine_variants(name, budget_plan))
        # The one call a user makes: plan_budget on the live model, no step measured.
        one_call_name = ONE_CALL_PREFIX + name.removeprefix("budget@")
        started = time.perf_counter()
        one_call = plan_one_call(runner, budget, device_model)
        plans[one_call_name] = {
            "budget_bytes": one_call.budget_bytes + optimizer_state_bytes(runner.optimizer),
            "fits": one_call.fits,
            "planning_seconds": time.perf_counter() - started,
            "same_choice_as_measured": _choice(one_call) == _choice(budget_plan),
            **_plan_fields(one_call, predicted),
        }
        print(one_call, flush=True)
        strategies[one_call_name] = guarded_one_call(runner, one_call_name, one_call, device_model)
        if compiled:
            # Planned for the compiled paths: its policy offloads nothing (Note [The budget
            # search], rule 11), which both compiled strategies run.
            with matepoint.options(compiled_offload=True):
                compiled_plan = memory_plan.fastest_under(total - states, device=device_model)
            labels = [add_compiled(runner, strategies, plans, name, compiled_plan, measured_peaks)]
            if not workload.hf:  # transformers' layers hand the checkpoint no block module
                labels.append(add_compiled_blocks(runner, strategies, name, compiled_plan))
            for label in labels:
                plans[label] = {
                    "budget_bytes": total,
                    "fits": compiled_plan.fits,
                    **_plan_fields(compiled_plan, predicted),
                }
    measured = alternate(runner, strategies, rounds, warmup)
    planned_peaks = {
        name: predicted(memory_plan[name].peak_bytes) for name in ("torch", "none", "matepoint")
    }
    for name, guard in runner.guards.items():
        _guarded_fields(plans[name], guard, predicted)
    rows = _rows(measured, runner.errors, planned_peaks)
    judged = verdicts(plans, measured.times, measured.peaks, runner.errors, measured.host_times)
    for name, verdict in judged.items():
        plans[name]["verdict"] = verdict
    return {
        "workload": workload_name,
        "rounds": rounds,
        "device": torch.cuda.get_device_name(),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "device_model": dataclasses.asdict(device_model),
        "optimizer_state_bytes": states,
        "optimizer_step_peak_bytes": optimizer_peak,
        "plans": plans,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the budget benchmark, or plot saved reports; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="matepoint-bench budget",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--budgets",
        default="torch,mid",
        help="comma-separated: torch (torch checkpoint's measured peak), mid (halfway to no "
        "checkpoint's) or a size such as 24GiB",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        help="cap this process's device memory (e.g. 24GiB) with "
        "torch.cuda.set_per_process_memory_fraction",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="add torch's compiled activation_memory_budget at each budget, for reference, and "
        "each budget plan under matepoint's compiled path",
    )
    parser.add_argument(
        "--twin",
        choices=sorted(EAGER_STRATEGIES),
        default=None,
        help="run this eager strategy twice each round: the verdict's control of the run's noise",
    )
    parser.add_argument(
        "--engines",
        action="store_true",
        help="also run each budget plan's policy under torch's checkpoint and under matepoint's "
        "with offload=False",
    )
    parser.add_argument(
        "--finalist-rounds",
        type=int,
        default=20,
        help="rounds the search's finalists are measured over (fewer for a slow step)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the frontier of REPORTS into this file"
    )
    parser.add_argument("reports", nargs="*", type=Path, help="saved reports, for --plot")
    args = parser.parse_args(argv)
    if args.plot is not None:
        plot_frontier([json.loads(path.read_text()) for path in args.reports], args.plot)
        return 0
    if not torch.cuda.is_available():
        print("the budget benchmark measures GPU memory and needs a CUDA device")
        return 2
    if args.device_memory is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_memory / total))
    budget_names = [name.strip() for name in args.budgets.split(",") if name.strip()]
    report = run(
        args.workload,
        args.rounds,
        args.warmup,
        budget_names,
        compiled=args.compiled,
        twin=args.twin,
        engines=args.engines,
        finalist_rounds=args.finalist_rounds,
    )
    report["device_memory_cap_bytes"] = args.device_memory
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
