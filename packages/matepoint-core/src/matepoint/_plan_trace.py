"""The planner's memory tracker: device bytes alive, op by op, during a step on the meta device.

Meta tensors have shapes, dtypes and storages but no memory, so a step on them costs no memory
and little time. Every operator output is seen by a dispatch mode, and every storage is watched
through a weak reference whose callback fires when the storage is freed: together they give the
bytes a CUDA caching allocator would have handed out at every moment of the step, exactly as
autograd, checkpointing and the offload engine keep tensors alive or let them go.

Note [Bytes before the step]
    Parameters, buffers, inputs and gradients existing before the step are allocated before
    tracking starts. The tracker learns of them when they are adopted (the function's module
    and arguments) or first used by an operator, and counts them from the step's start: a
    timeline sample stores the bytes allocated during the step minus the pre-existing bytes
    freed so far, and the pre-existing total (known at the end) is added when reporting.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

import matepoint_compat as compat

__all__ = ["ALLOCATION_GRANULARITY", "MemoryTracker", "Sample", "allocation_size"]

ALLOCATION_GRANULARITY = 512
"""Bytes the CUDA caching allocator rounds every allocation up to (its ``kMinBlockSize``)."""

CUBLAS_WORKSPACE_BYTES = 32 << 20
"""The cuBLAS workspace torch allocates per handle on a Hopper GPU (8 MiB + 128 KiB on older ones).

See Note [cuBLAS workspaces]."""

# Note [cuBLAS workspaces]
#     torch gives each thread that runs a matrix product its own cuBLAS handle, with a workspace
#     taken from the caching allocator and kept for the life of the process (cuBLASLt shares it).
#     A training step runs products on two threads: forward on the caller's, backward (and the
#     recomputation) on autograd's device thread. Both workspaces exist from the first step on, so
#     the planner counts one per phase that runs a product, as memory that predates the step.
_MATRIX_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm"})

Sample = tuple[int, int, int, int, int]
"""One timeline sample: ``(flops so far, device bytes, host bytes, host bytes in use, phase)``.

