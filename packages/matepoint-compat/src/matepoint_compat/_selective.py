"""Selective activation checkpointing's private pieces, for offloading what a policy offloads.

Note [Selective checkpointing's storage]
    ``create_selective_checkpoint_contexts`` returns two private dispatch modes sharing one
    storage dict.
    Rule 1. ``_CachingTorchDispatchMode`` runs the forward: it asks the policy about each op and
            stores each output the policy saves (``MUST_SAVE``/``PREFER_SAVE``) as a
            ``_VersionWrapper`` of a detached alias.
    Rule 2. ``_CachedTorchDispatchMode`` runs the recomputation: for a saved op it returns
            ``entry.get_val(allow_cache_entry_mutation)`` (mapped over the op's outputs) instead
            of running it.
    Rule 3. No eager release from 2.4 to 2.15 implements ``MUST_CPU_OFFLOAD``/
            ``PREFER_CPU_OFFLOAD``: they fall into the caching mode's "else" branch and are
            recomputed like ``PREFER_RECOMPUTE``. This shim stays until torch's eager checkpoint
            offloads them itself (pytorch/pytorch#185015 is open).
    Rule 4. Per op, the storage holds a list appended to (2.4 era: the recompute pops its head
            and asks the policy again with ``is_recompute=True``) or a dict keyed by call index
            (later: looked up by index, the policy not asked). Either way the entry the caching
            mode has just written is the list's last item or the dict's last inserted key: that
            is the one matepoint replaces. The recompute mode's policy is wrapped where it has
            one.
    Rule 5. The storage key is the op itself, or ``_sac_storage_key(func, args)`` where torch has
            it.
    Rule 6. From 2.14 a ``_VersionWrapper`` may carry an ``unpack_hook``: with
            ``respect_saved_tensors_hooks=True`` the value it wraps is already what the
            surrounding hooks (matepoint's) packed, and it is left alone.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_map

__all__ = [
    "SELECTIVE_OFFLOAD_POLICIES",
    "never_offloading",
    "offloading_selective_contexts",
    "tracing_ops",
]

# ``CheckpointPolicy`` gained the two offload values in torch 2.11 (pytorch/pytorch#172705);
# they are looked up rather than gated on the version, so the map is empty before them (and on
# 2.4, which has no ``CheckpointPolicy``). Each maps to the save value of the same strength.
_POLICY: Any = getattr(torch_checkpoint, "CheckpointPolicy", None)
_SAVE_FOR_OFFLOAD: dict[Any, Any] = {
    _POLICY[f"{strength}_CPU_OFFLOAD"]: _POLICY[f"{strength}_SAVE"]
    for strength in ("MUST", "PREFER")
    if hasattr(_POLICY, f"{strength}_CPU_OFFLOAD")
}

SELECTIVE_OFFLOAD_POLICIES: frozenset[Any] = frozenset(_SAVE_FOR_OFFLOAD)
"""The ``CheckpointPolicy`` values that ask for a CPU offload (empty where torch has none)."""

# Every supported release has both modes; ``object`` stands in where one is missing, so no
# pair ever matches it.
_CachingMode: type[Any] = getattr(torch_checkpoint, "_CachingTorchDispatchMode", object)
_CachedMode: type[Any] = getattr(torch_checkpoint, "_CachedTorchDispatchMode", object)
_VersionWrapper: type[Any] | None = getattr(torch_checkpoint, "_VersionWrapper", None)
_storage_key: Callable[..., Any] = getattr(torch_checkpoint, "_sac_storage_key", lambda op, _: op)
_is_compiling: Callable[..., bool] = getattr(torch_checkpoint, "_is_compiling", lambda *_: False)

# The dispatch modes of the tracers that compile or export ops: torch's own selective checkpoint
# asks for the proxy mode (``_is_compiling``) to know it is traced; a fake-tensor mode is there
# while Dynamo runs a checkpoint's ``context_fn``. Every supported release has both keys.
_get_dispatch_mode: Callable[..., Any] | None = getattr(torch._C, "_get_dispatch_mode", None)
_MODE_KEYS: Any = getattr(torch._C, "_TorchDispatchModeKey", None)
_TRACING_MODES: tuple[Any, ...] = tuple(
    getattr(_MODE_KEYS, name) for name in ("PROXY", "FAKE") if hasattr(_MODE_KEYS, name)
)


def tracing_ops() -> bool:
    """Whether the ops run now are traced (``torch.compile``, export, a fake-tensor mode).

    A ``context_fn`` called under a tracer shapes a compiled graph, where torch reads what its
    selective-checkpoint modes tag; in eager mode the same modes only cost host time. True where
    the release gives no way to tell, the answer that keeps the modes.
    """
    if torch.compiler.is_compiling():
        return True
    if _get_dispatch_mode is None or len(_TRACING_MODES) < 2:
        return True
    return any(_get_dispatch_mode(key) is not None for key in _TRACING_MODES)


_NO_KEY = object()
_NEVER_OFFLOADS = "_matepoint_never_offloads"


def never_offloading(policy: Callable[..., Any]) -> Callable[..., Any]:
    """Mark a policy that never answers an offload value; return it.

    Contexts around such a policy are left to torch as they are: the offload wrapper would
    cost a Python call on every op of the region and find nothing to offload.
    """
    policy.__dict__[_NEVER_OFFLOADS] = True
    return policy


@dataclasses.dataclass(slots=True)
class _Pending:
    """The op whose outputs the forward's policy marked for offload, until its entry is stored.

    Note [Offloading an entry once it is stored]
        Rule 1. The caching mode stores an op's entry after asking the policy, inside its own
                dispatch; matepoint replaces it at the next point its own code runs anyway: the
                policy call of the next op, or the mode's exit at the end of the region's
                forward.
        Rule 2. So an op of the region that offloads nothing (most of them) gets no extra Python
                frame, where a dispatch override on the mode would add one to every op: a
                policy's host cost is what bounds a selective step on a fast device.
        Rule 3. An in-place write by the next op bumps the version only after the mode's handler
                returns, so the entry is replaced first and matepoint's version check finds the
                write in the recomputation. An output whose version moved all the same stays in
                torch's wrapper, whose check raises there.
        Example: under a policy that offloads ``sin``, ``cos(sin(x))``'s policy call for ``cos``
        replaces ``sin``'s entry with its offloaded output (rule 1).

    Held by the policy wrapper and the mode, never referencing the mode, so no reference cycle
    keeps the storage (and the host copies in it) alive until the garbage collector runs.
    """

    storage: Any
    offload: Callable[..., Any] | None
    key: Any = _NO_KEY
    # The marked op's arguments, until its entry is replaced: an output may be a view of one.
    arguments: tuple[Any, ...] = ()

    def flush(self) -> None:
        """Replace the stored entry of the op marked for offload, if any."""
        if self.key is _NO_KEY:
            return
        container = self.storage[self.key]
        self.key = _NO_KEY
        arguments, self.arguments = self.arguments, ()
        # The list's last item or the dict's last inserted key (Note [Selective
        # checkpointing's storage], rule 4): no op stored an entry since the marked one.
        index = next(reversed(container)) if isinstance(container, dict) else -1
        offload = self.offload
        assert offload is not None

        def replace(leaf: Any) -> Any:
            # From 2.14 a wrapper with an unpack hook holds what matepoint's hooks packed already.
            ours = type(leaf) is _VersionWrapper and getattr(leaf, "unpack_hook", None) is None
            if not ours or not isinstance(leaf.val, torch.Tensor):
                return leaf
            # Written in place since it was stored: torch's wrapper raises its error when the
            # recomputation asks for it.
            if leaf.val._version != leaf.version:
                return leaf
            base = _argument_sharing_memory(leaf.val, arguments)
            return offload(leaf.val) if base is None else offload(leaf.val, base)

        # A dispatch mode's handler runs with the ADInplaceOrView key excluded, where detach()
        # makes an alias with a fresh version counter: matepoint's version witness would then
        # miss later in-place writes. torch's own ``_detach_helper`` lifts the exclusion the
        # same way.
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            container[index] = tree_map(replace, container[index])


def _argument_sharing_memory(value: torch.Tensor, arguments: tuple[Any, ...]) -> Any:
    """The op's tensor argument whose storage ``value`` shares (a view op's input), or None.

    The stored alias was made below autograd, so its own ``_base`` is empty. Storages are
    compared as objects (torch keeps one Python object per live storage; every meta tensor's
    ``data_ptr`` is 0).
    """
    storage = value.untyped_storage()
    for argument in arguments:
        if isinstance(argument, torch.Tensor) and argument.untyped_storage() is storage:
            return argument
    return None


def _offload_as_save(policy: Callable[..., Any], pending: _Pending | None) -> Callable[..., Any]:
    """Wrap a policy so that an offload value becomes the save value of the same strength.

    The forward's wrapper (with ``pending``) first replaces the entry the previous op marked
    (Note [Offloading an entry once it is stored]), then marks this op where the policy
    offloads it; under compile it returns the policy's own value, since the storage is then a
    tracing artifact and the partitioner reads that value. The recomputation's wrapper (no
    ``pending``; 2.4-era modes ask the policy again) decides as the forward did.
    """
    must, prefer = _SAVE_FOR_OFFLOAD

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if pending is not None and pending.key is not _NO_KEY:
            pending.flush()
        decision = policy(ctx, func, *args, **kwargs)
        # Identity tests: an enum's hash runs in Python, on every op of a region.
        if decision is not must and decision is not prefer:
            return decision
        if pending is not None and pending.offload is not None:
            if _is_compiling(func, args, kwargs):
                return decision
            pending.key = _storage_key(func, args)
            pending.arguments = args
        return _SAVE_FOR_OFFLOAD[decision]

    return decide


class _OffloadingCachingMode(_CachingMode):  # type: ignore[misc]
    """torch's forward caching mode, whose policy hands offloaded outputs to matepoint.

    Made from the mode the user's ``context_fn`` built (its state copied, so that object stays
    untouched); ``isinstance`` checks torch makes on it (2.14 sets
    ``respect_saved_tensors_hooks`` through one) still hold. Its exit replaces the region's
    last marked entry (Note [Offloading an entry once it is stored]).
    """

    _matepoint_pending: _Pending

    def __exit__(self, *exc_info: Any) -> Any:
        # Off the mode stack first: the offload's own ops are not the region's.
        result = super().__exit__(*exc_info)
        if exc_info[0] is None:
            self._matepoint_pending.flush()
        return result


def offloading_selective_contexts(contexts: Any, offload: Callable[..., Any]) -> Any:
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
        offload: Called with each tensor to offload (a detached alias of the op's output),
            and, where that output shares the memory of one of the op's tensor arguments (a
            view op's), with that argument as a second one (the alias has no ``_base``);
            returns the stored entry.

    Returns:
        The new pair; ``contexts`` itself when it is not the exact pair
        ``create_selective_checkpoint_contexts`` builds (other context managers, subclasses),
        torch's ``CheckpointPolicy`` has no offload values, or the policy is marked
        :func:`never_offloading`.
    """
    pair = tuple(map(type, contexts)) if isinstance(contexts, tuple) else ()
    if not _SAVE_FOR_OFFLOAD or pair != (_CachingMode, _CachedMode):
        return contexts
    forward, recompute = contexts
    if getattr(forward.policy_fn, _NEVER_OFFLOADS, False):
        return contexts
    caching = _OffloadingCachingMode.__new__(_OffloadingCachingMode)
    caching.__dict__.update(vars(forward))
    mutable = getattr(recompute, "allow_cache_entry_mutation", False)
    caching._matepoint_pending = _Pending(forward.storage, None if mutable else offload)
    caching.policy_fn = _offload_as_save(forward.policy_fn, caching._matepoint_pending)
    cached = copy.copy(recompute)
    if getattr(recompute, "policy_fn", None) is not None:  # 2.4-era modes ask the policy again
        cached.policy_fn = _offload_as_save(recompute.policy_fn, None)
    return caching, cached
