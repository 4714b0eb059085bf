"""Run one training step on the meta device under one strategy, and record what it held.

The step is the user's own code: ``matepoint.checkpoint`` runs as always, except that while the
planning thread runs a step its saved inputs go to the planner's replay of the engine instead of
the real one, and for the no-checkpoint strategy its function runs without torch's checkpoint
around it. See Note [Attaching the planner].

Note [Attaching the planner]
    ``matepoint._checkpoint`` calls the engine through three module globals looked up at call
    time: ``pack`` and ``unpack`` (inside its saved-tensor hooks) and ``torch_checkpoint``. While
    a plan runs they are replaced by wrappers that, on the planning thread only, send saved
    inputs to :class:`~matepoint._plan_engine.SimEngine` (and, for ``"none"``, call the function
    directly); every other thread, and every object the real engine made, goes to the originals.
    Plans run one at a time (a lock), and the originals are put back when the step ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

import matepoint_compat as compat
from matepoint import _checkpoint
from matepoint._options import OffloadSettings
from matepoint._plan_cuda import CudaKernels
from matepoint._plan_engine import SimEngine, SimRecord, Strategy
from matepoint._plan_rules import SavedInput
from matepoint._plan_trace import MemoryTracker, Sample
from matepoint._stats import Counters

__all__ = ["StepRecord", "run_step"]

_TORCH_CHECKPOINT_OPTIONS = _checkpoint._CHECKPOINT_OPTION_NAMES
_ATTACH_POINTS = ("pack", "unpack", "torch_checkpoint")

_lock = threading.RLock()
_local = threading.local()


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one planned step held, moved and computed.

    Attributes:
        strategy: ``"none"``, ``"torch"`` or ``"matepoint"``.
        samples: The timeline (see :data:`matepoint._plan_trace.Sample`).
        baseline_bytes: Device bytes allocated before the step (parameters, inputs, cuBLAS
            workspaces; see Note [cuBLAS workspaces] in ``_plan_trace``).
        parameter_bytes: The part of ``baseline_bytes`` that is parameters.
        forward_end: Index in ``samples`` of the moment forward (and the loss) ended.
        forward_flops: FLOPs of forward and loss.
        total_flops: FLOPs of the whole step (recomputation included).
        counters: The replayed engine's counters (zero unless ``"matepoint"``).
        pinned_bytes: Pinned host bytes the pool holds after the step.
        pageable_bytes: Host bytes that fell back to pageable memory (pool cap reached).
        pool_would_raise: Whether ``on_pool_exhausted="raise"`` would have raised.
        saves: Every checkpoint input matepoint saw, in order.
    """

    strategy: Strategy
    samples: tuple[Sample, ...]
    baseline_bytes: int
    parameter_bytes: int
    forward_end: int
    forward_flops: int
    total_flops: int
    counters: Counters
    pinned_bytes: int
    pageable_bytes: int
    pool_would_raise: bool
    saves: tuple[SavedInput, ...]

    def device_bytes(self, index: int) -> int:
        """Return the absolute device bytes of sample ``index``."""
        return self.samples[index][1] + self.baseline_bytes

    @property
    def peak_bytes(self) -> int:
        """The most device bytes alive at any moment of the step."""
        return max(sample[1] for sample in self.samples) + self.baseline_bytes

    @property
    def held_after_forward_bytes(self) -> int:
        """Device bytes forward left for backward (after forward minus before it)."""
        return self.samples[self.forward_end][1] - self.samples[0][1]


class _Run:
    """The planning thread's current step: which strategy, which engine, which options."""

    def __init__(self, engine: SimEngine, options: OffloadSettings | None) -> None:
        self.engine = engine
        self.options = options


def _current() -> _Run | None:
    run: _Run | None = getattr(_local, "run", None)
    return run


