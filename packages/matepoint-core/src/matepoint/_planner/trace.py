"""The planner's view of a step on the meta device: device bytes alive op by op, and FLOPs.

Meta tensors have shapes, dtypes and storages but no memory, so a step on them costs no memory
and little time. Every operator output is seen by a dispatch mode, and every storage is watched
through a weak reference whose callback fires when the storage is freed: together they give the
bytes a CUDA caching allocator would have handed out at every moment of the step, exactly as
autograd, checkpointing and the offload engine keep tensors alive or let them go.

Note [Bytes before the step]
    Rule 1. Parameters, buffers, inputs and gradients that exist before the step were allocated
        before tracking started; the tracker learns of them when they are adopted (the
        function's module and arguments) or first used by an operator, and counts them from the
        step's start.
    Rule 2. A timeline sample stores the bytes allocated during the step minus every byte freed
        so far; the pre-existing total, known only at the end, is added when reporting.

Note [cuBLAS workspaces]
    Rule 1. torch gives each thread that runs a matrix product its own cuBLAS handle, with a
        workspace taken from the caching allocator and kept for the life of the process
        (cuBLASLt shares it).
    Rule 2. A training step runs products on two threads: forward on the caller's, backward
        (and the recomputation) on autograd's device thread. Both workspaces exist from the
        first step on, so the planner counts one per phase that runs a product, as memory that
        predates the step.

Note [Meta results reused]
    A plan runs the same step once per strategy, and a budget search once per try: the same ops
    on tensors of the same shapes, whose meta results torch often computes in Python (its
    reference decompositions; docs/planner.md, "Speed", says what that costs).
    Rule 1. An op that writes none of its arguments and returns only fresh tensors (no alias in
        its schema) has results whose dtypes, shapes and strides follow from its arguments'
        dtypes, shapes and strides, its other arguments (their types included:
        ``full(size, True)`` is a bool tensor, ``full(size, 1)`` an integer one) and the
        default dtype.
    Rule 2. The tracker computes such an op's results once per argument signature, with their
        FLOPs, and later makes fresh meta tensors of the same layout instead.
    Rule 3. A result that is an argument's storage, or whose storage is not exactly the one its
        layout makes (as one at an offset is not), is never reused. Anything else runs as it
        is.

Note [Bookkeeping without torch function modes]
    Backward runs with ``CudaKernels`` (``matepoint._planner.kernels``) in force
    (``compat.run_backward``: the recomputation must meet it), and a torch function mode sees
    every tensor method and property called while it is in force, in Python; the tracker reads
    a dozen of them per op (storages, shapes, strides, dtypes).
    Rule 1. The tracker does its bookkeeping with torch function modes off; only the op itself
        runs with them in force, as it would without a tracker.
    Rule 2. Nothing the bookkeeping reads or makes depends on a mode: ``CudaKernels`` passes
        every such call through, and the meta tensors it makes name their device and dtype.
    Rule 3. Recent torch wraps every dispatch mode's handler in a guard that keeps Dynamo from
        compiling it; nothing compiles the planner's meta step, so the tracker declines the
        guard (``compat.UnguardedDispatchMode``).
    docs/planner.md, "Speed", gives what each of these cost a planned step.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
from torch import Tensor

import matepoint_compat as compat

__all__ = ["CUBLAS_WORKSPACE_BYTES", "PHASES", "MemoryTracker", "round_up", "tensors_in"]

# Bytes the CUDA caching allocator rounds every allocation up to (its ``kMinBlockSize``).
ALLOCATION_GRANULARITY = 512
# The cuBLAS workspace torch allocates per handle on a Hopper GPU (8 MiB + 128 KiB on older
# ones). See Note [cuBLAS workspaces].
CUBLAS_WORKSPACE_BYTES = 32 << 20
_MATRIX_PRODUCTS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_addmm_activation", "addbmm"})
PHASES = ("forward", "backward", "after")
# One timeline sample: (FLOPs so far, device bytes, host bytes, host bytes in use, phase index).
# Device bytes are relative; see Note [Bytes before the step], rule 2.
Sample = tuple[int, int, int, int, int]


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


def tensors_in(value: Any) -> list[Tensor]:
    """The tensors in an operator's arguments or results (tuples, lists, dicts), in order.

    A hand-written walk into one list: the planner calls it twice per op, and a pytree flatten
    builds a spec it does not need, nested generators a frame per level (docs/planner.md,
    "Speed").
    """
    if isinstance(value, Tensor):
        return [value]
    found: list[Tensor] = []
    _collect_tensors(value, found)
    return found


def _collect_tensors(value: Any, found: list[Tensor]) -> None:
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (tuple, list)):
        return
    for item in value:
        if isinstance(item, Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            _collect_tensors(item, found)


# See Note [Meta results reused], rule 2: per op and argument signature, a template of each
# result (a meta tensor of its layout, never handed out) and the op's FLOPs. Bounded: cleared
# when it holds _REUSE_LIMIT signatures.
_meta_results: dict[tuple[Any, ...], tuple[tuple[Tensor, ...], int]] = {}
_REUSE_LIMIT = 1 << 16
_PLAIN_VALUES = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)


def _meta_like(tensor: Tensor) -> Tensor:
    """A fresh meta tensor, in a storage of its own, of ``tensor``'s dtype, shape and strides."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


