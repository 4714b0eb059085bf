"""Micro benchmarks: matepoint's per-call CPU cost against torch's checkpoint, and the pool.

Run with ``nox -s bench-micro`` (or ``pytest packages/matepoint-core/benchmarks``). Each group
puts torch's checkpoint and matepoint side by side in one run, so their ratio is meaningful on
the machine at hand; the goal is matepoint <= 1.3 x torch per call on tiny layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._engine.pool import PinnedPool
from matepoint._options import ResolvedOptions
from matepoint.testing import CPUTestTransport, use_transport

pytest.importorskip("pytest_benchmark")

Step = Callable[[], None]


@pytest.fixture
def tiny() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 16), torch.randn(4, 16, requires_grad=True)


def _step(checkpoint: Callable[..., Any], layer: torch.nn.Module, x: torch.Tensor) -> Step:
    def step() -> None:
        # A fresh non-leaf input each call: the input a block gets inside a model.
        checkpoint(layer, x * 1.0).sum().backward()

    return step


def _torch(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _matepoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return matepoint.checkpoint(function, *args, **kwargs)


def _keep_matrix_products(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """A selective policy: matrix products saved, the rest recomputed."""
    if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return torch_checkpoint.CheckpointPolicy.MUST_SAVE
    return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE


def _selective() -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        _keep_matrix_products
    )


# Per call, nothing offloaded: plain, and under a selective policy (what a host-bound selective
# step pays per checkpoint call).
_POLICIES = [
    pytest.param({}, "per call, tiny layer, nothing to offload", id="plain"),
    pytest.param(
        {"context_fn": _selective},
        "per call, tiny layer, a selective policy",
        id="selective",
        marks=pytest.mark.skipif(
            not hasattr(torch_checkpoint, "CheckpointPolicy"),
            reason="selective checkpointing: torch 2.5",
        ),
    ),
]


@pytest.mark.benchmark(min_rounds=500)
@pytest.mark.parametrize(("checkpoint_options", "group"), _POLICIES)
@pytest.mark.parametrize("name", ["torch", "matepoint"])
def test_per_call_cost(
    benchmark: Any,
    tiny: tuple[torch.nn.Module, torch.Tensor],
    name: str,
    checkpoint_options: dict[str, Any],
    group: str,
) -> None:
    layer, x = tiny
    benchmark.group = group
    engine = _torch if name == "torch" else _matepoint
    benchmark(_step(functools.partial(engine, **checkpoint_options), layer, x))
    assert x.grad is not None


@pytest.fixture
def offloading() -> Iterator[CPUTestTransport]:
    transport = CPUTestTransport(completion="immediate")
    with use_transport(transport), matepoint.options(min_offload_bytes=0):
        yield transport


@pytest.mark.benchmark(group="per call, tiny layer, offloaded (CPU test transport)", min_rounds=500)
@pytest.mark.parametrize("name", ["torch", "matepoint"])
def test_per_call_cost_offloading(
    benchmark: Any,
    tiny: tuple[torch.nn.Module, torch.Tensor],
    offloading: CPUTestTransport,
    name: str,
) -> None:
    layer, x = tiny
    benchmark(_step(_torch if name == "torch" else _matepoint, layer, x))
    if name == "matepoint":
        assert offloading.copies_out > 0


@pytest.mark.benchmark(group="pinned pool")
@pytest.mark.parametrize("nbytes", [4096, 1 << 20])
def test_pool_reuse(benchmark: Any, nbytes: int) -> None:
    transport = CPUTestTransport(completion="immediate")
    pool = PinnedPool(transport.channel(torch.empty(0)))
    options = ResolvedOptions()

    def cycle() -> None:
        pool.give_back(pool.acquire(nbytes, options))

    benchmark(cycle)
    assert pool.blocks_allocated == 1
    assert pool.pinned_bytes == nbytes
