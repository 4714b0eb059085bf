"""``matepoint-bench``: every strategy on every workload, side by side, one subprocess each.

The benchmark reproduces the design's performance table in one run: step time (median after
warm-up) and its ratio to ``torch.utils.checkpoint``, device bytes held after forward, peak device
memory, host RAM added, and matepoint's bytes offloaded and link throughput, for no checkpoint,
torch's checkpoint, ``save_on_cpu``, torchtune's ``OffloadActivations`` and matepoint with and
without its pipeline. A transfer-bound micro-benchmark compares matepoint's offload and fetch
bandwidth with raw pinned copies. Results go to a terminal table, ``results.json``,
``results.md`` and PNG plots. Without a GPU it runs the small ``cpu-small`` workload.

Run ``matepoint-bench --quick`` or ``python -m matepoint_examples.bench --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from matepoint_examples import _bench_report as report
from matepoint_examples._bench_worker import environment, run_train, run_transfer
from matepoint_examples._runtime import resolve_device
from matepoint_examples._workloads import (
    CPU_WORKLOADS,
    GPU_WORKLOADS,
    WORKLOADS,
    get_workload,
)
from matepoint_examples.strategies import STRATEGIES

__all__ = ["main", "run_worker_subprocess"]

_OVERRIDES = ("depth", "width", "heads", "batch", "tokens", "vocab_size", "head_dim")


def _csv(value: str) -> list[str]:
    """Split a comma-separated flag value."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    """Build the command-line parser (orchestrator and worker share it)."""
    p = argparse.ArgumentParser(
        prog="matepoint-bench",
        description="Benchmark matepoint against torch checkpoint and offloading peers.",
    )
    p.add_argument(
        "--workloads",
        type=_csv,
        help=f"comma-separated, from: {', '.join(WORKLOADS)} "
        f"(default: {','.join(GPU_WORKLOADS)} on a GPU, {','.join(CPU_WORKLOADS)} without)",
    )
    p.add_argument(
        "--strategies",
        type=_csv,
        default=list(STRATEGIES),
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default: all)",
    )
    p.add_argument("--steps", type=int, help="timed steps per run (default 10; 3 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed warm-up steps (default 3; 1 with --quick)")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder")
    p.add_argument("--quick", action="store_true", help="fewer steps, smaller transfer test")
    p.add_argument(
        "--mode",
        choices=("all", "train", "transfer"),
        default="all",
        help="train: workloads x strategies; transfer: link micro-benchmark; all: both (default)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess (900)")
    p.add_argument("--no-timeline", action="store_true", help="skip the memory-timeline step")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    for name in _OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=argparse.SUPPRESS)
    # Worker side: one measurement, JSON on stdout.
    p.add_argument("--worker", choices=("train", "transfer"), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    return p


def _worker_main(args: argparse.Namespace) -> int:
    """Run one measurement in this process and print its JSON as the last stdout line."""
    device = resolve_device(args.device)
    if args.worker == "transfer":
        result = run_transfer(device, quick=args.quick)
    else:
        overrides = {k: getattr(args, k) for k in _OVERRIDES}
        workload = get_workload(args.workload).with_overrides(**overrides)
        result = run_train(
            workload, args.strategy, device, args.steps, args.warmup, timeline=not args.no_timeline
        )
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


def run_worker_subprocess(worker_args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run ``python -m matepoint_examples.bench --worker ...`` and parse its JSON.

    The package's own folder is put first on the child's ``PYTHONPATH`` so a source checkout
    works without installing.

    Args:
        worker_args: Arguments after the module name (must include ``--worker``).
        timeout: Seconds before the child is killed.

    Returns:
        The child's result, or a row with ``status`` ``"error"`` saying what went wrong.
    """
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "matepoint_examples.bench", *worker_args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"status": "error", "note": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                parsed: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                break
            return parsed
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"status": "error", "note": f"worker exit {proc.returncode}: {' / '.join(tail)}"[:500]}


