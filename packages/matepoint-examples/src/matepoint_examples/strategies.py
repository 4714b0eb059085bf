"""The registry of ways to run the example models: no checkpoint, torch's, matepoint's and peers.

A :class:`Strategy` is everything that differs between the compared runs: the ``checkpoint_fn``
each block goes through, a context entered around each forward (peers that offload through
saved-tensor hooks, the copies-only floor's per-step numbering), and a session entered once
around a whole run (matepoint on a CPU, where a test transport makes CPU tensors count as device
tensors so the offload path really runs). Because a strategy is only these three things, one
model can run under several strategies in turn, which is how ``matepoint-bench`` pairs them.

Three strategies compile the whole model with ``torch.compile`` (``torch-compile``,
``torch-compiled-offload``, ``matepoint-compile``); a strategy's ``compiled`` spec says how, and
:meth:`Strategy.forward_fn` gives each its own compiled forward of a model (see
:mod:`matepoint_examples.bench._compiled`).

Besides the peers, the registry holds probes (``probe=True``, run only when named): the
copies-only floor and its variants (see :mod:`matepoint_examples.bench._floor`), a forward with the
link kept busy, and matepoint with one feature switched off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor

import matepoint
import matepoint_compat
from matepoint._compiled import forward_window, inductor_order
from matepoint_examples.bench._compiled import (
    MARKS,
    CompiledForward,
    CompileSpec,
    torch_offload_session,
    torch_offload_settings,
    torch_offload_unavailable,
)
from matepoint_examples.bench._floor import CopyFloor, LinkBusy
from matepoint_examples.models import CheckpointFn, no_checkpoint

__all__ = ["DEFAULT_STRATEGIES", "STRATEGIES", "Strategy", "get_strategy", "strategy_names"]


def _torch_checkpoint(function: Callable[..., Tensor], /, *args: Tensor) -> Any:
    """Run ``function`` under ``torch.utils.checkpoint.checkpoint`` (non-reentrant)."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def _matepoint_checkpoint(function: Callable[..., Tensor], /, *args: Tensor) -> Any:
    """Run ``function`` under ``matepoint.checkpoint`` with the side-stream pipeline."""
    return matepoint.checkpoint(function, *args, use_reentrant=False, pipeline=True)


def _matepoint_checkpoint_nopipeline(function: Callable[..., Tensor], /, *args: Tensor) -> Any:
    """Run ``function`` under ``matepoint.checkpoint`` with synchronous copies."""
    return matepoint.checkpoint(function, *args, use_reentrant=False, pipeline=False)


def _no_wait_timing() -> AbstractContextManager[object]:
    """Switch matepoint's wait timing off around one forward (its backward keeps the choice).

    Set once per forward, not per call, so the probe's host cost per checkpoint is matepoint's.
    """
    return matepoint.options(measure_waits=False)


def _matepoint_stats() -> dict[str, Any]:
    """Return ``matepoint.stats()`` as a plain dict (JSON-ready)."""
    return dataclasses.asdict(matepoint.stats())


_LINK_BUSY = LinkBusy()


def _nothing() -> AbstractContextManager[object]:
    """Return a context that does nothing (strategies without a per-forward context)."""
    return contextlib.nullcontext()


def _no_session(device: torch.device) -> AbstractContextManager[object]:
    """Return a context that does nothing (strategies without a per-run session)."""
    return contextlib.nullcontext()


@contextlib.contextmanager
def _matepoint_session(device: torch.device) -> Iterator[None]:
    """Make matepoint really offload for the duration of a run, whatever the device.

    On an accelerator matepoint's own transport is used and nothing changes. On a CPU there is
    no device memory to free, so matepoint would skip every tensor; the test transport makes CPU
    tensors count as device tensors, and the minimum size is dropped so the small CPU
    configurations offload every block input.
    """
    if device.type != "cpu":
        yield
        return
    from matepoint.testing import CPUTestTransport, use_transport

    with use_transport(CPUTestTransport()), matepoint.options(min_offload_bytes=0):
        yield


@contextlib.contextmanager
def _matepoint_compiled_session(device: torch.device) -> Iterator[None]:
    """matepoint's session with its opt-in compiled path on (``compiled_offload=True``).

    Where the installed torch lacks what the compiled path takes
    (``matepoint_compat.COMPILED_OFFLOAD``), matepoint runs eagerly under compile, with a
    graph break at each checkpoint; the strategy's row says which.
    """
    with _matepoint_session(device), matepoint.options(compiled_offload=True):
        yield


