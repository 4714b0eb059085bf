"""The copies-only floor, and a link kept busy: probes of what an offloader's traffic costs.

Any offloading checkpoint adds two things to torch's: bytes moved over the host link, and the
bookkeeping around them (where each tensor lives, when device memory can be released, what to
fetch next). The traffic cannot be avoided; the bookkeeping can be made cheaper. A
:class:`CopyFloor` does only the traffic: it runs ``torch.utils.checkpoint`` unchanged and, from
saved-tensor hooks around it, copies each saved input to pinned host memory on a side stream at
the moment matepoint would (the checkpoint's forward, after the kernels that produced the
input), and copies it back in backward when the checkpoint's recompute asks for it, with the
same look-ahead, the compute stream waiting on the copy's event. It frees nothing, keeps no
records and moves a tensor shared by several checkpoints (nanochat's ``x0``) once each way per
step. Its step time over torch's checkpoint is the floor for any offloader on that workload.

:class:`LinkBusy` asks the opposite question: with no extra work per checkpoint at all, does a
link saturated by unrelated copies slow the forward's kernels or their launches?
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

import matepoint

__all__ = ["CopyFloor", "LinkBusy"]

_Saved = tuple[Tensor, int]
_Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


class CopyFloor:
    """torch's checkpoint plus the device-to-host and host-to-device copies of an offloader.

    Which tensors move follows matepoint's rule (plain tensors on the device, not parameters,
    at least ``matepoint.get_options().min_offload_bytes``; one tensor shared by several
    checkpoints once), and the look-ahead in backward is ``matepoint.get_options().prefetch``,
    so the traffic is the same as matepoint's when matepoint moves each tensor once.

    Args:
        copy_in: Copy back in backward; ``False`` leaves only the forward's copies (to split
            their cost). Default: ``True``.
        refetch: Copy a shared tensor back at every unpack instead of once per step, as an
            offloader that forgets a fetched tensor after each use does (to price that waste).
            Default: ``False``.
    """

    def __init__(self, *, copy_in: bool = True, refetch: bool = False) -> None:
        self.copy_in = copy_in
        self.refetch = refetch
        self.device_type = "cuda"
        self.counters: dict[str, int] = dict.fromkeys(
            ("copies_out", "bytes_out", "copies_in", "bytes_in"), 0
        )
        self._host: list[tuple[_Meta, Tensor] | None] = []
        self._events: list[Any] = []
        self._side: dict[int, Any] = {}
        self._compute_done: dict[int, Any] = {}
        self._device: torch.device | None = None
        self._slot_of: dict[tuple[Any, ...], int] = {}
        self._count = 0
        self._inbound: list[tuple[Tensor, Any] | None] = []
        self._consumed: list[bool] = []

    # -- strategy surface ------------------------------------------------------------------

    def checkpoint(self, function: Callable[..., Tensor], /, *args: Tensor) -> Any:
        """Run ``function`` under torch's (non-reentrant) checkpoint with the floor's copies."""
        with saved_tensors_hooks(self._pack, self._unpack):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Start a new step: slots are numbered from zero again, nothing counts as fetched.

        Entered around each forward (a strategy's ``forward_context``); the backward that
        follows uses the slots this forward numbered.
        """
        self._slot_of = {}
        self._count = 0
        self._inbound = []
        self._consumed = []
        yield

    @contextlib.contextmanager
    def session(self, device: torch.device) -> Iterator[None]:
        """Treat tensors on ``device``'s type as device tensors for a run.

        On a CPU there is no link: the copies are synchronous memcpys into ordinary host
        buffers, and every size counts, so the tests exercise the same slots and counts.
        """
        previous = self.device_type
        self.device_type = device.type
        try:
            if device.type == "cpu":
                with matepoint.options(min_offload_bytes=0):
                    yield
            else:
                yield
        finally:
            self.device_type = previous

    def stats(self) -> dict[str, Any]:
        """Return the copies made since the last :meth:`reset_stats` (JSON-ready)."""
        return dict(self.counters)

    def reset_stats(self) -> None:
        """Set the copy counters back to zero."""
        for name in self.counters:
            self.counters[name] = 0

    # -- hooks -----------------------------------------------------------------------------

    def _pack(self, tensor: Tensor) -> _Saved:
        if type(tensor) is not torch.Tensor or tensor.device.type != self.device_type:
            return (tensor, -1)
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes < max(matepoint.get_options().min_offload_bytes, 1):
            return (tensor, -1)
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
            tensor._version,
        )
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._count
            self._count += 1
            self._slot_of[key] = slot
            self._copy_out(tensor, slot, nbytes)
        return (tensor, slot)

    def _unpack(self, saved: _Saved) -> Tensor:
        tensor, slot = saved
        if slot < 0 or not self.copy_in:
            return tensor
        missing = self._count - len(self._inbound)
        if missing > 0:
            self._inbound += [None] * missing
            self._consumed += [False] * missing
        inbound = self._inbound[slot]
        if inbound is None:
            if self._consumed[slot] and not self.refetch:
                return tensor  # already back on the device this step; an offloader keeps it
            inbound = self._copy_in(slot)
        if inbound[1] is not None:
            torch.cuda.current_stream(tensor.device).wait_event(inbound[1])
        self._inbound[slot] = None
        self._consumed[slot] = True
        ahead = matepoint.get_options().prefetch
        for earlier in range(slot - 1, max(-1, slot - 1 - ahead), -1):
            if self._inbound[earlier] is None and not self._consumed[earlier]:
                self._inbound[earlier] = self._copy_in(earlier)
        return tensor

    # -- copies ----------------------------------------------------------------------------

    def _host_view(self, slot: int, tensor: Tensor, nbytes: int) -> Tensor:
        """Return slot ``slot``'s host buffer shaped like ``tensor`` (allocated once per shape)."""
        meta: _Meta = (tuple(tensor.shape), tensor.stride(), tensor.dtype)
        while len(self._host) <= slot:
            self._host.append(None)
            self._events.append(None)
        entry = self._host[slot]
        if entry is None or entry[0] != meta:
            pinned = self.device_type == "cuda"
            block = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=pinned)
            view = block.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())
            entry = (meta, view)
            self._host[slot] = entry
        return entry[1]

    def _streams(self, device: torch.device) -> tuple[Any, Any]:
        """Return the side stream and the reusable compute-done event of ``device``."""
        index = device.index  # a tensor's device always has its index
        side = self._side.get(index)
        if side is None:
            side = self._side[index] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._compute_done[index] = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._device = device
        return side, self._compute_done[index]

    def _copy_out(self, tensor: Tensor, slot: int, nbytes: int) -> None:
        host = self._host_view(slot, tensor, nbytes)
        self.counters["copies_out"] += 1
        self.counters["bytes_out"] += nbytes
        if self.device_type != "cuda":
            host.copy_(tensor)
            return
        side, compute_done = self._streams(tensor.device)
        compute = torch.cuda.current_stream(tensor.device)
        compute_done.record(compute)
        side.wait_event(compute_done)
        torch.cuda.set_stream(side)
        try:
            host.copy_(tensor, non_blocking=True)
        finally:
            torch.cuda.set_stream(compute)

    def _copy_in(self, slot: int) -> tuple[Tensor, Any]:
        entry = self._host[slot]
        assert entry is not None
        host = entry[1]
        self.counters["copies_in"] += 1
        self.counters["bytes_in"] += host.numel() * host.element_size()
        if self.device_type != "cuda":
            return (host.clone(), None)
        assert self._device is not None
        side, _ = self._streams(self._device)
        compute = torch.cuda.current_stream(self._device)
        # Allocated while the side stream is current, as an offloader's fetch is; nothing on the
        # compute stream ever reads it (torch's checkpoint still holds the original), so it is
        # dropped after the compute stream's wait without record_stream.
        torch.cuda.set_stream(side)
        try:
            target = torch.empty_strided(
                host.size(), host.stride(), dtype=host.dtype, device=self._device
            )
            target.copy_(host, non_blocking=True)
        finally:
            torch.cuda.set_stream(compute)
        event = self._events[slot]
        if event is None:
            event = self._events[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(side)
        return (target, event)


class LinkBusy:
    """Keep the device-to-host link busy with unrelated copies while a forward runs.

    At the start of each forward a side stream, ordered after the compute stream's work so far,
    is given ``nbytes`` of copies from one device buffer into one pinned buffer, ``chunk`` bytes
    each. The forward itself is torch's checkpoint, untouched, and the host issues only those
    few launches, so any slowdown of the forward is what the saturated link does to the
    compute kernels or to their launches.

    Args:
        nbytes: Bytes to copy per forward; at about 55 GB/s the default (2 GiB) keeps the link
            busy for about 40 ms, the length of nanochat d12's forward on an H200.
            Default: ``2 GiB``.
        chunk: Bytes per copy. Default: ``64 MiB``.
    """

    def __init__(self, nbytes: int = 2 << 30, chunk: int = 64 << 20) -> None:
        self.nbytes = nbytes
        self.chunk = chunk
        self._buffers: tuple[Tensor, Tensor, Any] | None = None

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Queue the copies on the side stream, then run the body (the forward)."""
        if not torch.cuda.is_available():
            raise RuntimeError("LinkBusy needs a CUDA device")
        if self._buffers is None:
            device = torch.device("cuda", torch.cuda.current_device())
            source = torch.empty(self.chunk, dtype=torch.uint8, device=device)
            target = torch.empty(self.chunk, dtype=torch.uint8, device="cpu", pin_memory=True)
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._buffers = (source, target, side)
        source, target, side = self._buffers
        side.wait_stream(torch.cuda.current_stream(source.device))
        with torch.cuda.stream(side):
            for _ in range(max(1, self.nbytes // self.chunk)):
                target.copy_(source, non_blocking=True)
        yield
