"""Host cost of a budget plan's selective steps against plain checkpointing (issue 39).

Run with ``nox -s bench-micro -- -k selective_host_cost`` (or ``pytest
packages/matepoint-core/benchmarks -k selective_host_cost``). A Llama-style stack so small (width
64, one sequence of 16 tokens) that its ops cost next to nothing: what a step takes is the host's
work per op, the part that bounds a narrow model's step on a fast device. Each case is one
training step (forward and backward) of four checkpointed blocks; one group puts every way of
checkpointing side by side, so their ratios are meaningful on the machine at hand:

- ``torch``: torch's checkpoint, nothing selective.
- ``torch, plan keeps``: torch's checkpoint under a plan's policy that keeps attention and three
  of the five matrix products per block (what torch's own selective checkpointing costs).
- ``matepoint``: matepoint's checkpoint, nothing selective (CPU test transport).
- ``matepoint, plan keeps``: the same plan through matepoint's checkpoint.
- ``matepoint, plan offloads``: one of the kept products offloaded instead (the offload wrapper
  around torch's modes).
- ``matepoint, plan keeps last``: a plan that keeps attention in the last block only and
  recomputes the rest (``kept_in_last``).
- ``matepoint, plan keeps projections``: the plan that keeps without attention: its modes run
  around the three kept products alone (Note [Scoped selective-checkpoint modes]).

docs/selective.md ("Host cost") has the numbers and where the time goes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._planner import policy
from matepoint._planner.policy import Decision
from matepoint.testing import CPUTestTransport, use_transport

pytest.importorskip("pytest_benchmark")
models = pytest.importorskip("matepoint_examples.models")
if not policy.OFFLOAD_AVAILABLE:
    pytest.skip("a plan that offloads needs torch 2.11", allow_module_level=True)

_CONFIG = {"depth": 4, "width": 64, "ffn_width": 128, "heads": 4, "seq_len": 16}
# The kinds of a block of that config (Note [Op kinds]): its fused QKV, output, SwiGLU gate and
# up (one shape, told apart by order) and down projections, and attention.
_KEEPS: dict[str, Decision] = {
    "attention": "keep",
    "matmul 64x192": "keep",
    "matmul 64x128 #1": "keep",
    "matmul 64x128 #2": "keep",
    "matmul 128x64": "recompute",
    "matmul 64x64": "recompute",
}
_OFFLOADS: dict[str, Decision] = {**_KEEPS, "matmul 64x128 #1": "offload"}
_PROJECTIONS: dict[str, Decision] = {**_KEEPS, "attention": "recompute"}
# (checkpoint, decisions, kept_in_last) per case; no decisions: no context_fn.
_CASES: dict[str, tuple[str, dict[str, Decision], dict[str, int]]] = {
    "torch": ("torch", {}, {}),
    "torch, plan keeps": ("torch", _KEEPS, {}),
    "matepoint": ("matepoint", {}, {}),
    "matepoint, plan keeps": ("matepoint", _KEEPS, {}),
    "matepoint, plan offloads": ("matepoint", _OFFLOADS, {}),
    "matepoint, plan keeps last": ("matepoint", {}, {"attention": 1}),
    "matepoint, plan keeps projections": ("matepoint", _PROJECTIONS, {}),
}


@pytest.fixture
def offloading() -> Iterator[CPUTestTransport]:
    transport = CPUTestTransport(completion="immediate")
    with use_transport(transport), matepoint.options(min_offload_bytes=0):
        yield transport


def _step(case: str) -> Callable[[], None]:
    """One training step of the stack, each block its own region under the case's plan."""
    engine, decisions, kept_in_last = _CASES[case]
    torch.manual_seed(0)
    config = models.LlamaConfig(**_CONFIG)
    stack = models.LlamaStack(config)
    blocks = list(stack.blocks)
    context_fns = [
        policy.context_fn_of(decisions, kept_in_last, config.depth, region)
        if decisions or kept_in_last
        else None
        for region in range(config.depth)
    ]

    def checkpoint(block: torch.nn.Module, *args: Any) -> Any:
        context_fn = context_fns[blocks.index(block)] or torch_checkpoint.noop_context_fn
        if engine == "torch":
            return torch_checkpoint.checkpoint(
                block, *args, use_reentrant=False, context_fn=context_fn
            )
        return matepoint.checkpoint(block, *args, context_fn=context_fn)

    stack.checkpoint_fn = checkpoint
    x = torch.randn(1, config.seq_len, config.width, requires_grad=True)

    def step() -> None:
        # A fresh non-leaf input each step: the input a stack gets inside a model.
        stack(x * 1.0).sum().backward()

    return step


@pytest.mark.benchmark(group="selective host cost, 4 tiny Llama blocks, one step", min_rounds=50)
@pytest.mark.parametrize("case", list(_CASES))
def test_selective_host_cost(benchmark: Any, offloading: CPUTestTransport, case: str) -> None:
    step = _step(case)
    step()  # warm up: the first step builds what later ones reuse
    benchmark(step)
    if case == "matepoint, plan offloads":
        assert offloading.copies_out > 0
