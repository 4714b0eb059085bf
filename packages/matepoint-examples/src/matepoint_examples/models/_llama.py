"""A Llama-style decoder stack: RMSNorm, rotary attention through SDPA, a SwiGLU MLP.

The workload of the memory-budget work: its blocks hold what a selective-checkpoint policy
chooses between (attention, and matrix products of four shapes), so a plan can keep, offload or
recompute each kind.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matepoint_examples.models._common import CheckpointFn, no_checkpoint

__all__ = ["LlamaBlock", "LlamaConfig", "LlamaStack"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a :class:`LlamaStack`.

    Args:
        depth: Number of blocks. Default: ``8``.
        width: Model width. Default: ``4096``.
        ffn_width: Hidden width of the SwiGLU MLP. Default: ``14336``.
        heads: Attention heads (``width`` must divide by it). Default: ``32``.
        seq_len: Tokens per sequence (the rotary tables' length). Default: ``8192``.
        rope_base: Rotary base. Default: ``500000.0``.
    """

    depth: int = 8
    width: int = 4096
    ffn_width: int = 14336
    heads: int = 32
    seq_len: int = 8192
    rope_base: float = 500000.0

    def __post_init__(self) -> None:
        if self.width % self.heads or (self.width // self.heads) % 2:
            raise ValueError(
                f"LlamaConfig: width {self.width} must split into {self.heads} heads of an "
                "even size"
            )

    @property
    def head_dim(self) -> int:
        """Width of one head."""
        return self.width // self.heads

    @property
    def parameters_per_block(self) -> int:
        """Weights of one block: four attention projections, three MLP matrices, two norms."""
        return 4 * self.width * self.width + 3 * self.width * self.ffn_width + 2 * self.width


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head of ``x`` (shape ``(B, T, H, D)``)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaBlock(nn.Module):
    """One pre-norm Llama block; the residual adds are inside, so a checkpoint saves its input.

    Args:
        config: The stack's configuration.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        d, f = config.width, config.ffn_width
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.attention_norm = nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d)
        self.w1 = nn.Linear(d, f, bias=False)
        self.w3 = nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Apply the block to the residual stream ``x`` of shape ``(batch, seq, width)``."""
        b, t, d = x.shape
        q, k, v = (
            self.wqkv(self.attention_norm(x)).view(b, t, 3, self.heads, self.head_dim).unbind(2)
        )
        q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        out: Tensor = x + self.w2(F.silu(self.w1(h)) * self.w3(h))
        return out


class LlamaStack(nn.Module):
    """Llama blocks on a given residual stream, each run through ``checkpoint_fn``, then a norm.

    No embedding or head: the stack is the part whose activations a budget plan decides on.
    The rotary tables are buffers handed to each block as checkpoint arguments (one pair shared
    by every block, which matepoint keeps once).

    Args:
        config: Shape of the stack. Default: ``LlamaConfig()``.
        checkpoint_fn: How each block is run (see :class:`CheckpointFn`). Default: none.

    Example:
        >>> cfg = LlamaConfig(depth=2, width=64, ffn_width=128, heads=4, seq_len=16)
        >>> stack = LlamaStack(cfg)
        >>> stack(torch.randn(1, 16, 64)).shape
        torch.Size([1, 16, 64])
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self, config: LlamaConfig | None = None, checkpoint_fn: CheckpointFn = no_checkpoint
    ) -> None:
        super().__init__()
        self.config = config if config is not None else LlamaConfig()
        self.checkpoint_fn = checkpoint_fn
        cfg = self.config
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.depth))
        self.norm = nn.RMSNorm(cfg.width)
        inv_freq = cfg.rope_base ** (
            -torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))

    def forward(self, x: Tensor) -> Tensor:
        """Run every block on ``x`` (``(batch, seq, width)``, ``seq <= config.seq_len``)."""
        t = x.shape[1]
        cos = self.cos[:, :t].to(x.dtype)
        sin = self.sin[:, :t].to(x.dtype)
        for block in self.blocks:
            x = self.checkpoint_fn(block, x, cos, sin)
        out: Tensor = self.norm(x)
        return out
