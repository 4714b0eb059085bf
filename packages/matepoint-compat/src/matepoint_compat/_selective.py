"""Selective activation checkpointing's private pieces, for offloading what a policy offloads.

Note [Selective checkpointing's storage]
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` returns two private dispatch
    modes sharing one storage dict. ``_CachingTorchDispatchMode`` runs the forward: it asks the
    policy about each op and stores each output the policy saves (``MUST_SAVE``/``PREFER_SAVE``)
    as a ``_VersionWrapper`` of a detached alias. ``_CachedTorchDispatchMode`` runs the
    recomputation and, for a saved op, returns ``entry.get_val(allow_cache_entry_mutation)``
    (mapped over the op's outputs) instead of running it. No eager release from 2.4 to 2.15
    implements the CPU-offload values (``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``): they fall
    into the caching mode's "else" branch and are recomputed, exactly like ``PREFER_RECOMPUTE``.

    Differences between releases, all handled here:

    - the storage holds, per op, a list appended to (2.4 era; the recompute pops its head and
      asks the policy again with ``is_recompute=True``) or a dict keyed by call index (later;
      the recompute looks entries up by index and never asks the policy). matepoint replaces
      the entry the caching mode has just written, which is the list's last item or the dict's
      last inserted key in both layouts, and wraps the recompute mode's policy where it has one;
    - the storage key is the op itself, or ``_sac_storage_key(func, args)`` where torch has it;
    - from 2.14 ``_VersionWrapper`` may carry an ``unpack_hook``: with
      ``respect_saved_tensors_hooks=True`` the value it wraps is already what the surrounding
      hooks (matepoint's) packed, and it is left alone.

    The shim stays until torch's eager checkpoint offloads these values itself (no release up
    to 2.15 does; pytorch/pytorch#185015 is open).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map

__all__ = ["SELECTIVE_OFFLOAD_POLICIES", "offloading_selective_contexts"]

_CheckpointPolicy: type[enum.Enum] | None = getattr(torch_checkpoint, "CheckpointPolicy", None)


def _save_for_offload() -> dict[Any, Any]:
    """Map each CPU-offload value of ``CheckpointPolicy`` to the save value of the same strength.

    ``CheckpointPolicy`` gained the two offload values in torch 2.11 (pytorch/pytorch#172705);
    they are looked up rather than gated on the version, so this map is empty before them.
    """
    if _CheckpointPolicy is None:
        return {}
    members = _CheckpointPolicy.__members__
    pairs = {"MUST_CPU_OFFLOAD": "MUST_SAVE", "PREFER_CPU_OFFLOAD": "PREFER_SAVE"}
    return {
        members[offload]: members[save]
        for offload, save in pairs.items()
        if offload in members and save in members
    }


_SAVE_FOR_OFFLOAD = _save_for_offload()

SELECTIVE_OFFLOAD_POLICIES: frozenset[Any] = frozenset(_SAVE_FOR_OFFLOAD)
"""The ``CheckpointPolicy`` values that ask for a CPU offload (empty where torch has none)."""

_CachingMode: type[Any] | None = getattr(torch_checkpoint, "_CachingTorchDispatchMode", None)
_CachedMode: type[Any] | None = getattr(torch_checkpoint, "_CachedTorchDispatchMode", None)
_VersionWrapper: type[Any] | None = getattr(torch_checkpoint, "_VersionWrapper", None)
_storage_key_of: Callable[[Any, Any], Any] | None = getattr(
    torch_checkpoint, "_sac_storage_key", None
)
_is_compiling: Callable[[Any, Any, Any], bool] | None = getattr(
    torch_checkpoint, "_is_compiling", None
)


class _Pending:
    """What the forward's policy wrapper tells the caching mode about the op now dispatched.

    Shared by the two instead of the wrapper referencing the mode, so no reference cycle keeps
    the storage (and the host copies in it) alive until the garbage collector runs.
    """

    __slots__ = ("offload",)

    def __init__(self) -> None:
        self.offload = False


def _forward_policy(policy: Callable[..., Any], pending: _Pending) -> Callable[..., Any]:
    """Wrap the forward's policy: an offload value becomes a save, remembered in ``pending``."""

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, func, *args, **kwargs)
        if not isinstance(decision, enum.Enum) or decision not in _SAVE_FOR_OFFLOAD:
            return decision
        # Under compile the storage is a tracing artifact and the partitioner reads the
        # policy's own value.
        if _is_compiling is not None and _is_compiling(func, args, kwargs):
            return decision
        pending.offload = True
        return _SAVE_FOR_OFFLOAD[decision]

    return decide


