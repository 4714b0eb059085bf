"""``matepoint-demo``: train a small deep stack three ways and show matepoint matches torch exactly.

The demo answers a new user's two questions in under a minute: are matepoint's gradients the
same as ``torch.utils.checkpoint``'s (bit for bit), and what does it cost and save. It trains a
:class:`~matepoint_examples.models.DeepLatentStack` from one seed with no checkpoint, with torch's
checkpoint and with matepoint, then prints one table. On a machine without a GPU it runs on the
CPU with matepoint's test transport, so the offload path runs for real there too.

Run ``matepoint-demo`` or ``python -m matepoint_examples.demo``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

import matepoint
from matepoint_examples._runtime import (
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
    "bitwise_equal",
    "default_config",
    "main",
    "reproducible_attention",
    "run_strategy",
]

DEMO_STRATEGIES = ("none", "torch", "matepoint")
REFERENCE = "torch"


@dataclass
class DemoResult:
    """What one strategy's run produced.

    Args:
        strategy: Strategy name.
        step_seconds: Median time of the steps after the first.
        peak_bytes: Peak device memory, or ``None`` on CPU.
        bytes_offloaded: Bytes matepoint offloaded in the run, or ``None`` for other strategies.
        first_grads: Gradients of the first step, on the CPU, in parameter order.
        final_params: Parameters after the last step, on the CPU.
        losses: Loss of every step.
    """

    strategy: str
    step_seconds: float
    peak_bytes: int | None
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
    name: str, config: DeepLatentConfig, device: torch.device, steps: int, seed: int = 0
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
            with strategy.forward_context():
                out = model(x)
            loss = out.float().square().mean()
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
    offloaded = matepoint.stats().bytes_offloaded if strategy.uses_matepoint else None
    return DemoResult(
        strategy=name,
        step_seconds=statistics.median(times[1:] or times),
        peak_bytes=peak_bytes(device),
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
    p.add_argument("--tokens", type=int, help="tokens per sample")
    p.add_argument("--steps", type=int, default=3, help="training steps per strategy (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default 0)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo and print its table.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0`` if matepoint's gradients equal torch checkpoint's bit for bit, else ``1``.
    """
    args = _parser().parse_args(argv)
    device = resolve_device(args.device)
    base = default_config(device)
    overrides = {k: getattr(args, k) for k in ("depth", "width", "heads", "batch", "tokens")}
    fields = {k: v for k, v in overrides.items() if v is not None}
    if "width" in fields and "heads" not in fields:
        fields["heads"] = math.gcd(fields["width"], base.heads)
    config = DeepLatentConfig(**{**base.__dict__, **fields})
    steps = max(1, args.steps)
    console = Console()
    latent = config.batch * config.tokens * config.width * (2 if device.type == "cuda" else 4)
    console.print(
        f"[bold]matepoint demo[/] on [cyan]{device}[/]: {config.depth} blocks, d={config.width}, "
        f"{config.batch}x{config.tokens} tokens ({format_bytes(latent)} per block input), "
        f"{steps} steps"
    )
    results: dict[str, DemoResult] = {}
    with console.status("training") as status:
        for name in DEMO_STRATEGIES:
            status.update(f"training with [bold]{name}[/]")
            results[name] = run_strategy(name, config, device, steps, seed=args.seed)
    ref = results[REFERENCE]
    table = Table(title="matepoint vs torch.utils.checkpoint")
    for column in ("strategy", "step time", "peak memory", "bytes offloaded", "grads equal"):
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for name, r in results.items():
        if name == REFERENCE:
            equal = "reference"
        else:
            equal = "[green]yes[/]" if bitwise_equal(r, ref) else "[red]NO[/]"
        table.add_row(
            name,
            f"{r.step_seconds * 1e3:.1f} ms",
            format_bytes(r.peak_bytes),
            "-" if r.bytes_offloaded is None else format_bytes(r.bytes_offloaded),
            equal,
        )
    console.print(table)
    ok = bitwise_equal(results["matepoint"], ref)
    if ok:
        console.print(
            "[green]matepoint's gradients are bitwise equal to torch.utils.checkpoint's.[/]"
        )
    else:
        console.print("[red]matepoint's gradients differ from torch.utils.checkpoint's.[/]")
    if device.type == "cuda":
        console.print(
            "[dim]Attention ran on the memory-efficient/math kernels: flash and cuDNN attention "
            "backward are not bitwise reproducible even run to run.[/]"
        )
    if device.type == "cpu":
        console.print(
            "[dim]CPU run: matepoint used its test transport (CPU tensors stand in for device "
            "tensors), so offloading ran but saves no memory; run on a GPU for real numbers.[/]"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
