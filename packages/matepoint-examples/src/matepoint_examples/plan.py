"""``matepoint-plan``: will an example model fit, how much host RAM, will the link keep up?

Plans one training step of a benchmark workload with :func:`matepoint.plan` on the meta device
(no GPU, no memory for the model), under no checkpoint, torch's checkpoint and matepoint, and
prints a table; ``--json`` and ``--plot`` write the report and a PNG of device and host memory
over the step. With ``--budget`` it prints one plan: the fastest step within the budget
(``MemoryPlan.fastest_under``: keep, offload or recompute per kind of op, look-ahead, inputs held
and stash), and where nothing fits, the share of the example batch that would. The optimizer's
states (``--optimizer``, AdamW by default) stay on the device through the step: they are
counted, and the step is planned within the budget less them.

The ``--json`` report gives that plan as ``budget_plan`` (its ``settings`` every setting it was
planned under, ``stash_bytes`` included, and ``batch_fraction``). The ``recommendation`` key of
earlier versions (``MemoryPlan.recommend``'s options-only answer) is written only where torch has
no selective checkpointing (before 2.5), which budget plans need: there it is the one answer.

Run ``matepoint-plan --model deep96`` or ``python -m matepoint_examples.plan --help``. The exit
status is 0, or 1 when nothing fits the budget; 2 for a usage error (argparse's convention).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

import matepoint
import matepoint._planner.policy as matepoint_policy
from matepoint._planner.live_model import size_in_bytes
from matepoint_examples._planning import (
    OPTIMIZERS,
    optimizer_states,
    plan_workload,
    with_optimizer_step,
)
from matepoint_examples._runtime import format_bytes
from matepoint_examples._workloads import WORKLOADS, Workload, get_workload

__all__ = ["describe", "main", "plot", "rich_table"]

_GIB = float(1 << 30)
_GB = 1e9
_MIB = 1 << 20
_LABELS = {"none": "no checkpoint", "torch": "torch checkpoint", "matepoint": "matepoint"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _ratios(strategy_plan: matepoint.StrategyPlan) -> str:
    """Link time over the compute it overlaps, each direction: above 1 the link sets the pace."""
    if not strategy_plan.link_bytes:
        return "-"
    forward = strategy_plan.to_host_seconds / max(strategy_plan.forward_seconds, 1e-12)
    backward = strategy_plan.to_device_seconds / max(strategy_plan.backward_seconds, 1e-12)
    return f"{forward:.2f} / {backward:.2f}"


def rich_table(
    memory_plan: matepoint.MemoryPlan, optimizer: tuple[str, int] | None = None
) -> Table:
    """Return the plan as a rich table: one column per strategy.

    Args:
        memory_plan: The plan.
        optimizer: The optimizer's name and its states' bytes, if any: a row gives each peak
            with them added (they stay on the device through the step).
    """
    plans = list(memory_plan.strategies.values())
    table = Table(title="One training step, planned on the meta device")
    table.add_column("")
    for strategy_plan in plans:
        table.add_column(
            _LABELS.get(strategy_plan.strategy, strategy_plan.strategy), justify="right"
        )
    rows: list[tuple[str, list[str]]] = [
        ("peak device memory", [format_bytes(p.peak_bytes) for p in plans]),
        ("  of which before the step", [format_bytes(p.baseline_bytes) for p in plans]),
        *(
            [(f"peak with {optimizer[0]} states", [
                format_bytes(p.peak_bytes + optimizer[1]) for p in plans
            ])]
            if optimizer is not None
            else []
        ),
        ("held after forward", [format_bytes(p.held_after_forward_bytes) for p in plans]),
        ("pinned host RAM", [format_bytes(p.pinned_bytes + p.pageable_bytes) for p in plans]),
        ("to host / to device", [
            f"{p.bytes_to_host / _GB:.2f} / {p.bytes_to_device / _GB:.2f} GB" for p in plans
        ]),
        ("link time, each way*", [
            f"{_ms(p.to_host_seconds)} / {_ms(p.to_device_seconds)}" for p in plans
        ]),
        ("compute fwd / bwd*", [
            f"{_ms(p.forward_seconds)} / {_ms(p.backward_seconds)}" for p in plans
        ]),
        ("link / compute, fwd / bwd*", [_ratios(p) for p in plans]),
    ]  # fmt: skip
    for label, cells in rows:
        table.add_row(label, *cells)
    return table


def _notes(memory_plan: matepoint.MemoryPlan) -> list[str]:
    notes = [
        f"* estimates: link at {memory_plan.link_bandwidth / _GB:.0f} GB/s each way; compute is "
        f"the step's FLOPs at {memory_plan.peak_flops / 1e12:.0f} TFLOP/s, a peak no real step "
        "reaches, so real compute is longer: a link/compute ratio below 1 means the copies hide "
        "behind compute even then.",
    ]
    if "matepoint" in memory_plan.strategies:
        counters = memory_plan["matepoint"].counters
        notes.append(
            f"matepoint: {counters['offloads']} inputs offloaded ({counters['dedupe_hits']} "
            f"shared saves), {counters['fetches']} copies back ({counters['prefetches']} "
            f"prefetched), {counters['stash_hits']} served on the device, "
            f"{counters['skipped_small']} small and {counters['skipped_parameters']} "
            "parameters kept in place."
        )
    return notes


def plot(
    memory_plan: matepoint.MemoryPlan,
    path: Path,
    budget_bytes: int | None = None,
    budget_label: str = "budget",
) -> Path:
    """Draw device and host memory over the step, one line per strategy, as a PNG.

    The horizontal axis is the step's allocations and frees in order (not time: the planner
    runs no kernels), with a marker where forward ends and backward starts.

    Args:
        memory_plan: The plan.
        path: Where to write the PNG.
        budget_bytes: A budget to draw as a horizontal line, or None.
        budget_label: The line's label. Default: ``"budget"``.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (device_ax, host_ax) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for strategy_plan in memory_plan.strategies.values():
        timeline = strategy_plan.timeline
        label = _LABELS.get(strategy_plan.strategy, strategy_plan.strategy)
        steps = range(len(timeline))
        device = [point.device_bytes / _GIB for point in timeline]
        (line,) = device_ax.plot(steps, device, label=label, linewidth=1.2)
        color = line.get_color()
        backward = next(i for i, point in enumerate(timeline) if point.phase != "forward")
        device_ax.axvline(backward, color=color, linestyle=":", linewidth=0.8)
        if max(point.host_bytes for point in timeline) > 0:
            host = [point.host_bytes / _GIB for point in timeline]
            in_use = [point.host_in_use_bytes / _GIB for point in timeline]
            host_ax.plot(steps, host, color=color, label=f"{label}: pinned pool")
            host_ax.plot(steps, in_use, color=color, linestyle=":", label=f"{label}: in use")
    if budget_bytes is not None:
        device_ax.axhline(budget_bytes / _GIB, color="black", linestyle="--", label=budget_label)
    device_ax.set_ylabel("device GiB allocated")
    device_ax.set_title("Device memory over one training step (planned; dotted: backward starts)")
    device_ax.legend(fontsize="small")
    host_ax.set_ylabel("host GiB")
    host_ax.set_xlabel("allocations and frees, in order")
    if host_ax.get_legend_handles_labels()[0]:
        host_ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# The shape flags, the Workload field each sets, and its help.
