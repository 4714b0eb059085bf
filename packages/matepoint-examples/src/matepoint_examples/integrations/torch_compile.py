"""Run ``torch.compile``-d blocks inside ``matepoint.checkpoint``.

matepoint.checkpoint itself runs eagerly: its ``saved_tensors_hooks`` cannot be traced by
Dynamo, so compile the blocks, not the loop that checkpoints them. Each block is compiled once
and called through the checkpoint; the recomputation in backward runs the same compiled code.
The twin (compiled blocks under torch's checkpoint) must reach the same losses and parameters.

Run: ``python -m matepoint_examples.integrations.torch_compile [--backend aot_eager]``
(``inductor`` is the default on CUDA, ``aot_eager`` on the CPU).
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import matepoint
from matepoint_examples._runtime import resolve_device
from matepoint_examples.integrations._twins import TwinResult, compare_twins
from matepoint_examples.models import CheckpointFn, DeepLatentConfig, DeepLatentStack

__all__ = ["compile_blocks", "main", "run"]


def compile_blocks(model: DeepLatentStack, backend: str) -> None:
    """Compile every block of ``model`` in place (``nn.Module.compile``, names unchanged).

    Args:
        model: The stack.
        backend: A ``torch.compile`` backend: ``"inductor"``, ``"aot_eager"``, ``"eager"``.
    """
    for block in model.blocks:
        block.compile(backend=backend)


def _use(checkpoint_fn: CheckpointFn, backend: str, model: nn.Module) -> None:
    assert isinstance(model, DeepLatentStack)
    compile_blocks(model, backend)
    model.checkpoint_fn = checkpoint_fn


def run(backend: str | None = None, steps: int = 3, device: str = "auto") -> TwinResult:
    """Train the twins and compare them.

    Args:
        backend: ``torch.compile`` backend. Default: ``"inductor"`` on CUDA, else ``"aot_eager"``.
        steps: Optimizer steps. Default: ``3``.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"``. Default: ``"auto"``.

    Returns:
        The comparison.
    """
    target = resolve_device(device)
    chosen = backend or ("inductor" if target.type == "cuda" else "aot_eager")
    latent = DeepLatentConfig(depth=4, width=64, heads=4, batch=2, tokens=32)
    torch.manual_seed(0)
    model = DeepLatentStack(latent)

    def torch_checkpoint(function: object, /, *args: Tensor) -> Tensor:
        out: Tensor = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        return out

    def loss_fn(model: nn.Module, step: int) -> Tensor:
        x = torch.randn(latent.latent_shape(), device=target)
        return F.mse_loss(model(x), torch.zeros_like(x))

    return compare_twins(
        model,
        functools.partial(_use, torch_checkpoint, chosen),
        functools.partial(_use, matepoint.checkpoint, chosen),
        loss_fn,
        target,
        steps,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns 0 when the twins agree bitwise."""
    parser = argparse.ArgumentParser(prog="python -m matepoint_examples.integrations.torch_compile")
    parser.add_argument("--backend", default=None, help="inductor, aot_eager or eager")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args(argv)
    result = run(args.backend, steps=args.steps, device=args.device)
    print(result.summary())
    return 0 if result.equal else 1


if __name__ == "__main__":
    sys.exit(main())
