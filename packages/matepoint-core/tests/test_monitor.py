"""Process-wide calls of ``matepoint._monitor``: ``prefetch_now`` and its legacy spelling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import Stack, assert_grads_equal, grads_of, mate_ckpt, torch_ckpt

import matepoint
from matepoint.testing import CPUTestTransport
from matepoint_compat import MatepointDeprecationWarning


def _step_with_early_prefetch(
    model: Stack, x: torch.Tensor, start_prefetch: Callable[[], Any]
) -> tuple[list[torch.Tensor], int]:
    model.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    out = model(leaf, mate_ckpt)
    before = matepoint.stats().prefetches
    start_prefetch()
    started = matepoint.stats().prefetches - before
    out.square().sum().backward()
    assert leaf.grad is not None
    grads = [leaf.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return grads, started


@pytest.mark.parametrize("spelling", ["prefetch_now", "legacy matepoint_pipeline"])
def test_prefetch_now_starts_the_newest_copies_before_backward(
    transport: CPUTestTransport, spelling: str
) -> None:
    model = Stack(depth=6)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    if spelling == "prefetch_now":
        start = matepoint.prefetch_now
    else:
        with pytest.warns(MatepointDeprecationWarning, match="matepoint_pipeline"):
            start = matepoint.matepoint_pipeline  # type: ignore[attr-defined]
    with matepoint.options(stash_bytes=0, max_inflight_bytes=0, prefetch=3):
        grads, started = _step_with_early_prefetch(model, x, start)
    # The newest input is still on the device (it counts towards the look-ahead); the two
    # before it are fetched early, and backward then uses those copies.
    assert started == 2
    assert matepoint.stats().prefetch_hits >= 2
    assert_grads_equal(grads, reference)


def test_prefetch_now_without_offloads_does_nothing() -> None:
    before = matepoint.stats().prefetches
    matepoint.prefetch_now()
    assert matepoint.stats().prefetches == before


def test_stats_add_the_compiled_graphs_copies_and_reset_clears_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The compiled path's copies (Note [Counting compiled copies]) are offloads and fetches."""
    from matepoint._compiled import traffic as compiled_traffic

    traffic = compiled_traffic.CompiledTrafficCounts(
        offloads=3, bytes_offloaded=3072, fetches=2, bytes_fetched=2048
    )
    monkeypatch.setattr(compiled_traffic, "COMPILED_TRAFFIC", traffic)
    stats = matepoint.stats()
    assert (stats.offloads, stats.bytes_offloaded) == (3, 3072)
    assert (stats.fetches, stats.bytes_fetched) == (2, 2048)
    assert "3 tensors, 3.00 KiB" in matepoint.report()
    matepoint.reset_stats()
    assert traffic == compiled_traffic.CompiledTrafficCounts()
