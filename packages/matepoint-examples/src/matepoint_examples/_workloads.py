"""The benchmark's workloads: named model shapes and how to build a training step for each."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from matepoint_examples._runtime import format_bytes
from matepoint_examples.models import (
    CheckpointFn,
    DeepLatentConfig,
    DeepLatentStack,
    GPTConfig,
    LlamaConfig,
    LlamaStack,
    NanoGPT,
    no_checkpoint,
)

__all__ = ["WORKLOADS", "Built", "Workload", "build", "get_workload"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Workload:
    """A named model shape the benchmark runs every strategy on.

    Args:
        name: Registry key, e.g. ``"deep96"``.
        kind: ``"latent"`` for a :class:`DeepLatentStack`, ``"gpt"`` for a :class:`NanoGPT`,
            ``"llama"`` for a :class:`LlamaStack` (SwiGLU width ``3.5 * width``).
        depth: Number of checkpointed blocks.
        width: Model dimension.
        heads: Attention heads. A GPT's is ``width // head_dim``, checked (see
            :meth:`with_overrides`, which keeps the two in step).
        batch: Batch size.
        tokens: Tokens per sample (sequence length for a GPT).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``.
        vocab_size: Vocabulary (GPT only). Default: ``65536``.
        head_dim: Head dimension (GPT only). Default: ``128``.
        x0_mixing: nanochat's per-layer mixing of the embedding ``x0`` into every block, inside
            the block's checkpoint (GPT only). Default: ``False``.
        note: What the shape is for, beyond its numbers (e.g. ``"compute-light"``); part of
            :meth:`describe`. Default: ``""``.

    Raises:
        ValueError: If the heads do not divide the width, or a GPT's ``heads * head_dim`` is not
            its width.
    """

    name: str
    kind: Literal["latent", "gpt", "llama"]
    depth: int
    width: int
    heads: int
    batch: int
    tokens: int
    dtype: str
    vocab_size: int = 65536
    head_dim: int = 128
    x0_mixing: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        """Reject a shape whose heads do not fit its width (see the class's Raises)."""
        if self.heads <= 0 or self.width % self.heads:
            raise ValueError(
                f"{self.name}: heads ({self.heads}) must divide width ({self.width}); "
                "pass heads that do"
            )
        if self.kind == "gpt" and self.heads * self.head_dim != self.width:
            raise ValueError(
                f"{self.name}: a GPT's heads x head_dim must equal its width: {self.heads} x "
                f"{self.head_dim} != {self.width}"
            )

    def describe(self) -> str:
        """Return one line saying what this shape is, from its fields (overrides included).

        Returns:
            E.g. ``"nanochat-style GPT, depth 32, width 4096, 32 heads of 128, batch 8, seq
            2048, vocab 65536, bf16"``.
        """
        if self.kind == "gpt":
            model = "nanochat GPT with x0 mixing" if self.x0_mixing else "nanochat-style GPT"
            text = (
                f"{model}, depth {self.depth}, width {self.width}, {self.heads} heads of "
                f"{self.head_dim}, batch {self.batch}, seq {self.tokens}, vocab "
                f"{self.vocab_size}, {self.dtype}"
            )
        elif self.kind == "llama":
            text = (
                f"Llama-style stack, {self.depth} blocks, width {self.width}, SwiGLU "
                f"{self.ffn_width()}, {self.heads} heads, {self.batch}x{self.tokens} tokens, "
                f"{self.dtype}"
            )
        else:
            text = (
                f"deep latent stack, {self.depth} blocks, width {self.width}, {self.heads} "
                f"heads, {self.batch}x{self.tokens} tokens, {self.dtype} "
                f"({format_bytes(self.block_input_bytes())} per block input)"
            )
        return f"{text}; {self.note}" if self.note else text

    def parameter_count(self) -> int:
        """Return the number of parameters of this shape's model, built on the meta device."""
        built = build(self, no_checkpoint, torch.device("meta"))
        return sum(p.numel() for p in built.model.parameters())

    def ffn_width(self) -> int:
        """Return a Llama stack's SwiGLU width: ``3.5 * width`` (Llama 3 8B's 14336 for 4096)."""
        return 7 * self.width // 2

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

        A GPT's heads follow from its width: unless both are given, ``heads`` becomes
        ``width // head_dim``, or, with ``heads`` given, ``head_dim`` becomes ``width // heads``.
        A latent stack keeps its heads unless they are given.

        Args:
            **fields: ``depth``, ``width``, ``heads``, ``batch``, ``tokens``, ``vocab_size`` or
                ``head_dim``.

        Returns:
            The new workload (same name).

        Raises:
            ValueError: If the resulting heads do not fit the width.
        """
        changes: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
        if not changes:
            return self
        if self.kind == "gpt":
            width = changes.get("width", self.width)
            if "heads" in changes and "head_dim" not in changes:
                changes["head_dim"] = width // changes["heads"]
            elif "heads" not in changes:
                changes["heads"] = width // changes.get("head_dim", self.head_dim)
        return dataclasses.replace(self, **changes)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("deep96", "latent", 96, 1536, 12, 8, 4096, "bf16"),
        Workload("deep48", "latent", 48, 1536, 12, 8, 4096, "bf16"),
        Workload("light48", "latent", 48, 512, 4, 8, 4096, "bf16", note="compute-light"),
        Workload("deep192", "latent", 192, 1024, 8, 2, 4096, "bf16"),
        Workload("gpt12", "gpt", 12, 768, 6, 8, 2048, "bf16"),
        Workload("nanochat12", "gpt", 12, 768, 6, 8, 2048, "bf16", x0_mixing=True,
                 note="x0 is an input of every checkpoint"),
        Workload("llama8", "llama", 8, 4096, 32, 1, 8192, "bf16",
                 note="the memory-budget workload"),
        Workload("llama16", "llama", 16, 2048, 16, 2, 4096, "bf16"),
        Workload("cpu-small", "latent", 8, 128, 4, 2, 256, "fp32",
                 note="the CPU run without a GPU"),
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
    if workload.kind == "llama":
        config = LlamaConfig(
            depth=workload.depth,
            width=workload.width,
            ffn_width=workload.ffn_width(),
            heads=workload.heads,
            seq_len=workload.tokens,
        )
        with torch.device(device):
            llama = LlamaStack(config, checkpoint_fn=checkpoint_fn)
            x = torch.randn(workload.batch, workload.tokens, workload.width)
        llama.to(dtype=dtype)
        x = x.to(dtype)
        return Built(llama, lambda: llama(x).float().square().mean(), list(llama.blocks))
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
