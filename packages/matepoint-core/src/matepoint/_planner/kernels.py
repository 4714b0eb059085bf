"""What the planner runs instead of two meta paths that allocate unlike their CUDA kernels.

Note [CUDA kernel stand-ins]
    Rule 1. While planning (:class:`CudaKernels`), ``F.scaled_dot_product_attention`` and, from
        torch 2.9, ``F.rms_norm`` on meta tensors are replaced by autograd functions that
        allocate and save exactly what the CUDA kernels allocate and save (flash or
        memory-efficient attention: its inputs, output and log-sum-exp; the fused RMS norm: its
        input and a few statistics), and count their FLOPs. On the meta device the attention
        takes the math path, which materialises and saves the ``seq x seq`` attention matrix,
        and the RMS norm saves a float32 copy of its input: a planner that ran those paths would
        overstate a transformer's activations several times over.
    Rule 2. The attention stand-in's forward is one operator of its own
        (``matepoint_plan::scaled_dot_product_attention``) rather than bare allocations, so that
        a selective-checkpoint policy sees it as attention, as it sees CUDA's fused kernels (a
        budget plan may keep or offload its outputs), and its FLOPs are counted only when it
        runs, not when a policy serves it cached.
    Rule 3. A call the stand-ins do not cover (other devices, other shapes, a mask that needs
        gradients) runs unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import register_flop_formula

import matepoint_compat as compat
from matepoint._planner.trace import MemoryTracker, round_up

__all__ = ["CudaKernels"]


def _attention_outputs(
    query: Tensor, key: Tensor, value: Tensor, flops: int
) -> tuple[Tensor, Tensor]:
    """The output and log-sum-exp of a fused attention kernel, as it allocates them."""
    batch, heads, seq_q, _ = query.shape
    # The kernels write (batch, seq, heads, dim) and return it transposed, so the usual
    # ``out.transpose(1, 2).reshape(b, t, d)`` afterwards is a view, not a copy.
    out = query.new_empty((batch, seq_q, heads, value.shape[-1])).transpose(1, 2)
    return out, query.new_empty((batch, heads, seq_q), dtype=torch.float32)


# The planner's attention operator: it runs on meta tensors only, where the fake implementation
# gives its outputs. The schema is spelled out: this module's annotations are strings, which
# torch 2.4 cannot infer a schema from.
_attention_op = torch.library.custom_op(
    "matepoint_plan::scaled_dot_product_attention",
    mutates_args=(),
    schema="(Tensor query, Tensor key, Tensor value, int flops) -> (Tensor, Tensor)",
)(_attention_outputs)
_attention_op.register_fake(_attention_outputs)


@register_flop_formula(torch.ops.matepoint_plan.scaled_dot_product_attention)
def _attention_op_flops(query: Any, key: Any, value: Any, flops: int, **_: Any) -> int:
    return flops


class _Attention(torch.autograd.Function):
    """Flash / memory-efficient attention: saves q, k, v, the output and its log-sum-exp.

    Its inputs are the query, key and value, and the mask if there is one (saved as well).
    """

    @staticmethod
    def forward(ctx: Any, tracker: MemoryTracker, flops: int, *inputs: Tensor) -> Tensor:
        outputs: tuple[Tensor, Tensor] = _attention_op(*inputs[:3], flops)
        ctx.save_for_backward(*inputs[:3], *outputs, *inputs[3:])
        ctx.tracker, ctx.flops = tracker, flops
        return outputs[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value = ctx.saved_tensors[:3]
        batch, heads, seq_q, dim = query.shape
        scratch: list[Tensor] = []
        if query.dtype in (torch.float16, torch.bfloat16):
            # FlashAttention-2's backward accumulates dq in float32 and keeps softmax row sums.
            rows = round_up(seq_q, 128)
            scratch.append(
                query.new_empty((batch, rows, heads, round_up(dim, 8)), dtype=torch.float32)
            )
            scratch.append(query.new_empty((batch, heads, rows), dtype=torch.float32))
        # The kernels write all three gradients; autograd drops those of inputs without grad.
        grads = [torch.empty_like(tensor) for tensor in (query, key, value)]
        del scratch
        ctx.tracker.flops += 2 * ctx.flops
        return (None, None, *grads, None)  # the last for the mask: dropped when there is none


class _RMSNorm(torch.autograd.Function):
    """torch's fused CUDA RMS norm: saves its input and the float32 ``rstd`` only."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, normalized_dims: int, weight: Tensor | None) -> Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        stats_shape = (*x.shape[: x.dim() - normalized_dims], *(1,) * normalized_dims)
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        ctx.save_for_backward(x, x.new_empty(stats_shape, dtype=stat_dtype), weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        x, _, weight = ctx.saved_tensors
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        needs_weight = weight is not None and ctx.needs_input_grad[2]
        return grad_x, None, torch.empty_like(weight) if needs_weight else None


class CudaKernels(TorchFunctionMode):
    """Route attention and RMS norm on meta tensors to stand-ins that mirror CUDA's kernels.

    See Note [CUDA kernel stand-ins]; a call they do not cover runs unchanged (rule 3).

    Args:
        tracker: The step's tracker, which the stand-ins give their FLOPs to.
    """

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        result = None
        if func is F.scaled_dot_product_attention:
            result = self._attention(*args, **kwargs)
        elif func is F.rms_norm and compat.CUDA_FUSED_RMS_NORM:
            result = self._rms_norm(*args, **kwargs)
        return func(*args, **kwargs) if result is None else result

    def _attention(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **_: Any,
    ) -> Tensor | None:
        if (
            any(t.device.type != "meta" or t.dim() != 4 for t in (query, key, value))
            or not query.is_floating_point()
            or (attn_mask is not None and attn_mask.requires_grad)
        ):
            return None
        batch, heads, seq_q, dim = query.shape
        # Forward FLOPs: ``QK^T`` and ``PV``, halved when causal (masked tiles are skipped).
        flops = 2 * batch * heads * seq_q * key.shape[-2] * (dim + value.shape[-1])
        flops = flops // 2 if is_causal else flops
        inputs = (query, key, value) if attn_mask is None else (query, key, value, attn_mask)
        return cast(Tensor, _Attention.apply(self.tracker, flops, *inputs))  # type: ignore[no-untyped-call]

    def _rms_norm(
        self,
        x: Tensor,
        normalized_shape: Sequence[int],
        weight: Tensor | None = None,
        eps: Any = None,
    ) -> Tensor | None:
        dims = len(normalized_shape)
        if (
            x.device.type != "meta"
            or not x.is_floating_point()
            or tuple(x.shape[x.dim() - dims :]) != tuple(normalized_shape)
            or (weight is not None and weight.dtype != x.dtype)
        ):
            return None
        return cast(Tensor, _RMSNorm.apply(x, dims, weight))  # type: ignore[no-untyped-call]
