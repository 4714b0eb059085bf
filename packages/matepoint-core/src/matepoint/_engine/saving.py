"""The saved-tensor hooks' work: which saved inputs move to the host, and bringing them back.

:func:`pack` keeps a saved input where it is (parameters and their views, small, non-dense, lazy
bits, not on an offloadable device) as a :class:`KeptTensor`, or hands it to its device's engine,
which returns a ``Record``; :func:`unpack` returns the device tensor from wherever it lives now.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Literal

import torch

from matepoint._engine.active_transport import transport
from matepoint._engine.channel_engine import Record
from matepoint._engine.engines import engine_of
from matepoint._engine.planning_scope import planning
from matepoint._engine.stats import Counters
from matepoint._errors import inplace_error
from matepoint._options import ResolvedOptions

__all__ = [
    "KeepReason",
    "KeptTensor",
    "count_kept",
    "kept_counters",
    "pack",
    "stay_reason",
    "unpack",
]


# Counts of tensors left in place (not per device), under ``_kept_lock``.
kept_counters = Counters()
_kept_lock = threading.Lock()


def _offloadable_dtypes() -> frozenset[torch.dtype]:
    names = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]
    names += ["uint8", "int8", "int16", "int32", "int64", "bool"]
    # The float8 formats (OCP, then the fnuz and MX-scale ones): only some releases have each,
    # hence the hasattr below.
    names += ["float8_e4m3fn", "float8_e5m2"]
    names += ["float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"]
    return frozenset(getattr(torch, name) for name in names if hasattr(torch, name))


# Dtypes a byte block can be viewed as and copied asynchronously; anything else (bit-packed,
# quantized, complex32) stays on the device.
_OFFLOADABLE_DTYPES = _offloadable_dtypes()


KeepReason = Literal["parameter", "other", "small", "empty"]
"""Why a saved input stays where it is; ``"empty"`` is torch 2.4-2.11's 0-element dummy."""


def stay_reason(
    tensor: torch.Tensor,
    min_offload_bytes: int,
    channel_key: Callable[[torch.Tensor], Hashable | None],
    *,
    traced_nbytes: int | None = None,
    base: torch.Tensor | None = None,
) -> KeepReason | None:
    """Why a saved input stays where it is, by every rule; None if it moves.

    The one answer to "does this saved input move?" for the pack hook and for the compiled
    path's joint-graph pass (See Note [The compiled path] in ``matepoint._compiled``); the
    planner applies the same rules through the pack hook. In order: the type (parameters and
    their views: moving a view of a parameter frees nothing, the parameter keeps its memory),
    what cannot be copied as one block, the size, then the device (the transport's
    ``channel_key``: None where it does not offload) and the layout (dense: one block of storage
    to copy).

    Args:
        tensor: The saved input (or, with ``traced_nbytes``, a compiled graph's value).
        min_offload_bytes: The call's minimum size to move.
        channel_key: The active transport's ``channel_key``.
        traced_nbytes: Given for a value of a compiled graph (a fake tensor standing for a plain
            tensor the graph computes): its bytes (the traced example's, with dynamic shapes).
            The type and parameter rules are then the graph's: AOTAutograd has flattened tensor
            subclasses, and parameters are graph inputs, which the compiled path never moves.
        base: The tensor whose memory ``tensor`` shares, where ``tensor`` itself does not say
            (a selective policy's output is a detached alias, with no ``_base``: See Note
            [Offloading what a selective policy saves], rule 4), or None.
    """
    if traced_nbytes is None:
        if type(tensor) is not torch.Tensor:  # parameters, subclasses (DTensor, fake tensors)
            return "parameter" if isinstance(tensor, torch.nn.Parameter) else "other"
        if _is_parameter_memory(tensor) or (base is not None and _is_parameter_memory(base)):
            return "parameter"
    # Conj and neg views carry a lazy bit that a non-blocking device-to-host copy does not honour
    # (pytorch/pytorch#146286), and a copy into a plain host view would drop the bit. Nested
    # tensors and non-strided layouts have no single strided block to copy.
    if (
        tensor.is_nested
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or tensor.dtype not in _OFFLOADABLE_DTYPES
        or tensor.is_conj()
        or tensor.is_neg()
        or tensor.is_inference()
    ):
        return "other"
    nbytes = tensor.numel() * tensor.element_size() if traced_nbytes is None else traced_nbytes
    if nbytes < max(min_offload_bytes, 1):
        return "small" if nbytes else "empty"
    # Dense: the elements fill exactly ``numel`` storage slots without overlap, that is, some
    # order of the dimensions (by stride, innermost last) is contiguous.
    by_stride = sorted(range(tensor.dim()), key=tensor.stride, reverse=True)
    if channel_key(tensor) is None or not tensor.permute(by_stride).is_contiguous():
        return "other"
    return None


