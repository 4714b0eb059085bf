"""Planning the benchmark workloads, and checking the plans against a real GPU.

Kept apart from the ``matepoint-plan`` command (which needs rich) so that the check runs on a
GPU machine with nothing but torch: ``python -m matepoint_examples._planning --out check.json``
plans each workload, measures it as ``matepoint-bench`` does (same model, loss, step and
counters), and writes predicted against measured values.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import matepoint
from matepoint._planner.live_model import with_optimizer_step as _with_optimizer_step
from matepoint._planner.optimizer_states import optimizer_class, optimizer_state_bytes
from matepoint_examples._workloads import GPU_WORKLOADS, Workload, build, get_workload
from matepoint_examples.strategies import get_strategy

__all__ = [
    "OPTIMIZERS",
    "check_workload",
    "largest_batch",
    "main",
    "optimizer_states",
    "plan_workload",
    "with_optimizer_step",
]

STRATEGIES = ("none", "torch", "matepoint")
# The optimizers a workload can be planned with, and the settings their states are counted
# under: SGD as it is trained, with momentum (without, it holds no states, as "none").
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adam": {},
    "sgd": {"momentum": 0.9},
    "none": {},
}


def plan_workload(
    workload: Workload,
    options: matepoint.OffloadSettings | None = None,
    *,
    link_bandwidth: float = 55e9,
    peak_flops: float = 989e12,
    strategies: tuple[str, ...] = STRATEGIES,
) -> matepoint.MemoryPlan:
    """Build ``workload`` on the meta device and plan one training step of it.

    The model is the benchmark's own (same blocks, loss and matepoint call), so the plan is a
    prediction of what ``matepoint-bench`` measures for that workload.

    Args:
        workload: The model shape.
        options: Options for matepoint's checkpoints. Default: the process defaults.
        link_bandwidth: Bytes per second each way. Default: 55 GB/s (pinned copies measured on
            an H200 host).
        peak_flops: FLOP/s for the compute estimate. Default: 989 TFLOP/s (H100/H200 bf16).
        strategies: Which strategies to plan. Default: all three.

    Returns:
        The plan.
    """
    built = build(workload, get_strategy("matepoint").checkpoint_fn, torch.device("meta"))
    return matepoint.plan(
        built.loss,
        options=options,
        link_bandwidth=link_bandwidth,
        peak_flops=peak_flops,
        strategies=strategies,
    )


def optimizer_states(workload: Workload, optimizer: str) -> tuple[str, int]:
    """Name and device bytes of the states ``optimizer`` keeps for ``workload``'s parameters.

    The model is built on the meta device (nothing allocated); the states are counted by class,
    as before the optimizer's first step (:func:`matepoint._planner.optimizer_states.
    optimizer_state_bytes`), each rounded as the CUDA caching allocator rounds it.

    Args:
        workload: The model shape.
        optimizer: One of :data:`OPTIMIZERS`.

    Returns:
        The class's name (``"AdamW"``; ``"no optimizer"`` for ``"none"``) and the bytes.
    """
    cls = optimizer_class(optimizer)
    if cls is None:
        return "no optimizer", 0
    built = build(workload, get_strategy("none").checkpoint_fn, torch.device("meta"))
    return cls.__name__, optimizer_state_bytes(
        optimizer, built.model.parameters(), **OPTIMIZERS[optimizer]
    )


def with_optimizer_step(
    budget_plan: matepoint.BudgetPlan, workload: Workload, optimizer: str
) -> matepoint.BudgetPlan:
    """``budget_plan`` with ``optimizer``'s step counted, as ``matepoint.plan_budget`` counts it.

    The step holds the parameters, their gradients and its own temporaries beside its states
    (:func:`matepoint._planner.optimizer_states.optimizer_step_bytes`); a budget below that fits
    no plan. The optimizer is made on the meta model's parameters (nothing allocated), with the
    settings of :data:`OPTIMIZERS`, stepping as on a GPU.
    """
    cls = optimizer_class(optimizer)
    if cls is None:
        return budget_plan
    built = build(workload, get_strategy("none").checkpoint_fn, torch.device("meta"))
    instance = cls(built.model.parameters(), **OPTIMIZERS[optimizer])
    return _with_optimizer_step(budget_plan, built.model, instance)


def largest_batch(workload: Workload, budget_bytes: int, options: matepoint.OffloadSettings) -> int:
    """Return the largest batch whose matepoint step peaks within ``budget_bytes`` (0 if none).

    A binary search below the workload's batch (peak memory grows with the batch), each
    candidate planned with ``options``.

    Args:
        workload: The model shape; its batch is the upper bound.
        budget_bytes: Device bytes the step may use.
        options: Options for matepoint's checkpoints.

    Returns:
        The batch, or 0 if not even one sample fits.
    """
    low, high = 0, workload.batch
    while low < high:
        middle = (low + high + 1) // 2
        candidate = dataclasses.replace(workload, batch=middle)
        peak = plan_workload(candidate, options, strategies=("matepoint",))["matepoint"].peak_bytes
        if peak <= budget_bytes:
            low = middle
        else:
            high = middle - 1
    return low


def _predicted(strategy_plan: matepoint.StrategyPlan) -> dict[str, int]:
    return {
        "peak_bytes": strategy_plan.peak_bytes,
        "held_after_forward_bytes": strategy_plan.held_after_forward_bytes,
        "pinned_bytes": strategy_plan.pinned_bytes,
        "bytes_to_host": strategy_plan.bytes_to_host,
        "bytes_to_device": strategy_plan.bytes_to_device,
    }


def _measured(result: dict[str, Any]) -> dict[str, Any]:
    stats = result.get("matepoint_stats") or {}
    return {
        "peak_bytes": result.get("peak_bytes"),
        "held_after_forward_bytes": result.get("held_after_forward_bytes"),
        "pinned_bytes": stats.get("pool_pinned_bytes", 0),
        "bytes_to_host": stats.get("bytes_offloaded", 0),
        "bytes_to_device": stats.get("bytes_fetched", 0),
        "host_rss_delta_bytes": result.get("host_rss_delta_bytes"),
    }


def check_workload(
    workload: Workload, device: torch.device, steps: int = 2, warmup: int = 1
) -> list[dict[str, Any]]:
    """Plan ``workload``, then measure each strategy on ``device``; one row per strategy.

    Each measurement is the benchmark worker's (:func:`matepoint_examples.bench._worker.
    run_train`), in this process: memory is released and the pinned pool emptied between
    strategies so that each starts from the same state.

    Args:
        workload: The model shape.
        device: A CUDA device.
        steps: Timed steps of each measurement. Default: ``2``.
        warmup: Untimed steps before them (they fill the pinned pool). Default: ``1``.

    Returns:
        Rows with ``predicted`` and ``measured`` dicts of the same keys.
    """
    from matepoint_examples.bench._worker import run_train

    started = time.perf_counter()
    memory_plan = plan_workload(workload)
    plan_seconds = time.perf_counter() - started
    rows = []
    for strategy in STRATEGIES:
        gc.collect()
        torch.cuda.empty_cache()
        matepoint.release_pool()
        before = torch.cuda.memory_allocated(device)
        result = run_train(workload, strategy, device, steps, warmup, timeline=False)
        rows.append(
            {
                "workload": workload.name,
                "strategy": strategy,
                "status": result.get("status"),
                "note": result.get("note"),
                "allocated_before_bytes": before,
                "plan_seconds": plan_seconds,
                "predicted": _predicted(memory_plan[strategy]),
                "measured": _measured(result),
            }
        )
    return rows


def _gap(predicted: int, measured: Any) -> str:
    if not isinstance(measured, int) or measured == 0:
        return "exact" if predicted == measured else "-"
    return f"{(predicted - measured) / measured * 100:+.2f}%"


def main(argv: Sequence[str] | None = None) -> int:
    """Check the planner against measurements on a CUDA device; write JSON, print a summary.

    Args:
        argv: Command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        ``0``, or ``2`` without a CUDA device.
    """
    parser = argparse.ArgumentParser(description="Planner predictions against measurement.")
    parser.add_argument("--workloads", default=",".join(GPU_WORKLOADS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("plan-check.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    for name in args.workloads.split(","):
        rows += check_workload(get_workload(name), device, args.steps, args.warmup)
        args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2))
        for row in rows[-len(STRATEGIES) :]:
            cells = [
                f"{key}={row['predicted'][key]}/{row['measured'][key]}"
                f"({_gap(row['predicted'][key], row['measured'][key])})"
                for key in row["predicted"]
            ]
            print(row["workload"], row["strategy"], row["status"], *cells, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
