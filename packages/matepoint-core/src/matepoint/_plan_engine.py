"""The offload engine's decisions, replayed on meta tensors for the planner.

The real engine cannot run on meta tensors (all their storages share the data pointer 0, which
its dedupe key uses, and it has no device to copy to), so the planner replays its rules here:
which saved inputs stay where they are, dedupe, the stash of newest originals, release of the
others at the next offload, fetches in backward with look-ahead, and the exact-size pinned
pool (the real :class:`~matepoint._pool.PinnedPool`, over blocks that hold no memory).

Note [Planner fidelity]
    This module mirrors ``matepoint._saving`` and ``matepoint._engine``: ``pack``'s keep rules,
    ``ChannelEngine.offload``, ``_release_held``, ``restore`` (a shared record fetched once per
    backward pass, see Note [Shared records] there) and ``_prefetch_scan``. One assumption differs
    from a GPU: a copy to the host has finished by the next offload (so a released original is
    freed at once, never held by a copy still running), which holds whenever the link keeps up
    with compute.
    ``tests/test_plan.py`` runs the real engine (CPU test transport) and the planner on the same
    models and compares their counters; a change to the engine's rules must be mirrored here.
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
import weakref
from typing import Any, Literal, cast

import torch

import matepoint_compat as compat
from matepoint._options import OffloadSettings
from matepoint._plan_rules import Fate, SavedInput, SizeOnlyChannel
from matepoint._plan_trace import MemoryTracker
from matepoint._pool import HostBlock, PinnedPool
from matepoint._saving import _is_dense as is_dense
from matepoint._saving import count_kept, keep_reason
from matepoint._stats import Counters
from matepoint._transport import Channel

__all__ = ["SimEngine", "SimRecord", "Strategy"]

Strategy = Literal["none", "torch", "matepoint"]

_PREFETCH_SCAN_LIMIT = 64


class SimRecord:
    """The planner's stand-in for :class:`matepoint._records.Record` (no host copy)."""

    __slots__ = (
        "__weakref__",
        "block",
        "device_tensor",
        "dtype",
        "engine",
        "fetched",
        "key",
        "last_use",
        "nbytes",
        "original",
        "packs",
        "pipelined",
        "prefetched",
        "sequence",
        "shape",
        "stride",
        "unpacks",
    )

    def __init__(
        self,
        engine: SimEngine,
        sequence: int,
        tensor: torch.Tensor,
        key: tuple[Any, ...],
        block: HostBlock,
        pipelined: bool,
    ) -> None:
        self.engine = engine
        self.sequence = sequence
        self.device_tensor: torch.Tensor | None = tensor
        self.original = weakref.ref(tensor)
        self.key = key
        self.block = block
        self.pipelined = pipelined
        self.nbytes = tensor.numel() * tensor.element_size()
        self.shape = tuple(tensor.shape)
        self.stride = tensor.stride()
        self.dtype = tensor.dtype
        self.prefetched: torch.Tensor | None = None
        self.fetched: torch.Tensor | None = None
        self.unpacks = 0
        self.packs = 1
        self.last_use = sequence

    def fresh_copy(self) -> torch.Tensor:
        """Allocate the device tensor a fetch would copy into."""
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")

    def __del__(self) -> None:
        # Like the real record: hand the block back at the engine's next operation.
        self.engine.graveyard.append((self.block, self.key, self.sequence))


