"""The offload engine of one device channel: where each checkpoint input lives until backward.

One ``ChannelEngine`` per device (per transport channel) owns that device's records, its held
originals (stash and copies in flight), its pinned pool and its counters.
``matepoint._engine.saving`` hands it the saved inputs that move; ``matepoint._engine.engines``
keeps one per channel.

A :class:`Record` is what the engine knows about one offloaded tensor. It is the object
matepoint's pack hook returns to autograd, so it dies with the graph (after backward, or when the
graph is dropped), and its death returns the host block.

Note [Record lifetime]
    Rule 1. Only what autograd keeps with the graph holds a record strongly (a saved value per
            checkpoint that saved it, Note [Shared records]; or a selective policy's storage
            entry); the engine refers to it weakly, so a dropped graph frees everything without
            a call from the user.
    Rule 2. A dying record takes no lock (it may die inside a locked section, through garbage
            collection): ``__del__`` only hands over its device original, if any (Note [Stream
            ordering], rule 2), and appends its host block to the channel's graveyard, a deque
            whose append is atomic.
    Rule 3. The engine settles the graveyard (the blocks go back to the pool) at its next
            operation and when stats are read.

Note [Weak record tables]
    Rule 1. The engine looks records up by pack sequence (``_records``) and by dedupe key
            (``_by_key``) in ``WeakValueDictionary`` objects, which a dead record leaves by
            itself, without the engine lock (Note [Record lifetime], rule 2).
    Rule 2. It never iterates over those two: a record dying on another thread (autograd's
            device threads) could change them under the iteration.
    Rule 3. What it iterates (held originals, shared records) are plain lists of weak
            references, changed only under the lock, whose dead entries it drops itself.

Note [Shared records]
    Rule 1. A record saved by N checkpoints (dedupe: same memory, layout, dtype and version) is
            unpacked N times per backward pass but crosses the link once each way per step: the
            first unpack's device copy (``fetched``) serves the other N-1, then is let go.
    Rule 2. It is prefetched by its latest use (``last_use``, the pack sequence of the newest
            checkpoint that saved it), where backward first needs it: when ``last_use`` falls in
            the look-ahead window that ends at the record being unpacked. Its pack position,
            long before, is reached too late.
    Rule 3. Only its last unpack of a pass starts the pack-order look-ahead: the earlier ones
            happen at other checkpoints' positions, which say nothing of what backward needs
            next.
    Example: a GPT's x0, passed to all 12 blocks, is offloaded once (block 1's pack). Backward
    prefetches it near block 12 (rule 2), block 12's unpack keeps the copy for blocks 11 to 1,
    and block 1's unpack, the last, lets it go and looks ahead from block 1 (rules 1, 3).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
import weakref
from collections import deque
from collections.abc import Hashable, Iterable
from typing import Any

import torch

import matepoint_compat as compat
from matepoint._engine.pool import HostBlock, PinnedPool
from matepoint._engine.stats import Counters
from matepoint._engine.transport import Channel, Transport
from matepoint._errors import inplace_error
from matepoint._options import OffloadSettings, ResolvedOptions

__all__ = ["ChannelEngine", "Record"]

_PREFETCH_SCAN_LIMIT = 64
_TIMING_BACKLOG = 4096


class _WeakReferable:
    """The weak-reference slot of the slotted :class:`Record`.

    The engine refers to records weakly; ``dataclass(weakref_slot=True)`` needs Python 3.11.
    """

    __slots__ = ("__weakref__",)


@dataclasses.dataclass(eq=False, slots=True)
class Record(_WeakReferable):
    """One offloaded tensor: its host copy, the events that order it, and its device state.

    Built from the tensor it offloads (``tensor``, not kept as a field) and the host block its
    copy goes to. Compared by identity (``eq=False``): each record is one saved value.

    Attributes:
        owner: The engine that made it.
        sequence: Pack order on its channel; backward unpacks in roughly decreasing order.
        block: The host block holding the copy, exactly its size.
        version: The original's version counter when it was saved.
        pipelined: Whether its copies run on the side stream (else synchronously).
        device_tensor: The device original while the engine still holds it (stash or copy in
            flight), else None.
        original: Weak reference to the original tensor, to serve it again without a copy when
            something else keeps it alive.
        host: The host copy (a view of ``block``), shaped and strided like the original.
        witness: Shares the original's version counter without holding its memory, so writes
            through any alias are seen in backward. See Note [Version witness] in
            ``matepoint_compat._version_counter``.
        compute: The compute stream current when it was packed (the stream the checkpointed
            function read it on), for ordering the release of the device original.
        last_use: Pack sequence of the newest checkpoint that saved it: where backward first
            needs it.
        nbytes: Bytes of the offloaded tensor (its host block has exactly this size).
        copy_event: Event of the copy to the host (None when synchronous).
        prefetched: A device copy brought back ahead of its unpack and its event, as
            ``Channel.copy_in`` returned them.
        modified: Set when the original was seen modified in place before its copy completed.
        unpacks: How many times autograd unpacked it (twice with ``retain_graph``).
        packs: How many checkpoints saved it (more than one when dedupe shared it).
        fetched: For a record several checkpoints share, the device copy the first of them
            fetched in this backward, served to the others so it crosses the link once.
    """

    owner: ChannelEngine
    sequence: int
    block: HostBlock
    version: int
    pipelined: bool
    tensor: dataclasses.InitVar[torch.Tensor]
    device_tensor: torch.Tensor | None = dataclasses.field(init=False)
    original: weakref.ref[torch.Tensor] = dataclasses.field(init=False)
    host: torch.Tensor = dataclasses.field(init=False)
    witness: torch.Tensor = dataclasses.field(init=False)
    compute: Any = dataclasses.field(init=False)
    last_use: int = dataclasses.field(init=False)
    nbytes: int = dataclasses.field(init=False)
    copy_event: Any = None
    prefetched: tuple[torch.Tensor, Any] | None = None
    modified: bool = False
    unpacks: int = 0
    packs: int = 1
    fetched: torch.Tensor | None = None

    def __post_init__(self, tensor: torch.Tensor) -> None:
        self.device_tensor = tensor
        self.original = weakref.ref(tensor)
        self.host = self.block.buffer.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
        self.witness = compat.version_witness(tensor)
        self.compute = self.owner.channel.current_compute()
        self.last_use = self.sequence
        self.nbytes = self.block.nbytes

    def __del__(self) -> None:
        # See Note [Record lifetime], rule 2: no locks here.
        if self.device_tensor is not None:
            copying = self.copy_event is not None
            self.owner.channel.release_original(self.device_tensor, self.compute, copying)
        self.owner.graveyard.append(self.block)


class ChannelEngine:
    """Offload bookkeeping of one device channel. All state changes happen under ``lock``.

    Args:
        channel: The transport's channel for the device.
        transport: The transport the channel belongs to.
    """

    def __init__(self, channel: Channel, transport: Transport) -> None:
        self.channel = channel
        self.transport = transport
        self.lock = threading.RLock()
        self.pool = PinnedPool(channel)
        self.counters = Counters()
        self.graveyard: deque[HostBlock] = deque()
        self._sequence = 0
        self._order: list[int] = []
        # See Note [Weak record tables].
        self._records: weakref.WeakValueDictionary[int, Record] = weakref.WeakValueDictionary()
        self._by_key: weakref.WeakValueDictionary[Hashable, Record] = weakref.WeakValueDictionary()
        self._held: list[weakref.ref[Record]] = []
        self._shared: list[weakref.ref[Record]] = []
        self._timings: deque[Any] = deque()
        self._in_flight: deque[tuple[Any, int]] = deque()

    # -- forward ---------------------------------------------------------------------------

    def offload(self, tensor: torch.Tensor, options: ResolvedOptions) -> Record:
        """Start moving ``tensor`` to the host and return its record (or a shared one).

        ``options.pipelined`` chooses the copy: on the side stream, or synchronously.
        """
        with self.lock:
            self._settle_graveyard()
            # Same memory, layout and version: the same saved value (dedupe). ``_version``: see
            # Note [Private tensor attributes read directly] in matepoint_compat.
            version = tensor._version
            memory = self.channel.memory_key(tensor)
            key = (memory, tensor.shape, tensor.stride(), tensor.dtype, version)
            shared = self._by_key.get(key)
            if shared is not None and shared.original() is not None and not shared.modified:
                self.counters.dedupe_hits += 1
                shared.packs += 1
                shared.last_use = self._sequence
                if shared.packs == 2:
                    self._shared.append(weakref.ref(shared))
                return shared
            block = self.pool.acquire(tensor.numel() * tensor.element_size(), options)
            self._sequence += 1
            record = Record(self, self._sequence, block, version, options.pipelined, tensor)
            if record.pipelined:
                record.copy_event = block.last_event = self.channel.copy_out(
                    tensor, record.host, record.compute
                )
            else:
                self.channel.copy_out_now(tensor, record.host)
            # Settle older originals first: the newest is in use by the call now running.
            self._release_held(options)
            self._records[record.sequence] = self._by_key[key] = record
            self._held.append(weakref.ref(record))
            self._order.append(record.sequence)
            self.counters.offloads += 1
            self.counters.bytes_offloaded += record.nbytes
            return record

    def _release_held(self, options: OffloadSettings) -> None:
        """Let go of device originals, keeping the newest ``stash_bytes`` of them.

        The host waits for the oldest copies only when more than ``max_inflight_bytes`` are still
        being copied: that bounds device memory when compute outruns the link.
        """
        while self._in_flight and self.channel.is_complete(self._in_flight[0][0]):
            self._in_flight.popleft()
        held = [record for reference in self._held if (record := reference()) is not None]
        held_bytes = sum(record.nbytes for record in held)
        for record in held:
            if held_bytes > options.stash_bytes and self._let_go(record):
                held_bytes -= record.nbytes
        held = [record for record in held if record.device_tensor is not None]
        self._held = [weakref.ref(record) for record in held]
        in_flight_bytes = sum(nbytes for _, nbytes in self._in_flight)
        while in_flight_bytes > options.max_inflight_bytes:
            event, nbytes = self._in_flight.popleft()
            in_flight_bytes -= nbytes
            self._wait_for_copy(event)
        watched = 0
        for record in held:
            # Still held (kept above) with its copy perhaps still running.
            if record.copy_event is not None:
                watched += record.nbytes
                if watched > options.stash_bytes + options.max_inflight_bytes:
                    self._wait_for_copy(record.copy_event)

    def _let_go(self, record: Record) -> bool:
        """Release a record's device original; return False if the engine must keep watching it.

        An original whose copy has finished is dropped after a last version check. One whose
        copy is still running is handed to the caching allocator if matepoint held the last
        reference, so its memory is reused as soon as the copy ends, without waiting for this
        host to notice; one referenced elsewhere is watched until its version can be checked
        (Note [Stream ordering], rule 2).
        """
        event = record.copy_event
        copying = event is not None and not self.channel.is_complete(event)
        tensor = record.device_tensor
        assert tensor is not None  # held records keep their original
        # Changed before we knew its copy had finished, the host copy may hold either version, so
        # backward must raise as torch would.
        record.modified |= tensor._version != record.version
        self.channel.release_original(tensor, record.compute, copying)
        record.device_tensor = None
        if not copying:
            record.copy_event = None
            use_count = compat.storage_use_count(tensor)
            del tensor
            if record.original() is not None or (use_count is not None and use_count > 1):
                # The tensor, or another view of its storage, lives on elsewhere.
                self.counters.offloads_freed_nothing += 1
            return True
        del tensor
        # Referenced elsewhere, it may still be modified under the copy: keep watching it.
        record.device_tensor = record.original()
        if record.device_tensor is None:
            self._in_flight.append((event, record.nbytes))
        return record.device_tensor is None

    def _wait_for_copy(self, event: Any) -> None:
        """Block the host until a copy out has finished; count it only if it had not."""
        if not self.channel.is_complete(event):
            self.counters.host_wait_seconds += self.channel.synchronize(event)
            self.counters.throttled_waits += 1

    # -- backward --------------------------------------------------------------------------

    def restore(self, record: Record, options: OffloadSettings) -> torch.Tensor:
        """Return a device tensor with the record's contents for the computation now running."""
        with self.lock:
            self._settle_graveyard()
            record.unpacks += 1
            original = record.original()
            # See Note [Version witness], rule 3: the witness sees writes through every alias
            # (base, other views, the parameter a view was taken from), also after the original
            # died.
            current = record.witness._version
            if record.modified or current != record.version:
                current = max(current, record.version + 1)
                raise inplace_error(
                    record.witness.type(), record.host.shape, current, record.version
                )
            if original is not None:
                # Still on the device (stash, copy in flight, or kept alive elsewhere): no copy.
                self.counters.stash_hits += 1
                self.counters.bytes_served_from_stash += record.nbytes
                result = original
            elif record.fetched is not None:
                # Shared by several checkpoints: fetched already for one of them in this pass.
                result = record.fetched
                self.counters.shared_fetch_hits += 1
            elif not record.pipelined:
                result = self.channel.copy_in_now(record.host)
                self.counters.fetches += 1
                self.counters.bytes_fetched += record.nbytes
            else:
                if record.prefetched is not None:
                    result, event = record.prefetched
                    record.prefetched = None
                    self.counters.prefetch_hits += 1
                else:
                    result, event = self.channel.copy_in(record.host)
                    record.block.last_event = event
                    self.counters.fetches += 1
                    self.counters.bytes_fetched += record.nbytes
                # Hand the copy to compute, which waits on its event.
                token = self.channel.hand_to_compute(result, event, options.measure_waits)
                if token is not None:
                    self._timings.append(token)
                    self._resolve_timings(block=True, keep=_TIMING_BACKLOG)
            # See Note [Shared records], rule 1.
            shared_unpacks_left = record.unpacks % record.packs != 0
            record.fetched = result if shared_unpacks_left and original is None else None
            if record.pipelined and options.prefetch > 0:
                self._prefetch_before(record, options)
            return result

    def _prefetch_before(self, record: Record, options: OffloadSettings) -> None:
        """Start copying back what backward needs next: shared records first, then look-ahead.

        See Note [Shared records], rules 2 and 3. Later in the pass a shared record's
        ``last_use`` lies above the window, and ``record`` itself has just been served.
        """
        index = bisect.bisect_left(self._order, record.sequence)
        window_start = self._order[max(index - options.prefetch, 0)]
        self._start_prefetches(
            candidate
            for reference in self._shared
            if (candidate := reference()) is not None
            and candidate is not record
            and candidate.pipelined
            and window_start <= candidate.last_use <= record.sequence
        )
        # See Note [Shared records], rule 3.
        if not record.unpacks % record.packs:
            self._prefetch_scan(index - 1, record.unpacks // record.packs, options)

    def prefetch_newest(self, options: OffloadSettings) -> None:
        """Start copying back the newest records not yet unpacked (what backward needs first)."""
        with self.lock:
            self._settle_graveyard()
            self._prefetch_scan(len(self._order) - 1, 1, options)

    def _prefetch_scan(self, position: int, unpacks_below: int, options: OffloadSettings) -> None:
        """Prefetch up to ``options.prefetch`` records at or before ``position`` in pack order.

        Only records unpacked fewer than ``unpacks_below`` times count: in a second backward
        (``retain_graph``) the ones the current pass has already unpacked are not needed again.
        """
        scanned = self._order[max(position + 1 - _PREFETCH_SCAN_LIMIT, 0) : position + 1]
        candidates = [
            candidate
            for sequence in reversed(scanned)
            if (candidate := self._records.get(sequence)) is not None
            and candidate.unpacks < unpacks_below
            and candidate.pipelined
        ]
        self._start_prefetches(candidates[: options.prefetch])

    def _start_prefetches(self, candidates: Iterable[Record]) -> None:
        """Copy each candidate back ahead of need unless it is on the device already.

        Stops at the first that device memory has no room for: a prefetch is only ahead of
        need, so that record and the rest are fetched on demand when their unpacks come (which
        raise if memory is still short).
        """
        for candidate in candidates:
            on_device = candidate.original() is not None or candidate.fetched is not None
            if candidate.modified or on_device or candidate.prefetched is not None:
                continue
            try:
                candidate.prefetched = self.channel.copy_in(candidate.host)
            except torch.cuda.OutOfMemoryError:
                self.counters.prefetches_skipped += 1
                return
            candidate.block.last_event = candidate.prefetched[1]
            self.counters.prefetches += 1
            self.counters.fetches += 1
            self.counters.bytes_fetched += candidate.nbytes

    # -- housekeeping ----------------------------------------------------------------------

    def _settle_graveyard(self) -> None:
        """Return dead records' host blocks to the pool. See Note [Record lifetime]."""
        if self.graveyard:
            self._shared = [reference for reference in self._shared if reference() is not None]
        while self.graveyard:
            self.pool.give_back(self.graveyard.popleft())
        if len(self._order) > 2 * len(self._records) + 16:
            self._order = [sequence for sequence in self._order if sequence in self._records]

    def _resolve_timings(self, block: bool, keep: int = 0) -> None:
        """Add measured compute waits to the counters, leaving at most ``keep`` unresolved."""
        while len(self._timings) > keep:
            seconds = self.channel.wait_seconds(self._timings[0], block)
            if seconds is None:
                return
            self._timings.popleft()
            self.counters.compute_wait_seconds += seconds

    def settle(self, block: bool) -> None:
        """Bring counters and the pool up to date (dead records, finished timings)."""
        with self.lock:
            self._settle_graveyard()
            self._resolve_timings(block=block)

    def live_records(self) -> int:
        """Return how many records are alive (held by some autograd graph)."""
        return len(self._records)

    def idle(self) -> bool:
        """Return whether no record, held original, copy in flight or pinned block in use is left.

        Originals are held only for live records, so no live record means none is held.
        """
        with self.lock:
            self._settle_graveyard()
            return not self._records and self.pool.in_use_bytes == 0 and not self._in_flight

    def held_bytes(self) -> int:
        """Return device bytes of originals the engine still references (stash and in flight)."""
        with self.lock:
            return sum(record.nbytes for reference in self._held if (record := reference()))

    def release_pool(self) -> int:
        """Free idle pinned blocks; return the bytes freed."""
        with self.lock:
            self._settle_graveyard()
            return self.pool.release_idle()
