"""Run one training step on the meta device under one strategy, and report what it held.

The step is the user's own code: ``matepoint.checkpoint`` runs as always, with a planning scope
on the thread (see Note [Planning scope] in ``matepoint._registry``) that sends its saved inputs
to the planner's own engine (see Note [Planner fidelity] in ``matepoint._plan_engine``) and, for
the no-checkpoint strategy, runs each checkpointed function directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

import matepoint_compat as compat
from matepoint._options import OffloadSettings
from matepoint._plan_cuda import CudaKernels
from matepoint._plan_engine import PlannedStep, SavedInput, Strategy
from matepoint._plan_trace import PHASES, MemoryTracker
from matepoint._registry import planning_scope
from matepoint._stats import OffloadStats

__all__ = ["StrategyPlan", "TimelinePoint", "run_step"]


@dataclasses.dataclass(frozen=True)
class TimelinePoint:
    """Device and host memory at one moment of the planned step.

    Attributes:
        flops: FLOPs computed so far in the step (divide by FLOP/s for an estimated time).
        device_bytes: Device bytes allocated at that moment (as the CUDA caching allocator
            counts them, rounded to 512 bytes).
        host_bytes: Host bytes the pinned pool holds (plus pageable fallbacks).
        host_in_use_bytes: The part of ``host_bytes`` holding live offloaded inputs.
        phase: ``"forward"``, ``"backward"`` or ``"after"``.
    """

    flops: int
    device_bytes: int
    host_bytes: int
    host_in_use_bytes: int
    phase: str


@dataclasses.dataclass(frozen=True)
class StrategyPlan:
    """The planned step under one strategy.

    Attributes:
        strategy: ``"none"`` (no checkpoint), ``"torch"`` (``torch.utils.checkpoint``) or
            ``"matepoint"``.
        peak_bytes: Most device bytes alive at once, parameters and inputs included.
        baseline_bytes: Device bytes before the step (parameters, buffers, inputs, and the
            cuBLAS workspaces of the threads that run matrix products).
        parameter_bytes: The parameters among them (their gradients add as much in backward).
        held_after_forward_bytes: Device bytes forward leaves for backward (after forward,
            loss included, minus before it).
        pinned_bytes: Pinned host RAM the pool holds (exact-size blocks, reused every step).
        pageable_bytes: Host bytes in pageable memory because the pool cap was reached.
        bytes_to_host: Bytes copied device to host in the step (a shared input once).
        bytes_to_device: Bytes copied host to device (fetches and prefetches).
        forward_flops: FLOPs of forward and loss.
        backward_flops: FLOPs of backward, recomputation included.
        to_host_seconds: ``bytes_to_host`` at the link bandwidth.
        to_device_seconds: ``bytes_to_device`` at the link bandwidth.
        forward_seconds: Estimated forward compute: ``forward_flops`` at the peak FLOP/s.
        backward_seconds: Estimated backward compute, likewise.
        counters: The planned engine's :class:`matepoint.OffloadStats` after the step, by name
            (times are 0: nothing waits on the meta device).
        pool_would_raise: Whether ``on_pool_exhausted="raise"`` would raise in this step.
        timeline: Device and host memory through the step.
    """

    strategy: str
    peak_bytes: int
    baseline_bytes: int
    parameter_bytes: int
    held_after_forward_bytes: int
    pinned_bytes: int
    pageable_bytes: int
    bytes_to_host: int
    bytes_to_device: int
    forward_flops: int
    backward_flops: int
    to_host_seconds: float
    to_device_seconds: float
    forward_seconds: float
    backward_seconds: float
    counters: dict[str, int]
    pool_would_raise: bool
    timeline: tuple[TimelinePoint, ...]

    @property
    def link_bytes(self) -> int:
        """Bytes over the link, both ways."""
        return self.bytes_to_host + self.bytes_to_device

    @property
    def link_bound(self) -> bool:
        """Whether some direction's copies need longer than the compute they overlap."""
        return (
            self.to_host_seconds > self.forward_seconds
            or self.to_device_seconds > self.backward_seconds
        )

    def to_dict(self, max_points: int = 2000) -> dict[str, Any]:
        """Return a JSON-ready dict, the timeline thinned to at most ``max_points`` points.

        Thinning keeps every local extreme it can, so the peak survives.
        """
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        fields["timeline"] = [
            dataclasses.astuple(point) for point in _thin(self.timeline, max_points)
        ]
        fields["timeline_columns"] = [field.name for field in dataclasses.fields(TimelinePoint)]
        return fields


