"""The benchmark's workloads: named model shapes and how to build a training step for each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from matepoint_examples.models import (
    CheckpointFn,
    DeepLatentConfig,
    DeepLatentStack,
    GPTConfig,
    NanoGPT,
)

__all__ = ["WORKLOADS", "Built", "Workload", "build", "get_workload"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Workload:
    """A named model shape the benchmark runs every strategy on.

    Args:
        name: Registry key, e.g. ``"deep96"``.
        kind: ``"latent"`` for a :class:`DeepLatentStack`, ``"gpt"`` for a :class:`NanoGPT`.
        depth: Number of checkpointed blocks.
        width: Model dimension.
        heads: Attention heads (latent stacks; a GPT uses ``width // head_dim``).
        batch: Batch size.
        tokens: Tokens per sample (sequence length for a GPT).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        vocab_size: Vocabulary (GPT only). Default: ``65536``.
        head_dim: Head dimension (GPT only). Default: ``128``.
        x0_mixing: nanochat's per-layer mixing of the embedding ``x0`` into every block, inside
            the block's checkpoint (GPT only). Default: ``False``.
        description: One line for reports.
    """

    name: str
    kind: Literal["latent", "gpt"]
    depth: int
    width: int
    heads: int
    batch: int
    tokens: int
    dtype: str
    vocab_size: int = 65536
    head_dim: int = 128
    x0_mixing: bool = False
    description: str = ""

    def torch_dtype(self) -> torch.dtype:
        """Return the ``torch.dtype`` for :attr:`dtype`."""
        return _DTYPES[self.dtype]

    def block_input_bytes(self) -> int:
        """Return the bytes of one block's input, what each checkpoint saves."""
        return self.batch * self.tokens * self.width * self.torch_dtype().itemsize

    def row_fields(self) -> dict[str, Any]:
        """Return the shape fields every benchmark row of this workload starts with."""
        return {
            "workload": self.name,
            "kind": self.kind,
            "depth": self.depth,
            "width": self.width,
            "batch": self.batch,
            "tokens": self.tokens,
            "dtype": self.dtype,
        }

    def with_overrides(self, **fields: int | None) -> Workload:
        """Return a copy with the given fields replaced (``None`` values are ignored).

        Args:
            **fields: ``depth``, ``width``, ``heads``, ``batch``, ``tokens``, ``vocab_size`` or
                ``head_dim``.

        Returns:
            The new workload (same name).
        """
        changes = {k: v for k, v in fields.items() if v is not None}
        return dataclasses.replace(self, **changes) if changes else self  # type: ignore[arg-type]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("deep96", "latent", 96, 1536, 12, 8, 4096, "bf16",
                 description="96 blocks d1536, 8x4096 tokens, bf16 (96 MiB per block input)"),
        Workload("deep48", "latent", 48, 1536, 12, 8, 4096, "bf16",
                 description="48 blocks d1536, 8x4096 tokens, bf16"),
        Workload("light48", "latent", 48, 512, 4, 8, 4096, "bf16",
                 description="48 blocks d512, 8x4096 tokens, bf16 (compute-light)"),
        Workload("deep192", "latent", 192, 1024, 8, 2, 4096, "bf16",
                 description="192 blocks d1024, 2x4096 tokens, bf16"),
        Workload("gpt12", "gpt", 12, 768, 6, 8, 2048, "bf16",
                 description="nanochat-style GPT depth 12, batch 8, seq 2048, vocab 65536, bf16"),
        Workload("nanochat12", "gpt", 12, 768, 6, 8, 2048, "bf16", x0_mixing=True,
                 description="nanochat GPT d12 with x0 mixing (x0 is an input of every "
                 "checkpoint), batch 8, seq 2048, vocab 65536, bf16"),
        Workload("cpu-small", "latent", 8, 256, 4, 2, 256, "fp32",
                 description="8 blocks d256, 2x256 tokens, fp32 (CPU run without a GPU)"),
    )
}  # fmt: skip
"""Every workload by name; ``cpu-small`` is what runs without a GPU."""

GPU_WORKLOADS = ("deep96", "deep48", "light48", "deep192", "gpt12", "nanochat12")
CPU_WORKLOADS = ("cpu-small",)


def get_workload(name: str) -> Workload:
    """Look a workload up by name.

    Args:
        name: A key of :data:`WORKLOADS`.

    Returns:
        The workload.

    Raises:
        KeyError: If there is no such workload; the message lists the known names.
    """
    try:
        return WORKLOADS[name]
    except KeyError:
        raise KeyError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


@dataclass
class Built:
    """A workload's model on its device and a way to compute its loss.

    Args:
        model: The model, parameters on the device.
        loss: Runs one forward pass and returns the scalar loss.
        blocks: The checkpointed blocks, in order (for memory-timeline hooks).
    """

    model: nn.Module
    loss: Callable[[], Tensor]
    blocks: list[nn.Module]


def build(
    workload: Workload, checkpoint_fn: CheckpointFn, device: torch.device, seed: int = 0
) -> Built:
    """Build ``workload``'s model and one fixed batch on ``device``.

    Args:
        workload: What to build.
        checkpoint_fn: How each block runs.
        device: Where to put the model and the batch.
        seed: Seed for weights and data. Default: ``0``.

    Returns:
        The model and its loss closure.
    """
    torch.manual_seed(seed)
    dtype = workload.torch_dtype()
    if workload.kind == "gpt":
        gcfg = GPTConfig(
            depth=workload.depth,
            width=workload.width,
            head_dim=workload.head_dim,
            seq_len=workload.tokens,
            vocab_size=workload.vocab_size,
            x0_mixing=workload.x0_mixing,
        )
        with torch.device(device):
            gpt = NanoGPT(gcfg, checkpoint_fn=checkpoint_fn)
        gpt.to(dtype=dtype)
        idx, targets = gpt.example_batch(workload.batch, device)
        return Built(gpt, lambda: gpt(idx, targets), list(gpt.blocks))
    lcfg = DeepLatentConfig(
        depth=workload.depth,
        width=workload.width,
        heads=workload.heads,
        batch=workload.batch,
        tokens=workload.tokens,
    )
    with torch.device(device):
        stack = DeepLatentStack(lcfg, checkpoint_fn=checkpoint_fn)
    stack.to(dtype=dtype)
    x = stack.example_input(device, dtype)
    return Built(stack, lambda: stack(x).float().square().mean(), list(stack.blocks))