def _recompute_policy(policy: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap the recomputation's policy (2.4-era modes ask it again) to decide as forward did."""

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        decision = policy(ctx, func, *args, **kwargs)
        if isinstance(decision, enum.Enum) and decision in _SAVE_FOR_OFFLOAD:
            return _SAVE_FOR_OFFLOAD[decision]
        return decision

    return decide


def _replace_last_entry(
    storage: MutableMapping[Any, Any], func: Any, args: Any, offload: Callable[[Any], Any]
) -> None:
    """Offload the tensors of the entry the caching mode stored last for ``func``.

    See Note [Selective checkpointing's storage] for the two layouts.
    """
    key = func if _storage_key_of is None else _storage_key_of(func, args)
    container = storage.get(key)
    if isinstance(container, list) and container:
        index: Any = len(container) - 1
    elif isinstance(container, dict) and container:
        index = next(reversed(container))
    else:
        return

    def replace(leaf: Any) -> Any:
        if (
            _VersionWrapper is not None
            and type(leaf) is _VersionWrapper
            and isinstance(leaf.val, torch.Tensor)
            and getattr(leaf, "unpack_hook", None) is None
        ):
            return offload(leaf.val)
        return leaf

    # A dispatch mode's handler runs with the ADInplaceOrView key excluded, where detach()
    # makes an alias with a fresh version counter: matepoint's version witness would then miss
    # later in-place writes. torch's own ``_detach_helper`` lifts the exclusion the same way.
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        container[index] = tree_map(replace, container[index])


if _CachingMode is not None:
    _CachingBase: type[Any] = _CachingMode
else:  # pragma: no cover - every supported release has the mode
    _CachingBase = object


class _OffloadingCachingMode(_CachingBase):  # type: ignore[misc]
    """torch's forward caching mode, with the outputs of offloaded ops handed to ``_offload``.

    Made from the mode the user's ``context_fn`` built (its state copied, so that object stays
    untouched); ``isinstance`` checks torch makes on it (2.14 sets
    ``respect_saved_tensors_hooks`` through one) still hold.
    """

    _matepoint_pending: _Pending
    _matepoint_offload: Callable[[torch.Tensor], Any] | None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        pending = self._matepoint_pending
        pending.offload = False
        out = super().__torch_dispatch__(func, types, args, kwargs)
        offload = self._matepoint_offload
        if pending.offload and offload is not None:
            pending.offload = False
            _replace_last_entry(self.storage, func, args, offload)
        return out


def offloading_selective_contexts(
    contexts: Any, offload: Callable[[torch.Tensor], Any]
) -> tuple[Any, Any] | None:
    """Make torch's selective-checkpoint pair offload what its policy marks for CPU offload.

    See Note [Selective checkpointing's storage]. The forward mode's policy answers "save" for
    the two CPU-offload values, and the entry it then stores for such an op holds
    ``offload(tensor)`` for each tensor output instead of the tensor; that object's
    ``get_val(allow_cache_entry_mutation)`` returns the device tensor in the recomputation.
    Everything else (what is saved on the device, what is recomputed, the error for a second
    backward, the mismatch checks) stays torch's. With ``allow_cache_entry_mutation=True`` the
    offload values are saved on the device: a host copy would miss the mutations torch lets the
    recomputation see.

    Args:
        contexts: What the call's ``context_fn`` returned.
        offload: Called with each tensor to offload (a detached alias of the op's output);
            returns the stored entry.

    Returns:
        The new pair, or None when ``contexts`` is not the exact pair
        ``create_selective_checkpoint_contexts`` builds (other context managers, subclasses),
        or torch's ``CheckpointPolicy`` has no offload values: use ``contexts`` unchanged.
    """
    if not _SAVE_FOR_OFFLOAD or _CachingMode is None or _CachedMode is None:
        return None
    if not isinstance(contexts, tuple) or len(contexts) != 2:
        return None
    forward, recompute = contexts
    if type(forward) is not _CachingMode or type(recompute) is not _CachedMode:
        return None
    pending = _Pending()
    caching = _OffloadingCachingMode.__new__(_OffloadingCachingMode)
    caching.__dict__.update(vars(forward))
    caching.policy_fn = _forward_policy(forward.policy_fn, pending)
    caching._matepoint_pending = pending
    mutable = bool(getattr(recompute, "allow_cache_entry_mutation", False))
    caching._matepoint_offload = None if mutable else offload
    cached = recompute
    if getattr(recompute, "policy_fn", None) is not None:
        cached = copy.copy(recompute)
        cached.policy_fn = _recompute_policy(recompute.policy_fn)
    return caching, cached