Device bytes are relative; see Note [Bytes before the step].
"""

PHASES = ("forward", "backward", "after")


def allocation_size(nbytes: int) -> int:
    """Return what the CUDA caching allocator counts for a storage of ``nbytes``."""
    if nbytes <= 0:
        return 0
    return -(-nbytes // ALLOCATION_GRANULARITY) * ALLOCATION_GRANULARITY


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Yield the tensors in an operator's arguments or results (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


class _Live:
    """A watched storage: its weak reference, counted bytes and whether it predates the step."""

    __slots__ = ("nbytes", "preexisting", "reference")

    def __init__(self, reference: weakref.ref[Any], nbytes: int, preexisting: bool) -> None:
        self.reference = reference
        self.nbytes = nbytes
        self.preexisting = preexisting


class MemoryTracker(compat.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Count the bytes of live storages on ``device_type`` through a step, and its FLOPs.

    Args:
        device_type: The device whose memory is counted (``"meta"``, standing in for CUDA).
        workspace_bytes: The cuBLAS workspace of each thread that runs a matrix product.
            Default: :data:`CUBLAS_WORKSPACE_BYTES`. See Note [cuBLAS workspaces].

    Example:
        >>> tracker = MemoryTracker("meta")
        >>> with tracker:
        ...     x = torch.empty(1000, device="meta")
        >>> tracker.peak_bytes()
        4096
    """

    def __init__(
        self, device_type: str = "meta", workspace_bytes: int = CUBLAS_WORKSPACE_BYTES
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type
        self.workspace_bytes = workspace_bytes
        self.workspace_phases: set[int] = set()
        self.flops = 0
        self.phase = 0
        self.step_bytes = 0
        self.preexisting_bytes = 0
        self.preexisting_freed = 0
        self.parameter_bytes = 0
        # Host bytes held and in use now (the plan's pinned pool), read at every sample.
        self.host: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.samples: list[Sample] = [(0, 0, 0, 0, 0)]
        self.marks: dict[str, int] = {}
        self.flops_at: dict[str, int] = {}
        self.paused = 0
        self.closed = False
        self._live: dict[int, _Live] = {}
        self._leaves: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    # -- what the step allocates -----------------------------------------------------------

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        for tensor in _tensors((args, kwargs)):
            self._watch(tensor, preexisting=True)
        flops = compat.op_flops(func, args, kwargs, out)
        if flops:
            self.flops += flops
        if self.phase not in self.workspace_phases and self._is_product(func):
            # See Note [cuBLAS workspaces].
            self.workspace_phases.add(self.phase)
            self.preexisting_bytes += self.workspace_bytes
        for tensor in _tensors(out):
            self._watch(tensor, preexisting=False)
        return out

    @staticmethod
    def _is_product(func: Any) -> bool:
        packet = getattr(func, "overloadpacket", None)
        return getattr(packet, "__name__", "") in _MATRIX_PRODUCTS

    def adopt(self, tensor: torch.Tensor) -> None:
        """Count a tensor that exists before the step (a parameter, an input, a gradient)."""
        self._watch(tensor, preexisting=True)

    def exclude(self, tensor: torch.Tensor) -> None:
        """Never count ``tensor``'s storage (a host block: host memory, not device memory)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        self._live[key] = _Live(weakref.ref(storage, self._freed_callback(key)), 0, True)

    def _watch(self, tensor: torch.Tensor, preexisting: bool) -> None:
        if tensor.device.type != self.device_type or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        live = self._live.get(key)
        nbytes = allocation_size(storage.nbytes())
        if live is not None:
            if nbytes != live.nbytes and not live.preexisting:  # resized in place
                self.step_bytes += nbytes - live.nbytes
                live.nbytes = nbytes
                self.sample()
            return
        reference = weakref.ref(storage, self._freed_callback(key))
        self._live[key] = _Live(reference, nbytes, preexisting)
        if preexisting:
            self.preexisting_bytes += nbytes
            if tensor.is_leaf and tensor.requires_grad:
                self._leaves.append((tensor, tensor.grad))
            if isinstance(tensor, torch.nn.Parameter):
                self.parameter_bytes += nbytes
        else:
            self.step_bytes += nbytes
            self.sample()

    def _freed_callback(self, key: int) -> Any:
        def freed(_reference: Any) -> None:
            live = self._live.pop(key, None)
            if live is None or self.closed:
                return
            if live.preexisting:
                self.preexisting_freed += live.nbytes
            else:
                self.step_bytes -= live.nbytes
            self.sample()

        return freed

    # -- samples ---------------------------------------------------------------------------

    def sample(self) -> None:
        """Append the current state to the timeline."""
        host, host_in_use = self.host()
        device = self.step_bytes - self.preexisting_freed
        self.samples.append((self.flops, device, host, host_in_use, self.phase))

    def add_flops(self, flops: int) -> None:
        """Count FLOPs of work the tracker cannot see as operators (imitated kernels)."""
        self.flops += flops

    def mark(self, name: str) -> None:
        """Name the current moment (``"forward_end"``) and move to the next phase."""
        self.sample()
        self.marks[name] = len(self.samples) - 1
        self.flops_at[name] = self.flops
        self.phase = min(self.phase + 1, len(PHASES) - 1)

    def close(self) -> None:
        """Stop sampling and give every leaf seen the gradient it had before the step.

        Planning runs the same step several times (one per strategy), each from the same
        state; the gradients a step accumulated would otherwise count as existing in the next.
        """
        self.sample()
        self.closed = True
        for tensor, grad in self._leaves:
            tensor.grad = grad
        self._leaves.clear()

    # -- results ---------------------------------------------------------------------------

    def peak_bytes(self) -> int:
        """Return the most device bytes alive at any moment of the step."""
        return max(sample[1] for sample in self.samples) + self.preexisting_bytes
