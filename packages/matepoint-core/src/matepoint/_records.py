"""What the engine knows about one offloaded tensor, and the holder for tensors it keeps in place.

A record is the object matepoint's pack hook returns to autograd, so autograd owns its lifetime:
it dies with the graph (after backward, or when the graph is dropped), and its death returns the
host block. See Note [Record lifetime].

Note [Record lifetime]
    Records are referenced strongly only by autograd (and by another checkpoint that shares the
    tensor, see dedupe in the engine). The engine refers to them through weak references, so a
    dropped graph frees everything without any call from the user. A dying record must not take
    the engine lock (it may die inside a locked section, through garbage collection), so
    ``__del__`` only appends to the channel's graveyard, a deque whose append is atomic; the
    engine settles the graveyard at its next operation and when stats are read.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

import matepoint_compat as compat
from matepoint._errors import InplaceModificationError
from matepoint._options import OffloadSettings
from matepoint._pool import HostBlock
from matepoint._stats import Counters
from matepoint._transport import Channel

__all__ = ["KeptTensor", "Record", "RecordOwner", "inplace_error"]


class RecordOwner(Protocol):
    """What a record's users need of the engine that made it (``matepoint._engine``).

    A protocol rather than the engine's class: the engine imports this module, and this module
    must not import the engine (no import circle).
    """

    @property
    def channel(self) -> Channel: ...
    @property
    def graveyard(self) -> deque[HostBlock]: ...
    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def counters(self) -> Counters: ...

    def restore(self, record: Record, options: OffloadSettings) -> torch.Tensor:
        """Return a device tensor with the record's contents."""


def inplace_error(
    tensor_type: str, shape: tuple[int, ...], version: int, expected: int
) -> InplaceModificationError:
    """Build the error for a saved checkpoint input modified in place, worded as torch words it."""
    sizes = ", ".join(str(size) for size in shape)
    return InplaceModificationError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{tensor_type} [{sizes}]] (an input of a matepoint.checkpoint) is at "
        f"version {version}; expected version {expected} instead. Hint: clone the input before "
        "modifying it in place, or modify it only after backward."
    )


class KeptTensor:
    """A saved input matepoint leaves where it is, with the version it had when saved.

    With saved-tensor hooks in place autograd skips its own version check, so matepoint does it.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        try:
            self.version = tensor._version
        except RuntimeError:  # inference tensors have no version counter
            self.version = -1

    def unpack(self) -> torch.Tensor:
        """Return the tensor, or raise if it was modified in place since it was saved."""
        tensor = self.tensor
        if self.version >= 0 and tensor._version != self.version:
            raise inplace_error(tensor.type(), tensor.shape, tensor._version, self.version)
        return tensor


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

    owner: RecordOwner
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
        # See Note [Record lifetime]: no locks here.
        if self.device_tensor is not None:
            copying = self.copy_event is not None
            self.owner.channel.release_original(self.device_tensor, self.compute, copying)
        self.owner.graveyard.append(self.block)
