"""Tests for matepoint_examples.strategies: the registry and each CPU-runnable strategy."""

from __future__ import annotations

import pytest
import torch

from matepoint_examples.models import DeepLatentConfig, DeepLatentStack
from matepoint_examples.strategies import (
    DEFAULT_STRATEGIES,
    STRATEGIES,
    Strategy,
    get_strategy,
    strategy_names,
)

CPU = torch.device("cpu")
TINY = DeepLatentConfig(depth=2, width=32, heads=2, batch=2, tokens=8)


def _grads(strategy: Strategy) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = DeepLatentStack(TINY, checkpoint_fn=strategy.checkpoint_fn)
    x = model.example_input()
    with strategy.session(CPU):
        with strategy.forward_context():
            loss = model(x).square().mean()
        loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_registry_names_and_order() -> None:
    assert strategy_names() == [
        "none",
        "torch",
        "save_on_cpu",
        "torchtune",
        "matepoint",
        "matepoint-nopipeline",
        "torch-compile",
        "torch-compiled-offload",
        "matepoint-compile",
        "copies-floor",
        "copies-floor-out",
        "copies-floor-refetch",
        "link-busy",
        "matepoint-nowaittiming",
    ]
    assert all(STRATEGIES[n].name == n for n in STRATEGIES)
    uses = {n for n, s in STRATEGIES.items() if s.uses_matepoint}
    assert uses == {
        "matepoint",
        "matepoint-nopipeline",
        "matepoint-nowaittiming",
        "matepoint-compile",
    }
    probes = {n for n, s in STRATEGIES.items() if s.probe}
    assert probes == {
        "copies-floor-out",
        "copies-floor-refetch",
        "link-busy",
        "matepoint-nowaittiming",
    }
    compiled = {n for n, s in STRATEGIES.items() if s.compiled is not None}
    assert compiled == {"torch-compile", "torch-compiled-offload", "matepoint-compile"}
    assert list(DEFAULT_STRATEGIES) == [n for n in STRATEGIES if n not in probes | compiled]


def test_unknown_strategy_lists_known_names() -> None:
    with pytest.raises(KeyError, match="matepoint-nopipeline"):
        get_strategy("nope")


def test_torchtune_needs_cuda_or_package() -> None:
    reason = get_strategy("torchtune").unavailable_reason(CPU)
    assert reason is not None
    assert "torchtune" in reason or "CUDA" in reason


# The compiled strategies are tested compiled, in test_compiled.py.
CPU_RUNNABLE = [
    n
    for n, s in STRATEGIES.items()
    if n not in ("torch", "torchtune") and not s.needs_cuda and s.compiled is None
]


@pytest.mark.parametrize("name", CPU_RUNNABLE)
def test_strategy_gradients_equal_torch_checkpoint(name: str) -> None:
    strategy = get_strategy(name)
    assert strategy.unavailable_reason(CPU) is None
    ref = _grads(get_strategy("torch"))
    got = _grads(strategy)
    assert len(ref) == len(got) == len(list(DeepLatentStack(TINY).parameters()))
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


@pytest.mark.parametrize("name", ["matepoint", "matepoint-nowaittiming"])
def test_matepoint_strategy_offloads_on_cpu(name: str) -> None:
    strategy = get_strategy(name)
    assert strategy.reset_stats is not None
    assert strategy.stats is not None
    strategy.reset_stats()
    _grads(strategy)
    assert strategy.stats()["bytes_offloaded"] > 0


def test_no_wait_timing_switches_timing_off_around_one_forward() -> None:
    import matepoint
    from matepoint_examples.strategies import get_strategy

    strategy = get_strategy("matepoint-nowaittiming")
    before = matepoint.get_options()
    with strategy.forward_context():
        inside = matepoint.get_options()
        assert inside.measure_waits is False
        assert inside.prefetch == before.prefetch  # every other setting as in force
    assert matepoint.get_options() is before