def _thin(points: tuple[TimelinePoint, ...], limit: int) -> list[TimelinePoint]:
    if len(points) <= limit:
        return list(points)
    stride = -(-len(points) // limit)
    kept: list[TimelinePoint] = []
    for start in range(0, len(points), stride):
        window = points[start : start + stride]
        top = max(window, key=lambda point: point.device_bytes)
        low = min(window, key=lambda point: point.device_bytes)
        kept.extend(sorted({id(top): top, id(low): low}.values(), key=window.index))
    return kept


def _adopt_existing(tracker: MemoryTracker, fn: Any, values: Any) -> None:
    """Count what exists before the step: the function's module state and the arguments."""
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(module, torch.nn.Module):
        devices = {tensor.device.type for tensor in (*module.parameters(), *module.buffers())}
        if devices - {"meta"}:
            raise ValueError(
                "matepoint.plan runs the step on the meta device, where tensors hold no memory, "
                f"but the model has parameters or buffers on {', '.join(devices - {'meta'})}; "
                "build it under `with torch.device('meta'):` (or pass device='meta')"
            )
        for tensor in (*module.parameters(), *module.buffers()):
            tracker.adopt(tensor)
            if tensor.grad is not None:
                tracker.adopt(tensor.grad)
    leaves, _ = compat.tree_flatten(values)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tracker.adopt(leaf)


def _loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None) -> torch.Tensor:
    """Reduce the function's output to the scalar the step differentiates."""
    if loss_fn is not None:
        return loss_fn(output)
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else output.sum()
    leaves, _ = compat.tree_flatten(output)
    terms = [leaf.sum() for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
    if not terms:
        raise ValueError(
            "matepoint.plan: the function returned no tensor that requires grad; pass loss_fn="
        )
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


def run_step(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    strategy: Strategy,
    options: OffloadSettings | None,
    loss_fn: Callable[[Any], torch.Tensor] | None,
    link_bandwidth: float,
    peak_flops: float,
    context_fn: Callable[[], Any] | None = None,
) -> tuple[StrategyPlan, tuple[SavedInput, ...]]:
    """Run forward and backward of ``fn`` once under ``strategy`` and report its memory.

    Args:
        fn: The model or function; its tensors must be on the meta device.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        strategy: ``"none"``, ``"torch"`` or ``"matepoint"``.
        options: Settings every offloading checkpoint uses instead of its own, or None.
        loss_fn: Turns the output into the loss; None sums it.
        link_bandwidth: Bytes per second each way, for the link times.
        peak_flops: FLOP/s, for the compute times.
        context_fn: A ``context_fn`` for every non-reentrant checkpoint call instead of its
            own (a budget plan's selective-checkpoint policy), or None. Default: None.

    Returns:
        The step's plan, and every checkpoint input matepoint saw, in order.
    """
    tracker = MemoryTracker("meta")
    planned = PlannedStep(tracker, strategy, options, context_fn)
    engine = planned.engine
    with planning_scope(planned), compat.meta_checkpointing(), tracker, CudaKernels(tracker):
        _adopt_existing(tracker, fn, (args, kwargs))
        with torch.enable_grad():
            loss = _loss_of(fn(*args, **kwargs), loss_fn)
        tracker.mark("forward_end")
        compat.run_backward(loss)
        del loss
        engine.settle(block=False)  # what died at the end of the step, as stats() settles it
        tracker.mark("backward_end")
        tracker.close()
    stats = OffloadStats()
    stats.add(engine.counters)
    stats.add(engine.pool.snapshot())
    stats.live_records, stats.device_bytes_held = engine.live_records(), engine.held_bytes()
    counters = {name: int(value) for name, value in dataclasses.asdict(stats).items()}
    samples = tracker.samples
    forward_end = samples[tracker.marks["forward_end"]][1]
    forward_flops = tracker.flops_at["forward_end"]
    backward_flops = tracker.flops - forward_flops
    to_host, to_device = counters["bytes_offloaded"], counters["bytes_fetched"]
    plan = StrategyPlan(
        strategy=strategy,
        peak_bytes=tracker.peak_bytes(),
        baseline_bytes=tracker.preexisting_bytes,
        parameter_bytes=tracker.parameter_bytes,
        held_after_forward_bytes=forward_end - samples[0][1],
        pinned_bytes=engine.pool.pinned_bytes,
        pageable_bytes=planned.peak_pageable_bytes,
        bytes_to_host=to_host,
        bytes_to_device=to_device,
        forward_flops=forward_flops,
        backward_flops=backward_flops,
        to_host_seconds=to_host / link_bandwidth,
        to_device_seconds=to_device / link_bandwidth,
        forward_seconds=forward_flops / peak_flops,
        backward_seconds=backward_flops / peak_flops,
        counters=counters,
        pool_would_raise=planned.pool_would_raise,
        timeline=tuple(
            TimelinePoint(flops, device + tracker.preexisting_bytes, host, in_use, PHASES[phase])
            for flops, device, host, in_use, phase in samples
        ),
    )
    return plan, tuple(planned.saves)
