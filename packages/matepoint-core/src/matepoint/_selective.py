"""Selective checkpointing with offload: a policy's ``*_CPU_OFFLOAD`` outputs go to host memory.

Note [Offloading what a selective policy saves]
    torch's eager checkpoint recomputes the ops a selective-checkpoint policy marks
    ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``; matepoint offloads their outputs.
    Rule 1. When a call with such a ``context_fn`` offloads, the forward saves those outputs, and
            the entry stored for each is what :func:`matepoint._engine.saving.pack` returns for
            it (a ``Record`` copying on the side stream, or a ``KeptTensor`` where a keep rule
            applies) instead of the device tensor.
    Rule 2. The recomputation asks the entry for its value, which
            :func:`matepoint._engine.saving.unpack` brings back: the op does not run again.
    Rule 3. So the engine's rules apply to these outputs as to checkpoint inputs (keep rules,
            dedupe, stash, look-ahead, bytes in flight, version checks, stream ordering), and a
            host copy lives as long as torch's storage entry: until the recomputation consumes
            it, or the graph dies.
    Rule 4. torch stores a detached alias of each output, made below autograd: a view of a
            parameter (``weight.t()``, a slice) has lost its ``_base`` there. So the op's
            argument whose memory the output shares comes with it as its ``base``, and the keep
            rules see through to it: a view of a parameter stays on the device, counted as a
            parameter, as a checkpoint input that is one does.
    Example: a block's offloaded output that is also the next checkpoint's input (same memory
    and version) is one record (rule 3, dedupe): it crosses the link once.
    How torch's private modes are reached: Note [Selective checkpointing's storage] in
    ``matepoint_compat._selective``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import matepoint_compat as compat
from matepoint._engine.channel_engine import Record
from matepoint._engine.saving import KeptTensor, pack, unpack
from matepoint._errors import InplaceModificationError
from matepoint._options import ResolvedOptions

__all__ = ["offload_policy_outputs"]


class _OffloadedOutput:
    """The storage entry of one offloaded policy output: torch asks it for the tensor back.

    Stands in for torch's ``_VersionWrapper``; the version check it makes is the one
    :func:`matepoint._engine.saving.unpack` makes on every saved tensor, worded here as torch
    words it.
    """

    __slots__ = ("options", "saved")

    def __init__(self, saved: Record | KeptTensor, options: ResolvedOptions) -> None:
        self.saved = saved
        self.options = options

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        """Return the device tensor (the caller never allows mutation here; see compat)."""
        try:
            return unpack(self.saved, self.options)
        except InplaceModificationError as error:
            raise InplaceModificationError(
                "Tensor cached during selective activation checkpoint has been mutated (an "
                f"output that matepoint offloaded for the policy; {error})"
            ) from error


def offload_policy_outputs(
    context_fn: Callable[[], Any], options: ResolvedOptions
) -> Callable[[], Any]:
    """Wrap a checkpoint's ``context_fn`` so its policy's CPU-offload outputs go to the host.

    See Note [Offloading what a selective policy saves]. Contexts other than torch's
    selective-checkpoint pair, or a budget plan's scoping of it, are returned as the
    ``context_fn`` made them.

    Args:
        context_fn: The checkpoint call's ``context_fn``.
        options: The call's resolved options (``pipelined`` among them).

    Returns:
        A ``context_fn`` to give torch's checkpoint instead.
    """

    def offload(tensor: torch.Tensor, base: torch.Tensor | None = None) -> _OffloadedOutput:
        # Pack hooks run under no-grad; so does this, from inside the forward.
        with torch.no_grad():
            saved = pack(tensor, options, base)  # See the Note's rule 4.
        if isinstance(saved, Record) and saved.packs == 1:
            # A new record (a shared one has packs > 1): count it as the policy's.
            with saved.owner.lock:
                saved.owner.counters.policy_offloads += 1
                saved.owner.counters.bytes_offloaded_by_policy += saved.nbytes
        return _OffloadedOutput(saved, options)

    def offloading_context_fn() -> Any:
        contexts = context_fn()
        # A budget plan's scoped modes hold torch's pair inside (Note [Scoped
        # selective-checkpoint modes] in matepoint._planner.scoped_modes).
        with_modes = getattr(contexts, "with_modes", None)
        if with_modes is not None:
            return with_modes(compat.offloading_selective_contexts(contexts.modes, offload))
        return compat.offloading_selective_contexts(contexts, offload)

    return offloading_context_fn
