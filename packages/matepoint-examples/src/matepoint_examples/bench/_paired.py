"""Paired step times: every strategy on one model and optimizer, alternating step by step.

Separate processes per strategy differ by several percent from run to run on a shared host
(clocks, memory placement, other tenants), so the ratio of two processes' medians is not
evidence at the 1% level. Here one process builds one model and one optimizer; each round runs
one step of every strategy, the order rotated by one every round so that no strategy always
follows the same one. A strategy's step divided by the reference's step *of the same round*
cancels whatever drifts slower than a round; the median of those per-round ratios, with its
interquartile range, is what the reports show.

A step here is forward plus backward (timed), then an untimed optimizer step, so the model
trains as it would and every strategy works on the same weights.

A compiled strategy (``torch-compile`` and its kin) runs the same model through its own compiled
forward (:meth:`Strategy.forward_fn`); each compiles in one untimed step before the warm-up
rounds, so no compile time is ever timed, and its row says what the compiler did (``compile``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from matepoint_examples._runtime import synchronize
from matepoint_examples._workloads import Built, Workload, build
from matepoint_examples.bench._compiled import CompiledForward
from matepoint_examples.bench._errors import error_note, portable
from matepoint_examples.bench._trace import trace_step
from matepoint_examples.bench._worker import environment, held_forward, write_partial
from matepoint_examples.strategies import Strategy, get_strategy

__all__ = [
    "COMPILED_REFERENCE",
    "METRICS",
    "REFERENCE",
    "StrategySwitch",
    "per_round_ratios",
    "quartiles",
    "round_order",
    "run_paired",
]

REFERENCE = "torch"
"""The strategy every ratio is taken against: ``torch.utils.checkpoint``."""

COMPILED_REFERENCE = "torch-compile"
"""The same-mode baseline of the compiled strategies: torch's checkpoint, compiled."""

METRICS = ("step_s", "forward_host_s", "forward_gpu_s", "backward_gpu_s")
"""What each timed step records (GPU spans only on CUDA; see :func:`run_paired`)."""


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """Return the first quartile, the median and the third quartile of ``values``.

    Quartiles are interpolated between data points (``statistics.quantiles`` with the
    inclusive method), so a handful of rounds gives a range inside the observed values.

    Args:
        values: At least one number.

    Returns:
        ``(q1, median, q3)``.

    Raises:
        ValueError: If ``values`` is empty.
    """
    if not values:
        raise ValueError("quartiles() needs at least one value")
    if len(values) == 1:
        return (values[0], values[0], values[0])
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q1, median, q3)


def per_round_ratios(
    times: Mapping[str, Sequence[float | None]], reference: str = REFERENCE
) -> dict[str, list[float]]:
    """Divide each strategy's time by the reference's time of the same round.

    Args:
        times: Per strategy, one time per round (``None`` where that round's step did not run).
        reference: The strategy to divide by.

    Returns:
        Per strategy, the ratios of the rounds where both it and the reference ran (empty if
        the reference never ran).
    """
    ref = times.get(reference, [])
    ratios: dict[str, list[float]] = {}
    for name, values in times.items():
        ratios[name] = [
            value / base
            for value, base in zip(values, ref, strict=False)
            if value is not None and base is not None and base > 0
        ]
    return ratios


def round_order(names: Sequence[str], round_index: int) -> list[str]:
    """Return the strategies in the order round ``round_index`` runs them (rotated by one each).

    Args:
        names: The strategies, in their listed order.
        round_index: Zero-based round number.

    Returns:
        The names, starting at ``round_index % len(names)``.
    """
    if not names:
        return []
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


class StrategySwitch:
    """A ``checkpoint_fn`` that runs each block through the current strategy's.

    The model is built once with this as its checkpoint function; setting :attr:`current`
    changes how its blocks are checkpointed from the next forward on.

    Args:
        current: The strategy to start with.
    """

    def __init__(self, current: Strategy) -> None:
        self.current = current

    def __call__(self, function: Callable[..., Tensor], /, *args: Tensor) -> Any:
        """Run ``function(*args)`` through the current strategy's ``checkpoint_fn``."""
        return self.current.checkpoint_fn(function, *args)


