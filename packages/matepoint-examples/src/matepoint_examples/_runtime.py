"""Small device and process helpers shared by the demo and the benchmark."""

from __future__ import annotations

import torch
from torch import nn

# The project's one byte formatter and one RSS reader live in core (this package pins its release).
from matepoint._engine.stats import format_bytes, rss_bytes

__all__ = [
    "allocated_bytes",
    "format_bytes",
    "parameter_bytes",
    "peak_bytes",
    "reset_peak",
    "resolve_device",
    "rss_bytes",
    "synchronize",
]


def resolve_device(name: str) -> torch.device:
    """Turn ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` into a device.

    Args:
        name: The requested device; ``"auto"`` picks CUDA when available.

    Returns:
        The device.

    Raises:
        SystemExit: If CUDA is requested but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (a no-op on CPU), so host timers mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated_bytes(device: torch.device) -> int | None:
    """Return the bytes held by the caching allocator on ``device``, or ``None`` on CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    """Reset the allocator's peak counter on ``device`` (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device: torch.device) -> int | None:
    """Return the allocator's peak since the last :func:`reset_peak`, or ``None`` on CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def parameter_bytes(model: nn.Module) -> int:
    """Return the bytes of ``model``'s parameters."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
