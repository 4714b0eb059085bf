"""Exact-size pinned host blocks, reused across steps.

Training repeats the same shapes every step, so blocks keyed by their exact byte size are reused
almost always and host RAM stays close to the bytes offloaded (no power-of-two rounding). When
shapes change, idle blocks of sizes no longer asked for are released, so the pool follows the
working set instead of growing with every shape it has seen.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from matepoint._engine.stats import OffloadStats
from matepoint._engine.transport import Channel
from matepoint._errors import PinnedMemoryExhausted
from matepoint._options import ResolvedOptions

__all__ = ["HostBlock", "PinnedPool"]

_IDLE_FLOOR_BYTES = 64 << 20
_IDLE_FRACTION = 0.05


class HostBlock:
    """One host buffer and the side-stream event of its last copy (None when known finished)."""

    __slots__ = ("buffer", "last_event", "nbytes", "pinned")

    def __init__(self, buffer: torch.Tensor, pinned: bool) -> None:
        self.buffer = buffer
        self.nbytes = int(buffer.numel())
        self.pinned = pinned
        self.last_event: Any = None


class PinnedPool:
    """The pinned host blocks of one channel.

    Not thread-safe on its own: the engine calls it under its channel lock.

    Args:
        channel: The channel whose side stream uses these blocks.
    """

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._idle: OrderedDict[int, list[HostBlock]] = OrderedDict()
        self.pinned_bytes = self.in_use_bytes = self.pageable_bytes = 0
        self.reset_counters()
        self.warn_on_fallback = True  # once per pool

    def acquire(self, nbytes: int, options: ResolvedOptions) -> HostBlock:
        """Return a host block of exactly ``nbytes``, pinned unless the policy allows otherwise.

        Args:
            nbytes: Size of the block.
            options: The call's options: pool cap and exhaustion policy, and ``pipelined``
                (copies on the side stream are ordered after the block's previous copy without a
                wait; a synchronous copy waits for it). See Note [Stream ordering], rule 6.

        Returns:
            The block; give it back with :meth:`give_back`.

        Raises:
            PinnedMemoryExhausted: If pinned memory is out and the policy is ``"raise"``.
        """
        idle = self._idle.get(nbytes)
        if idle:
            block = idle.pop()
            if not idle:
                del self._idle[nbytes]
            self.in_use_bytes += nbytes
            self.blocks_reused += 1
            if not options.pipelined and block.last_event is not None:
                self._channel.synchronize(block.last_event)
                block.last_event = None
            return block
        cap = options.pool_cap_bytes
        if cap is not None and self.pinned_bytes + nbytes > cap:
            self.release_idle(target_idle=cap - nbytes - self.in_use_bytes)
            if self.pinned_bytes + nbytes > cap:
                return self._fallback(
                    nbytes,
                    options,
                    f"the pinned pool cap of {cap} bytes is reached ({self.pinned_bytes} bytes "
                    f"pinned, {self.in_use_bytes} in use, {nbytes} more asked)",
                )
        failure: str | None = None
        try:
            buffer = self._channel.allocate_host(nbytes)
        except RuntimeError as error:
            self.release_idle()
            try:
                buffer = self._channel.allocate_host(nbytes)
            except RuntimeError:
                failure = f"allocating {nbytes} bytes of pinned host memory failed: {error}"
        if failure is not None:  # outside the handler: a raise there would chain the RuntimeError
            return self._fallback(nbytes, options, failure)
        self.pinned_bytes += nbytes
        self.in_use_bytes += nbytes
        self.blocks_allocated += 1
        # A new size was just allocated: sizes sitting idle are from shapes no longer asked for.
        self.release_idle(max(_IDLE_FLOOR_BYTES, int(_IDLE_FRACTION * self.in_use_bytes)))
        return HostBlock(buffer, pinned=True)

    def _fallback(self, nbytes: int, options: ResolvedOptions, failure: str) -> HostBlock:
        if options.on_pool_exhausted == "raise":
            raise PinnedMemoryExhausted(
                f"matepoint: {failure}. Raise the cap (matepoint.configure(pool_cap_bytes=...)), "
                "free host memory, or "
                "set on_pool_exhausted='pageable' to continue with slower pageable copies."
            )
        if self.warn_on_fallback:
            self.warn_on_fallback = False
            warnings.warn(
                f"matepoint: {failure}; offloading to pageable host memory from now on when "
                "pinned memory is short (copies are slower). Set on_pool_exhausted='raise' to "
                "make this an error instead.",
                ResourceWarning,
                stacklevel=2,
            )
        self.pageable_fallbacks += 1
        self.pageable_bytes += nbytes
        return HostBlock(self._channel.allocate_pageable(nbytes), pinned=False)

    def reset_counters(self) -> None:
        """Zero the event counts (allocations, reuses, fallbacks); sizes are current values."""
        self.blocks_allocated = self.blocks_reused = self.pageable_fallbacks = 0

    def give_back(self, block: HostBlock) -> None:
        """Return a block; pinned ones become idle for reuse, pageable ones are freed."""
        if not block.pinned:
            self.pageable_bytes -= block.nbytes
            return
        self.in_use_bytes -= block.nbytes
        self._idle.setdefault(block.nbytes, []).append(block)
        self._idle.move_to_end(block.nbytes)

    def release_idle(self, target_idle: int = 0) -> int:
        """Free idle blocks until at most ``target_idle`` bytes are idle, oldest sizes first.

        The oldest sizes are those given back longest ago.

        Returns:
            The bytes freed (0 when no more than ``target_idle`` were idle).
        """
        before = self.pinned_bytes
        while self.pinned_bytes - self.in_use_bytes > target_idle and self._idle:
            nbytes, blocks = next(iter(self._idle.items()))
            block = blocks.pop()
            if not blocks:
                del self._idle[nbytes]
            if block.last_event is not None:
                # The side stream may still copy into or out of this block.
                self._channel.synchronize(block.last_event)
            self.pinned_bytes -= nbytes
        return before - self.pinned_bytes

    def snapshot(self) -> OffloadStats:
        """Return the pool's sizes and event counts as the ``pool_*`` fields of a stats snapshot."""
        return OffloadStats(
            pool_pinned_bytes=self.pinned_bytes,
            pool_in_use_bytes=self.in_use_bytes,
            pool_blocks_allocated=self.blocks_allocated,
            pool_blocks_reused=self.blocks_reused,
            pageable_fallbacks=self.pageable_fallbacks,
        )
