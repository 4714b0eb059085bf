"""How long a budget plan of a 7B-parameter model takes on the CPU: ``plan`` then ``fastest_under``.

Run with ``nox -s bench-micro -- -k budget_planning`` (or ``pytest
packages/matepoint-core/benchmarks -k budget_planning``). The bar of the budget work: a
7B-parameter, 32-block config planned against a budget in 10 seconds or less on a CPU. The model
is the examples' Llama-style stack built on the meta device (nothing is allocated); each case is
``matepoint.plan`` (every strategy, as a user calls it) and one search, timed together from a
cold start, once per round. Budgets are placed between matepoint's planned peak and no
checkpoint's (a share of the way) or above torch checkpoint's, where the search's kinds of op
mostly fit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import matepoint
from matepoint._planner import trace as _plan_trace

pytest.importorskip("pytest_benchmark")
models = pytest.importorskip("matepoint_examples.models")
if not hasattr(torch.utils.checkpoint, "CheckpointPolicy"):  # budget plans need torch >= 2.5
    pytest.skip("budget plans need torch's selective checkpointing (2.5+)", allow_module_level=True)

# A Llama-2-7B-sized stack: 32 blocks of width 4096, SwiGLU 11008, 32 heads (6.5 billion
# parameters in the blocks).
_SEVEN_B = {"depth": 32, "width": 4096, "ffn_width": 11008, "heads": 32}


def _step(tokens: int) -> tuple[Any, torch.nn.Module]:
    """The stack's training step on the meta device, and the stack it takes."""
    config = models.LlamaConfig(seq_len=tokens, **_SEVEN_B)
    with torch.device("meta"):
        stack = models.LlamaStack(config).to(torch.bfloat16)
        x = torch.randn(1, tokens, config.width, dtype=torch.bfloat16)
    stack.checkpoint_fn = matepoint.checkpoint

    def loss(model: Any) -> torch.Tensor:
        return model(x).float().square().mean()

    return loss, stack


@pytest.mark.benchmark(group="budget plan, 7B, 32 blocks", min_rounds=1)
@pytest.mark.parametrize("tokens", [4096, 8192])
@pytest.mark.parametrize("budget", ["10% to none", "60% to none", "110% of torch"])
def test_budget_planning(benchmark: Any, tokens: int, budget: str) -> None:
    every = matepoint.plan(*_step(tokens))
    lowest, highest = every["matepoint"].peak_bytes, every["none"].peak_bytes
    budget_bytes = {
        "10% to none": lowest + (highest - lowest) // 10,
        "60% to none": lowest + (highest - lowest) * 6 // 10,
        "110% of torch": every["torch"].peak_bytes * 11 // 10,
    }[budget]

    def plan_and_search() -> matepoint.BudgetPlan:
        # What a user runs: plan every strategy, then search; from a cold start (Note [Meta
        # results reused]: nothing remembered from the plan above).
        _plan_trace._meta_results.clear()
        return matepoint.plan(*_step(tokens)).fastest_under(budget_bytes)

    chosen = benchmark.pedantic(plan_and_search, rounds=2, iterations=1)
    assert chosen.fits