def _matepoint_compiled_report() -> dict[str, Any]:
    """Say whether matepoint's compiled path was taken, and what its forward copy window did.

    The window counts are the process's (graphs asked for, copies found, waits moved later; see
    Note [The forward copy window] in ``matepoint._compiled.forward_window``), and so are the
    graphs inductor compiled in their own order (Note [Inductor's peak-memory reorder] in
    ``matepoint._compiled.inductor_order``; a graph loaded from AOTAutograd's cache counts in
    neither).
    """
    taken = matepoint_compat.COMPILED_OFFLOAD
    info: dict[str, Any] = {"matepoint_path": "compiled" if taken else "eager, graph breaks"}
    if taken:
        counts = forward_window.FORWARD_WINDOW_COUNTS
        info["forward_window"] = (
            f"{counts.waits_moved} of {counts.copies} waits moved in {counts.graphs} graphs"
        )
        order = inductor_order.INDUCTOR_ORDER_COUNTS
        info["inductor_order"] = (
            f"kept in {order.compiled} of {order.marked} graphs (peak-memory reorder off)"
        )
    return info


def _torch_offload_report() -> dict[str, Any]:
    """Return what the offload pass marked in the graphs compiled so far (JSON-ready)."""
    return {"marked_for_offload": MARKS.values, "marked_bytes": MARKS.bytes}


def _save_on_cpu() -> AbstractContextManager[object]:
    """Return torch's ``save_on_cpu(pin_memory=True)``, the built-in peer."""
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def _torchtune_offload() -> AbstractContextManager[object]:
    """Return torchtune's ``OffloadActivations`` with its streams on, the strongest peer."""
    from torchtune.training import OffloadActivations  # type: ignore[import-not-found,unused-ignore]

    ctx: AbstractContextManager[object] = OffloadActivations(use_streams=True)
    return ctx


