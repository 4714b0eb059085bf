"""Train a reference model and a matepoint model side by side and compare them."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import matepoint
from matepoint_examples.strategies import get_strategy

__all__ = ["TwinResult", "compare_twins"]


@dataclasses.dataclass
class TwinResult:
    """What :func:`compare_twins` found.

    Args:
        reference_losses: Loss per step of the reference (torch's checkpointing).
        matepoint_losses: Loss per step of the matepoint twin.
        max_param_diff: Largest absolute difference between the final parameters.
        stats: ``matepoint.stats()`` after the matepoint run.
    """

    reference_losses: list[float]
    matepoint_losses: list[float]
    max_param_diff: float
    stats: matepoint.OffloadStats

    @property
    def equal(self) -> bool:
        """Whether losses and final parameters agree bitwise."""
        return self.reference_losses == self.matepoint_losses and self.max_param_diff == 0.0

    def summary(self) -> str:
        """A few lines for the terminal."""
        verdict = "bitwise equal" if self.equal else "DIFFERENT"
        return (
            f"losses (torch checkpoint): {[round(v, 6) for v in self.reference_losses]}\n"
            f"losses (matepoint):        {[round(v, 6) for v in self.matepoint_losses]}\n"
            f"final parameters: {verdict} (max |diff| {self.max_param_diff:.3g})\n"
            f"matepoint: {self.stats.offloads} offloads, {self.stats.bytes_offloaded} bytes "
            f"offloaded, {self.stats.bytes_fetched} fetched back"
        )


def _train(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, int], Tensor],
    steps: int,
    lr: float,
) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        torch.manual_seed(1000 + step)  # the same data and dropout masks for both twins
        loss = loss_fn(model, step)
        loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def compare_twins(
    model: nn.Module,
    enable_reference: Callable[[nn.Module], Any],
    enable_matepoint: Callable[[nn.Module], Any],
    loss_fn: Callable[[nn.Module, int], Tensor],
    device: torch.device,
    steps: int = 3,
    lr: float = 1e-2,
) -> TwinResult:
    """Train a copy of ``model`` with each checkpointing and compare the results.

    The matepoint twin offloads every block input whatever its size (the example models are
    small); on a CPU it runs under the CPU test transport (see ``matepoint_examples.strategies``),
    so its offload path really runs there too.

    Args:
        model: The model to copy (left untouched).
        enable_reference: Turns on the library's own (torch) checkpointing on a copy.
        enable_matepoint: Turns on matepoint's on the other copy.
        loss_fn: ``loss_fn(model, step)``: one step's loss; draws its data from the global RNG.
        device: Where to train.
        steps: Optimizer steps. Default: ``3``.
        lr: SGD learning rate. Default: ``1e-2``.

    Returns:
        The comparison.
    """
    reference = copy.deepcopy(model).to(device)
    twin = copy.deepcopy(model).to(device)
    enable_reference(reference)
    enable_matepoint(twin)
    reference.train()
    twin.train()
    reference_losses = _train(reference, loss_fn, steps, lr)
    with get_strategy("matepoint").session(device), matepoint.options(min_offload_bytes=0):
        matepoint.reset_stats()
        matepoint_losses = _train(twin, loss_fn, steps, lr)
        stats = matepoint.stats(synchronize=True)
    diff = max(
        float((a.detach() - b.detach()).abs().max())
        for a, b in zip(reference.parameters(), twin.parameters(), strict=True)
    )
    return TwinResult(reference_losses, matepoint_losses, diff, stats)
