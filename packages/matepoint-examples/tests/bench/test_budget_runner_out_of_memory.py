"""A benchmark step that runs out of memory gives its memory back before the next strategy's."""

from __future__ import annotations

import math
import weakref
from typing import Any

import pytest
import torch

import matepoint
from matepoint_examples.bench import _budget_runner as budget_runner
from matepoint_examples.bench import budget


def test_the_cache_is_emptied_once_the_failed_steps_tensors_are_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = budget_runner.Runner(budget.WORKLOADS["llama-tiny"], device="cpu")
    first, second = list(runner.model.blocks)[:2]
    held: list[weakref.ref[torch.Tensor]] = []

    def keep_a_reference(_module: Any, _args: Any, output: torch.Tensor) -> None:
        held.append(weakref.ref(output))

    def run_out(_module: Any, _args: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    alive_when_emptied: list[bool] = []
    monkeypatch.setattr(
        torch.cuda, "empty_cache", lambda: alive_when_emptied.append(held[-1]() is not None)
    )
    handles = [
        first.register_forward_hook(keep_a_reference),
        second.register_forward_pre_hook(run_out),
    ]
    try:
        step = runner.step("matepoint", matepoint.checkpoint)
    finally:
        for handle in handles:
            handle.remove()
    assert math.isnan(step.seconds)
    assert step.peak_bytes == -1
    # The first block's output, which the failed step's frames held, was gone by then.
    assert alive_when_emptied == [False]
    assert all(parameter.grad is None for parameter in runner.model.parameters())