class _Clock:
    """Host timers and, on CUDA, three reusable events around forward and backward."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[Any] = []
        if device.type == "cuda":
            self.events = [
                torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                for _ in range(3)
            ]

    def mark(self, index: int) -> float:
        """Record event ``index`` on the current stream (CUDA) and return the host time."""
        if self.events:
            self.events[index].record()
        return time.perf_counter()

    def spans(self) -> tuple[float | None, float | None]:
        """Return the forward's and the backward's span on the compute stream, in seconds."""
        if not self.events:
            return (None, None)
        start, forward_done, end = self.events
        return (start.elapsed_time(forward_done) / 1e3, forward_done.elapsed_time(end) / 1e3)


def _timed_step(
    built: Built, strategy: Strategy, optimizer: torch.optim.Optimizer, clock: _Clock
) -> dict[str, float | None]:
    """Run one timed forward and backward under ``strategy``, then an untimed optimizer step."""
    device = clock.device
    synchronize(device)
    t0 = clock.mark(0)
    with strategy.forward_context():
        loss = built.loss()
    t1 = clock.mark(1)
    torch.autograd.backward(loss)
    clock.mark(2)
    synchronize(device)
    t3 = time.perf_counter()
    del loss
    forward_gpu, backward_gpu = clock.spans()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {
        "step_s": t3 - t0,
        "forward_host_s": t1 - t0,
        "forward_gpu_s": forward_gpu,
        "backward_gpu_s": backward_gpu,
    }


def _release(device: torch.device) -> None:
    """Give back what a failed step left (its graph is gone once the exception is)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_paired(
    workload: Workload,
    strategy_names: Sequence[str],
    device: torch.device,
    rounds: int,
    warmup: int,
    trace: bool = False,
    compile_backend: str | None = None,
    partial: Path | None = None,
) -> list[dict[str, Any]]:
    """Measure every strategy on one model, alternating step by step, and summarize.

    Each strategy's own session is entered once for the whole run. A strategy that runs out
    of memory or fails leaves the rotation (its row says why); the others go on. After the
    rounds, each strategy runs one more step with its counters reset (what it held after
    forward and what it moved per step) and, with ``trace``, one step under ``torch.profiler``
    with a synchronize between forward and backward (kernel busy time and runtime calls per
    phase). Compiled strategies compile in one untimed step each before the warm-up rounds.

    Args:
        workload: The model shape.
        strategy_names: Registered strategies; ``"torch"`` should be among them (the reference).
        device: Where to run.
        rounds: Timed rounds.
        warmup: Untimed rounds before them (these also fill pinned pools and caches).
        trace: Add the profiled step. Default: ``False``.
        compile_backend: ``torch.compile`` backend of the compiled strategies. Default:
            inductor on CUDA, aot_eager elsewhere.
        partial: File rewritten with the rows so far after the compile step, every round and
            the counted step (:func:`_save_partial`), so a worker killed by its timeout still
            hands over what it measured. Default: none.

    Returns:
        One JSON-ready row per strategy: ``status``, per-round ``times``, the median
        ``step_time_s``, the per-round ``ratio`` to torch's checkpoint with ``ratio_q1`` and
        ``ratio_q3``, the same for every metric under ``ratios``, ``held_after_forward_bytes``,
        ``stats``/``trace``, and for a compiled strategy ``compile`` (backend, graphs, graph
        breaks, recompiles) and, when ``torch-compile`` ran too, ``ratio_to_torch_compile``
        (the step's, same form).
    """
    common = {
        "mode": "paired",
        **workload.row_fields(),
        "rounds": rounds,
        "warmup": warmup,
        "reference": REFERENCE,
        **environment(device),
    }
    rows: dict[str, dict[str, Any]] = {}
    active: list[Strategy] = []
    for name in strategy_names:
        strategy = get_strategy(name)
        row: dict[str, Any] = {**common, "strategy": name, "status": "ok"}
        reason = strategy.unavailable_reason(device)
        if reason is not None:
            row.update(status="skipped", note=reason)
        else:
            active.append(strategy)
        rows[name] = row
    if not active:
        return list(rows.values())

    names = [s.name for s in active]
    times: dict[str, list[dict[str, float | None] | None]] = {n: [] for n in names}
    try:
        with contextlib.ExitStack() as stack:
            sessions: list[Callable[[torch.device], Any]] = []
            for strategy in active:
                if strategy.session not in sessions:
                    sessions.append(strategy.session)
                    stack.enter_context(strategy.session(device))
            switch = StrategySwitch(active[0])
            built = build(workload, switch, device)
            runs = {
                s.name: dataclasses.replace(
                    built, loss=s.forward_fn(built.loss, device, compile_backend)
                )
                for s in active
            }
            optimizer = torch.optim.AdamW(
                built.model.parameters(), lr=1e-4, fused=device.type == "cuda"
            )
            clock = _Clock(device)
            _rounds(runs, switch, optimizer, clock, active, rows, times, rounds, warmup, partial)
            live = [s for s in active if rows[s.name]["status"] == "ok"]
            for strategy in live:
                run = runs[strategy.name]
                _counted_step(run, switch, optimizer, clock, strategy, rows[strategy.name])
            if partial is not None:
                _save_partial(partial, rows, runs, times, warmup + rounds, counted=True)
            if trace:
                for strategy in live:
                    switch.current = strategy
                    rows[strategy.name]["trace"] = trace_step(runs[strategy.name], strategy, device)
                    optimizer.zero_grad(set_to_none=True)
            _add_compile_reports(rows, runs)
    except Exception as exc:  # the model or a session failed: every row says so
        note, failure_trace = error_note(exc), portable(traceback.format_exc())[-4000:]
        for row in rows.values():
            if row["status"] == "ok":
                row.update(status="error", note=note, traceback=failure_trace)
    _summarize(rows, times)
    return list(rows.values())


