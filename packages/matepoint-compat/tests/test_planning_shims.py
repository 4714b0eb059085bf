"""The planner's shims: FLOPs of an operator, checkpointing on meta tensors, backward in a mode."""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.overrides import TorchFunctionMode

import matepoint_compat as compat


class _Flops(compat.TorchDispatchMode):  # type: ignore[no-untyped-call,misc]
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.flops = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        self.flops += compat.op_flops(func, args, kwargs or {}, out)
        return out


def test_op_flops_counts_a_matrix_product_and_nothing_else() -> None:
    a = torch.empty(64, 32, device="meta")
    b = torch.empty(32, 16, device="meta")
    with _Flops() as counter:
        (a @ b).relu()
    assert counter.flops == 2 * 64 * 32 * 16


def test_checkpoint_runs_on_meta_tensors() -> None:
    x = torch.empty(8, 8, device="meta", requires_grad=True)
    with compat.meta_checkpointing():
        for reentrant in (False, True):
            y = torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=reentrant)
            y.sum().backward()
    assert x.grad is not None
    assert x.grad.device.type == "meta"
    assert not hasattr(torch, "meta") or compat.TORCH_2_6_PLUS


class _Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.sines = 0

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if func in (torch.sin, torch.Tensor.sin):
            self.sines += 1
        return func(*args, **(kwargs or {}))


def test_run_backward_keeps_a_function_mode_in_force() -> None:
    x = torch.empty(4, device="meta", requires_grad=True)
    with compat.meta_checkpointing(), _Counting() as mode:
        loss = torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum()
        compat.run_backward(loss)
    assert mode.sines == 2  # forward, and the recomputation inside backward
    assert x.grad is not None
