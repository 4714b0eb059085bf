"""Run one training step on the meta device under one strategy, and report what it held.

The step is the user's own code: ``matepoint.checkpoint`` runs as always, with a planning scope
on the thread (see Note [Planning scope] in ``matepoint._engine.planning_scope``) that sends its
saved inputs to the planner's own engine and, for the no-checkpoint strategy, runs each
checkpointed function directly.

Note [Planner fidelity]
    Rule 1. The planner predicts what matepoint does by running the code that does it: the
        checkpoint, ``matepoint._engine.saving.pack``'s keep rules and
        :class:`~matepoint._engine.channel_engine.ChannelEngine` (dedupe, the stash, release of
        originals, fetches and look-ahead in backward, the exact-size
        :class:`~matepoint._engine.pool.PinnedPool`), attached through the planning scope.
    Rule 2. Only the channel differs: :class:`MetaChannel` copies nothing. Its copies have
        finished when they are queued (a copy back is an empty meta tensor, which the memory
        tracker counts), its host blocks are meta tensors the tracker does not count, and it
        names memory by storage, since every meta tensor's ``data_ptr`` is 0.
    Rule 3. So one assumption differs from a GPU: a copy to the host has finished by the next
        offload (a released original is freed at once, never held by a copy still running),
        which holds whenever the link keeps up with compute.
    ``tests/test_plan_conformance.py`` runs the CPU test transport and the planner on the same
    models and compares every counter.

Note [Planned steps one at a time]
    Rule 1. A planned step changes state that other steps read: backward accumulates into the
        meta model's ``.grad`` and the tracker puts the old ones back when the step ends (Note
        [Bytes before the step] in ``matepoint._planner.trace``); before torch 2.6
        ``compat.meta_checkpointing`` installs and removes a process-wide stand-in module; the
        tracker's cache of meta results is process-wide.
    Rule 2. So :func:`run_step` holds ``_STEP_LOCK`` for the whole step: steps planned from
        several threads (``plan``, ``replan``, ``fastest_under`` on one ``MemoryPlan`` or on
        several over one model) run one after another, each from the state the last one left,
        and answer as a sequential run does.
    Rule 3. The step keeps mutating rather than being made not to: gradients accumulated into
        ``.grad`` are memory the plan must count as a real step holds it, and planning is
        CPU-bound Python under the GIL, so steps in parallel would gain little. The lock is
        reentrant: a step that plans another on its own thread does not wait on itself.
    Example: four threads each calling ``fastest_under`` on one plan get the plan one thread
    alone gets, and the model's ``.grad`` are as before (``tests/test_planning_threads.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
from collections.abc import Callable, Hashable, Iterator
from typing import Any, cast

import torch

import matepoint_compat as compat
from matepoint._engine.channel_engine import ChannelEngine
from matepoint._engine.planning_scope import planning_scope
from matepoint._engine.saving import KeepReason, count_kept
from matepoint._engine.transport import Channel
from matepoint._options import (
    OffloadOptions,
    OffloadSettings,
    ResolvedOptions,
    get_options,
    resolve_over,
)
from matepoint._planner.kernels import CudaKernels
from matepoint._planner.time_model import compute_seconds, link_seconds
from matepoint._planner.trace import PHASES, MemoryTracker

__all__ = ["Planned", "SavedInput", "StrategyPlan", "TimelinePoint", "run_step"]


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


_device_bytes = operator.attrgetter("device_bytes")

# Held by every planned step. See Note [Planned steps one at a time], rule 2.
_STEP_LOCK = threading.RLock()


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
        checkpoint_calls: The non-reentrant checkpoint calls of the step's forward, those
            that ran their function directly included (a budget plan's regions: Note [A plan's
            regions]).
        recomputed_checkpoint_calls: Those of backward: checkpoint calls nested in another's
            recomputation.
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
    checkpoint_calls: int = 0
    recomputed_checkpoint_calls: int = 0

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

        Thinning keeps the highest and the lowest point of every stretch of the timeline
        (at most two per ``max_points``-th of it), so the peak survives.
        """
        fields = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        stride = -(-len(self.timeline) // max_points)
        kept: list[TimelinePoint] = []
        for start in range(0, len(self.timeline), stride):
            window = self.timeline[start : start + stride]
            extremes = (max(window, key=_device_bytes), min(window, key=_device_bytes))
            kept.extend(point for point in window if any(point is e for e in extremes))
        fields["timeline"] = [dataclasses.astuple(point) for point in kept]
        fields["timeline_columns"] = [field.name for field in dataclasses.fields(TimelinePoint)]
        return fields


@dataclasses.dataclass(frozen=True)
class SavedInput:
    """One tensor a checkpoint saved for recomputation, and what matepoint did with it.

    Attributes:
        index: Order of the save in the step (0 for the first).
        nbytes: Its bytes.
        shape: Its shape.
        dtype: Its dtype, as a string (``"torch.bfloat16"``).
        fate: ``"offloaded"`` (copied to host memory), ``"shared"`` (already offloaded by another
            checkpoint: dedupe), ``"small"`` (below ``min_offload_bytes``, kept on the device),
            ``"parameter"`` or ``"other"`` (kept: not on the device, not dense, a subclass...).
    """

    index: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    fate: str


# A planned step, and every checkpoint input it saved, in order.
Planned = tuple[StrategyPlan, tuple[SavedInput, ...]]


class MetaChannel:
    """A transport, and its one channel, over meta tensors that moves nothing.

    See Note [Planner fidelity], rules 2 and 3.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        self.allocate_host = self.allocate_pageable = tracker.allocate_uncounted

    def channel_key(self, tensor: torch.Tensor) -> Hashable | None:
        return "plan" if tensor.device.type == "meta" else None

    def channel(self, tensor: torch.Tensor) -> Channel:
        return self

    def memory_key(self, tensor: torch.Tensor) -> Hashable:
        return id(tensor.untyped_storage()), tensor.storage_offset()

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.copy_in_now(host), None

    def copy_in_now(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="meta")

    def is_complete(self, event: Any) -> bool:
        return True

    def _nothing(self, *args: Any) -> None:
        """Queue, mark or release nothing: the meta device copies nothing and keeps no streams."""

    def _no_wait(self, *args: Any) -> float:
        return 0.0

    current_compute = copy_out = copy_out_now = hand_to_compute = release_original = _nothing
    synchronize = wait_seconds = _no_wait


class PlannedStep:
    """One planned step's ``Planning`` (``matepoint._engine.planning_scope``): engine, saves.

    Args:
        strategy: ``"matepoint"`` offloads; ``"torch"`` checkpoints without offloading;
            ``"none"`` runs each checkpointed function directly.
        options: Settings for every offloading call instead of its own, or None.
        context_fn: A ``context_fn`` for every non-reentrant checkpoint call instead of its
            own, or None.
        checkpointed_calls: How many of the step's first non-reentrant checkpoint calls
            checkpoint; the later ones run their function directly (a budget plan's unchecked
            last regions), or None for all.

    Attributes:
        tracker: The step's memory tracker (it reads the host pool at every sample).
        checkpoint_calls: The non-reentrant checkpoint calls of forward so far.
        recomputed_checkpoint_calls: Those of backward so far, once ``in_backward`` is set.
        in_backward: Whether the step's backward has begun.
    """

    def __init__(
        self,
        strategy: str,
        options: OffloadSettings | None,
        context_fn: Callable[[], Any] | None,
        in_force: OffloadSettings | None = None,
        checkpointed_calls: int | None = None,
    ) -> None:
        self.strategy = strategy
        self._in_force = in_force
        self._checkpointed_calls = checkpointed_calls
        self.checkpoint_calls = self.recomputed_checkpoint_calls = 0
        self.in_backward = False
        self.context_fn = context_fn
        self.tracker = MemoryTracker(self._host)
        channel = MetaChannel(self.tracker)
        self.engine = ChannelEngine(channel, channel)
        self.engine.pool.warn_on_fallback = False
        self._override = {} if options is None else dataclasses.asdict(options)
        self.saves: list[SavedInput] = []
        self.raise_policy = False
        self.peak_pageable_bytes = 0

    def options_for(
        self, offload: OffloadOptions | bool | None, pipeline: bool
    ) -> ResolvedOptions | None:
        # The call's own choices over the settings the plan runs under: a search's candidate
        # (Note [Settings a search plans under] in matepoint._planner.memory_plan), else the
        # process's.
        in_force = self._in_force if self._in_force is not None else get_options()
        call = resolve_over(in_force, offload, pipeline)
        if call is None or self.strategy != "matepoint":
            return None
        call = dataclasses.replace(call, **self._override)
        # The plan reports that the step would raise (pool_would_raise) and goes on.
        self.raise_policy |= call.on_pool_exhausted == "raise"
        return dataclasses.replace(call, on_pool_exhausted="pageable")

    def saved(self, tensor: torch.Tensor, fate: str) -> None:
        if fate not in ("offloaded", "shared"):
            count_kept(self.engine.counters, cast(KeepReason, fate))
        if nbytes := tensor.numel() * tensor.element_size():
            shape, dtype = tuple(tensor.shape), str(tensor.dtype)
            self.saves.append(SavedInput(len(self.saves), nbytes, shape, dtype, fate))

    def runs_checkpointed(self) -> bool:
        if self.in_backward:  # nested in a recomputation: as its forward call ran
            self.recomputed_checkpoint_calls += 1
            return True
        self.checkpoint_calls += 1
        limit = self._checkpointed_calls
        return limit is None or self.checkpoint_calls <= limit

    def _host(self) -> tuple[int, int]:
        pool = self.engine.pool
        self.peak_pageable_bytes = max(self.peak_pageable_bytes, pool.pageable_bytes)
        return pool.pinned_bytes + pool.pageable_bytes, pool.in_use_bytes + pool.pageable_bytes


def _adopt_existing(tracker: MemoryTracker, fn: Any, values: Any) -> None:
    """Count what exists before the step: the function's module state and the arguments."""
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    state = [*module.parameters(), *module.buffers()] if isinstance(module, torch.nn.Module) else []
    if devices := {tensor.device.type for tensor in state} - {"meta"}:
        raise ValueError(
            "matepoint.plan runs the step on the meta device, where tensors hold no memory, "
            f"but the model has parameters or buffers on {', '.join(devices)}; "
            "build it under `with torch.device('meta'):` (or pass device='meta')"
        )
    tracker.watch((state, [tensor.grad for tensor in state], values), preexisting=True)


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
    return sum(terms[1:], terms[0])


@contextlib.contextmanager
def _value_reads_named() -> Iterator[None]:
    """Name the cause when the step reads a tensor's value, which a meta tensor does not have."""
    try:
        yield
    except RuntimeError as error:
        if "cannot be called on meta tensors" not in str(error):
            raise
        raise RuntimeError(
            "the planned step reads a tensor's value (.item(), bool(), a branch on a tensor), "
            f"which planning on the meta device cannot: it has shapes only ({error}). Remove "
            "the read from the planned step or answer it as the real step would; see the "
            "planner's limits in docs/planner.md"
        ) from error


def _counters(engine: ChannelEngine) -> dict[str, int]:
    """The planned engine's :class:`matepoint.OffloadStats` after the step, by name."""
    stats = engine.pool.snapshot()
    stats.add(engine.counters)
    stats.live_records, stats.device_bytes_held = engine.live_records(), engine.held_bytes()
    return {name: int(value) for name, value in dataclasses.asdict(stats).items()}


def run_step(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor] | None,
    link_bandwidth: float,
    peak_flops: float,
    strategy: str,
    options: OffloadSettings | None,
    context_fn: Callable[[], Any] | None = None,
    in_force: OffloadSettings | None = None,
    checkpointed_calls: int | None = None,
) -> Planned:
    """Run forward and backward of ``fn`` once under ``strategy`` and report its memory.

    Args:
        fn: The model or function, its tensors on the meta device; ``args``, ``kwargs``: its
            arguments; ``loss_fn``: turns the output into the loss (None sums it).
        link_bandwidth: Bytes/s each way, for link times; peak_flops: FLOP/s, for compute.
        strategy: ``"none"``, ``"torch"`` or ``"matepoint"``.
        options: Settings every offloading checkpoint uses instead of its own, or None.
        context_fn: A ``context_fn`` for every non-reentrant checkpoint call instead of its
            own (a budget plan's selective-checkpoint policy), or None. Default: None.
        in_force: The settings each call's own choices are laid over, instead of the process's.
        checkpointed_calls: How many first non-reentrant calls checkpoint (None: all).

    Returns:
        The step's plan, and every checkpoint input matepoint saw, in order.
    """
    planned = PlannedStep(strategy, options, context_fn, in_force, checkpointed_calls)
    tracker, engine = planned.tracker, planned.engine
    with (
        _STEP_LOCK,  # See Note [Planned steps one at a time], rule 2.
        _value_reads_named(),
        planning_scope(planned),
        compat.meta_checkpointing(),
        tracker,
        CudaKernels(tracker),
    ):
        _adopt_existing(tracker, fn, (args, kwargs))
        with torch.enable_grad():
            loss = _loss_of(fn(*args, **kwargs), loss_fn)
        forward_flops, forward_end_bytes = tracker.end_phase()[:2]
        planned.in_backward = True
        compat.run_backward(loss)
        del loss
        engine.settle(block=False)  # what died at the end of the step, as stats() settles it
        tracker.end_phase()
        tracker.close()
    counters = _counters(engine)
    baseline = tracker.preexisting_bytes
    timeline = tuple(
        TimelinePoint(flops, device + baseline, host, in_use, PHASES[phase])
        for flops, device, host, in_use, phase in tracker.samples
    )
    backward_flops = tracker.flops - forward_flops
    to_host, to_device = counters["bytes_offloaded"], counters["bytes_fetched"]
    plan = StrategyPlan(
        strategy=strategy,
        peak_bytes=max(point.device_bytes for point in timeline),
        baseline_bytes=baseline,
        parameter_bytes=tracker.parameter_bytes,
        held_after_forward_bytes=forward_end_bytes,  # the step starts at 0
        pinned_bytes=engine.pool.pinned_bytes,
        pageable_bytes=planned.peak_pageable_bytes,
        bytes_to_host=to_host,
        bytes_to_device=to_device,
        forward_flops=forward_flops,
        backward_flops=backward_flops,
        to_host_seconds=link_seconds(to_host, link_bandwidth),
        to_device_seconds=link_seconds(to_device, link_bandwidth),
        forward_seconds=compute_seconds(forward_flops, peak_flops),
        backward_seconds=compute_seconds(backward_flops, peak_flops),
        counters=counters,
        pool_would_raise=planned.raise_policy and engine.pool.pageable_fallbacks > 0,
        timeline=timeline,
        checkpoint_calls=planned.checkpoint_calls,
        recomputed_checkpoint_calls=planned.recomputed_checkpoint_calls,
    )
    return plan, tuple(planned.saves)