class SimEngine:
    """Replays one device engine's decisions for one strategy. See Note [Planner fidelity].

    Args:
        tracker: The step's memory tracker (told about the pinned pool).
        strategy: ``"matepoint"`` offloads; ``"torch"`` and ``"none"`` keep every saved tensor.
        device_type: The device whose tensors matepoint would offload.
    """

    def __init__(self, tracker: MemoryTracker, strategy: Strategy, device_type: str) -> None:
        self.tracker = tracker
        self.strategy = strategy
        self.device_type = device_type
        self.pool = PinnedPool(cast(Channel, SizeOnlyChannel(tracker)))
        self.counters = Counters()
        self.saves: list[SavedInput] = []
        self.graveyard: list[tuple[HostBlock, tuple[Any, ...], int]] = []
        self.pool_would_raise = False
        self.peak_pageable_bytes = 0
        self._sequence = 0
        self._order: list[int] = []
        self._records: dict[int, weakref.ref[SimRecord]] = {}
        self._by_key: dict[tuple[Any, ...], weakref.ref[SimRecord]] = {}
        self._held: list[weakref.ref[SimRecord]] = []
        self._shared: list[weakref.ref[SimRecord]] = []

    # -- forward ---------------------------------------------------------------------------

    def _keep_reason(self, tensor: torch.Tensor, options: OffloadSettings) -> Fate | None:
        """``matepoint._saving.pack``'s rules: why a saved tensor stays where it is, or None."""
        reason = keep_reason(tensor, options.min_offload_bytes)
        if reason is None:
            if tensor.device.type == self.device_type and is_dense(tensor):
                return None
            reason = "other"
        count_kept(self.counters, reason)
        return "small" if reason == "empty" else reason

    def pack(self, tensor: torch.Tensor, options: OffloadSettings, pipelined: bool) -> Any:
        """Return what autograd keeps for a saved checkpoint input under this strategy."""
        if self.strategy != "matepoint":
            return tensor
        self._settle()
        reason = self._keep_reason(tensor, options)
        if reason is not None:
            if tensor.numel():
                self._note(tensor, reason)
            return tensor
        key = (
            id(tensor.untyped_storage()),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        shared_ref = self._by_key.get(key)
        shared = shared_ref() if shared_ref is not None else None
        if shared is not None and shared.original() is not None:
            self.counters.dedupe_hits += 1
            shared.packs += 1
            shared.last_use = self._sequence
            if shared.packs == 2:
                self._shared.append(weakref.ref(shared))
            self._note(tensor, "shared")
            return shared
        nbytes = tensor.numel() * tensor.element_size()
        block = self._acquire(nbytes, options, pipelined)
        self._sequence += 1
        record = SimRecord(self, self._sequence, tensor, key, block, pipelined)
        self._release_held(options)
        reference = weakref.ref(record)
        self._records[record.sequence] = reference
        self._order.append(record.sequence)
        self._by_key[key] = reference
        self._held.append(reference)
        self.counters.offloads += 1
        self.counters.bytes_offloaded += nbytes
        self._note(tensor, "offloaded")
        return record

    def _note(self, tensor: torch.Tensor, fate: Fate) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.saves.append(
            SavedInput(len(self.saves), nbytes, tuple(tensor.shape), str(tensor.dtype), fate)
        )

    def _acquire(self, nbytes: int, options: OffloadSettings, pipelined: bool) -> HostBlock:
        if options.on_pool_exhausted == "raise":
            options = dataclasses.replace(options, on_pool_exhausted="pageable")
            raising = True
        else:
            raising = False
        fallbacks = self.pool.pageable_fallbacks
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            block = self.pool.acquire(nbytes, options, on_side_stream=pipelined)
        if raising and self.pool.pageable_fallbacks > fallbacks:
            self.pool_would_raise = True
        self._host_changed()
        return block

    def _release_held(self, options: OffloadSettings) -> None:
        """Mirror ``ChannelEngine._release_held`` with every copy already finished."""
        alive = [
            record
            for record in (reference() for reference in self._held)
            if record is not None and record.device_tensor is not None
        ]
        held_bytes = sum(record.nbytes for record in alive)
        kept: list[weakref.ref[SimRecord]] = []
        for record in alive:
            if held_bytes <= options.stash_bytes:
                kept.append(weakref.ref(record))
                continue
            tensor = record.device_tensor
            assert tensor is not None
            use_count = compat.storage_use_count(tensor)
            del tensor
            record.device_tensor = None
            held_bytes -= record.nbytes
            if record.original() is not None or (use_count is not None and use_count > 1):
                self.counters.offloads_freed_nothing += 1
        self._held = kept

    # -- backward --------------------------------------------------------------------------

    def unpack(self, record: SimRecord, options: OffloadSettings) -> torch.Tensor:
        """Mirror ``ChannelEngine.restore``: serve from the device, a prefetch, or a fetch."""
        self._settle()
        record.unpacks += 1
        original = record.original()
        if original is not None:
            self.counters.stash_hits += 1
            self.counters.bytes_served_from_stash += record.nbytes
            result = original
        elif record.fetched is not None:
            result = record.fetched
            self.counters.shared_fetch_hits += 1
        elif record.prefetched is not None:
            result = record.prefetched
            record.prefetched = None
            self.counters.prefetch_hits += 1
        else:
            result = record.fresh_copy()
            self.counters.fetches += 1
            self.counters.bytes_fetched += record.nbytes
        # A record several checkpoints share keeps its copy for their other unpacks this pass.
        shared_unpacks_left = record.unpacks % record.packs != 0
        record.fetched = result if shared_unpacks_left and original is None else None
        if record.pipelined and options.prefetch > 0:
            self._prefetch_before(record, options)
        return result

    def _prefetch_before(self, record: SimRecord, options: OffloadSettings) -> None:
        """Mirror ``ChannelEngine._prefetch_before``: shared records first, then look-ahead."""
        index = bisect.bisect_left(self._order, record.sequence)
        if self._shared:
            window_start = self._order[max(index - options.prefetch, 0)]
            alive: list[weakref.ref[SimRecord]] = []
            for reference in self._shared:
                candidate = reference()
                if candidate is None:
                    continue
                alive.append(reference)
                if (
                    candidate is not record
                    and window_start <= candidate.last_use <= record.sequence
                    and candidate.pipelined
                    and candidate.fetched is None
                ):
                    self._start_prefetch(candidate)
            self._shared = alive
        self._prefetch_scan(index - 1, record.unpacks, options)

    def _prefetch_scan(self, position: int, unpacks_below: int, options: OffloadSettings) -> None:
        """Mirror ``ChannelEngine._prefetch_scan``."""
        started = 0
        scanned = 0
        while position >= 0 and started < options.prefetch and scanned < _PREFETCH_SCAN_LIMIT:
            reference = self._records.get(self._order[position])
            candidate = reference() if reference is not None else None
            position -= 1
            scanned += 1
            if candidate is None or candidate.unpacks >= unpacks_below or not candidate.pipelined:
                continue
            started += 1
            if candidate.fetched is None:
                self._start_prefetch(candidate)

    def _start_prefetch(self, candidate: SimRecord) -> None:
        """Mirror ``ChannelEngine._start_prefetch`` (device memory never runs short here)."""
        if (
            candidate.prefetched is not None
            or candidate.fetched is not None
            or candidate.original() is not None
        ):
            return
        candidate.prefetched = candidate.fresh_copy()
        self.counters.prefetches += 1
        self.counters.fetches += 1
        self.counters.bytes_fetched += candidate.nbytes

    # -- housekeeping ----------------------------------------------------------------------

    def _settle(self) -> None:
        """Return dead records' blocks to the pool, as ``ChannelEngine._settle_graveyard``."""
        settled = False
        while self.graveyard:
            block, key, sequence = self.graveyard.pop(0)
            self.pool.give_back(block)
            self._records.pop(sequence, None)
            reference = self._by_key.get(key)
            if reference is not None and reference() is None:
                del self._by_key[key]
            settled = True
        if settled:
            if len(self._order) > 2 * len(self._records) + 16:
                self._order = [sequence for sequence in self._order if sequence in self._records]
            self._host_changed()

    def finish(self) -> None:
        """Settle what died at the end of the step (as reading ``matepoint.stats()`` does)."""
        self._settle()

    def _host_changed(self) -> None:
        pageable = self.pool.pageable_bytes
        self.peak_pageable_bytes = max(self.peak_pageable_bytes, pageable)
        self.tracker.set_host(self.pool.pinned_bytes + pageable, self.pool.in_use_bytes + pageable)
