"""Train a tiny Hugging Face Llama with its gradient checkpointing run by matepoint.

The model is built from a config (no download). One call replaces transformers' own
``gradient_checkpointing_enable``; the twin trained with transformers' checkpointing (torch's
checkpoint) must reach the same losses and parameters bitwise.

Run: ``python -m matepoint_examples.integrations.huggingface [--steps 3] [--device auto]``
(needs ``pip install transformers``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from matepoint.integrations import enable_hf_gradient_checkpointing
from matepoint_examples._runtime import resolve_device
from matepoint_examples.integrations._twins import TwinResult, compare_twins

__all__ = ["main", "run"]


def _torch_checkpointing(model: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):  # transformers 5 renamed gradient_checkpointing_enable
        enable(activation_checkpointing_kwargs=kwargs)
    elif callable(legacy_enable := getattr(model, "gradient_checkpointing_enable", None)):
        legacy_enable(gradient_checkpointing_kwargs=kwargs)


def run(steps: int = 3, device: str = "auto", layers: int = 4, hidden: int = 64) -> TwinResult:
    """Train the twins and compare them.

    Args:
        steps: Optimizer steps. Default: ``3``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``. Default: ``"auto"``.
        layers: Decoder layers. Default: ``4``.
        hidden: Hidden size. Default: ``64``.

    Returns:
        The comparison.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    target = resolve_device(device)

    def loss_fn(model: nn.Module, step: int) -> Tensor:
        ids = torch.randint(0, config.vocab_size, (2, 32), device=target)
        loss: Tensor = model(input_ids=ids, labels=ids).loss
        return loss

    return compare_twins(
        model, _torch_checkpointing, enable_hf_gradient_checkpointing, loss_fn, target, steps
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0 when the twins agree bitwise."""
    parser = argparse.ArgumentParser(prog="python -m matepoint_examples.integrations.huggingface")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    result = run(steps=args.steps, device=args.device)
    print(result.summary())
    return 0 if result.equal else 1


if __name__ == "__main__":
    sys.exit(main())
