"""Checkpoint the blocks of an example model with torch's ``apply_activation_checkpointing``.

``apply_matepoint_checkpointing(model, check_fn)`` is torch's ``apply_activation_checkpointing``
with ``checkpoint_fn=matepoint.checkpoint``: the blocks are wrapped in torch's
``CheckpointWrapper`` (same state-dict names, FSDP-compatible), and each block input is
offloaded. The twin wrapped with torch's defaults must reach the same losses and parameters.

Run: ``python -m matepoint_examples.integrations.checkpoint_wrapper [--model latent|gpt]``
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matepoint.integrations import apply_matepoint_checkpointing
from matepoint_examples._runtime import resolve_device
from matepoint_examples.integrations._twins import TwinResult, compare_twins
from matepoint_examples.models import (
    DeepLatentConfig,
    DeepLatentStack,
    GPTBlock,
    GPTConfig,
    LatentBlock,
    NanoGPT,
)

__all__ = ["main", "run"]


def run(model_name: str = "latent", steps: int = 3, device: str = "auto") -> TwinResult:
    """Train the twins and compare them.

    Args:
        model_name: ``"latent"`` (:class:`DeepLatentStack`) or ``"gpt"`` (:class:`NanoGPT`).
            Default: ``"latent"``.
        steps: Optimizer steps. Default: ``3``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``. Default: ``"auto"``.

    Returns:
        The comparison.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    target = resolve_device(device)
    torch.manual_seed(0)
    model: nn.Module
    block_type: type[nn.Module]
    if model_name == "latent":
        latent = DeepLatentConfig(depth=4, width=64, heads=4, batch=2, tokens=32)
        model, block_type = DeepLatentStack(latent), LatentBlock

        def loss_fn(model: nn.Module, step: int) -> Tensor:
            x = torch.randn(latent.latent_shape(), device=target)
            return F.mse_loss(model(x), torch.zeros_like(x))

    else:
        gpt = GPTConfig(depth=4, width=64, head_dim=16, seq_len=32, vocab_size=128)
        model, block_type = NanoGPT(gpt), GPTBlock

        def loss_fn(model: nn.Module, step: int) -> Tensor:
            tokens = torch.randint(0, gpt.vocab_size, (2, gpt.seq_len + 1), device=target)
            loss: Tensor = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
            return loss

    def is_block(module: nn.Module) -> bool:
        return isinstance(module, block_type)

    return compare_twins(
        model,
        lambda m: apply_activation_checkpointing(m, check_fn=is_block),
        lambda m: apply_matepoint_checkpointing(m, check_fn=is_block),
        loss_fn,
        target,
        steps,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0 when the twins agree bitwise."""
    parser = argparse.ArgumentParser(
        prog="python -m matepoint_examples.integrations.checkpoint_wrapper"
    )
    parser.add_argument("--model", choices=("latent", "gpt"), default="latent")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    result = run(args.model, steps=args.steps, device=args.device)
    print(result.summary())
    return 0 if result.equal else 1


if __name__ == "__main__":
    sys.exit(main())
