"""A small GPT in the style of nanochat, written from scratch, with every block checkpointable."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matepoint_examples.models._common import CheckpointFn, no_checkpoint

__all__ = ["GPTBlock", "GPTConfig", "NanoGPT"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`NanoGPT`.

    nanochat derives the whole model from one number, the depth: width is ``64 * depth`` and the
    head dimension is 128. :meth:`from_depth` does the same; every field stays overridable so tests
    can build a model small enough for a CPU.

    Args:
        depth: Number of blocks. Default: ``12``.
        width: Model dimension. Default: ``768``.
        head_dim: Dimension per attention head; must divide ``width``. Default: ``128``.
        seq_len: Maximum sequence length (rotary tables are built for it). Default: ``2048``.
        vocab_size: Vocabulary size. Default: ``65536``.
        mlp_ratio: MLP hidden size as a multiple of ``width``. Default: ``4``.
        softcap: Logit soft-cap, ``softcap * tanh(logits / softcap)``. Default: ``15.0``.
        rope_base: Rotary base frequency. Default: ``10000.0``.
        x0_mixing: nanochat's residual mixing: before block ``i`` the stream becomes
            ``resid_lambdas[i] * x + x0_lambdas[i] * x0``, ``x0`` being the normed embedding and
            both scalars learnable per layer. The mixing runs inside the block's checkpoint, so
            ``x0`` is an input of every checkpoint, as in nanochat. Default: ``False``.
    """

    depth: int = 12
    width: int = 768
    head_dim: int = 128
    seq_len: int = 2048
    vocab_size: int = 65536
    mlp_ratio: int = 4
    softcap: float = 15.0
    rope_base: float = 10000.0
    x0_mixing: bool = False

    def __post_init__(self) -> None:
        """Reject shapes the model cannot run.

        Raises:
            ValueError: If ``head_dim`` is odd or does not divide ``width``, or a size is
                not positive.
        """
        sizes = (self.depth, self.width, self.head_dim, self.seq_len, self.vocab_size)
        if min(sizes) <= 0:
            raise ValueError(f"all sizes must be positive: {self}")
        if self.width % self.head_dim or self.head_dim % 2:
            raise ValueError(
                f"head_dim ({self.head_dim}) must be even and divide width ({self.width})"
            )

    @classmethod
    def from_depth(cls, depth: int, **overrides: int | float | bool) -> GPTConfig:
        """Build the nanochat configuration for ``depth``: width ``64 * depth``, head dim 128.

        Args:
            depth: Number of blocks.
            **overrides: Any other field of :class:`GPTConfig`, e.g. ``vocab_size=256``.

        Returns:
            The configuration.
        """
        fields: dict[str, int | float | bool] = {"depth": depth, "width": 64 * depth}
        fields.update(overrides)
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def heads(self) -> int:
        """Number of attention heads, ``width // head_dim``."""
        return self.width // self.head_dim