@cache
def _reusable(func: Any) -> bool:
    """Whether an op writes no argument and returns only fresh tensors.

    See Note [Meta results reused], rule 1.
    """
    schema = func._schema
    return (
        not schema.is_mutable
        and bool(schema.returns)
        and all(
            result.alias_info is None and str(result.type) == "Tensor" for result in schema.returns
        )
    )


def _signature(value: Any) -> Any:
    """An argument's part of an op's key; raises TypeError for one the cache cannot key."""
    if isinstance(value, Tensor):
        plain = type(value) in (Tensor, torch.nn.Parameter) and value.is_meta
        if not plain or value.layout != torch.strided:
            raise TypeError("not a plain strided meta tensor")
        return (Tensor, value.dtype, value.shape, value.stride())  # a torch.Size is a tuple
    if isinstance(value, (tuple, list)):
        return (type(value), *[_signature(item) for item in value])
    if isinstance(value, _PLAIN_VALUES) or value is torch.contiguous_format:
        return (type(value), value)
    raise TypeError(f"cannot key a {type(value).__name__}")


def _reuse_key(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """The op's key in ``_meta_results``, or None where its results are not reused."""
    if not _reusable(func):
        return None
    try:
        return (
            func,
            torch.get_default_dtype(),  # a factory without a dtype makes this one
            _signature(args),
            _signature(sorted(kwargs.items())) if kwargs else None,
        )
    except TypeError:
        return None  # an argument the cache cannot key: the op runs


def _run_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    """Run an op, or remake its results, and return them with its FLOPs.

    See Note [Meta results reused], rules 2 and 3. Only the op runs with torch function modes in
    force: see Note [Bookkeeping without torch function modes], rule 1.
    """
    with compat.no_torch_function_modes():
        key = _reuse_key(func, args, kwargs)
        known = _meta_results.get(key) if key is not None else None
        if known is not None:
            templates, flops = known
            results = tuple(_meta_like(template) for template in templates)
            return (results[0] if len(results) == 1 else results), flops
    out = func(*args, **kwargs)
    with compat.no_torch_function_modes():
        flops = compat.op_flops(func, args, kwargs, out)
        produced: tuple[Any, ...] = out if isinstance(out, tuple) else (out,)
        if key is not None and all(
            isinstance(result, Tensor) and result.is_meta and result.layout == torch.strided
            for result in produced
        ):
            inputs = {tensor.untyped_storage()._cdata for tensor in tensors_in((args, kwargs))}
            templates = tuple(_meta_like(result) for result in produced)
            # Note [Meta results reused], rule 3: a result that is an argument's storage after
            # all (a kernel that breaks its schema), or whose storage is not the one its layout
            # makes, is never reused.
            if all(
                result.untyped_storage()._cdata not in inputs
                and result.untyped_storage().nbytes() == template.untyped_storage().nbytes()
                for result, template in zip(produced, templates, strict=True)
            ):
                if len(_meta_results) >= _REUSE_LIMIT:
                    _meta_results.clear()
                _meta_results[key] = (templates, flops)
    return out, flops


class MemoryTracker(compat.UnguardedDispatchMode):
    """Count the bytes of live storages on the meta device (standing in for CUDA), and FLOPs.

    Args:
        host: Returns the host bytes held and in use now (the plan's pinned pool), read at every
            sample. Default: none held.

    Example:
        >>> tracker = MemoryTracker()
        >>> with tracker:
        ...     x = torch.empty(1000, device="meta")
        >>> max(sample[1] for sample in tracker.samples)
        4096
    """

    def __init__(self, host: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.host = host
        self.flops = 0
        self.phase = 0
        self.product_phases: set[int] = set()
        self.device_bytes = 0  # See Note [Bytes before the step], rule 2.
        self.preexisting_bytes = 0
        self.parameter_bytes = 0
        self.samples: list[Sample] = [(0, 0, 0, 0, 0)]
        self.paused = False
        # Each watched storage's weak reference and counted bytes (None: never counted).
        self._watched: dict[int, tuple[weakref.ref[Any], int | None]] = {}
        self._leaves: list[tuple[Tensor, Tensor | None]] = []

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        out, flops = _run_meta(func, args, kwargs)
        # See Note [Bookkeeping without torch function modes], rule 1.
        with compat.no_torch_function_modes():
            self.watch((args, kwargs), preexisting=True)
            self.flops += flops
            if func.overloadpacket.__name__ in _MATRIX_PRODUCTS:
                self.product_phases.add(self.phase)  # Note [cuBLAS workspaces], rule 2.
            self.watch(out, preexisting=False)
        return out

    def allocate_uncounted(self, nbytes: int) -> Tensor:
        """Return a meta block never counted (a host block: host memory, not device memory)."""
        self.paused = True
        block = torch.empty(nbytes, dtype=torch.uint8, device="meta")
        self.paused = False
        storage = block.untyped_storage()
        self._watched[id(storage)] = (weakref.ref(storage, partial(self._freed, id(storage))), None)
        return block

    def watch(self, values: Any, preexisting: bool) -> None:
        """Count the tensors in ``values`` not yet counted: made before the step or during it.

        Tensors made before the step (parameters, inputs, gradients) are adopted: see Note
        [Bytes before the step], rule 1.
        """
        for tensor in tensors_in(values):
            if not tensor.is_meta or tensor.layout != torch.strided:
                continue
            storage = tensor.untyped_storage()
            key = id(storage)
            # An op's inputs: one seen before can only have been resized as an output.
            if preexisting and key in self._watched:
                continue
            nbytes = round_up(storage.nbytes(), ALLOCATION_GRANULARITY)
            if key in self._watched:
                reference, counted = self._watched[key]
                if counted is None or counted == nbytes:  # a host block, or not resized
                    continue
            else:
                reference, counted = weakref.ref(storage, partial(self._freed, key)), 0
            self._watched[key] = (reference, nbytes)
            if not preexisting:
                self.device_bytes += nbytes - counted
                self.sample()
                continue
            self.preexisting_bytes += nbytes
            if tensor.is_leaf and tensor.requires_grad:
                self._leaves.append((tensor, tensor.grad))
            if isinstance(tensor, torch.nn.Parameter):
                self.parameter_bytes += nbytes

    def _freed(self, key: int, _reference: Any) -> None:
        self.device_bytes -= self._watched.pop(key)[1] or 0
        self.sample()

    def sample(self) -> None:
        """Append the current state to the timeline."""
        self.samples.append((self.flops, self.device_bytes, *self.host(), self.phase))

    def end_phase(self) -> Sample:
        """Sample the current moment, move to the next phase and return the sample."""
        self.sample()
        self.phase += 1
        return self.samples[-1]

    def close(self) -> None:
        """Stop sampling, add the workspaces, and give every leaf seen its gradient from before.

        Planning runs the same step several times (one per strategy), each from the same
        state; the gradients a step accumulated would otherwise count as existing in the next.
        """
        self.sample()
        self._watched.clear()  # their weak references go, and with them the callbacks
        self.preexisting_bytes += len(self.product_phases) * CUBLAS_WORKSPACE_BYTES
        for tensor, grad in self._leaves:
            tensor.grad = grad
