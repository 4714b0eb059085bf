"""``matepoint-demo``: train a small deep stack three ways and show matepoint matches torch exactly.

The demo answers a new user's two questions in under a minute: are matepoint's gradients the
same as ``torch.utils.checkpoint``'s (bit for bit), and what does it cost and save. It trains a
:class:`~matepoint_examples.models.DeepLatentStack` from one seed with no checkpoint, with torch's
checkpoint and with matepoint, showing each step's progress, then prints a table and one summary
line. On a machine without a GPU it runs on the CPU with matepoint's test transport, so the
offload path runs for real there too. A CPU can show the first answer, not the second: it has no
device memory apart from host memory and its step times say nothing about a GPU's. So on a CPU
the demo says that plainly, gives what the same model would save on a GPU as
:func:`matepoint.plan` predicts it on the meta device (see ``_demo_cpu``), and prints no
timings.

Run ``matepoint-demo`` or ``python -m matepoint_examples.demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import matepoint
from matepoint_examples._demo_cpu import GPUPlan, cpu_lines, planned_on_gpu
from matepoint_examples._runtime import (
    allocated_bytes,
    format_bytes,
    peak_bytes,
    reset_peak,
    resolve_device,
    synchronize,
)
from matepoint_examples.models import DeepLatentConfig, DeepLatentStack
from matepoint_examples.strategies import get_strategy

__all__ = [
    "DemoResult",
    "GPUPlan",
    "bitwise_equal",
    "cpu_lines",
    "default_config",
    "main",
    "planned_on_gpu",
    "reproducible_attention",
    "run_strategy",
    "summary_line",
]

# What each strategy keeps for backward: the legend printed before training.
DEMO_STRATEGIES = {
    "none": "no checkpoint (keeps every activation for backward)",
    "torch": "torch.utils.checkpoint (recomputes; block inputs stay on the device)",
    "matepoint": "matepoint.checkpoint (recomputes; moves block inputs to host memory)",
}
REFERENCE = "torch"


@dataclass
class DemoResult:
    """What one strategy's run produced.

    Args:
        strategy: Strategy name.
        step_seconds: Median time of the steps after the first.
        peak_bytes: Peak device memory, or ``None`` on CPU.
        held_after_forward: Device bytes the first step's forward (loss included) left for
            backward, or ``None`` on CPU.
        bytes_offloaded: Bytes matepoint offloaded in the run, or ``None`` for other strategies.
        first_grads: Gradients of the first step, on the CPU, in parameter order.
        final_params: Parameters after the last step, on the CPU.
        losses: Loss of every step.
    """

    strategy: str
    step_seconds: float
    peak_bytes: int | None
    held_after_forward: int | None
    bytes_offloaded: int | None
    first_grads: list[torch.Tensor]
    final_params: list[torch.Tensor]
    losses: list[float]


def default_config(device: torch.device) -> DeepLatentConfig:
    """Return the demo's default stack for ``device``.

    The CPU default is sized to finish all three runs in seconds on two cores; the CUDA default
    is deep enough for the memory saving to show.

    Args:
        device: The device the demo runs on.

    Returns:
        The configuration.
    """
    if device.type == "cuda":
        return DeepLatentConfig(depth=32, width=1024, heads=8, batch=4, tokens=2048)
    return DeepLatentConfig(depth=8, width=256, heads=4, batch=2, tokens=256)


def reproducible_attention(device: torch.device) -> AbstractContextManager[object]:
    """Return a context that pins attention to kernels whose backward is bitwise reproducible.

    # Note [Reproducible attention]
    On CUDA the default attention kernels (flash, cuDNN) accumulate part of their backward with
    atomics, so two runs of plain torch checkpoint already differ in the last bits, and no
    bitwise comparison could pass (seen on an H200 with torch 2.11). The memory-efficient and
    math kernels gave bitwise-equal gradients run to run, so the demo pins those. CPU kernels are
    deterministic and stay as they are.

    Args:
        device: The device the demo runs on.

    Returns:
        The context (a no-op on CPU).
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def run_strategy(
    name: str,
    config: DeepLatentConfig,
    device: torch.device,
    steps: int,
    seed: int = 0,
    on_step: Callable[[], None] | None = None,
) -> DemoResult:
    """Train a fresh stack from ``seed`` for ``steps`` SGD steps with one strategy.

    Every strategy starts from the same weights and sees the same inputs, so gradients can be
    compared bit for bit.

    Args:
        name: Strategy name (see :mod:`matepoint_examples.strategies`).
        config: The stack to build.
        device: Where to run.
        steps: Number of training steps (at least 1).
        seed: Seed for weights and inputs. Default: ``0``.
        on_step: Called after each step (progress display). Default: ``None``.

    Returns:
        The run's timings, memory and tensors to compare.
    """
    strategy = get_strategy(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    model = DeepLatentStack(config, checkpoint_fn=strategy.checkpoint_fn).to(device, dtype)
    inputs = [model.example_input(device, dtype) for _ in range(steps)]
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    times: list[float] = []
    losses: list[float] = []
    first_grads: list[torch.Tensor] = []
    held_after_forward: int | None = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    reset_peak(device)
    matepoint.reset_stats()
    # See Note [Reproducible attention].
    with strategy.session(device), reproducible_attention(device):
        for step, x in enumerate(inputs):
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            before = allocated_bytes(device)
            with strategy.forward_context():
                out = model(x)
            loss = out.float().square().mean()
            after = allocated_bytes(device)
            if step == 0 and before is not None and after is not None:
                held_after_forward = after - before
            loss.backward()
            synchronize(device)
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
            if step == 0:
                first_grads = [
                    torch.zeros(0) if p.grad is None else p.grad.detach().cpu().clone()
                    for p in model.parameters()
                ]
            opt.step()
            if on_step is not None:
                on_step()
    offloaded = matepoint.stats().bytes_offloaded if strategy.uses_matepoint else None
    return DemoResult(
        strategy=name,
        step_seconds=statistics.median(times[1:] or times),
        peak_bytes=peak_bytes(device),
        held_after_forward=held_after_forward,
        bytes_offloaded=offloaded,
        first_grads=first_grads,
        final_params=[p.detach().cpu().clone() for p in model.parameters()],
        losses=losses,
    )


def bitwise_equal(a: DemoResult, b: DemoResult) -> bool:
    """Return whether two runs had identical first-step gradients and identical final weights.

    Args:
        a: One run.
        b: The other run.

    Returns:
        ``True`` if every tensor is ``torch.equal``.
    """
    if len(a.first_grads) != len(b.first_grads) or len(a.final_params) != len(b.final_params):
        return False
    pairs = [
        *zip(a.first_grads, b.first_grads, strict=True),
        *zip(a.final_params, b.final_params, strict=True),
    ]
    return all(torch.equal(x, y) for x, y in pairs)


def _parser() -> argparse.ArgumentParser:
    """Build the command-line parser."""
    p = argparse.ArgumentParser(
        prog="matepoint-demo",
        description="Train a small deep stack with no checkpoint, torch checkpoint and matepoint; "
        "check matepoint's gradients equal torch's bit for bit.",
    )
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    p.add_argument("--depth", type=int, help="number of blocks")
    p.add_argument("--width", type=int, help="model width d")
    p.add_argument("--heads", type=int, help="attention heads (must divide width)")
    p.add_argument("--batch", type=int, help="batch size")
    p.add_argument("--seq", type=int, help="tokens per sample (sequence length)")
    # The flag's name before 0.2.1, as matepoint-plan calls it --seq; see _warn_renamed.
    p.add_argument("--tokens", dest="seq", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=3, help="training steps per strategy (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default 0)")
    return p


def summary_line(
    results: dict[str, DemoResult],
    device: torch.device,
    steps: int,
    planned: GPUPlan | None = None,
) -> str:
    """Return the demo's one-line verdict: memory saved, step-time ratio, gradients equal.

    Compares matepoint with torch's checkpoint. On a CPU there is no device memory apart from
    host memory and step times say nothing about a GPU's, so the line gives the bytes moved
    and the planned saving on a GPU instead of numbers that would mislead.

    Args:
        results: The runs, by strategy name; needs ``"torch"`` and ``"matepoint"``.
        device: The device they ran on.
        steps: Steps per strategy.
        planned: On a CPU, the plan of the same model on a GPU. Default: ``None``.

    Returns:
        The line, without markup.
    """
    ref, mate = results[REFERENCE], results["matepoint"]
    if mate.held_after_forward is not None and ref.held_after_forward is not None:
        saved = ref.held_after_forward - mate.held_after_forward
        memory = (
            f"matepoint holds {format_bytes(mate.held_after_forward)} after forward vs "
            f"{format_bytes(ref.held_after_forward)} with torch's checkpoint "
            f"({format_bytes(saved)} saved)"
        )
    else:
        moved = format_bytes((mate.bytes_offloaded or 0) / steps)
        memory = f"{moved} of block inputs per step moved to host memory (a CPU saves nothing"
        if planned is not None:
            memory += f"; planned on a GPU: {format_bytes(planned.saved)} less held after forward"
        memory += ")"
    if device.type == "cpu":
        timing = "CPU times say nothing about a GPU's"
    else:
        timing = f"step time {mate.step_seconds / ref.step_seconds:.2f}x torch's"
    grads = "gradients bitwise equal" if bitwise_equal(mate, ref) else "gradients DIFFER"
    return f"Summary: {memory}; {timing}; {grads}."


def _table(results: dict[str, DemoResult], device: torch.device, steps: int) -> Table:
    """The per-strategy table; on a CPU without the columns a CPU cannot measure."""
    on_device = device.type != "cpu"
    columns = ["strategy"]
    if on_device:
        columns += ["step time", "held after forward", "peak memory"]
    columns += ["offloaded per step", "grads vs torch"]
    table = Table(title="matepoint vs torch.utils.checkpoint")
    for column in columns:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    ref = results[REFERENCE]
    for name, r in results.items():
        if name == REFERENCE:
            equal = "reference"
        else:
            equal = "[green]bitwise equal[/]" if bitwise_equal(r, ref) else "[red]DIFFER[/]"
        row = [name]
        if on_device:
            row += [
                f"{r.step_seconds * 1e3:.1f} ms",
                format_bytes(r.held_after_forward),
                format_bytes(r.peak_bytes),
            ]
        row += ["-" if r.bytes_offloaded is None else format_bytes(r.bytes_offloaded / steps)]
        table.add_row(*row, equal)
    return table


def _renamed_flag_used(argv: Sequence[str]) -> bool:
    """Whether ``argv`` uses ``--tokens``, the name ``--seq`` had before (kept working)."""
    return any(a == "--tokens" or a.startswith("--tokens=") for a in argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo: a legend, per-step progress, a table and a summary line.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0`` if matepoint's gradients equal torch checkpoint's bit for bit, else ``1``.
    """
    args = _parser().parse_args(argv)
    device = resolve_device(args.device)
    base = default_config(device)
    overrides = {k: getattr(args, k) for k in ("depth", "width", "heads", "batch")}
    overrides["tokens"] = args.seq
    fields = {k: v for k, v in overrides.items() if v is not None}
    if "width" in fields and "heads" not in fields:
        fields["heads"] = math.gcd(fields["width"], base.heads)
    config = DeepLatentConfig(**{**base.__dict__, **fields})
    steps = max(1, args.steps)
    # Lines are not wrapped by rich: one line each also where the output is a log, not a terminal.
    console = Console(soft_wrap=True)
    latent = config.batch * config.tokens * config.width * (2 if device.type == "cuda" else 4)
    console.print(
        f"[bold]matepoint demo[/] on [cyan]{device}[/]: {config.depth} blocks, d={config.width}, "
        f"{config.batch}x{config.tokens} tokens ({format_bytes(latent)} per block input), "
        f"{steps} steps per strategy"
    )
    if _renamed_flag_used(sys.argv[1:] if argv is None else argv):
        console.print("[yellow]--tokens is now --seq (as in matepoint-plan); it still works.[/]")
    for name, meaning in DEMO_STRATEGIES.items():
        console.print(f"  [bold]{name:<9}[/] {meaning}")
    planned = None
    if device.type == "cpu":
        # The run offloads every block input (see the matepoint strategy's CPU session); the
        # GPU demo's model is planned with matepoint's defaults, as it would run.
        every_input = dataclasses.replace(matepoint.get_options(), min_offload_bytes=0)
        planned = planned_on_gpu(config, every_input)
        gpu_default = planned_on_gpu(default_config(torch.device("cuda")))
        for line in cpu_lines(planned, gpu_default):
            console.print(line, highlight=False)
    results: dict[str, DemoResult] = {}
    columns = [TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn()]
    columns.append(TextColumn("steps"))
    if device.type != "cpu":  # CPU times of the three would be read as a comparison
        columns.append(TimeElapsedColumn())
    with Progress(*columns, console=console) as progress:
        for name in DEMO_STRATEGIES:
            task = progress.add_task(name, total=steps)
            advance = functools.partial(progress.advance, task)
            results[name] = run_strategy(
                name, config, device, steps, seed=args.seed, on_step=advance
            )
    console.print(_table(results, device, steps))
    if device.type == "cuda":
        console.print(
            "[dim]Attention ran on the memory-efficient/math kernels: flash and cuDNN attention "
            "backward are not bitwise reproducible even run to run.[/]"
        )
    ok = bitwise_equal(results["matepoint"], results[REFERENCE])
    line = summary_line(results, device, steps, planned)
    console.print(f"[bold green]{line}[/]" if ok else f"[bold red]{line}[/]")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
