"""Failure modes: in-place writes to saved inputs, threads, interrupts, and long runs (soak).

Each test records its numbers with ``record_property`` (see _recording.py);
test_faults_and_inputs.py has the rest.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from _helpers import (
    Stack,
    assert_grads_equal,
    assert_nothing_leaked,
    grads_of,
    mate_ckpt,
    run_in_threads,
    settle,
    torch_ckpt,
)
from _recording import Record, rss_bytes

import matepoint
from matepoint.testing import CPUTestTransport, use_transport


def _report(record_property: Record, **numbers: object) -> None:
    """Record a test's numbers (``steps``, ``faults_injected``, ``*_before``...) as data."""
    for name, value in numbers.items():
        record_property(name, value)


def _levels(stage: str) -> dict[str, int]:
    """The memory levels a fault must leave unchanged, and RSS, keyed ``<name>_<stage>``."""
    snapshot = settle()
    return {
        f"live_records_{stage}": snapshot.live_records,
        f"pool_in_use_bytes_{stage}": snapshot.pool_in_use_bytes,
        f"pool_pinned_bytes_{stage}": snapshot.pool_pinned_bytes,
        f"device_bytes_held_{stage}": snapshot.device_bytes_held,
        f"rss_bytes_{stage}": rss_bytes(),
    }


def _restored(before: dict[str, int]) -> dict[str, int]:
    """The levels now, asserted equal to ``before`` (all but RSS, which the interpreter owns)."""
    after = _levels("after")
    for name, value in before.items():
        if not name.startswith("rss_bytes"):
            current = after[name.replace("_before", "_after")]
            assert current == value, f"{name}: {value}; after the fault: {current}"
    return after


# -- in-place modification of a saved input after forward ----------------------------------------


def test_inplace_while_original_is_held_raises(
    transport: CPUTestTransport, record_property: Record
) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    y = matepoint.checkpoint(torch.sin, h)
    h.add_(1.0)  # the original is still held (its copy has not run)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as caught:
        y.sum().backward()
    assert isinstance(caught.value, matepoint.InplaceModificationError)
    assert "[torch.FloatTensor [4, 16]]" in str(caught.value)  # names the tensor, as torch does
    _report(
        record_property,
        faults_injected=1,
    )


def test_torch_raises_for_the_same_modification(record_property: Record) -> None:
    # The contract matepoint keeps: torch's own checkpoint raises here too.
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    y = torch_ckpt(torch.sin, h)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    _report(
        record_property,
        faults_injected=1,
    )


def test_inplace_after_release_raises(
    fast_transport: CPUTestTransport, record_property: Record
) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    with matepoint.options(stash_bytes=0):
        h = x * 1
        y = matepoint.checkpoint(torch.sin, h)
        z = matepoint.checkpoint(torch.cos, y)  # settles h's copy: its original is released
        assert matepoint.stats().device_bytes_held < 2 * h.numel() * h.element_size()
        h.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            z.sum().backward()
    _report(
        record_property,
        faults_injected=1,
    )


def test_inplace_through_another_view_after_release_is_never_silently_wrong(
    fast_transport: CPUTestTransport, record_property: Record
) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    expected = torch.exp(torch.sin(x.detach()[:4])) * torch.cos(x.detach()[:4])
    with matepoint.options(stash_bytes=0):
        base = x * 1
        h = base[:4]
        y = matepoint.checkpoint(torch.sin, h)
        z = matepoint.checkpoint(torch.exp, y)
        del h  # only the base keeps the storage now
        with torch.no_grad():
            base.mul_(3.0)
        error: RuntimeError | None = None
        try:
            z.sum().backward()
        except RuntimeError as raised:
            error = raised
        if error is not None:
            assert "inplace" in str(error)
        else:
            # Served from the copy taken before the write: the gradient of the forward computed.
            assert x.grad is not None
            torch.testing.assert_close(x.grad[:4], expected, rtol=0, atol=0)
    _report(
        record_property,
        faults_injected=1,
        behaviour="raised" if error is not None else "served the pre-write copy",
    )


def test_inplace_racing_an_inflight_copy_raises_not_poison(
    transport: CPUTestTransport, record_property: Record
) -> None:
    # The copy is still queued when the input is modified: it would read the new bytes (the test
    # transport poisons them). The engine must notice and raise, never return NaN gradients.
    x = torch.randn(4, 16, requires_grad=True)
    one = x.numel() * x.element_size()
    with matepoint.options(stash_bytes=0, max_inflight_bytes=one):
        h = x * 1
        y = matepoint.checkpoint(torch.sin, h)
        h.add_(1.0)
        del h
        y2 = matepoint.checkpoint(torch.cos, y * 1)  # the engine waits for h's copy, drops h
        y3 = matepoint.checkpoint(torch.tanh, y2 * 1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y3.sum().backward()
    _report(
        record_property,
        faults_injected=1,
    )


# -- threads ------------------------------------------------------------------------------


@pytest.mark.parametrize("completion", ["deferred", "on_query"])
def test_threads_training_their_own_models(
    completion: str, fresh_stats: None, record_property: Record
) -> None:
    test_transport = CPUTestTransport(completion=completion)  # type: ignore[arg-type]
    models = [Stack(depth=4, seed=seed) for seed in range(4)]
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 + i)) for i in range(4)]
    references = [grads_of(model, x, torch_ckpt) for model, x in zip(models, inputs, strict=True)]

    def train(index: int) -> list[torch.Tensor]:
        return grads_of(models[index], inputs[index], mate_ckpt)

    with (
        use_transport(test_transport),
        matepoint.options(min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=256, prefetch=2),
    ):
        results = run_in_threads(train, 4, 15)
    for index in range(4):
        assert len(results[index]) == 15
        for got in results[index]:
            assert_grads_equal(got, references[index])
    test_transport.drain()
    offloads = settle().offloads
    assert offloads == 4 * 15 * 4
    assert_nothing_leaked()
    _report(
        record_property,
        steps=4 * 15,
        offloads=offloads,
        **_levels("after"),
    )


