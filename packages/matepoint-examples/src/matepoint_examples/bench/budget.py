"""Budget plans on a GPU: measured peak and step against the plan, and against the peers.

Run ``python -m matepoint_examples.bench.budget --workload llama8``. One process builds one
Llama-style stack and one AdamW optimizer, measures torch's checkpoint and no checkpoint once,
plans a budget step on the meta device for each budget (torch checkpoint's measured peak, and
halfway to no checkpoint's), then runs every strategy alternately, step by step (see
``matepoint_examples.bench._paired`` for why), and reports per strategy the median per-round
step ratio to torch's checkpoint [interquartile range], the measured peak, and for the budget
plans the predicted peak.

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
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor

import matepoint
from matepoint._budget_profile import op_kind
from matepoint_examples.bench._paired import per_round_ratios, quartiles, round_order
from matepoint_examples.models import LlamaConfig, LlamaStack

__all__ = ["WORKLOADS", "main", "selective_policy"]

_GIB = float(1 << 30)

WORKLOADS: dict[str, tuple[LlamaConfig, int, int]] = {
    "llama8": (LlamaConfig(depth=8, width=4096, ffn_width=14336, heads=32, seq_len=8192), 1, 8192),
    "llama16": (LlamaConfig(depth=16, width=2048, ffn_width=7168, heads=16, seq_len=4096), 2, 4096),
    "llama-tiny": (LlamaConfig(depth=2, width=64, ffn_width=128, heads=4, seq_len=64), 1, 64),
}
"""Name -> (config, batch, tokens)."""


def selective_policy(saved_kinds: frozenset[str]) -> Callable[..., Any]:
    """torch's selective checkpoint saving the ops of ``saved_kinds`` (``matepoint`` op kinds)."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        del ctx, kwargs
        if op_kind(func, args) in saved_kinds:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpoint_fns(config: LlamaConfig) -> dict[str, Callable[..., Any]]:
    d, f = config.width, config.ffn_width
    down = f"matmul {f}x{d}"
    every_matmul = {f"matmul {d}x{3 * d}", f"matmul {d}x{d}", f"matmul {d}x{f}", down}
    sac = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)
    return {
        "torch": sac,
        "matepoint": functools.partial(matepoint.checkpoint, use_reentrant=False),
        "none": lambda function, *args: function(*args),
        "sac-attention-down": functools.partial(
            sac,
            context_fn=functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts,
                selective_policy(frozenset({"attention", down})),
            ),
        ),
        "sac-every-matmul": functools.partial(
            sac,
            context_fn=functools.partial(
                torch_checkpoint.create_selective_checkpoint_contexts,
                selective_policy(frozenset({"attention", *every_matmul})),
            ),
        ),
    }