def _header(device: torch.device, steps: int, warmup: int) -> str:
    """Describe the run above the markdown table."""
    env = environment(device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"matepoint benchmark, {when}: {env['device_name']} ({env['device']}), torch "
        f"{env['torch']}, Python {env['python']}; {steps} timed steps after {warmup} warm-up, "
        "median. Step = forward + backward. GB = 1e9 bytes."
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one measurement of it).

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0`` when every run finished (skipped and out-of-memory rows count as finished),
        ``1`` if a run errored, ``2`` for bad arguments.
    """
    args = _parser().parse_args(argv)
    if args.steps is None:
        args.steps = 3 if args.quick else 10
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.worker:
        return _worker_main(args)

    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    device = resolve_device(args.device)
    workloads = args.workloads or list(GPU_WORKLOADS if device.type == "cuda" else CPU_WORKLOADS)
    unknown = [w for w in workloads if w not in WORKLOADS]
    unknown += [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        console.print(f"[red]unknown workload/strategy: {', '.join(unknown)}[/]")
        return 2
    common = ["--device", str(device), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    common += ["--quick"] * args.quick + ["--no-timeline"] * args.no_timeline
    for name in _OVERRIDES:
        if getattr(args, name) is not None:
            common += [f"--{name.replace('_', '-')}", str(getattr(args, name))]

    jobs: list[tuple[str, list[str]]] = []
    if args.mode in ("all", "train"):
        for w in workloads:
            for s in args.strategies:
                jobs.append((f"{w} / {s}", ["--worker", "train", "--workload", w, "--strategy", s]))
    if args.mode in ("all", "transfer"):
        jobs.append(("transfer micro-benchmark", ["--worker", "transfer"]))

    rows: list[dict[str, Any]] = []
    transfer: dict[str, Any] | None = None
    progress_columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*progress_columns, console=console) as progress:
        task = progress.add_task("benchmark", total=len(jobs))
        for label, job in jobs:
            progress.update(task, description=label)
            reason = None if job[1] == "transfer" else STRATEGIES[job[5]].unavailable_reason(device)
            if reason is not None:  # no need to start a process to learn that
                result = {"mode": "train", "status": "skipped", "note": reason}
                result["kind"] = get_workload(job[3]).kind
            else:
                result = run_worker_subprocess([*job, *common], args.timeout)
            if job[1] == "transfer":
                transfer = result
            else:
                result.setdefault("workload", job[3])
                result.setdefault("strategy", job[5])
                rows.append(result)
            if result.get("status") not in ("ok", "skipped"):
                progress.console.print(
                    f"[yellow]{label}: {result.get('status')}: {result.get('note')}"
                )
            progress.advance(task)

    report.add_ratios(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    header = _header(device, args.steps, args.warmup)
    files = [
        report.write_json(
            args.out / "results.json",
            {
                "header": header,
                "argv": list(argv or sys.argv[1:]),
                "train": rows,
                "transfer": transfer,
            },
        ),
        report.write_markdown(args.out / "results.md", rows, transfer, header),
    ]
    if not args.no_plots and rows:
        files.append(report.plot_step_time_ratio(args.out / "step_time_ratio.png", rows))
        files.append(report.plot_memory_vs_depth(args.out / "memory_vs_depth.png", rows))
        files += report.plot_timelines(args.out, rows)
    if rows:
        console.print(report.rich_table(rows))
        for line in report.notes(rows):
            console.print(f"[dim]{line}[/]", highlight=False)
    if transfer is not None:
        console.print("[bold]Transfer-bound micro-benchmark[/]")
        console.print(report.transfer_markdown(transfer), markup=False)
    console.print("wrote " + ", ".join(str(f) for f in files))
    failed = [r for r in [*rows, *([transfer] if transfer else [])] if r.get("status") == "error"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