# -- interrupts ------------------------------------------------------------------------------


def test_keyboard_interrupt_in_forward_leaves_nothing(
    transport: CPUTestTransport, record_property: Record
) -> None:
    model = Stack(depth=5)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)  # the pool holds one step
    before = _levels("before")
    calls = 0

    def interrupted(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return torch.tanh(layer(h)) + h

    def forward_with_interrupt() -> None:
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1
        for block in model.blocks:
            h = matepoint.checkpoint(interrupted, block, h)
        h.sum().backward()

    with pytest.raises(KeyboardInterrupt):
        forward_with_interrupt()
    gc.collect()
    transport.drain()
    assert_nothing_leaked()
    # The next step works and is exact.
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    assert_nothing_leaked()
    _report(
        record_property,
        steps=3,
        faults_injected=1,
        **before,
        **_restored(before),
    )


def test_exception_in_recompute_leaves_nothing(
    transport: CPUTestTransport, record_property: Record
) -> None:
    model = Stack(depth=4)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)  # the pool holds one step
    before = _levels("before")
    fail = {"now": False}

    def flaky(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        if fail["now"]:
            raise ValueError("boom in recomputation")
        return torch.tanh(layer(h)) + h

    def step() -> None:
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1
        for block in model.blocks:
            h = matepoint.checkpoint(flaky, block, h)
        fail["now"] = True
        h.sum().backward()

    with pytest.raises(ValueError, match="boom"):
        step()
    fail["now"] = False
    gc.collect()
    transport.drain()
    assert_nothing_leaked()
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    _report(
        record_property,
        steps=3,
        faults_injected=1,
        **before,
        **_restored(before),
    )


# -- soak ---------------------------------------------------------------------------------------


def _soak(steps: int, check_rss: bool) -> dict[str, int]:
    test_transport = CPUTestTransport(completion="deferred")
    model = Stack(depth=6, width=32)
    rng = random.Random(0)
    lengths = [8, 16, 24, 32, 48]
    warmup = min(steps // 5, 100)
    pinned_at_warmup = rss_at_warmup = 0
    peak_pinned = peak_live = 0
    with (
        use_transport(test_transport),
        matepoint.options(
            min_offload_bytes=0, stash_bytes=2048, max_inflight_bytes=4096, prefetch=2
        ),
    ):
        for step in range(steps):
            x = torch.randn(rng.choice(lengths), 32, requires_grad=True)
            out = model(x, mate_ckpt)
            if step % 10 == 9:
                del out  # graph dropped without backward
            else:
                out.square().mean().backward()
                del out
            snapshot = matepoint.stats()
            assert snapshot.live_records == 0
            assert snapshot.pool_in_use_bytes == 0
            peak_live = max(peak_live, snapshot.live_records)
            if step == warmup:
                gc.collect()
                pinned_at_warmup = snapshot.pool_pinned_bytes
                rss_at_warmup = rss_bytes()
            if step > warmup:
                peak_pinned = max(peak_pinned, snapshot.pool_pinned_bytes)
        test_transport.drain()
    final = settle()
    assert final.live_records == 0
    assert final.pool_in_use_bytes == 0
    # Every shape was seen during warm-up: the pool does not grow after it.
    assert peak_pinned <= max(pinned_at_warmup, 6 * 48 * 32 * 4 * 2)
    assert len(test_transport.pending) == 0
    rss_final = rss_bytes()
    if check_rss and rss_at_warmup:
        assert rss_final - rss_at_warmup < 64 << 20
    assert_nothing_leaked()
    return {
        "steps": steps,
        "faults_injected": steps // 10,  # graphs dropped without backward
        "live_records_after": final.live_records,
        "pool_in_use_bytes_after": final.pool_in_use_bytes,
        "pool_pinned_bytes_before": pinned_at_warmup,  # after warm-up
        "pool_pinned_bytes_after": final.pool_pinned_bytes,
        "peak_pool_pinned_bytes": peak_pinned,
        "rss_bytes_before": rss_at_warmup,
        "rss_bytes_after": rss_final,
        "offloads": final.offloads,
    }


_SOAK_CHECKS = (
    "6 checkpoints, 5 input shapes at random, every 10th graph dropped without backward: no "
    "record alive and no block in use after any step; the pool does not grow after warm-up"
)


@pytest.mark.slow
def test_soak_short(fresh_stats: None, record_property: Record) -> None:
    _report(
        record_property,
        **_soak(100, check_rss=False),
    )


@pytest.mark.slow
def test_soak_long(fresh_stats: None, record_property: Record) -> None:
    _report(
        record_property,
        **_soak(1500, check_rss=True),
    )