class _Runner:
    """One model and optimizer; a step under any strategy, timed, with its peak memory."""

    def __init__(self, config: LlamaConfig, batch: int, tokens: int) -> None:
        self.stack = LlamaStack(config).to(device="cuda", dtype=torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.stack.parameters(), lr=1e-5, foreach=True)
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.x = torch.randn(
            batch, tokens, config.width, device="cuda", dtype=torch.bfloat16, generator=generator
        )
        self.settings: dict[str, dict[str, Any]] = {}

    def state_bytes(self) -> int:
        """Bytes of the optimizer's states (they stay on the device through every step)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, Tensor) and value.is_cuda
        )

    def optimizer_step_peak(self) -> int:
        """The peak of an optimizer step alone, gradients in place (zero gradients)."""
        for parameter in self.stack.parameters():
            parameter.grad = torch.zeros_like(parameter)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.optimizer.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        self.optimizer.zero_grad(set_to_none=True)
        return peak

    def step(self, name: str, checkpoint_fn: Callable[..., Any]) -> tuple[float, int]:
        self.stack.checkpoint_fn = checkpoint_fn
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with matepoint.options(**self.settings.get(name, {})):
            loss = self.stack(self.x).float().square().mean()
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated()


def _plan(config: LlamaConfig, batch: int, tokens: int) -> matepoint.MemoryPlan:
    with torch.device("meta"):
        stack = LlamaStack(config).to(torch.bfloat16)
        stack.checkpoint_fn = functools.partial(matepoint.checkpoint, use_reentrant=False)
        x = torch.randn(batch, tokens, config.width, dtype=torch.bfloat16)

    def loss_fn(output: Tensor) -> Tensor:
        return output.float().square().mean()

    return matepoint.plan(stack, x, loss_fn=loss_fn)


def run(workload: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Measure every strategy and the budget plans of ``workload``; return the report."""
    config, batch, tokens = WORKLOADS[workload]
    runner = _Runner(config, batch, tokens)
    strategies = _checkpoint_fns(config)
    measured_peaks: dict[str, int] = {}
    for name in ("torch", "none"):
        for _ in range(2):
            measured_peaks[name] = runner.step(name, strategies[name])[1]
    memory_plan = _plan(config, batch, tokens)
    # See Note [Calibrating the planned peak].
    states = runner.state_bytes()
    optimizer_peak = runner.optimizer_step_peak()

    def predicted(planned_peak: int) -> int:
        return max(planned_peak + states, optimizer_peak)

    # The time model's rates, measured on this device (cached per device and torch).
    device_model = matepoint.calibrate(refresh=True)
    print(device_model, flush=True)

    budgets = {
        "budget@torch": measured_peaks["torch"],
        "budget@mid": (measured_peaks["torch"] + measured_peaks["none"]) // 2,
    }
    plans: dict[str, dict[str, Any]] = {}
    for name, budget in budgets.items():
        started = time.perf_counter()
        budget_plan = memory_plan.fastest_under(budget - states, device=device_model)
        plans[name] = {
            "budget_bytes": budget,
            "fits": budget_plan.fits,
            "decisions": dict(budget_plan.decisions),
            "prefetch": budget_plan.prefetch,
            "predicted_peak_bytes": predicted(budget_plan.peak_bytes),
            "smallest_budget_bytes": predicted(budget_plan.smallest_budget_bytes),
            "estimated_step_ratio": budget_plan.step_seconds / budget_plan.every_block_seconds,
            "search_seconds": time.perf_counter() - started,
        }
        print(budget_plan, flush=True)
        context_fn = budget_plan.context_fn()
        extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
        strategies[name] = functools.partial(matepoint.checkpoint, use_reentrant=False, **extra)
        runner.settings[name] = budget_plan.settings_changes()
    names = list(strategies)
    times: dict[str, list[float | None]] = {name: [] for name in names}
    peaks: dict[str, int] = {}
    for round_index in range(warmup + rounds):
        for name in round_order(names, round_index):
            try:
                seconds, peak = runner.step(name, strategies[name])
            except torch.cuda.OutOfMemoryError:
                seconds, peak = float("nan"), -1
                runner.optimizer.zero_grad(set_to_none=True)
            if round_index >= warmup:
                times[name].append(None if seconds != seconds else seconds)
                peaks[name] = max(peaks.get(name, 0), peak)
    ratios = per_round_ratios(times)
    rows = {}
    for name in names:
        row: dict[str, Any] = {"peak_bytes": peaks.get(name)}
        if ratios.get(name):
            q1, median, q3 = quartiles(ratios[name])
            row.update(ratio=median, ratio_q1=q1, ratio_q3=q3)
        planned = name in ("torch", "none", "matepoint")
        row["planned_peak_bytes"] = predicted(memory_plan[name].peak_bytes) if planned else None
        rows[name] = row
    return {
        "workload": workload,
        "config": dataclasses.asdict(config),
        "batch": batch,
        "tokens": tokens,
        "rounds": rounds,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "device_model": dataclasses.asdict(device_model),
        "optimizer_state_bytes": states,
        "optimizer_step_peak_bytes": optimizer_peak,
        "plans": plans,
        "rows": rows,
    }


def _print(report: dict[str, Any]) -> None:
    print(f"{report['workload']}: {report['rounds']} rounds on {report['device']}")
    print(f"{'strategy':<20}{'step / torch':>24}{'peak GiB':>10}{'predicted':>11}")
    predicted = {name: plan["predicted_peak_bytes"] for name, plan in report["plans"].items()}
    for name, row in report["rows"].items():
        ratio = (
            f"{row['ratio']:.3f} [{row['ratio_q1']:.3f}-{row['ratio_q3']:.3f}]"
            if "ratio" in row
            else "-"
        )
        planned = predicted.get(name, row["planned_peak_bytes"])
        peak = row["peak_bytes"]
        print(
            f"{name:<20}{ratio:>24}"
            f"{'-' if peak is None or peak < 0 else f'{peak / _GIB:.2f}':>10}"
            f"{'-' if planned is None else f'{planned / _GIB:.2f}':>11}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the budget benchmark; see the module docstring."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the budget benchmark measures GPU memory and needs a CUDA device")
        return 2
    report = run(args.workload, args.rounds, args.warmup)
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
