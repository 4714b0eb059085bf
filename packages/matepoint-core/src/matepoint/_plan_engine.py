"""The planner's engine: matepoint's own ``ChannelEngine``, over a channel that moves nothing.

Note [Planner fidelity]
    The planner predicts what matepoint does by running the code that does it: the checkpoint,
    ``matepoint._saving.pack``'s keep rules and :class:`~matepoint._engine.ChannelEngine` (dedupe,
    the stash, release of originals, fetches and look-ahead in backward, the exact-size
    :class:`~matepoint._pool.PinnedPool`), attached through the planning scope (see Note
    [Planning scope] in ``matepoint._registry``). Only the channel differs: :class:`MetaChannel`
    copies nothing. Its copies have finished when they are queued (a copy back is an empty meta
    tensor, which the memory tracker counts), its host blocks are meta tensors the tracker does
    not count, and it names memory by storage, since every meta tensor's ``data_ptr`` is 0. So one
    assumption differs from a GPU: a copy to the host has finished by the next offload (a
    released original is freed at once, never held by a copy still running), which holds
    whenever the link keeps up with compute. ``tests/test_plan_conformance.py`` runs the CPU
    test transport and the planner on the same models and compares every counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any, Literal, cast

import torch

from matepoint._engine import ChannelEngine
from matepoint._options import OffloadSettings, ResolvedOptions
from matepoint._plan_trace import MemoryTracker
from matepoint._saving import KeepReason, count_kept
from matepoint._transport import Channel

__all__ = ["Fate", "MetaChannel", "PlannedStep", "SavedInput", "Strategy"]

Strategy = Literal["none", "torch", "matepoint"]
Fate = Literal["offloaded", "shared", "small", "parameter", "other"]
_SETTING_NAMES = tuple(field.name for field in dataclasses.fields(OffloadSettings))


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
    fate: Fate


class MetaChannel:
    """A channel over meta tensors that moves nothing. See Note [Planner fidelity]."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self._tracker = tracker

    def channel_key(self, tensor: torch.Tensor) -> Hashable | None:
        return "plan" if tensor.device.type == "meta" else None

    def channel(self, tensor: torch.Tensor) -> Channel:
        return self

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self._tracker.paused += 1
        try:
            block = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        finally:
            self._tracker.paused -= 1
        self._tracker.exclude(block)
        return block

    allocate_pageable = allocate_host

    def current_compute(self) -> Any:
        return None

    def memory_key(self, tensor: torch.Tensor) -> Hashable:
        return id(tensor.untyped_storage()), tensor.storage_offset()

    def copy_out(self, source: torch.Tensor, host: torch.Tensor, compute: Any) -> Any:
        return None

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.copy_in_now(host), None

    def copy_out_now(self, source: torch.Tensor, host: torch.Tensor) -> None:
        pass

    def copy_in_now(self, host: torch.Tensor) -> torch.Tensor:
        return torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device="meta")

    def hand_to_compute(self, tensor: torch.Tensor, event: Any, measure: bool) -> Any:
        return None

    def release_original(self, tensor: torch.Tensor, compute: Any, copying: bool) -> None:
        pass

    def is_complete(self, event: Any) -> bool:
        return True

    def synchronize(self, event: Any) -> float:
        return 0.0

    def wait_seconds(self, token: Any, block: bool) -> float | None:
        return 0.0


class PlannedStep:
    """One planned step's :class:`matepoint._registry.Planning`: its engine, options and saves.

    Args:
        tracker: The step's memory tracker (it reads the host pool at every sample).
        strategy: ``"matepoint"`` offloads; ``"torch"`` checkpoints without offloading;
            ``"none"`` runs each checkpointed function directly.
        options: Settings for every offloading call instead of its own, or None.
        context_fn: A ``context_fn`` for every non-reentrant checkpoint call instead of its
            own, or None. Default: None.
    """

    def __init__(
        self,
        tracker: MemoryTracker,
        strategy: Strategy,
        options: OffloadSettings | None,
        context_fn: Callable[[], Any] | None = None,
    ) -> None:
        self.strategy = strategy
        self.context_fn = context_fn
        channel = MetaChannel(tracker)
        self.engine = ChannelEngine(channel, channel)
        self.engine.pool.warn_on_fallback = False
        self._override = (
            None if options is None else {name: getattr(options, name) for name in _SETTING_NAMES}
        )
        self.saves: list[SavedInput] = []
        self.raise_policy = False
        self.peak_pageable_bytes = 0
        tracker.host = self._host

    def options_for(self, call: ResolvedOptions | None) -> ResolvedOptions | None:
        if call is None or self.strategy != "matepoint":
            return None
        if self._override is not None:
            call = dataclasses.replace(call, **self._override)
        if call.on_pool_exhausted == "raise":
            # The plan reports that the step would raise (pool_would_raise) and goes on.
            self.raise_policy = True
            call = dataclasses.replace(call, on_pool_exhausted="pageable")
        return call

    def saved(self, tensor: torch.Tensor, fate: str) -> None:
        if fate not in ("offloaded", "shared"):
            count_kept(self.engine.counters, cast(KeepReason, fate))
        if tensor.numel():
            nbytes = tensor.numel() * tensor.element_size()
            shape, dtype = tuple(tensor.shape), str(tensor.dtype)
            self.saves.append(SavedInput(len(self.saves), nbytes, shape, dtype, cast(Fate, fate)))

    @property
    def pool_would_raise(self) -> bool:
        """Whether ``on_pool_exhausted="raise"`` was in force and the pool fell back."""
        return self.raise_policy and self.engine.pool.pageable_fallbacks > 0

    def _host(self) -> tuple[int, int]:
        pool = self.engine.pool
        self.peak_pageable_bytes = max(self.peak_pageable_bytes, pool.pageable_bytes)
        return pool.pinned_bytes + pool.pageable_bytes, pool.in_use_bytes + pool.pageable_bytes