_SHAPE_FLAGS = (
    ("depth", "depth", "number of checkpointed blocks"),
    ("width", "width", "model dimension"),
    ("heads", "heads", "attention heads (a GPT's follow from --width and --head-dim)"),
    ("batch", "batch", "batch size"),
    ("seq", "tokens", "tokens per sample (sequence length)"),
    ("vocab", "vocab_size", "vocabulary (GPT)"),
    ("head-dim", "head_dim", "head dimension (GPT)"),
)
_DEFAULT_MODEL = "gpt12"


def _models_epilog() -> str:
    """List every model's shape: the defaults of the shape flags."""
    lines = ["models (their shapes are the defaults of the shape flags):"]
    lines += [f"  {w.name:<11} {w.describe()}" for w in WORKLOADS.values()]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="matepoint-plan",
        description="Plan device memory, host RAM and link traffic of an example model's "
        "training step, without a GPU.",
        epilog=_models_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default = get_workload(_DEFAULT_MODEL)
    p.add_argument(
        "--model", default=_DEFAULT_MODEL, help=f"one of the models below (default: {default.name})"
    )
    for flag, field, text in _SHAPE_FLAGS:
        value = getattr(default, field)
        p.add_argument(
            f"--{flag}", type=int, help=f"{text} (default: the model's; {default.name}: {value})"
        )
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        help=f"parameter/activation dtype (default: the model's; {default.name}: {default.dtype})",
    )
    p.add_argument(
        "--stash", type=_mib("--stash"), help="stash_bytes, in MiB (default: matepoint's)"
    )
    p.add_argument("--prefetch", type=int, help="prefetch depth (default: matepoint's)")
    p.add_argument("--min-offload", type=_mib("--min-offload"), help="min_offload_bytes, in MiB")
    p.add_argument(
        "--budget",
        type=_size("--budget"),
        help=f"device memory budget, the optimizer's states included ({_SIZE_FORMAT}): the "
        "fastest step within it (keep, offload or recompute per kind of op) and offload "
        "options that fit; the exit status is 1 when nothing fits",
    )
    p.add_argument(
        "--optimizer",
        choices=tuple(OPTIMIZERS),
        default="adamw",
        help="the optimizer whose states stay on the device through the step, counted against "
        "--budget: adamw and adam two per parameter, sgd (with momentum) one, none (default: "
        "adamw)",
    )
    p.add_argument(
        "--host-budget",
        type=_size("--host-budget", zero=True),
        help="pinned host RAM per node for --budget (e.g. 256GiB; 0 offloads nothing)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=_count,
        default=1,
        help="processes per node sharing its host RAM (default: 1)",
    )
    p.add_argument(
        "--bandwidth",
        type=_rate("--bandwidth"),
        default=55.0,
        help="link GB/s each way (default: 55)",
    )
    p.add_argument(
        "--peak-tflops",
        type=_rate("--peak-tflops"),
        default=989.0,
        help="compute TFLOP/s (default: 989)",
    )
    p.add_argument("--json", type=Path, help="write the report as JSON here")
    p.add_argument("--plot", type=Path, help="write the memory timeline PNG here")
    return p


