"""``matepoint-bench``: every strategy on every workload, step times paired, memory per process.

The benchmark reproduces the design's performance table in one run. Step times are measured
*paired*: one process per workload builds one model and optimizer and alternates the strategies
step by step, and each strategy's ratio to ``torch.utils.checkpoint`` is the median over rounds
of its step over torch's step in the same round, with the interquartile range (see
:mod:`matepoint_examples.bench._paired`). Memory is measured with one process per (workload,
strategy), so that no strategy's allocator state or pinned pool leaks into another's numbers:
device bytes held after forward, peak device memory, host RAM added, matepoint's bytes offloaded
and link throughput. A transfer-bound micro-benchmark compares matepoint's offload and fetch
bandwidth with raw pinned copies. Results go to terminal tables, ``results.json``,
``results.md`` and PNG plots in ``./bench-results`` (``--out``).

Without a GPU it runs only what a CPU can show (see Note [What a CPU run shows]).

Run ``matepoint-bench --quick`` or ``python -m matepoint_examples.bench --help``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from matepoint_examples._runtime import resolve_device
from matepoint_examples._workloads import (
    CPU_WORKLOADS,
    GPU_WORKLOADS,
    WORKLOADS,
    get_workload,
)
from matepoint_examples.bench import _plots as plots
from matepoint_examples.bench import _report as report
from matepoint_examples.bench._paired import REFERENCE, run_paired
from matepoint_examples.bench._worker import environment, run_train, run_transfer
from matepoint_examples.strategies import DEFAULT_STRATEGIES, STRATEGIES

__all__ = ["main", "run_worker_subprocess"]

_OVERRIDES = ("depth", "width", "heads", "batch", "tokens", "vocab_size", "head_dim")

# Note [What a CPU run shows]
# Without a GPU, matepoint runs through its CPU test transport: host and "device" are the same
# memory, and a copy to the host is a memcpy. So a CPU can show that every strategy runs and
# how many bytes each moves per step, and matepoint's host-side cost next to torch's checkpoint
# on the same steps; it cannot show device memory saved, link throughput or GPU step times.
# Unless told otherwise a CPU run is therefore the paired run alone, on ``cpu-small``, of torch's
# checkpoint and matepoint (CPU_MODE, CPU_STRATEGIES), and says so in one line (cpu_notice);
# ``--mode`` and ``--strategies`` still run anything asked for.
CPU_MODE = "paired"
CPU_STRATEGIES = ("torch", "matepoint")
DEFAULT_OUT = Path("bench-results")


def cpu_notice(mode: str, strategies: Sequence[str], workloads: Sequence[str]) -> str:
    """Return the one line a run without a GPU prints first (see Note [What a CPU run shows]).

    Args:
        mode: The mode that will run.
        strategies: The strategies that will run.
        workloads: The workloads that will run.

    Returns:
        The line.
    """
    ran = f"--mode {mode}, {', '.join(strategies)} on {', '.join(workloads)}"
    return (
        f"No GPU: running {ran}, matepoint through its CPU test transport. A CPU shows bytes "
        "moved and host-side cost, not device memory, link speed or GPU step times."
    )


def _csv(value: str) -> list[str]:
    """Split a comma-separated flag value."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    """Build the command-line parser (orchestrator and worker share it)."""
    p = argparse.ArgumentParser(
        prog="matepoint-bench",
        description="Benchmark matepoint against torch checkpoint and offloading peers.",
        epilog="matepoint-bench budget ...: the memory-budget benchmark (budget plans against "
        "the peers at the same budget; matepoint-bench budget --help)",
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
        help=f"comma-separated, from: {', '.join(STRATEGIES)} (default on a GPU: all but the "
        f"probes and the compiled ones: {','.join(DEFAULT_STRATEGIES)}; without: "
        f"{','.join(CPU_STRATEGIES)}); {REFERENCE} is added to paired runs if missing",
    )
    p.add_argument(
        "--rounds", type=int, help="paired: timed rounds, one step per strategy (15; 3 --quick)"
    )
    p.add_argument("--steps", type=int, help="memory: timed steps per process (10; 3 --quick)")
    p.add_argument("--warmup", type=int, help="untimed warm-up rounds or steps (3; 1 --quick)")
    p.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"output folder, made if missing (default: ./{DEFAULT_OUT} in the current directory)",
    )
    p.add_argument("--quick", action="store_true", help="fewer steps, smaller transfer test")
    p.add_argument(
        "--mode",
        choices=("all", "paired", "memory", "transfer"),
        help="paired: step-time ratios, strategies alternating in one process per workload; "
        "memory: one process per workload x strategy; transfer: link micro-benchmark; "
        f"all: the three (default on a GPU; without one: {CPU_MODE})",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="paired: also profile one step per strategy (kernel busy time, runtime calls)",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess (900)")
    p.add_argument("--no-timeline", action="store_true", help="skip the memory-timeline step")
    p.add_argument(
        "--compile-backend",
        help="torch.compile backend of the compiled strategies (default: inductor on CUDA, "
        "aot_eager without)",
    )
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    for name in _OVERRIDES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=argparse.SUPPRESS)
    # Worker side: one measurement, JSON on stdout.
    p.add_argument("--worker", choices=("paired", "train", "transfer"), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--partial", type=Path, help=argparse.SUPPRESS)  # paired: rows so far
    return p


def _worker_main(args: argparse.Namespace) -> int:
    """Run one measurement in this process and print its JSON as the last stdout line."""
    device = resolve_device(args.device)
    overrides = {k: getattr(args, k) for k in _OVERRIDES}
    result: dict[str, Any]
    if args.worker == "transfer":
        result = run_transfer(device, quick=args.quick)
    elif args.worker == "paired":
        workload = get_workload(args.workload).with_overrides(**overrides)
        rows = run_paired(
            workload,
            args.strategies or list(DEFAULT_STRATEGIES),
            device,
            args.rounds,
            args.warmup,
            trace=args.trace,
            compile_backend=args.compile_backend,
            partial=args.partial,
        )
        result = {"mode": "paired", "rows": rows}
    else:
        workload = get_workload(args.workload).with_overrides(**overrides)
        result = run_train(
            workload,
            args.strategy,
            device,
            args.steps,
            args.warmup,
            timeline=not args.no_timeline,
            compile_backend=args.compile_backend,
        )
    sys.stdout.write(json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


def run_worker_subprocess(worker_args: Sequence[str], timeout: float) -> dict[str, Any]:
    """Run ``python -m matepoint_examples.bench --worker ...`` and parse its JSON.

    The package's own folder is put first on the child's ``PYTHONPATH`` so a source checkout
    works without installing. The child gets ``--partial FILE`` in a temporary folder: a paired
    worker keeps its rows so far there, so a timeout does not lose the rounds it finished.

    Args:
        worker_args: Arguments after the module name (must include ``--worker``).
        timeout: Seconds before the child is killed.

    Returns:
        The child's result; after a timeout, a paired worker's partial result (see
        :func:`_timed_out`); else a row with ``status`` ``"error"`` saying what went wrong.
    """
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="matepoint-bench-") as folder:
        partial = Path(folder) / "partial.json"
        cmd = [sys.executable, "-m", "matepoint_examples.bench", *worker_args]
        cmd += ["--partial", str(partial)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as exc:
            raw: bytes | str | None = exc.stderr  # bytes, whatever ``text`` says
            err = raw.decode(errors="replace") if isinstance(raw, bytes) else raw or ""
            return _timed_out(timeout, err, partial)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                parsed: dict[str, Any] = json.loads(line)
            except json.JSONDecodeError:
                break
            return parsed
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"status": "error", "note": f"worker exit {proc.returncode}: {' / '.join(tail)}"[:500]}


def _timed_out(timeout: float, stderr: str, partial: Path) -> dict[str, Any]:
    """Describe a worker killed by its timeout, keeping the rows of a paired worker's last round.

    The note says how far the worker got from what it reported on stderr: every compile-step
    line (a long compile is the usual reason for a timeout) and the last lines. A paired worker
    that got past its compile step left ``partial`` (see ``_paired._save_partial``): its rows
    come back, the ones that were running marked ``"partial"`` with a note saying which rounds
    they cover and what is missing, so that no report takes them for a complete run.

    Args:
        timeout: The seconds the worker had.
        stderr: What it wrote on stderr.
        partial: Where a paired worker keeps its rows so far.

    Returns:
        The partial result (``rows`` and ``progress``), or an error row without one.
    """
    lines = stderr.strip().splitlines()
    reported = dict.fromkeys([*(x for x in lines if ": compile step" in x), *lines[-6:]])
    tail = f"; last reported: {' / '.join(reported)}" if reported else ""
    note = f"timed out after {timeout:.0f} s"
    try:
        result: dict[str, Any] = json.loads(partial.read_text())
        done, counted = result["progress"]["rounds_done"], result["progress"]["counted_step"]
        first = result["rows"][0]
    except (OSError, ValueError, KeyError, IndexError):
        return {"status": "error", "note": (note + tail)[:1000]}
    of = f"of {first['warmup'] + first['rounds']} (of which {first['warmup']} warm-up)"
    note += f" after round {done} {of}" if done else f" after the compile step, before round 1 {of}"
    note += " and the counted step" if counted else "; counted step not run: no held-after-forward"
    for row in result["rows"]:
        if row.get("status") == "ok":
            row.update(status="partial", note=(note + tail)[:1000])
    return result


def _header(device: torch.device, args: argparse.Namespace) -> str:
    """Describe the run above the markdown tables (only the parts of it that ran)."""
    env = environment(device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [
        f"matepoint benchmark, {when}: {env['device_name']} ({env['device']}), torch "
        f"{env['torch']}, Python {env['python']}, matepoint {env['matepoint']}. Step = forward "
        "+ backward."
    ]
    if args.mode in ("all", "paired"):
        parts.append(
            f"Paired: {args.rounds} rounds after {args.warmup} warm-up, strategies alternating "
            f"in one process per workload, median of per-round ratios to {REFERENCE} "
            "[interquartile range]."
        )
    if args.mode in ("all", "memory"):
        parts.append(
            f"Memory: one process per strategy, {args.steps} steps after {args.warmup} warm-up."
        )
    return " ".join([*parts, "GB = 1e9 bytes."])


def _save(out: Path, header: str, argv: Sequence[str], results: dict[str, Any]) -> Path:
    """Write what has been measured so far (a run cut short still leaves its JSON)."""
    out.mkdir(parents=True, exist_ok=True)
    return report.write_json(
        out / "results.json", {"header": header, "argv": list(argv), **results}
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (or, with ``--worker``, one measurement of it).

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0`` when every run finished (skipped and out-of-memory rows count as finished),
        ``1`` if a run errored or timed out (partial rows too), ``2`` for bad arguments.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments[:1] == ["budget"]:
        from matepoint_examples.bench import budget

        return budget.main(arguments[1:])
    args = _parser().parse_args(arguments)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 15
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
    on_gpu = device.type == "cuda"
    workloads = args.workloads or list(GPU_WORKLOADS if on_gpu else CPU_WORKLOADS)
    if args.mode is None:
        args.mode = "all" if on_gpu else CPU_MODE
    if args.strategies is None:
        args.strategies = list(DEFAULT_STRATEGIES if on_gpu else CPU_STRATEGIES)
    unknown = [w for w in workloads if w not in WORKLOADS]
    unknown += [s for s in args.strategies if s not in STRATEGIES]
    if unknown:
        console.print(f"[red]unknown workload/strategy: {', '.join(unknown)}[/]")
        return 2
    common = ["--device", str(device), "--warmup", str(args.warmup)]
    common += ["--quick"] * args.quick + ["--no-timeline"] * args.no_timeline
    if args.compile_backend:
        common += ["--compile-backend", args.compile_backend]
    for name in _OVERRIDES:
        if getattr(args, name) is not None:
            common += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    paired_strategies = list(dict.fromkeys([REFERENCE, *args.strategies]))

    jobs: list[tuple[str, str, list[str]]] = []
    if args.mode in ("all", "paired"):
        for w in workloads:
            job = ["--worker", "paired", "--workload", w, "--rounds", str(args.rounds)]
            job += ["--strategies", ",".join(paired_strategies)] + ["--trace"] * args.trace
            jobs.append((f"{w} / paired", "paired", job))
    if args.mode in ("all", "memory"):
        for w in workloads:
            for s in args.strategies:
                job = ["--worker", "train", "--workload", w, "--strategy", s]
                jobs.append((f"{w} / {s}", "memory", [*job, "--steps", str(args.steps)]))
    if args.mode in ("all", "transfer"):
        jobs.append(("transfer micro-benchmark", "transfer", ["--worker", "transfer"]))

    if not on_gpu:
        console.print(cpu_notice(args.mode, paired_strategies, workloads), highlight=False)
    header = _header(device, args)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    results: dict[str, Any] = {"paired": [], "memory": [], "transfer": None}
    progress_columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    with Progress(*progress_columns, console=console) as progress:
        task = progress.add_task("benchmark", total=len(jobs))
        for label, kind, job in jobs:
            progress.update(task, description=label)
            for line in _run_job(kind, job, common, device, args.timeout, results):
                progress.console.print(f"[yellow]{line}")
            _save(args.out, header, argv_list, results)
            progress.advance(task)

    paired, memory, transfer = results["paired"], results["memory"], results["transfer"]
    report.add_host_baselines(memory)
    files = [
        _save(args.out, header, argv_list, results),
        report.write_markdown(args.out / "results.md", paired, memory, transfer, header),
    ]
    unplotted: list[str] = []
    if not args.no_plots and (paired or memory):
        for name, draw, rows, missing in (
            ("step_time_ratio.png", plots.plot_step_time_ratio, paired, "no step-time ratios"),
            ("memory_vs_depth.png", plots.plot_memory_vs_depth, memory, "no device memory"),
        ):
            written = draw(args.out / name, rows)
            if written is None:
                unplotted.append(f"{name} ({missing})")
            else:
                files.append(written)
        files += plots.plot_timelines(args.out, memory)
    if paired:
        console.print(report.rich_paired_table(paired))
    if memory:
        console.print(report.rich_memory_table(memory))
    for line in report.notes([*paired, *memory]) + report.compile_notes([*paired, *memory]):
        console.print(f"[dim]{line}[/]", highlight=False)
    if transfer is not None:
        console.print("[bold]Transfer-bound micro-benchmark[/]")
        console.print(report.transfer_markdown(transfer), markup=False)
    console.print("wrote " + ", ".join(str(f) for f in files), highlight=False)
    if unplotted:
        console.print("not plotted: " + ", ".join(unplotted), highlight=False)
    everything = [*paired, *memory, *([transfer] if transfer else [])]
    return 1 if any(r.get("status") in ("error", "partial") for r in everything) else 0


def _run_job(
    kind: str,
    job: list[str],
    common: list[str],
    device: torch.device,
    timeout: float,
    results: dict[str, Any],
) -> list[str]:
    """Run one worker job and file its result in ``results``.

    Returns:
        Lines worth printing (rows that did not run, and why).
    """
    if kind == "memory":
        workload, strategy = job[3], job[5]
        reason = STRATEGIES[strategy].unavailable_reason(device)
        if reason is not None:  # no need to start a process to learn that
            row: dict[str, Any] = {"mode": "train", "status": "skipped", "note": reason}
            row["kind"] = get_workload(workload).kind
        else:
            row = run_worker_subprocess([*job, *common], timeout)
        row.setdefault("workload", workload)
        row.setdefault("strategy", strategy)
        results["memory"].append(row)
        rows = [row]
    elif kind == "paired":
        result = run_worker_subprocess([*job, *common], timeout)
        rows = result.get("rows") or [{**result, "workload": job[3], "strategy": "(all)"}]
        results["paired"].extend(rows)
    else:
        results["transfer"] = result = run_worker_subprocess([*job, *common], timeout)
        rows = [{**result, "workload": "transfer", "strategy": "-"}]
    return [
        f"{r.get('workload')} / {r.get('strategy')}: {r.get('status')}: {r.get('note')}"
        for r in rows
        if r.get("status") not in ("ok", "skipped")
    ]


if __name__ == "__main__":
    raise SystemExit(main())
