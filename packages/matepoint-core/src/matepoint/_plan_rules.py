"""What the planner needs of the offload engine besides its decisions: keep rules, saves, blocks.

See Note [Planner fidelity] in ``matepoint._plan_engine``: the keep rules are
``matepoint._saving``'s own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import torch

from matepoint._plan_trace import MemoryTracker

__all__ = ["Fate", "SavedInput", "SizeOnlyChannel"]

Fate = Literal["offloaded", "shared", "small", "parameter", "other"]


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


class SizeOnlyChannel:
    """A channel whose host blocks are meta tensors: the pool's bookkeeping without memory."""

    def __init__(self, tracker: MemoryTracker) -> None:
        self.device = torch.device("meta")
        self._tracker = tracker

    def allocate_host(self, nbytes: int) -> torch.Tensor:
        self._tracker.paused += 1
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        finally:
            self._tracker.paused -= 1

    allocate_pageable = allocate_host

    def synchronize(self, event: Any) -> float:
        return 0.0