@dataclass(frozen=True)
class Strategy:
    """One way of running a model, as compared by the demo and the benchmark.

    Args:
        name: Registry key, e.g. ``"matepoint"``.
        summary: One line for tables and ``--help``.
        checkpoint_fn: Passed to the model; runs each block.
        forward_context: Factory of a context entered around each forward pass.
        session: Factory of a context entered once around a whole run, given the device.
        uses_matepoint: Whether matepoint's statistics mean anything for this strategy.
        requires: Modules that must be importable, e.g. ``("torchtune",)``.
        needs_cuda: Whether the strategy only runs on a CUDA device.
        stats: Returns the strategy's own counters of what it moved (JSON-ready), if it has any.
        reset_stats: Sets those counters back to zero.
        probe: A diagnostic variant, not a way anyone would train: run only when named.
        compiled: How the strategy compiles the whole model, or ``None`` (eager).
    """

    name: str
    summary: str
    checkpoint_fn: CheckpointFn
    forward_context: Callable[[], AbstractContextManager[object]] = _nothing
    session: Callable[[torch.device], AbstractContextManager[object]] = _no_session
    uses_matepoint: bool = False
    requires: tuple[str, ...] = field(default=())
    needs_cuda: bool = False
    stats: Callable[[], dict[str, Any]] | None = None
    reset_stats: Callable[[], None] | None = None
    probe: bool = False
    compiled: CompileSpec | None = None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Say why the strategy cannot run on ``device``, or ``None`` if it can.

        Args:
            device: The device the run would use.

        Returns:
            A short reason (used as the "skipped" note), or ``None``.
        """
        for module in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install {module})"
        if self.needs_cuda and device.type != "cuda":
            return "needs a CUDA device"
        if self.compiled is not None:
            return self.compiled.unavailable(device)
        return None

    def forward_fn(
        self, loss: Callable[[], Tensor], device: torch.device, backend: str | None = None
    ) -> Callable[[], Tensor]:
        """Return what runs one forward of a model under this strategy.

        Args:
            loss: The model's forward (returns the loss).
            device: Where the model runs.
            backend: The ``torch.compile`` backend of a compiled strategy. Default: inductor on
                CUDA, aot_eager elsewhere.

        Returns:
            ``loss`` itself, or for a compiled strategy a :class:`CompiledForward` of it (its
            own compiled copy: call it once, untimed, to compile).
        """
        if self.compiled is None:
            return loss
        return CompiledForward(loss, self.name, self.compiled, device, backend)


def _floor_strategy(
    name: str, description: str, floor: CopyFloor, *, probe: bool = False
) -> Strategy:
    """A strategy that runs torch's checkpoint with ``floor``'s copies (see ``_floor``)."""
    return Strategy(
        name,
        description,
        floor.checkpoint,
        forward_context=floor.step,
        session=floor.session,
        stats=floor.stats,
        reset_stats=floor.reset_stats,
        probe=probe,
    )


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("none", "no checkpoint: every activation stays on the device", no_checkpoint),
        Strategy("torch", "torch.utils.checkpoint around each block", _torch_checkpoint),
        Strategy(
            "save_on_cpu",
            "torch save_on_cpu(pin_memory=True) around torch-checkpointed blocks",
            _torch_checkpoint,
            forward_context=_save_on_cpu,
        ),
        Strategy(
            "torchtune",
            "torchtune OffloadActivations around torch-checkpointed blocks",
            _torch_checkpoint,
            forward_context=_torchtune_offload,
            requires=("torchtune",),
            needs_cuda=True,
        ),
        Strategy(
            "matepoint",
            "matepoint.checkpoint, copies pipelined on a side stream",
            _matepoint_checkpoint,
            session=_matepoint_session,
            uses_matepoint=True,
            stats=_matepoint_stats,
            reset_stats=matepoint.reset_stats,
        ),
        Strategy(
            "matepoint-nopipeline",
            "matepoint.checkpoint(pipeline=False), synchronous copies",
            _matepoint_checkpoint_nopipeline,
            session=_matepoint_session,
            uses_matepoint=True,
            stats=_matepoint_stats,
            reset_stats=matepoint.reset_stats,
        ),
        Strategy(
            "torch-compile",
            "torch.utils.checkpoint around each block, the whole model under torch.compile",
            _torch_checkpoint,
            compiled=CompileSpec(),
        ),
        Strategy(
            "torch-compiled-offload",
            "torch-compile plus torch's compiled activation offloading of the block inputs",
            _torch_checkpoint,
            session=torch_offload_session,
            compiled=CompileSpec(
                settings=torch_offload_settings,
                unavailable=torch_offload_unavailable,
                report=_torch_offload_report,
            ),
        ),
        Strategy(
            "matepoint-compile",
            "matepoint.checkpoint, the whole model under torch.compile (compiled_offload=True)",
            _matepoint_checkpoint,
            session=_matepoint_compiled_session,
            uses_matepoint=True,
            stats=_matepoint_stats,
            reset_stats=matepoint.reset_stats,
            compiled=CompileSpec(report=_matepoint_compiled_report),
        ),
        _floor_strategy(
            "copies-floor",
            "torch.utils.checkpoint plus the same copies on a side stream, no bookkeeping",
            CopyFloor(),
        ),
        _floor_strategy(
            "copies-floor-out",
            "copies-floor with the forward's copies only (nothing copied back)",
            CopyFloor(copy_in=False),
            probe=True,
        ),
        _floor_strategy(
            "copies-floor-refetch",
            "copies-floor copying a shared input back at every unpack, not once per step",
            CopyFloor(refetch=True),
            probe=True,
        ),
        Strategy(
            "link-busy",
            "torch.utils.checkpoint with the link saturated by unrelated copies during forward",
            _torch_checkpoint,
            forward_context=_LINK_BUSY.forward,
            needs_cuda=True,
            probe=True,
        ),
        Strategy(
            "matepoint-nowaittiming",
            "matepoint.checkpoint with measure_waits=False (no timing events)",
            _matepoint_checkpoint,
            forward_context=_no_wait_timing,
            session=_matepoint_session,
            uses_matepoint=True,
            stats=_matepoint_stats,
            reset_stats=matepoint.reset_stats,
            probe=True,
        ),
    )
}
"""Every strategy by name, in the order tables show them."""

DEFAULT_STRATEGIES = tuple(
    name for name, s in STRATEGIES.items() if not s.probe and s.compiled is None
)
"""What ``matepoint-bench`` runs unless told otherwise: every strategy but the probes and the
compiled ones (a whole-model compile of a deep stack takes minutes: name them to run them)."""


def strategy_names() -> list[str]:
    """Return the registered strategy names in table order.

    Returns:
        The names.
    """
    return list(STRATEGIES)


def get_strategy(name: str) -> Strategy:
    """Look a strategy up by name.

    Args:
        name: A key of :data:`STRATEGIES`.

    Returns:
        The strategy.

    Raises:
        KeyError: If there is no such strategy; the message lists the known names.
    """
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