def _rounds(
    runs: Mapping[str, Built],
    switch: StrategySwitch,
    optimizer: torch.optim.Optimizer,
    clock: _Clock,
    active: Sequence[Strategy],
    rows: dict[str, dict[str, Any]],
    times: dict[str, list[dict[str, float | None] | None]],
    rounds: int,
    warmup: int,
    partial: Path | None,
) -> None:
    """Run the compile step, the warm-up and the timed rounds of :func:`run_paired`.

    The compile step runs each compiled strategy once (its first forward and backward compile;
    the row keeps that step's time as ``compile_step_s``); the rounds then fill ``times``. With
    ``partial``, the rows so far are saved after the compile step (if any) and every round.
    """
    by_name = {s.name: s for s in active}
    schedule = [[s.name for s in active if s.compiled is not None]]
    schedule += [round_order(list(by_name), index) for index in range(warmup + rounds)]
    for index, order in enumerate(schedule):
        timed = index > warmup
        measured: dict[str, dict[str, float | None] | None] = {}
        for name in order:
            if rows[name]["status"] != "ok":
                continue
            switch.current = by_name[name]
            failure: tuple[str, str] | None = None
            try:
                measured[name] = _timed_step(runs[name], by_name[name], optimizer, clock)
            except torch.cuda.OutOfMemoryError as exc:
                failure = ("oom", str(exc).splitlines()[0][:300])
            except Exception as exc:
                failure = ("error", error_note(exc))
                rows[name]["traceback"] = portable(traceback.format_exc())[-4000:]
            compiled_loss = runs[name].loss
            if index == 0 and isinstance(compiled_loss, CompiledForward):
                compiled_loss.end_compile_step()  # before the next strategy compiles
            if failure is not None:
                rows[name].update(status=failure[0], note=failure[1])
                optimizer.zero_grad(set_to_none=True)
                _release(clock.device)
        if timed:
            for name in by_name:
                times[name].append(measured.get(name))
        if index == 0:  # the compile step: how long compiling took
            for name, step in measured.items():
                rows[name]["compile_step_s"] = None if step is None else step["step_s"]
                _report_progress(f"{rows[name]['workload']} / {name}: compile step", step)
        else:
            workload = rows[order[0]]["workload"]
            _report_progress(f"{workload}: round {index} of {len(schedule) - 1}")
        if partial is not None and order:
            _save_partial(partial, rows, runs, times, index, counted=False)