_SIZE_FORMAT = "a size such as 40GiB, 12.5GB, 512MiB, 8e9B (bytes), or 24 (a bare number is GiB)"
_SIZE_FLAGS = ("--budget", "--host-budget")


def _size(flag: str, zero: bool = False) -> Callable[[str], int]:
    """The argparse type of a size flag: bytes above 0 (or 0 where ``zero``), or a usage error.

    A usage error names the flag and the format; it is never a traceback (``inf``,
    ``1e400`` and ``nan`` are refused as sizes that are not finite).
    """

    def parse(text: str) -> int:
        value = size_in_bytes(text, bare_unit=1 << 30)
        if math.isnan(value):
            reason = "is not a size"
        elif not math.isfinite(value):
            reason = "is not a finite size"
        elif value < 0 or (value < 1 and not (zero and value == 0)):
            reason = "is not a size of 0 bytes or more" if zero else "is not above 0 bytes"
        else:
            return int(value)
        raise argparse.ArgumentTypeError(f"{text!r} {reason}: {flag} takes {_SIZE_FORMAT}")

    return parse


def _count(text: str) -> int:
    """``--ranks-per-node``: a whole number of processes, 1 or more."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: --ranks-per-node takes a whole number of processes, 1 or more"
        )
    return value


def _number(flag: str, zero: bool, what: str) -> Callable[[str], float]:
    """The argparse type of a finite number above 0 (or 0 and more where ``zero``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
            raise argparse.ArgumentTypeError(f"{text!r}: {flag} takes {what}")
        return value

    return parse


def _rate(flag: str) -> Callable[[str], float]:
    """A rate flag's type: a finite number above 0."""
    return _number(flag, False, "a number above 0")


def _mib(flag: str) -> Callable[[str], float]:
    """A MiB flag's type: a finite number, 0 or more."""
    return _number(flag, True, "a number of MiB, 0 or more")


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse ``argv``; a size's unit given as a word of its own gets the format in its error."""
    words = list(sys.argv[1:] if argv is None else argv)
    # argparse takes "-5GiB" for an option ("expected one argument"): hand it to the size's
    # type, which says what a size is.
    for index, word in enumerate(words[:-1]):
        if word in _SIZE_FLAGS and re.match(r"-[0-9.]", words[index + 1]):
            words[index : index + 2] = [f"{word}={words[index + 1]}"]
    args, extras = parser.parse_known_args(words)
    if extras:
        message = f"unrecognized arguments: {' '.join(extras)}"
        for extra in extras:
            unit, index = extra.strip(), words.index(extra)
            before = words[max(index - 2, 0) : index]
            if before[-1:] and "=" in before[-1]:  # --budget=10 GB
                before = before[-1].split("=", 1)
            known_unit = bool(unit) and not math.isnan(size_in_bytes(f"1{unit}"))
            if known_unit and len(before) == 2 and before[0] in _SIZE_FLAGS:
                flag, number = before
                message += f"; {flag} takes {_SIZE_FORMAT}, in one word: {flag} {number}{unit}"
                break
        parser.error(message)
    return args


def _workload(args: argparse.Namespace) -> Workload:
    overrides = {field: getattr(args, flag.replace("-", "_")) for flag, field, _ in _SHAPE_FLAGS}
    workload = get_workload(args.model).with_overrides(**overrides)
    return dataclasses.replace(workload, dtype=args.dtype) if args.dtype else workload


def describe(workload: Workload) -> str:
    """Say which model is planned: its shape, its parameters, and what differs from its name's.

    The name is a registered shape; flags change it (``--model gpt12 --depth 32``), so the line
    gives the shape actually planned and lists each field that is not the name's.

    Args:
        workload: The shape planned.

    Returns:
        E.g. ``"gpt12 with depth 32 (not 12), width 4096 (not 768), heads 32 (not 6):
        nanochat-style GPT, depth 32, ...; 6.98 B parameters (13.00 GiB in bf16)"``.
    """
    base = get_workload(workload.name)
    changed = [
        f"{field.name} {getattr(workload, field.name)} (not {getattr(base, field.name)})"
        for field in dataclasses.fields(workload)
        if getattr(workload, field.name) != getattr(base, field.name)
    ]
    name = f"{workload.name} with {', '.join(changed)}" if changed else workload.name
    count = workload.parameter_count()
    size = count * workload.torch_dtype().itemsize
    return (
        f"{name}: {workload.describe()}; {count / 1e9:.2f} B parameters "
        f"({format_bytes(size)} in {workload.dtype})"
    )


def _options(args: argparse.Namespace) -> matepoint.OffloadSettings:
    options = matepoint.get_options()
    if args.stash is not None:
        options = dataclasses.replace(options, stash_bytes=int(args.stash * _MIB))
    if args.prefetch is not None:
        options = dataclasses.replace(options, prefetch=args.prefetch)
    if args.min_offload is not None:
        options = dataclasses.replace(options, min_offload_bytes=int(args.min_offload * _MIB))
    return options


def _budget_search(
    memory_plan: matepoint.MemoryPlan,
    step_budget: int,
    args: argparse.Namespace,
    workload: Workload,
) -> matepoint.BudgetPlan | matepoint.Recommendation:
    """The one answer to ``--budget``: the budget search's plan, or, where torch has no
    selective checkpointing (before 2.5), the options that fit (``MemoryPlan.recommend``)."""
    if not matepoint_policy.AVAILABLE:
        return memory_plan.recommend(step_budget)
    budget_plan = memory_plan.fastest_under(
        step_budget, host_budget_bytes=args.host_budget, ranks_per_node=args.ranks_per_node
    )
    # The optimizer step holds more than its states: counted as the one call counts it.
    return with_optimizer_step(budget_plan, workload, args.optimizer)


def _budget_plan_report(budget_plan: matepoint.BudgetPlan) -> dict[str, Any]:
    """The budget plan as the ``--json`` report gives it."""
    return {
        "budget_bytes": budget_plan.budget_bytes,
        "fits": budget_plan.fits,
        "checkpoint": budget_plan.checkpoint,
        "decisions": dict(budget_plan.decisions),
        "kept_in_last": dict(budget_plan.kept_in_last),
        "unchecked_last": budget_plan.unchecked_last,
        "regions": budget_plan.regions,
        "settings": budget_plan.settings_changes(),
        "peak_bytes": budget_plan.peak_bytes,
        "pinned_bytes_per_node": budget_plan.pinned_bytes_per_node,
        "step_seconds": budget_plan.step_seconds,
        "every_block_seconds": budget_plan.every_block_seconds,
        "smallest_budget_bytes": budget_plan.smallest_budget_bytes,
        "batch_fraction": budget_plan.batch_fraction,
        "optimizer_step_bytes": budget_plan.optimizer_step_bytes,
    }


def _recommendation_report(recommendation: matepoint.Recommendation) -> dict[str, Any]:
    """The options search's answer as the ``--json`` report gives it (torch before 2.5)."""
    options = recommendation.options
    return {
        "fits": recommendation.fits,
        "options": None if options is None else dataclasses.asdict(options),
        "peak_bytes": recommendation.plan.peak_bytes,
        "link_bytes": recommendation.plan.link_bytes,
        "minimum_peak_bytes": recommendation.minimum_peak_bytes,
        "batch_fraction": recommendation.batch_fraction,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Plan a workload and print, and optionally write, the report.

    Everything is planned first (the strategies and the budget search), then printed: "planned
    in" is the time all of it took.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0``; ``1`` when nothing fits ``--budget``; ``2`` for an unknown model or a shape the
        model cannot take. A usage error exits with ``2`` (argparse's ``SystemExit``).
    """
    args = _parse(_parser(), argv)
    console = Console() if sys.stdout.isatty() else Console(width=140)
    started = time.perf_counter()
    try:
        workload = _workload(args)
        options = _options(args)
        memory_plan = plan_workload(
            workload,
            options,
            link_bandwidth=args.bandwidth * _GB,
            peak_flops=args.peak_tflops * 1e12,
        )
        optimizer_name, state_bytes = optimizer_states(workload, args.optimizer)
    except (KeyError, ValueError) as error:
        console.print(f"[red]{error}[/]")
        return 2
    states = (
        "no optimizer states counted (--optimizer none)"
        if args.optimizer == "none"
        else f"{optimizer_name} states {format_bytes(state_bytes)} counted"
    )
    report: dict[str, Any] = {
        "model": {
            **dataclasses.asdict(workload),
            "description": workload.describe(),
            "parameters": workload.parameter_count(),
        },
        "optimizer": {"name": args.optimizer, "state_bytes": state_bytes},
        "plan": memory_plan.to_dict(),
    }
    budget: int | None = args.budget
    # The states stay on the device through the step: the step has the budget less them.
    step_budget = None if budget is None else budget - state_bytes
    fastest: matepoint.BudgetPlan | matepoint.Recommendation | None = None
    if step_budget is not None and step_budget > 0:
        fastest = _budget_search(memory_plan, step_budget, args, workload)
    seconds = time.perf_counter() - started
    report["planning_seconds"] = seconds

    console.print(describe(workload), highlight=False, soft_wrap=True)
    console.print(
        states
        if args.optimizer == "none"
        else f"{states}: they stay on the device through the step; 'peak with "
        f"{optimizer_name} states' adds them to each peak",
        highlight=False,
    )
    table_optimizer = None if args.optimizer == "none" else (optimizer_name, state_bytes)
    console.print(rich_table(memory_plan, table_optimizer))
    for note in _notes(memory_plan):
        console.print(f"[dim]{note}[/]", highlight=False)
    fits = True
    if budget is not None and step_budget is not None:
        report["budget_bytes"] = budget
        report["step_budget_bytes"] = step_budget
        console.print(
            f"[bold]budget {format_bytes(budget)}[/]: {states}, "
            + (
                f"{format_bytes(step_budget)} left for the step"
                if step_budget > 0
                else "nothing left for the step: nothing fits"
            ),
            highlight=False,
        )
        fits = step_budget > 0 and fastest is not None and fastest.fits
        report["fits"] = fits
    if isinstance(fastest, matepoint.BudgetPlan):
        console.print(str(fastest), highlight=False)
        report["budget_plan"] = _budget_plan_report(fastest)
    elif fastest is not None and step_budget is not None:
        console.print(
            "[dim]no budget plan: torch's selective checkpointing, which it chooses through, "
            "arrived in 2.5; the offload options that fit instead[/]",
            highlight=False,
        )
        console.print(f"[bold]step budget {format_bytes(step_budget)}[/]: {fastest}")
        report["recommendation"] = _recommendation_report(fastest)
    console.print(f"[dim]planned in {seconds:.1f} s[/]")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"wrote {args.json}")
    if args.plot is not None:
        label = "budget" if not state_bytes else f"budget less {optimizer_name} states"
        plot(
            memory_plan, args.plot, step_budget if step_budget and step_budget > 0 else None, label
        )
        console.print(f"wrote {args.plot}")
    return 0 if fits else 1


if __name__ == "__main__":
    raise SystemExit(main())
