"""A weather-like deep stack of pre-norm transformer blocks over one large latent."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matepoint_examples.models._common import CheckpointFn, no_checkpoint

__all__ = ["DeepLatentConfig", "DeepLatentStack", "LatentBlock"]


@dataclass(frozen=True)
class DeepLatentConfig:
    """Shape of a :class:`DeepLatentStack` and of the latent it runs on.

    The latent of one block is ``batch * tokens * width`` elements; with the defaults (8 x 4096
    tokens, width 1536, bf16) that is 96 MiB, which is what each checkpoint saves and what an
    offloading checkpoint moves to host memory.

    Args:
        depth: Number of blocks. Default: ``96``.
        width: Model dimension ``d``. Default: ``1536``.
        heads: Attention heads; must divide ``width``. Default: ``12``.
        batch: Batch size of the latent. Default: ``8``.
        tokens: Tokens per sample. Default: ``4096``.
        mlp_ratio: Hidden size of the MLP as a multiple of ``width``. Default: ``4``.
        dropout: Dropout probability in attention and MLP (use > 0 to exercise RNG replay).
            Default: ``0.0``.
    """

    depth: int = 96
    width: int = 1536
    heads: int = 12
    batch: int = 8
    tokens: int = 4096
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        """Reject shapes the blocks cannot run.

        Raises:
            ValueError: If ``heads`` does not divide ``width`` or a size is not positive.
        """
        if min(self.depth, self.width, self.heads, self.batch, self.tokens, self.mlp_ratio) <= 0:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.width % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide width ({self.width})")

    def latent_shape(self) -> tuple[int, int, int]:
        """Return the shape ``(batch, tokens, width)`` of the latent the stack runs on.

        Returns:
            The latent's shape.
        """
        return (self.batch, self.tokens, self.width)


class LatentBlock(nn.Module):
    """One pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    The whole block, residual adds included, is the unit a checkpoint wraps, so the only tensor a
    checkpoint saves per block is the block's input latent.

    Args:
        config: The stack's configuration.
    """

    def __init__(self, config: DeepLatentConfig) -> None:
        super().__init__()
        d = config.width
        self.heads = config.heads
        self.dropout = config.dropout
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, config.mlp_ratio * d)
        self.fc2 = nn.Linear(config.mlp_ratio * d, d)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: Latent of shape ``(batch, tokens, width)``.

        Returns:
            The updated latent, same shape.
        """
        b, t, d = x.shape
        p = self.dropout if self.training else 0.0
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), p, self.training)
        h = F.gelu(self.fc1(self.norm2(x)), approximate="tanh")
        return x + F.dropout(self.fc2(h), p, self.training)


class DeepLatentStack(nn.Module):
    """A deep stack of :class:`LatentBlock` over one latent, each block through ``checkpoint_fn``.

    This is the workload offloading is made for: activation memory of a checkpointed stack grows
    by one latent per block, so a deep stack on a small card runs out of memory even with
    checkpointing, while compute per block is large enough to hide the copies.

    Args:
        config: Shape of the stack. Default: ``DeepLatentConfig()``.
        checkpoint_fn: How each block is run (see :class:`CheckpointFn`).
            Default: no checkpoint.

    Example:
        >>> import matepoint
        >>> cfg = DeepLatentConfig(depth=2, width=32, heads=2, batch=1, tokens=16)
        >>> model = DeepLatentStack(cfg, checkpoint_fn=matepoint.checkpoint)
        >>> model(torch.randn(cfg.latent_shape())).shape
        torch.Size([1, 16, 32])
    """

    def __init__(
        self,
        config: DeepLatentConfig | None = None,
        checkpoint_fn: CheckpointFn = no_checkpoint,
    ) -> None:
        super().__init__()
        self.config = config if config is not None else DeepLatentConfig()
        self.checkpoint_fn = checkpoint_fn
        self.blocks = nn.ModuleList(LatentBlock(self.config) for _ in range(self.config.depth))
        self.norm = nn.LayerNorm(self.config.width)

    def forward(self, x: Tensor) -> Tensor:
        """Run every block, each through ``checkpoint_fn``, then a final norm.

        Args:
            x: Latent of shape ``config.latent_shape()``.

        Returns:
            The output latent, same shape.
        """
        for block in self.blocks:
            x = self.checkpoint_fn(block, x)
        out: Tensor = self.norm(x)
        return out

    def example_input(
        self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> Tensor:
        """Return a random latent of the right shape (from the global RNG).

        Args:
            device: Where to create it. Default: ``"cpu"``.
            dtype: Its dtype. Default: ``torch.float32``.

        Returns:
            A tensor of shape ``config.latent_shape()``.
        """
        return torch.randn(self.config.latent_shape(), device=device, dtype=dtype)