class _TorchCheckpointProxy:
    """``torch.utils.checkpoint`` as matepoint sees it, minus the checkpoint for ``"none"``."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def checkpoint(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        run = _current()
        if run is None or run.engine.strategy != "none":
            return self._module.checkpoint(function, *args, **kwargs)
        kwargs.pop("use_reentrant", None)
        for name in _TORCH_CHECKPOINT_OPTIONS:
            kwargs.pop(name, None)
        return function(*args, **kwargs)


@contextlib.contextmanager
def _attached(run: _Run) -> Iterator[None]:
    """Send this thread's engine calls to ``run``. See Note [Attaching the planner]."""
    missing = [name for name in _ATTACH_POINTS if not hasattr(_checkpoint, name)]
    if missing:
        raise RuntimeError(
            "matepoint.plan cannot attach to this matepoint build: matepoint._checkpoint has no "
            f"{', '.join(missing)}; the planner must follow the checkpoint module's changes"
        )
    with _lock:
        original = {name: getattr(_checkpoint, name) for name in _ATTACH_POINTS}
        pack, unpack = original["pack"], original["unpack"]

        def planned_pack(tensor: torch.Tensor, options: OffloadSettings, pipelined: bool) -> Any:
            current = _current()
            if current is None:
                return pack(tensor, options, pipelined)
            return current.engine.pack(tensor, current.options or options, pipelined)

        def planned_unpack(saved: Any, options: OffloadSettings) -> torch.Tensor:
            if isinstance(saved, SimRecord):
                return saved.engine.unpack(saved, run.options or options)
            if isinstance(saved, torch.Tensor):
                return saved
            result: torch.Tensor = unpack(saved, options)
            return result

        setattr(_checkpoint, "pack", planned_pack)  # noqa: B010  (a module global, not an attribute)
        setattr(_checkpoint, "unpack", planned_unpack)  # noqa: B010
        proxy = _TorchCheckpointProxy(original["torch_checkpoint"])
        setattr(_checkpoint, "torch_checkpoint", proxy)  # noqa: B010
        _local.run = run
        try:
            yield
        finally:
            _local.run = None
            for name, value in original.items():
                setattr(_checkpoint, name, value)


def _adopt_existing(tracker: MemoryTracker, fn: Any, values: Any) -> None:
    """Count what exists before the step: the function's module state and the arguments."""
    module = fn if isinstance(fn, torch.nn.Module) else getattr(fn, "__self__", None)
    if isinstance(module, torch.nn.Module):
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
    device_type: str = "meta",
) -> StepRecord:
    """Run forward and backward of ``fn`` once under ``strategy`` and record its memory.

    Args:
        fn: The model or function; its tensors must be on the meta device.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        strategy: ``"none"``, ``"torch"`` or ``"matepoint"``.
        options: Options every offloading checkpoint uses instead of its own, or None.
        loss_fn: Turns the output into the loss; None sums it.
        device_type: The device standing in for CUDA. Default: ``"meta"``.

    Returns:
        The step's record.
    """
    tracker = MemoryTracker(device_type)
    engine = SimEngine(tracker, strategy, device_type)
    run = _Run(engine, options)
    with _attached(run), compat.meta_checkpointing(), tracker, CudaKernels(tracker, device_type):
        _adopt_existing(tracker, fn, (args, kwargs))
        with torch.enable_grad():
            loss = _loss_of(fn(*args, **kwargs), loss_fn)
        tracker.mark("forward_end")
        forward_flops = tracker.flops
        compat.run_backward(loss)
        del loss
        engine.finish()
        tracker.mark("backward_end")
        tracker.close()
    return StepRecord(
        strategy=strategy,
        samples=tuple(tracker.samples),
        baseline_bytes=tracker.preexisting_bytes,
        parameter_bytes=tracker.parameter_bytes,
        forward_end=tracker.marks["forward_end"],
        forward_flops=forward_flops,
        total_flops=tracker.flops,
        counters=engine.counters,
        pinned_bytes=engine.pool.pinned_bytes,
        pageable_bytes=engine.peak_pageable_bytes,
        pool_would_raise=engine.pool_would_raise,
        saves=tuple(engine.saves),
    )