def _add_compile_reports(rows: dict[str, dict[str, Any]], runs: Mapping[str, Built]) -> None:
    """Put what the compiler did into each compiled strategy's row (``compile``)."""
    for name, run in runs.items():
        if isinstance(run.loss, CompiledForward):
            rows[name]["compile"] = run.loss.report()


def _save_partial(
    path: Path,
    rows: dict[str, dict[str, Any]],
    runs: Mapping[str, Built],
    times: Mapping[str, Sequence[dict[str, float | None] | None]],
    done: int,
    counted: bool,
) -> None:
    """Write copies of the rows, summarized over the timed rounds so far, for a run cut short.

    The file (:func:`write_partial`) holds ``{"mode": "paired", "rows": [...], "progress":
    {"rounds_done": done, "counted_step": counted}}``; ``done`` counts the warm-up rounds, as
    the rows' ``warmup`` and ``rounds`` do, and before the counted step rows lack its figures.
    """
    snapshot = copy.deepcopy(rows)
    _add_compile_reports(snapshot, runs)
    _summarize(snapshot, times)
    progress = {"rounds_done": done, "counted_step": counted}
    write_partial(path, {"mode": "paired", "rows": list(snapshot.values()), "progress": progress})


def _report_progress(what: str, step: dict[str, float | None] | None = None) -> None:
    """Say on stderr how far the run got, so that a run killed by its timeout still tells."""
    took = "" if step is None else f" {step['step_s']:.1f} s"
    print(f"{what}{took}", file=sys.stderr, flush=True)


def _counted_step(
    built: Built,
    switch: StrategySwitch,
    optimizer: torch.optim.Optimizer,
    clock: _Clock,
    strategy: Strategy,
    row: dict[str, Any],
) -> None:
    """Run one more step and store what it held after forward and, if it counts, what it moved.

    Held after forward is :func:`held_forward`'s, as in the memory mode (parameters, optimizer
    state and the batch are counted before and after; gradients are ``None`` between steps), so
    a compiled strategy gets its memory row without compiling again in a process of its own.
    """
    device = clock.device
    switch.current = strategy
    if strategy.reset_stats is not None:
        strategy.reset_stats()
    gc.collect()
    loss, row["held_after_forward_bytes"], _ = held_forward(built, strategy, device)
    torch.autograd.backward(loss)
    del loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if strategy.stats is not None:
        row["stats"] = strategy.stats()


def _ratio_summary(values: Sequence[float]) -> dict[str, float | int]:
    """Return the median and quartiles of per-round ratios, and how many rounds."""
    q1, median, q3 = quartiles(values)
    return {"median": median, "q1": q1, "q3": q3, "rounds": len(values)}


def _summarize(
    rows: dict[str, dict[str, Any]], times: Mapping[str, Sequence[dict[str, float | None] | None]]
) -> None:
    """Add medians and per-round ratios (median and quartiles) to every row.

    A compiled strategy's step is also divided by ``torch-compile``'s (the same-mode baseline)
    when that ran.
    """
    for name, steps in times.items():
        rows[name]["times"] = [dict(t) if t is not None else None for t in steps]
    for metric in METRICS:
        series = {
            name: [None if t is None else t.get(metric) for t in steps]
            for name, steps in times.items()
        }
        ratios = per_round_ratios(series, REFERENCE)
        for name, values in series.items():
            row = rows[name]
            present = [v for v in values if v is not None]
            if present:
                row.setdefault("medians_s", {})[metric] = statistics.median(present)
            if ratios.get(name):
                row.setdefault("ratios", {})[metric] = _ratio_summary(ratios[name])
        if metric == "step_s":
            for name, same_mode in per_round_ratios(series, COMPILED_REFERENCE).items():
                if same_mode and "compile" in rows[name]:
                    rows[name]["ratio_to_torch_compile"] = _ratio_summary(same_mode)
    for row in rows.values():
        step = row.get("ratios", {}).get("step_s")
        row["step_time_s"] = row.get("medians_s", {}).get("step_s")
        row["ratio"] = step["median"] if step else None
        row["ratio_q1"] = step["q1"] if step else None
        row["ratio_q3"] = step["q3"] if step else None
