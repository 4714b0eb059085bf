"""Parameters across ranks for :mod:`.distributed`: gather, norm, compare."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["checksums", "compare_params", "full_params", "grad_norm"]

_WRAPPED_PREFIX = "_checkpoint_wrapped_module."


def _clean_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP's ``module.``, the checkpoint's)."""
    name = name.replace(_WRAPPED_PREFIX, "")
    return name.removeprefix("module.")


def _full(tensor: Tensor) -> Tensor:
    """The full tensor of an FSDP2 shard (a collective: every rank must call it), else itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _local(tensor: Tensor) -> Tensor:
    """This rank's piece of an FSDP2 shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def grad_norm(model: nn.Module, sharded: bool) -> float:
    """The global gradient norm (sharded: the squares of each rank's shard summed over ranks)."""
    total = torch.zeros((), dtype=torch.float64)
    for parameter in model.parameters():
        if parameter.grad is not None:
            total += _local(parameter.grad).detach().double().square().sum().cpu()
    if sharded:
        device = next(model.parameters()).device
        total = total.to(device)
        dist.all_reduce(total)
    return math.sqrt(float(total))


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter, whole, in float32 on the CPU, by its unwrapped name (all ranks call it)."""
    return {
        _clean_name(name): _full(parameter.detach()).float().cpu()
        for name, parameter in model.named_parameters()
    }


def checksums(params: dict[str, Tensor]) -> dict[str, Any]:
    total = sum(float(t.double().sum()) for t in params.values())
    total_abs = sum(float(t.double().abs().sum()) for t in params.values())
    return {
        "sum": total,
        "abs_sum": total_abs,
        "per_parameter_sum": {name: float(t.double().sum()) for name, t in params.items()},
    }


def compare_params(
    got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float
) -> dict[str, Any]:
    """Compare two parameter dictionaries with ``torch.allclose`` and report the largest gaps.

    Args:
        got: Parameters by name.
        want: Reference parameters by name (the same names and shapes).
        rtol: Relative tolerance.
        atol: Absolute tolerance.

    Returns:
        ``{"allclose", "bitwise_equal", "max_abs_diff", "max_rel_diff", "worst_parameter"}``.

    Raises:
        ValueError: If the names or shapes differ.
    """
    if set(got) != set(want):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(want))}")
    allclose = bitwise = True
    max_abs = max_rel = 0.0
    worst = ""
    for name, reference in want.items():
        value = got[name]
        if value.shape != reference.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(reference.shape)}")
        diff = (value.double() - reference.double()).abs()
        abs_diff = float(diff.max()) if diff.numel() else 0.0
        relative = diff / reference.double().abs().clamp_min(1e-30)
        rel_diff = float(relative.max()) if diff.numel() else 0.0
        allclose &= torch.allclose(value, reference, rtol=rtol, atol=atol)
        bitwise &= torch.equal(value, reference)
        if abs_diff > max_abs:
            max_abs, worst = abs_diff, name
        max_rel = max(max_rel, rel_diff)
    return {
        "allclose": allclose,
        "bitwise_equal": bitwise,
        "rtol": rtol,
        "atol": atol,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst_parameter": worst,
    }
