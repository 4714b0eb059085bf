"""Stand-ins, on meta tensors, for CUDA kernels whose memory differs from their meta fallback.

On the meta device ``F.scaled_dot_product_attention`` takes the math path, which materialises
and saves the ``seq x seq`` attention matrix, and ``F.rms_norm`` saves a float32 copy of its
input. On CUDA both run fused kernels (flash or memory-efficient attention; the fused RMS norm
from torch 2.9) that save only their inputs, outputs and a few statistics. A planner that ran the
meta paths would overstate a transformer's activations several times over, so while planning
these two calls are replaced by autograd functions that allocate and save exactly what the CUDA
kernels allocate and save, and count their FLOPs.

The attention stand-in's forward is one operator of its own (``matepoint_plan::
scaled_dot_product_attention``) rather than bare allocations, so that a selective-checkpoint
policy sees it as attention, as it sees CUDA's fused kernels (a budget plan may keep or offload
its outputs), and its FLOPs are counted only when it runs, not when a policy serves it cached.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

import matepoint_compat as compat
from matepoint._plan_trace import MemoryTracker

__all__ = ["CudaKernels"]

_FLASH_DTYPES = (torch.float16, torch.bfloat16)


# The schema is spelled out: this module's annotations are strings, which torch 2.4 cannot infer
# a schema from.
@torch.library.custom_op(
    "matepoint_plan::scaled_dot_product_attention",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, int flops) -> (Tensor, Tensor)",
)
def _attention_op(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, flops: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The output and log-sum-exp of a fused attention kernel; planned on meta tensors only."""
    raise RuntimeError("matepoint's planning attention runs on meta tensors only")


@_attention_op.register_fake
def _attention_outputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, flops: int
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, _ = query.shape
    # The kernels write (batch, seq, heads, dim) and return it transposed, so the usual
    # ``out.transpose(1, 2).reshape(b, t, d)`` afterwards is a view, not a copy.
    out = query.new_empty((batch, seq_q, heads, value.shape[-1])).transpose(1, 2)
    return out, query.new_empty((batch, heads, seq_q), dtype=torch.float32)


@register_flop_formula(torch.ops.matepoint_plan.scaled_dot_product_attention)
def _attention_op_flops(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
    flops: int = args[3] if len(args) > 3 else kwargs["flops"]
    return flops


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class _Attention(torch.autograd.Function):
    """Flash / memory-efficient attention: saves q, k, v, the output and its log-sum-exp."""

    @staticmethod
    def forward(
        ctx: Any,
        tracker: MemoryTracker,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        flops: int,
    ) -> torch.Tensor:
        outputs: tuple[torch.Tensor, torch.Tensor] = _attention_op(query, key, value, flops)
        out, logsumexp = outputs
        saved = (query, key, value, out, logsumexp) + ((mask,) if mask is not None else ())
        ctx.save_for_backward(*saved)
        ctx.tracker = tracker
        ctx.flops = flops
        ctx.flash = query.dtype in _FLASH_DTYPES
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        query, key, value = ctx.saved_tensors[:3]
        batch, heads, seq_q, dim = query.shape
        scratch: list[torch.Tensor] = []
        if ctx.flash:
            # FlashAttention-2's backward accumulates dq in float32 and keeps softmax row sums.
            seq_rounded = _round_up(seq_q, 128)
            shape = (batch, seq_rounded, heads, _round_up(dim, 8))
            scratch.append(query.new_empty(shape, dtype=torch.float32))
            scratch.append(query.new_empty((batch, heads, seq_rounded), dtype=torch.float32))
        grads = (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value))
        del scratch
        ctx.tracker.add_flops(2 * ctx.flops)
        needs = ctx.needs_input_grad
        return (None, *(g if needs[i + 1] else None for i, g in enumerate(grads)), None, None)


class _RMSNorm(torch.autograd.Function):
    """torch's fused CUDA RMS norm: saves its input and the float32 ``rstd`` only."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        normalized_dims: int,
        weight: torch.Tensor | None,
    ) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        stats_shape = tuple(x.shape[: x.dim() - normalized_dims]) + (1,) * normalized_dims
        rstd = x.new_empty(stats_shape, dtype=stat_dtype)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, _, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[2] else None
        )
        return grad_x, None, grad_weight


def _attention_flops(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, causal: bool
) -> int:
    """Forward FLOPs of attention: ``QK^T`` and ``PV``, halved when causal (masked tiles skip)."""
    batch, heads, seq_q, dim = query.shape
    seq_k = key.shape[-2]
    flops = 2 * batch * heads * seq_q * seq_k * (dim + value.shape[-1])
    return flops // 2 if causal else flops


class CudaKernels(TorchFunctionMode):
    """Route attention and RMS norm on meta tensors to stand-ins that mirror CUDA's kernels.

    Anything these stand-ins do not cover (other devices, other shapes, a mask that needs
    gradients) runs the call unchanged.

    Args:
        tracker: The step's tracker, which the stand-ins give their FLOPs to.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            result = self._attention(*args, **kwargs)
            if result is not None:
                return result
        elif func is F.rms_norm and compat.CUDA_FUSED_RMS_NORM:
            result = self._rms_norm(*args, **kwargs)
            if result is not None:
                return result
        return func(*args, **kwargs)

    def _attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor | None:
        tensors = (query, key, value)
        if (
            any(t.device.type != "meta" or t.dim() != 4 for t in tensors)
            or not query.is_floating_point()
            or (attn_mask is not None and attn_mask.requires_grad)
        ):
            return None
        flops = _attention_flops(query, key, value, is_causal)
        out: torch.Tensor = _Attention.apply(  # type: ignore[no-untyped-call]
            self.tracker, query, key, value, attn_mask, flops
        )
        return out

    def _rms_norm(
        self,
        x: torch.Tensor,
        normalized_shape: list[int] | tuple[int, ...],
        weight: torch.Tensor | None = None,
        eps: float | None = None,
    ) -> torch.Tensor | None:
        dims = len(normalized_shape)
        if (
            x.device.type != "meta"
            or not x.is_floating_point()
            or tuple(x.shape[x.dim() - dims :]) != tuple(normalized_shape)
            or (weight is not None and weight.dtype != x.dtype)
        ):
            return None
        out: torch.Tensor = _RMSNorm.apply(x, dims, weight)  # type: ignore[no-untyped-call]
        return out
