"""Stream, event and pinned-memory calls, spelled the way the installed torch spells them.

matepoint's CUDA transport talks to the device only through these functions and the device module
:func:`device_module` returns, so the transport itself stays version-free.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from matepoint_compat._version import TORCH_2_13_PLUS

__all__ = [
    "allocate_pinned",
    "delay_stream",
    "device_module",
    "new_event",
    "new_stream",
    "per_process_memory_cap",
    "set_current_stream",
    "storage_use_count",
    "stream_context",
]


# The torch module of a device type (``torch.cuda`` for ``cuda``), for a device or its name.
# ``torch.get_device_module`` exists on every supported release (2.3+); ``torch.accelerator``
# (2.6+) does not cover events and stream contexts for all backends, so the per-type module is
# the one spelling that works from 2.4 to the newest.
device_module = torch.get_device_module


def new_stream(device: torch.device) -> Any:
    """Create a stream on ``device`` (matepoint's side stream for copies)."""
    return device_module(device).Stream(device=device)


def new_event(device: torch.device, *, enable_timing: bool = False) -> Any:
    """Create an event usable on ``device``'s streams."""
    return device_module(device).Event(enable_timing=enable_timing)


def stream_context(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Return a context manager that makes ``stream`` current for its device."""
    return device_module(stream.device).stream(stream)  # type: ignore[no-any-return]


def set_current_stream(module: Any, stream: Any) -> None:
    """Make ``stream`` current on its device, which must already be the current device.

    The cheap switch for the offload hot path: ``torch.cuda.stream(...)`` looks the current device
    up through the slow generic device query twice per use (tens of microseconds on a launch-bound
    forward); ``set_stream`` is one call into torch. Callers restore the previous stream
    themselves and use :func:`stream_context` when the stream's device is not the current one
    (``set_stream`` would also switch the current device).

    Args:
        module: The device's torch module (:func:`device_module`), looked up once by the caller.
        stream: The stream to make current.
    """
    module.set_stream(stream)


def delay_stream(stream: Any, cycles: int) -> None:
    """Queue a busy-wait of ``cycles`` GPU cycles on ``stream`` (a debug knob for race probes).

    Uses ``torch.cuda._sleep``, which torch has kept private on every release (present on 2.4 to
    2.15; run by the GPU tests on 2.11); without it the delay is skipped (the probe then tests
    less, it never breaks a run).
    """
    if cycles > 0 and stream.device.type == "cuda" and hasattr(torch.cuda, "_sleep"):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(int(cycles))  # type: ignore[no-untyped-call]


def allocate_pinned(nbytes: int) -> torch.Tensor:
    """Allocate ``nbytes`` of page-locked host memory, costing ``nbytes`` of RAM (no rounding).

    On torch 2.4-2.12 the caching host allocator rounds each pinned block up to a power of two (a
    96 MiB tensor costs 128 MiB), so there the memory is taken as an ordinary host tensor and
    page-locked with ``cudaHostRegister``; it is unregistered when the tensor dies. From 2.13 the
    allocator hands out exact sizes and is used directly. The register path can go when torch 2.13
    is the oldest supported release. The block names its device: under ``torch.device("cuda")`` or
    ``torch.set_default_device("cuda")`` an unnamed factory would allocate on the GPU.

    Args:
        nbytes: The size of the block in bytes (at least 1).

    Returns:
        A 1-D ``uint8`` CPU tensor of ``nbytes`` elements whose memory is pinned. Keep this tensor
        for as long as any view of it is in use.

    Raises:
        RuntimeError: If the memory cannot be allocated or page-locked (out of host memory, or a
            limit on locked memory).
    """
    block = torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=TORCH_2_13_PLUS)
    if TORCH_2_13_PLUS:
        return block
    address = block.data_ptr()
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    code = int(cudart.cudaHostRegister(address, nbytes, 0))  # a pybind11 enum of cudaError_t
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {code}")
    # The finalizer hangs on the returned tensor: callers keep it for the block's whole life and
    # only make short-lived views of it.
    weakref.finalize(block, cudart.cudaHostUnregister, address)
    return block


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """Return how many tensors share ``tensor``'s storage, or None where torch cannot tell.

    matepoint reports offloads that freed no device memory (the storage is kept alive elsewhere).
    torch offers the count only through the private ``torch._C._storage_Use_Count``, present on
    every release from 2.4 to 2.15 (checked by the test matrix); where a release lacks it, the
    count is None and only that report loses it.
    """
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    # The Python storage object made for the query holds one reference of its own.
    return int(use_count(tensor.untyped_storage()._cdata)) - 1


def per_process_memory_cap(device: torch.device) -> int | None:
    """The bytes the caching allocator may hold on CUDA ``device``, or None without a cap.

    ``torch.cuda.set_per_process_memory_fraction`` caps what this process's allocator may hold
    at that fraction of the device's memory; a plan for "what this device can give" must stay
    under it. torch reads the fraction back with ``torch.cuda.get_per_process_memory_fraction``
    (from 2.6 on); where a release lacks it, the cap cannot be read and this says None, so a
    caller plans to the device's free memory. The shim can go when torch 2.6 is the oldest
    supported release.
    """
    read: Any = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if read is None:
        return None
    # torch reads the fraction of a numbered device only: "cuda" is the current one.
    number: int | None = device.index  # None for "cuda", whatever the stubs say
    index = torch.cuda.current_device() if number is None else number
    fraction = float(read(index))
    if fraction >= 1.0:
        return None
    return int(fraction * torch.cuda.get_device_properties(index).total_memory)
