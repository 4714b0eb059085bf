"""The one place that reads the installed torch version and turns it into named gates.

Every other module in matepoint asks these booleans instead of comparing versions itself, so a
shim can be found (and deleted) by grepping for its gate.
"""

from __future__ import annotations

import re

import torch

__all__ = [
    "TORCH_2_5_PLUS",
    "TORCH_2_6_PLUS",
    "TORCH_2_8_PLUS",
    "TORCH_2_9_PLUS",
    "TORCH_2_11_PLUS",
    "TORCH_2_12_PLUS",
    "TORCH_2_13_PLUS",
    "TORCH_2_14_PLUS",
    "TORCH_VERSION",
    "parse_base_version",
]


def parse_base_version(version: str) -> tuple[int, int, int]:
    """Return the release a torch version string belongs to, as a comparable tuple.

    Nightlies (``2.15.0.dev20260101``), local builds (``2.13.0+cpu``) and release candidates count
    as their base release, so a gate means "this release's behaviour", whatever the build.

    Args:
        version: A version string such as ``torch.__version__``.

    Returns:
        ``(major, minor, patch)``; a missing patch counts as 0.

    Raises:
        ValueError: If the string does not start with ``major.minor``.

    Example:
        >>> parse_base_version("2.13.0+cpu")
        (2, 13, 0)
    """
    match = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        raise ValueError(f"cannot read a torch release from version string {version!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


TORCH_VERSION: tuple[int, int, int] = parse_base_version(torch.__version__)
"""The installed torch's base release, ``(major, minor, patch)``, read once at import."""

TORCH_2_5_PLUS: bool = TORCH_VERSION >= (2, 5, 0)
"""``Tensor.pin_memory(device)`` is deprecated from 2.5 on; 2.4's checkpoint still recomputes under
the deprecated ``torch.cpu.amp.autocast`` (and warns about it)."""
TORCH_2_6_PLUS: bool = TORCH_VERSION >= (2, 6, 0)
"""``torch.accelerator`` (current stream, device index) exists from 2.6 on."""
TORCH_2_8_PLUS: bool = TORCH_VERSION >= (2, 8, 0)
"""``torch._C._autograd._top_saved_tensors_default_hooks`` (reads the hook stack): 2.8+."""
TORCH_2_9_PLUS: bool = TORCH_VERSION >= (2, 9, 0)
"""``torch.utils.checkpoint.checkpoint`` takes ``early_stop=`` from 2.9 on."""
TORCH_2_11_PLUS: bool = TORCH_VERSION >= (2, 11, 0)
"""matepoint's compiled path (``_compile.COMPILED_OFFLOAD``) is checked from 2.11 on."""
TORCH_2_12_PLUS: bool = TORCH_VERSION >= (2, 12, 0)
"""``streams::record_stream`` (compiled transfer-stream offload) compiles from 2.12 on."""
TORCH_2_13_PLUS: bool = TORCH_VERSION >= (2, 13, 0)
"""The caching host allocator stops rounding pinned blocks up to a power of two from 2.13 on."""
TORCH_2_14_PLUS: bool = TORCH_VERSION >= (2, 14, 0)
"""Checkpoint takes ``respect_saved_tensors_hooks=`` and ``function=None`` from 2.14 on."""
