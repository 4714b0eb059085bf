"""The planner against the engine: the same models, the same options, every counter equal.

The planner runs matepoint's own engine over a channel that moves nothing (see Note [Planner
fidelity] in ``matepoint._planner.step``). Here each model runs twice: for real on the CPU test
transport (copies complete at once, the planner's one assumption) and planned on the meta
device, and every field of :class:`matepoint.OffloadStats` the step leaves must agree. The models
share inputs the ways real ones do: one tensor passed to every block (nanochat's ``x0``), and
small rotary tables passed to every block of a Llama-style stack.
"""

from __future__ import annotations

import dataclasses
import gc
import warnings
from collections.abc import Callable

import pytest
import torch

import matepoint
from matepoint.testing import CPUTestTransport, use_transport

TOKENS, WIDTH = 64, 64
ACTIVATION = TOKENS * WIDTH * 4  # bytes of one block input (float32)
TABLE = TOKENS * WIDTH // 2 * 4  # bytes of one rotary table

Model = Callable[[torch.Tensor], torch.Tensor]


def _chain(x: torch.Tensor) -> torch.Tensor:
    h = x * 1  # dies with the graph, like an activation: backward must fetch it
    for _ in range(6):
        h = matepoint.checkpoint(lambda a: a.sin().sin(), h)
    return h


def _shared_x0(x: torch.Tensor) -> torch.Tensor:
    """nanochat's pattern: the embedding ``x0`` is an input of every block."""
    x0 = x.cos()
    h = x * 1
    for _ in range(5):
        h = matepoint.checkpoint(lambda a, r: (a * r).sin(), h, x0)
    return h


def _rotary_block(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = h.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).tanh()


def _shared_rotary(x: torch.Tensor) -> torch.Tensor:
    """A Llama-style stack: every block gets the same small cos and sin tables."""
    angles = torch.arange(TOKENS * WIDTH // 2, device=x.device, dtype=x.dtype) * 1e-3
    cos, sin = angles.view(TOKENS, -1).cos(), angles.view(TOKENS, -1).sin()
    h = x * 1
    for _ in range(6):
        h = matepoint.checkpoint(_rotary_block, h, cos, sin)
    return h


def _mixed(x: torch.Tensor) -> torch.Tensor:
    """A shared input, a small shared slice, and a block input that is not the last output."""
    x0 = x.cos()
    small = x[:16].tanh()
    h = x
    for index in range(6):
        h = matepoint.checkpoint(lambda a, r, s: (a * r).sin() + s.sum(), h, x0, small)
        if index == 1:
            h = h * 1.0
    return h


MODELS: dict[str, Model] = {
    "chain": _chain,
    "shared_x0": _shared_x0,
    "shared_rotary": _shared_rotary,
    "mixed": _mixed,
}
VARIANTS: dict[str, dict[str, int]] = {
    "plain": {"min_offload_bytes": 0},
    "stash": {"min_offload_bytes": 0, "stash_bytes": 2 * ACTIVATION},
    "small_kept": {"min_offload_bytes": TABLE + 1},
    "pool_cap": {"min_offload_bytes": 0, "pool_cap_bytes": 2 * ACTIVATION + TABLE},
}


def _real(model: Model, settings: matepoint.OffloadSettings) -> dict[str, float]:
    """Run ``model`` for real on a fresh CPU test transport; return the step's stats."""
    gc.collect()
    fields = {field.name: getattr(settings, field.name) for field in dataclasses.fields(settings)}
    with (
        use_transport(CPUTestTransport(completion="immediate")),
        matepoint.options(**fields),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", ResourceWarning)  # the pool cap's pageable fallback
        before = dataclasses.asdict(matepoint.stats())
        x = torch.randn(TOKENS, WIDTH, requires_grad=True)
        model(x).sum().backward()
        del x
        gc.collect()
        after = dataclasses.asdict(matepoint.stats())
    return {name: after[name] - before[name] for name in after}


def _planned(model: Model, settings: matepoint.OffloadSettings) -> matepoint.StrategyPlan:
    x = torch.empty(TOKENS, WIDTH, device="meta", requires_grad=True)
    return matepoint.plan(model, x, options=settings, strategies=("matepoint",))["matepoint"]


@pytest.mark.parametrize("prefetch", [0, 1, 2, 4])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_the_plan_counts_what_the_engine_does(model: str, variant: str, prefetch: int) -> None:
    settings = matepoint.OffloadSettings(prefetch=prefetch, **VARIANTS[variant])
    real = _real(MODELS[model], settings)
    planned = _planned(MODELS[model], settings)
    every_field = [field.name for field in dataclasses.fields(matepoint.OffloadStats)]
    assert {name: planned.counters.get(name) for name in every_field} == {
        name: int(real[name]) for name in every_field
    }
    assert planned.bytes_to_host == real["bytes_offloaded"]
    assert planned.bytes_to_device == real["bytes_fetched"]
    assert planned.pinned_bytes == real["pool_pinned_bytes"]


@pytest.mark.parametrize("model", ["shared_x0", "shared_rotary"])
def test_a_shared_input_crosses_the_link_once_each_way(model: str) -> None:
    """One copy out and one copy back per step however many checkpoints share the input."""
    settings = matepoint.OffloadSettings(min_offload_bytes=0, prefetch=2)
    planned = _planned(MODELS[model], settings)
    shared = 1 if model == "shared_x0" else 2
    blocks = 5 if model == "shared_x0" else 6
    assert planned.counters["dedupe_hits"] == shared * (blocks - 1)
    assert planned.counters["shared_fetch_hits"] == shared * (blocks - 1)
    # The shared inputs and every block input but the newest (still on the device) come back.
    assert planned.counters["fetches"] == shared + blocks - 1


def test_the_pool_cap_raises_where_the_plan_says_it_would() -> None:
    raising = matepoint.OffloadSettings(
        min_offload_bytes=0, pool_cap_bytes=2 * ACTIVATION, on_pool_exhausted="raise"
    )
    assert _planned(_chain, raising).pool_would_raise
    with pytest.raises(matepoint.PinnedMemoryExhausted):
        _real(_chain, raising)
    roomy = dataclasses.replace(raising, pool_cap_bytes=6 * ACTIVATION)
    assert not _planned(_chain, roomy).pool_would_raise
    _real(_chain, roomy)
