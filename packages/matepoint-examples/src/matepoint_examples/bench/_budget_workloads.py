"""The budget benchmark's workloads: how to build each model, feed it and checkpoint its blocks.

Each is a :class:`BudgetWorkload`; ``WORKLOADS`` names them for ``--workload``. The models
are built in bf16 on whatever device is in force (the GPU for a measured step, the meta device
for a plan).
"""

from __future__ import annotations

import contextlib
import dataclasses
import unittest.mock
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import matepoint.integrations
from matepoint_examples.models import GPTConfig, LlamaConfig, LlamaStack, NanoGPT

__all__ = ["WORKLOADS", "BudgetWorkload", "CheckpointFn"]

CheckpointFn = Callable[..., Any]


def _set_checkpoint_fn(model: nn.Module, fn: CheckpointFn) -> None:
    setattr(model, "checkpoint_fn", fn)  # noqa: B010 (an attribute of the example models only)


@dataclasses.dataclass(frozen=True)
class BudgetWorkload:
    """A model of the budget benchmark: how to build it, feed it and point it at a checkpoint.

    Attributes:
        build: Makes the model (in bf16, on the device in force) and its inputs.
        loss: The training loss of the model on its inputs.
        set_checkpoint: Runs every block of the model through a ``checkpoint_fn``. Default:
            the example models' ``checkpoint_fn`` attribute.
        projections: The matrix products of one block, as op kinds, for torch's selective
            peers: (every projection, the MLP's down projection).
        hf: Whether it is a Hugging Face model (checkpointed through its own layers).
        planning: The context the model is planned in on the meta device.
        one_call: The inputs as ``matepoint.plan_budget`` takes them (the model's positional
            arguments, or its keyword arguments as a dict) and the loss of the model's output
            (None where the output is the loss, or has one: a transformers model's).
    """

    build: Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]
    loss: Callable[[Callable[..., Any], tuple[Tensor, ...]], Tensor]
    projections: tuple[frozenset[str], str]
    set_checkpoint: Callable[[nn.Module, CheckpointFn], None] = _set_checkpoint_fn
    hf: bool = False
    planning: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    one_call: Callable[[tuple[Tensor, ...]], tuple[Any, Callable[[Any], Tensor] | None]] = (
        lambda inputs: (inputs, None)
    )


def _mean_square(output: Tensor) -> Tensor:
    return output.float().square().mean()


def _llama(config: LlamaConfig, batch: int) -> BudgetWorkload:
    d, f = config.width, config.ffn_width

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        stack = LlamaStack(config).to(torch.bfloat16)
        return stack, (torch.randn(batch, config.seq_len, d, dtype=torch.bfloat16),)

    every = frozenset(
        {f"matmul {d}x{3 * d}", f"matmul {d}x{d}", f"matmul {d}x{f}", f"matmul {f}x{d}"}
    )
    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: _mean_square(model(*inputs)),
        projections=(every, f"matmul {f}x{d}"),
        one_call=lambda inputs: (inputs, _mean_square),
    )


def _nanochat(depth: int, batch: int, seq_len: int) -> BudgetWorkload:
    config = GPTConfig.from_depth(depth, seq_len=seq_len, x0_mixing=True)
    d, hidden = config.width, config.mlp_ratio * config.width

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        model = NanoGPT(config).to(torch.bfloat16)
        idx = torch.randint(0, config.vocab_size, (batch, seq_len))
        return model, (idx, idx)

    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: model(*inputs),
        projections=(
            frozenset({f"matmul {d}x{d}", f"matmul {d}x{hidden}", f"matmul {hidden}x{d}"}),
            f"matmul {hidden}x{d}",
        ),
    )


def _hf_llama(
    layers: int, width: int, ffn_width: int, heads: int, batch: int, seq_len: int
) -> BudgetWorkload:
    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=ffn_width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=32000,
            max_position_embeddings=seq_len,
            attn_implementation="sdpa",
        )
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.train()
        # Layers call _gradient_checkpointing_func; torch's own until a strategy replaces it.
        matepoint.integrations.enable_hf_gradient_checkpointing(model)
        return model, (torch.randint(0, 32000, (batch, seq_len)),)

    def set_checkpoint(model: nn.Module, fn: CheckpointFn) -> None:
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                setattr(module, "_gradient_checkpointing_func", fn)  # noqa: B010

    every = frozenset(
        {f"matmul {width}x{width}", f"matmul {width}x{ffn_width}", f"matmul {ffn_width}x{width}"}
    )
    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: model(input_ids=inputs[0], labels=inputs[0]).loss,
        set_checkpoint=set_checkpoint,
        projections=(every, f"matmul {ffn_width}x{width}"),
        hf=True,
        planning=_one_sequence_per_row,
        one_call=lambda inputs: ({"input_ids": inputs[0], "labels": inputs[0]}, None),
    )


def _one_sequence_per_row() -> contextlib.AbstractContextManager[Any]:
    """transformers' search for packed sequences, answered as the real step answers it: none.

    Without an attention mask, transformers reads the position ids' values to find sequences
    packed into one row, which the meta device cannot; the real step's ids are one range per
    row, so it finds none and runs SDPA causal, with no mask. Planning with a 4D mask instead
    traced an attention the real step does not run (the mask a checkpoint input of every
    layer): torch checkpoint's planned peak was 13 MiB above its measured one on an H200.
    """
    import transformers.masking_utils

    if not hasattr(transformers.masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return unittest.mock.patch.object(
        transformers.masking_utils, "find_packed_sequence_indices", return_value=None
    )


WORKLOADS: dict[str, BudgetWorkload] = {
    "llama8": _llama(LlamaConfig(depth=8, width=4096, ffn_width=14336, heads=32, seq_len=8192), 1),
    "llama16": _llama(LlamaConfig(depth=16, width=2048, ffn_width=7168, heads=16, seq_len=4096), 2),
    # Beyond 24 GiB under torch's checkpoint (its saved block inputs: 16 GiB), within it once
    # matepoint offloads them: the fixed-budget workload.
    "llama64-long": _llama(
        LlamaConfig(depth=64, width=1024, ffn_width=3584, heads=8, seq_len=8192), 16
    ),
    "nanochat12": _nanochat(12, 8, 2048),
    "hf-llama16": _hf_llama(16, 2048, 5632, 16, 2, 4096),
    "llama-tiny": _llama(LlamaConfig(depth=2, width=64, ffn_width=128, heads=4, seq_len=64), 1),
}
"""Name -> workload."""
