"""A short measurement of the real device for the budget plan's time model, cached on disk.

The default :class:`~matepoint.DeviceModel` holds an H200's published peak and the link
bandwidth measured on one H200 host. Real matrix rates are lower than the peak, hosts differ in
their link, and the host time a selective-checkpoint policy adds per op depends on the CPU. A
calibration measures the four on the device itself in a second or two, and caches them per
device name and torch release, so the next plan on that machine reads them back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._budget_profile import DeviceModel

__all__ = ["cached_model", "calibrate"]


def _seconds(device: torch.device, work: Callable[[], object]) -> float:
    """The median of five timings of ``work`` on ``device``'s current stream (device events)."""
    work()
    times: list[float] = []
    for _ in range(5):
        start, end = (compat.new_event(device, enable_timing=True) for _ in range(2))
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _policy_seconds_per_op() -> float:
    """Host time torch's selective-checkpoint mode adds to one small op (forward mode)."""
    if not compat.TORCH_2_5_PLUS:  # no selective checkpointing, nothing to charge
        return 0.0
    x = torch.ones(8, device="cuda")
    ops = 200

    def run(mode: contextlib.AbstractContextManager[Any]) -> float:
        with mode:
            start = time.perf_counter()
            for _ in range(ops):
                x.add(1)
            return time.perf_counter() - start

    # The fastest of a few runs each (a fresh forward mode for each); the first plain run also
    # warms up.
    plain = min(run(contextlib.nullcontext()) for _ in range(6))
    create_contexts: Any = torch_checkpoint.create_selective_checkpoint_contexts
    recompute = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    with_policy = min(run(create_contexts(lambda *_, **__: recompute)[0]) for _ in range(5))
    torch.cuda.synchronize()
    return max(0.0, (with_policy - plain) / ops)


def _measure(device: torch.device) -> DeviceModel:
    """Measure matrix rate, memory bandwidth, the link each way and the policy's cost."""
    with torch.cuda.device(device):
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        matmul = _seconds(device, lambda: a @ a)
        source = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        copy = _seconds(device, lambda: target.copy_(source))
        pinned = compat.allocate_pinned(source.numel())
        to_host = _seconds(device, lambda: pinned.copy_(source, non_blocking=True))
        to_device = _seconds(device, lambda: source.copy_(pinned, non_blocking=True))
        return DeviceModel(
            peak_flops=2 * a.shape[0] ** 3 / matmul,
            memory_bandwidth=2 * source.numel() / copy,
            to_host_bandwidth=source.numel() / to_host,
            to_device_bandwidth=source.numel() / to_device,
            policy_seconds_per_op=_policy_seconds_per_op(),
        )


def calibrate(
    device: torch.device | str = "cuda", *, cache: Path | None = None, refresh: bool = False
) -> DeviceModel:
    """Return a :class:`~matepoint.DeviceModel` measured on ``device``, from the cache if there.

    Takes a second or two on a GPU (a bf16 matrix product, a 256 MiB copy on the device and
    each way over the link, a few hundred small ops with and without a selective-checkpoint
    mode). Pass the result to :meth:`matepoint.MemoryPlan.fastest_under` as ``device=``.

    Args:
        device: A CUDA device. Default: ``"cuda"`` (the current one).
        cache: The cache file, keyed by device name and torch release. Default:
            ``$XDG_CACHE_HOME/matepoint/device-models.json`` (``~/.cache`` without the variable).
        refresh: Measure again even if the cache has this device. Default: ``False``.

    Returns:
        The measured model.

    Raises:
        ValueError: If ``device`` is not a CUDA device, or no GPU is present.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(
            f"calibrate() measures a CUDA device and its link; got {device} "
            f"({'no GPU present' if not torch.cuda.is_available() else 'not CUDA'}); without "
            "one, plans use DeviceModel()'s H200 figures"
        )
    key = f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}"
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = cache or Path(cache_home) / "matepoint" / "device-models.json"
    return cached_model(path, key, lambda: _measure(device), refresh=refresh)


def cached_model(
    path: Path, key: str, measure: Callable[[], DeviceModel], *, refresh: bool = False
) -> DeviceModel:
    """Return the model stored under ``key`` in ``path``, or measure, store and return it.

    Other keys in the file are kept; a file that is missing or cannot be read is measured over,
    not trusted.
    """
    try:
        stored: Any = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stored = {}
    if not isinstance(stored, dict):  # valid JSON, but not what this module writes
        stored = {}
    if not refresh and isinstance(stored.get(key), dict):
        with contextlib.suppress(TypeError):  # fields of another release's DeviceModel
            return DeviceModel(**stored[key])
    model = measure()
    stored[key] = dataclasses.asdict(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=2) + "\n", encoding="utf-8")
    return model
