"""What ``matepoint-demo`` says on a CPU: what a CPU shows, and what a GPU would save.

A CPU run answers whether matepoint's gradients equal torch's checkpoint's; it cannot show the
memory matepoint saves or what it costs in time (host and device are the same memory there, and
matepoint copies through its test transport). What the same model would save on a GPU comes from
:func:`matepoint.plan` instead, on the meta device, so the demo can say it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import matepoint
from matepoint_examples._runtime import format_bytes
from matepoint_examples.models import DeepLatentConfig, DeepLatentStack
from matepoint_examples.strategies import get_strategy

__all__ = ["GPUPlan", "cpu_lines", "planned_on_gpu"]


@dataclass(frozen=True)
class GPUPlan:
    """Device bytes one step of a stack holds after forward on a GPU, as the planner predicts.

    Args:
        config: The stack planned.
        torch_held: Bytes held after forward with torch's checkpoint.
        matepoint_held: Bytes held after forward with matepoint.
    """

    config: DeepLatentConfig
    torch_held: int
    matepoint_held: int

    @property
    def saved(self) -> int:
        """Bytes matepoint holds less than torch's checkpoint after forward."""
        return self.torch_held - self.matepoint_held


def planned_on_gpu(
    config: DeepLatentConfig, options: matepoint.OffloadSettings | None = None
) -> GPUPlan:
    """Plan one step of ``config``'s stack as the demo trains it on a GPU, without one.

    The stack is built on the meta device in bf16 (the demo's GPU dtype) and
    :func:`matepoint.plan` traces its forward and backward under torch's checkpoint and under
    matepoint: no memory is allocated and nothing runs, so this works on any machine.

    Args:
        config: The stack.
        options: matepoint's options for the plan. Default: the process defaults.

    Returns:
        What each holds after forward.
    """
    meta, dtype = torch.device("meta"), torch.bfloat16
    with meta:
        model = DeepLatentStack(config, checkpoint_fn=get_strategy("matepoint").checkpoint_fn)
    model.to(dtype=dtype)
    x = model.example_input(meta, dtype)
    memory_plan = matepoint.plan(
        lambda: model(x).float().square().mean(),
        options=options,
        strategies=("torch", "matepoint"),
    )
    return GPUPlan(
        config,
        memory_plan["torch"].held_after_forward_bytes,
        memory_plan["matepoint"].held_after_forward_bytes,
    )


def _shape(config: DeepLatentConfig) -> str:
    return f"{config.depth} blocks, d={config.width}, {config.batch}x{config.tokens} tokens"


def cpu_lines(here: GPUPlan, on_gpu: GPUPlan) -> list[str]:
    """Say what a CPU run can and cannot show, and what a GPU would save (planned).

    Args:
        here: The plan of the stack this run trains, with this run's options.
        on_gpu: The plan of the stack the demo trains on a GPU, with matepoint's defaults.

    Returns:
        The lines, without markup.
    """
    return [
        "What a CPU shows: gradients identical to torch's checkpoint: yes, checked bit for bit "
        "below. Memory saved and speed: no, those need a GPU (here host and device are the "
        "same memory, matepoint copies through its test transport, and CPU step times say "
        "nothing about a GPU's).",
        "On a GPU, as matepoint.plan predicts on the meta device (bf16): this model holds "
        f"{format_bytes(here.torch_held)} after forward with torch's checkpoint and "
        f"{format_bytes(here.matepoint_held)} with matepoint ({format_bytes(here.saved)} less, "
        f"every block input offloaded as here); the GPU demo's {_shape(on_gpu.config)}: "
        f"{format_bytes(on_gpu.torch_held)} and {format_bytes(on_gpu.matepoint_held)} "
        f"({format_bytes(on_gpu.saved)} less).",
    ]