def _rms_norm(x: Tensor) -> Tensor:
    """Parameter-free RMS norm over the last dimension, as nanochat uses everywhere."""
    return F.rms_norm(x, (x.size(-1),))


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the two halves of each head of ``x`` (shape ``(B, T, H, D)``) by the rotary angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class GPTBlock(nn.Module):
    """One nanochat block: rotary, QK-norm causal attention and a relu² MLP, no biases.

    The residual adds are inside ``forward`` so a checkpoint around the block saves only the
    block's input, the residual stream.

    Args:
        config: The model's configuration.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.width
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.c_q = nn.Linear(d, d, bias=False)
        self.c_k = nn.Linear(d, d, bias=False)
        self.c_v = nn.Linear(d, d, bias=False)
        self.c_attn_proj = nn.Linear(d, d, bias=False)
        self.c_fc = nn.Linear(d, config.mlp_ratio * d, bias=False)
        self.c_mlp_proj = nn.Linear(config.mlp_ratio * d, d, bias=False)

    def forward(self, x: Tensor, *, cos: Tensor, sin: Tensor) -> Tensor:
        """Apply the block.

        Args:
            x: Residual stream of shape ``(batch, seq, width)``.
            cos: Rotary cosines broadcastable to ``(1, seq, 1, head_dim // 2)``.
            sin: Rotary sines, same shape as ``cos``.

        Returns:
            The updated residual stream, same shape as ``x``.
        """
        b, t, d = x.shape
        h = _rms_norm(x)
        q = self.c_q(h).view(b, t, self.heads, self.head_dim)
        k = self.c_k(h).view(b, t, self.heads, self.head_dim)
        v = self.c_v(h).view(b, t, self.heads, self.head_dim)
        q = _rms_norm(_apply_rotary(q, cos, sin))
        k = _rms_norm(_apply_rotary(k, cos, sin))
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.c_attn_proj(a.transpose(1, 2).reshape(b, t, d))
        out: Tensor = x + self.c_mlp_proj(F.relu(self.c_fc(_rms_norm(x))).square())
        return out


class NanoGPT(nn.Module):
    """A nanochat-style GPT whose blocks, residual mixing included, run through ``checkpoint_fn``.

    Rotary embeddings, QK-norm, relu² MLP, untied input/output embeddings, no biases and a
    logit soft-cap, like nanochat. The rotary tables are handed to each block by closure rather
    than as checkpoint arguments, so the residual stream is the only tensor a checkpoint saves;
    with ``config.x0_mixing`` the normed embedding ``x0`` is a second argument of every
    checkpoint, one tensor shared by all of them (what an offloader should move once per step).

    Args:
        config: Shape of the model. Default: ``GPTConfig()`` (nanochat depth 12).
        checkpoint_fn: How each block is run (see :class:`CheckpointFn`). Default: no checkpoint.

    Example:
        >>> cfg = GPTConfig.from_depth(2, head_dim=32, seq_len=16, vocab_size=64)
        >>> model = NanoGPT(cfg)
        >>> idx = torch.randint(0, 64, (1, 16))
        >>> model(idx, idx).ndim
        0
    """

    cos: Tensor
    sin: Tensor

    def __init__(
        self, config: GPTConfig | None = None, checkpoint_fn: CheckpointFn = no_checkpoint
    ) -> None:
        super().__init__()
        self.config = config if config is not None else GPTConfig()
        self.checkpoint_fn = checkpoint_fn
        cfg = self.config
        self.wte = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.depth))
        self.lm_head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)
        self.resid_lambdas: nn.Parameter | None = None
        self.x0_lambdas: nn.Parameter | None = None
        if cfg.x0_mixing:
            # nanochat starts these at 1 and 0; x0's weight starts small but not zero so that its
            # gradient, and the recompute's use of x0, are informative from the first step.
            self.resid_lambdas = nn.Parameter(torch.ones(cfg.depth))
            self.x0_lambdas = nn.Parameter(torch.full((cfg.depth,), 0.1))
        inv_freq = cfg.rope_base ** (
            -torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim
        )
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos()[None, :, None, :], persistent=False)
        self.register_buffer("sin", angles.sin()[None, :, None, :], persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """Initialise like a standard GPT (no zero-init, so every gradient is informative)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.in_features))
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        """Return the mean cross-entropy loss if ``targets`` is given, else the logits.

        Args:
            idx: Token ids of shape ``(batch, seq)`` with ``seq <= config.seq_len``.
            targets: Next-token ids, same shape; ``-1`` is ignored. Default: ``None``.

        Returns:
            A scalar loss (computed in float32), or logits of shape ``(batch, seq, vocab_size)``.
        """
        t = idx.size(1)
        cos, sin = self.cos[:, :t], self.sin[:, :t]
        x = _rms_norm(self.wte(idx))
        if self.config.x0_mixing:
            x0 = x
            for i in range(len(self.blocks)):
                mixed = functools.partial(self._mixed_block, i, cos=cos, sin=sin)
                x = self.checkpoint_fn(mixed, x, x0)
        else:
            for block in self.blocks:
                x = self.checkpoint_fn(functools.partial(block, cos=cos, sin=sin), x)
        logits = self.lm_head(_rms_norm(x))
        cap = self.config.softcap
        logits = cap * torch.tanh(logits.float() / cap)
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)

    def _mixed_block(self, i: int, x: Tensor, x0: Tensor, *, cos: Tensor, sin: Tensor) -> Tensor:
        """Mix ``x0`` back into the stream with layer ``i``'s scalars, then run block ``i``."""
        assert self.resid_lambdas is not None
        assert self.x0_lambdas is not None
        block: GPTBlock = self.blocks[i]  # type: ignore[assignment]
        out: Tensor = block(self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0, cos=cos, sin=sin)
        return out

    def example_batch(
        self, batch: int, device: torch.device | str = "cpu", seq_len: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """Return random ``(idx, targets)`` of shape ``(batch, seq_len)`` (from the global RNG).

        Args:
            batch: Batch size.
            device: Where to create them. Default: ``"cpu"``.
            seq_len: Sequence length. Default: ``config.seq_len``.

        Returns:
            Token ids and targets.
        """
        t = seq_len if seq_len is not None else self.config.seq_len
        tokens = torch.randint(0, self.config.vocab_size, (batch, t + 1), device=device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