def _is_parameter_memory(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (torch's ``_base`` is the root)."""
    # See Note [Private tensor attributes read directly] in matepoint_compat.
    base = tensor._base if tensor._is_view() else tensor
    return isinstance(base, torch.nn.Parameter)


def count_kept(counters: Counters, reason: KeepReason) -> None:
    """Count a saved input kept in place under its reason (the 0-element dummy is not counted)."""
    if reason != "empty":
        name = "skipped_parameters" if reason == "parameter" else f"skipped_{reason}"
        setattr(counters, name, getattr(counters, name) + 1)


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


def pack(
    tensor: torch.Tensor, options: ResolvedOptions, base: torch.Tensor | None = None
) -> Record | KeptTensor:
    """Decide where a saved checkpoint input lives until backward; start its copy if it moves.

    Args:
        tensor: A tensor torch's checkpoint saves for recomputation.
        options: The call's resolved options (``pipelined``: copy on the side stream, or
            synchronously on the compute stream).
        base: The tensor whose memory ``tensor`` shares where ``tensor`` does not say (see
            :func:`stay_reason`), or None. Default: None.

    Returns:
        The object autograd keeps in place of the tensor.
    """
    plan = planning()  # See Note [Planning scope] in matepoint._engine.planning_scope.
    active = transport() if plan is None else plan.engine.transport
    reason = stay_reason(tensor, options.min_offload_bytes, active.channel_key, base=base)
    if reason is None:
        engine = engine_of(tensor, active) if plan is None else plan.engine
        record = engine.offload(tensor, options)
        if plan is not None:
            plan.saved(tensor, "offloaded" if record.packs == 1 else "shared")
        return record
    if plan is not None:
        plan.saved(tensor, reason)
    else:
        with _kept_lock:
            count_kept(kept_counters, reason)
    return KeptTensor(tensor)


def stays_in_place(args: tuple[Any, ...], options: ResolvedOptions) -> bool:
    """Whether no tensor argument of a checkpoint call would move; if so, count them as kept.

    See Note [A call that moves nothing] in ``matepoint._checkpoint``: ``True`` means the call
    runs without the pack hook, so its inputs are counted here, as the pack hook counts them.
    Only top-level tensors are looked at: torch saves no other (``_flattened_call`` lifts
    nested ones first).

    Args:
        args: The call's positional arguments, as torch's checkpoint will get them.
        options: The call's resolved options.
    """
    channel_key = transport().channel_key
    reasons: list[KeepReason] = []
    for value in args:
        if isinstance(value, torch.Tensor):
            reason = stay_reason(value, options.min_offload_bytes, channel_key)
            if reason is None:
                return False
            reasons.append(reason)
    with _kept_lock:
        for reason in reasons:
            count_kept(kept_counters, reason)
    return True


def unpack(saved: Record | KeptTensor, options: ResolvedOptions) -> torch.Tensor:
    """Return the device tensor for a saved input, from wherever it lives now.

    Args:
        saved: What :func:`pack` returned.
        options: The options of the checkpoint call that saved it (look-ahead, debug delay).
    """
    if isinstance(saved, KeptTensor):
        return saved.unpack()
    return saved.owner.restore(saved, options)
