"""Reliability on a real GPU: faults, pinned exhaustion, threads, autograd variety.

The CPU suites (test_reliability.py, test_faults_and_inputs.py) check the engine's bookkeeping
through the CPU test transport. These run the same failure modes through the CUDA transport,
where copies really run on a side stream, originals really go back to the caching allocator and
out-of-memory errors come from the allocator itself. Besides matepoint's own levels (live
records, pool bytes, device originals held) each fault checks ``torch.cuda.memory_allocated()``:
after the fault and a recovery step it is back to the byte where it was before.

Every test records its numbers (``record_property``, see _recording.py) in the junit XML of the
run, the data behind the "On a GPU" section of ``docs/reliability.md``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _cuda_helpers import (
    TOKENS,
    WIDTH,
    assert_restored,
    levels,
    make_stack,
    run_blocks,
    torch_ckpt,
)
from _helpers import run_in_threads
from _recording import Record, report

import matepoint
from matepoint._engine import transport as _transport

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_start")]

DEPTH = 6
ONE_INPUT = TOKENS * WIDTH * 4  # bytes of one fp32 block input


class Faulty:
    """Calls a block, raising ``error("injected")`` on the ``fail_at``-th call.

    A forward pass over ``DEPTH`` blocks makes calls ``0 .. DEPTH - 1``; recomputation in
    backward continues the count from the last block down. Each fault raises a new exception:
    a stored instance would keep its last traceback, and with it the failed step's graph, alive.
    """

    def __init__(self) -> None:
        self.calls = 0
        self.fail_at: int | None = None
        self.error: type[BaseException] = RuntimeError

    def __call__(self, block: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        index = self.calls
        self.calls += 1
        if index == self.fail_at:
            raise self.error("injected")
        result: torch.Tensor = block(h)
        return result


def _step(
    blocks: torch.nn.ModuleList,
    x0: torch.Tensor,
    checkpoint_fn: Callable[..., Any],
    seed: int = 2,
) -> list[torch.Tensor]:
    """One seeded forward and backward; the gradients (parameter grads are reset to None)."""
    blocks.zero_grad(set_to_none=True)
    x = x0.detach().clone().requires_grad_(True)
    torch.cuda.manual_seed(seed)
    out = run_blocks(blocks, x * 1, checkpoint_fn)  # x * 1: the first input is an activation
    out.float().square().mean().backward()
    assert x.grad is not None
    grads = [p.grad for p in blocks.parameters() if p.grad is not None] + [x.grad]
    blocks.zero_grad(set_to_none=True)
    return grads


def _equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert not torch.isnan(got).any(), "NaN in a gradient: a copy was read before it ended"
        assert torch.equal(got, want), "gradient differs from torch.utils.checkpoint's"


def _mate(faulty: Faulty | None = None, **options: Any) -> Callable[..., Any]:
    """A checkpoint function; ``min_offload_bytes`` is the call's, the rest settings in force."""
    call = {name: options.pop(name) for name in list(options) if name == "min_offload_bytes"}
    offload = matepoint.OffloadOptions(**call) if call else None

    def checkpoint_fn(block: torch.nn.Module, h: torch.Tensor) -> Any:
        with matepoint.options(**options):
            if faulty is None:
                return matepoint.checkpoint(block, h, offload=offload)
            return matepoint.checkpoint(faulty, block, h, offload=offload)

    return checkpoint_fn


# -- faults ---------------------------------------------------------------------------------------

_FAULTS = {
    "exception in forward": "the error reaches the caller of forward",
    "exception in recompute": "the error reaches the caller of backward",
    "KeyboardInterrupt in forward": "KeyboardInterrupt reaches the caller",
    "graph dropped with copies in flight": "the graph is dropped right after forward",
    "CUDA OOM in backward (allocator limit)": "a memory limit just above the forward's "
    "footprint makes backward fail with the allocator's out-of-memory error",
    "CUDA OOM in prefetch (injected)": "the side stream's first allocation in backward fails: "
    "the prefetch is skipped, the input fetched on demand, the step still equals torch",
}


def _oom_in_backward(
    blocks: torch.nn.ModuleList, x0: torch.Tensor, mate: Callable[..., Any]
) -> None:
    """Run forward, cap device memory just above what it holds, run backward: it must fail."""
    x = x0.detach().clone().requires_grad_(True)
    torch.cuda.manual_seed(2)
    loss = run_blocks(blocks, x * 1, mate).float().square().mean()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + (2 << 20)) / total)
    try:
        with pytest.raises(RuntimeError, match="out of memory") as caught:
            loss.backward()
        assert isinstance(caught.value, torch.cuda.OutOfMemoryError)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    del caught, loss, x


@pytest.mark.parametrize("fault", list(_FAULTS))
def test_fault_leaves_nothing_and_next_step_is_exact(
    fault: str, monkeypatch: pytest.MonkeyPatch, record_property: Record
) -> None:
    blocks = make_stack(DEPTH)
    torch.manual_seed(1)
    x0 = torch.randn(TOKENS, WIDTH, device="cuda")
    reference = _step(blocks, x0, torch_ckpt)
    faulty = Faulty()
    mate = _mate(faulty, prefetch=2)
    _equal(_step(blocks, x0, mate), reference)  # the pool now holds one step's blocks
    before = levels()
    if fault == "exception in forward":
        faulty.calls, faulty.fail_at = 0, DEPTH // 2
        with pytest.raises(RuntimeError, match="injected"):
            _step(blocks, x0, mate)
    elif fault == "exception in recompute":
        faulty.calls, faulty.fail_at = 0, DEPTH + 2
        with pytest.raises(RuntimeError, match="injected"):
            _step(blocks, x0, mate)
    elif fault == "KeyboardInterrupt in forward":
        faulty.calls, faulty.fail_at, faulty.error = 0, DEPTH - 1, KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            _step(blocks, x0, mate)
    elif fault == "graph dropped with copies in flight":
        out = run_blocks(blocks, x0 * 1, mate)
        del out  # the last copies are still running on the side stream
    elif fault == "CUDA OOM in backward (allocator limit)":
        _oom_in_backward(blocks, x0, mate)
    else:
        original = _transport._CudaChannel.copy_in
        failures = {"left": 1}

        def copy_in(self: Any, host: torch.Tensor) -> Any:
            if failures["left"]:
                failures["left"] -= 1
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected into a prefetch)")
            return original(self, host)

        monkeypatch.setattr(_transport._CudaChannel, "copy_in", copy_in)
        _equal(_step(blocks, x0, mate), reference)
        assert failures["left"] == 0
        assert matepoint.stats().prefetches_skipped == 1
    faulty.fail_at = None
    at_fault = levels()
    blocks.zero_grad(set_to_none=True)
    assert at_fault["live_records"] == at_fault["pool_in_use_bytes"] == 0
    assert at_fault["device_bytes_held"] == 0
    _equal(_step(blocks, x0, mate), reference)
    _equal(_step(blocks, x0, mate), reference)
    after = levels()
    assert_restored(before, after)
    report(
        record_property,
        steps=4,
        faults=1,
        before=before,
        after=after,
        prefetches_skipped=matepoint.stats().prefetches_skipped,
    )


@pytest.mark.parametrize("policy", ["pageable", "raise"])
def test_pinned_pool_cap_exhausted(policy: str, record_property: Record) -> None:
    blocks = make_stack(DEPTH)
    torch.manual_seed(1)
    x0 = torch.randn(TOKENS, WIDTH, device="cuda")
    wide = torch.randn(TOKENS + 512, WIDTH, device="cuda")  # new sizes: the pool must allocate
    reference = _step(blocks, x0, torch_ckpt)
    wide_reference = _step(blocks, wide, torch_ckpt)
    mate = _mate()  # no per-call options: the process-wide cap and policy below apply
    _equal(_step(blocks, x0, mate), reference)
    before = levels()
    caught_warnings: list[warnings.WarningMessage] = []
    with matepoint.options(pool_cap_bytes=before["pool_pinned_bytes"], on_pool_exhausted=policy):
        if policy == "raise":
            with pytest.raises(matepoint.PinnedMemoryExhausted, match="pool_cap_bytes") as caught:
                _step(blocks, wide, mate)
            assert "on_pool_exhausted='pageable'" in str(caught.value)
            del caught
        else:
            with warnings.catch_warnings(record=True) as caught_warnings:
                warnings.simplefilter("always")
                _equal(_step(blocks, wide, mate), wide_reference)
                _equal(_step(blocks, wide, mate), wide_reference)
        at_fault = levels()
        fallbacks = matepoint.stats().pageable_fallbacks
    if policy == "pageable":
        pageable_warnings = [w for w in caught_warnings if "pageable" in str(w.message)]
        assert len(pageable_warnings) <= 1  # once per pool (none if it warned before)
        assert fallbacks > 0
    assert at_fault["live_records"] == at_fault["pool_in_use_bytes"] == 0
    assert at_fault["pool_pinned_bytes"] <= before["pool_pinned_bytes"]
    matepoint.release_pool()
    _equal(_step(blocks, x0, mate), reference)
    after = levels()
    assert_restored(before, after)
    report(
        record_property,
        steps=5 if policy == "pageable" else 4,
        faults=1,
        before=before,
        after=after,
        pageable_fallbacks=fallbacks,
    )


# -- concurrency and autograd variety -------------------------------------------------------------


@pytest.mark.parametrize("streams_kind", ["default stream", "a stream per thread"])
def test_threads_training_their_own_models(streams_kind: str, record_property: Record) -> None:
    """Three threads train their own models at once through one engine per device.

    No dropout: the CUDA generator is shared by the threads, so dropout masks would depend on
    their interleaving. With their own streams, each thread's copies must order against the
    stream current in that thread.
    """
    threads_count, steps = 3, 8
    models = [make_stack(4, seed=seed, dropout=0.0) for seed in range(threads_count)]
    inputs = [torch.randn(TOKENS, WIDTH, device="cuda") for _ in range(threads_count)]
    references = [_step(m, x, torch_ckpt) for m, x in zip(models, inputs, strict=True)]
    torch.cuda.synchronize()
    before = levels()
    mate = _mate(prefetch=2, max_inflight_bytes=ONE_INPUT)
    streams = [
        torch.cuda.Stream() if streams_kind != "default stream" else None
        for _ in range(threads_count)
    ]

    def train(index: int) -> list[torch.Tensor]:
        with torch.cuda.stream(streams[index]):
            grads = _step(models[index], inputs[index], mate)
            torch.cuda.current_stream().synchronize()
        return grads

    results = run_in_threads(train, threads_count, steps)
    for index in range(threads_count):
        assert len(results[index]) == steps
        for got in results[index]:
            _equal(got, references[index])
    offloads = matepoint.stats().offloads
    assert offloads >= threads_count * steps * 4
    results.clear()
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == after["device_bytes_held"] == 0
    # Device memory is recorded, not compared: each new thread (and stream) gets its own cuBLAS
    # handle and workspace, which torch keeps for reuse.
    report(
        record_property,
        steps=threads_count * steps,
        offloads=offloads,
        before=before,
        after=after,
    )


@pytest.mark.parametrize("entry", ["autograd.grad", "create_graph", "backward(inputs=...)"])
def test_autograd_entry_points(entry: str, record_property: Record) -> None:
    blocks = make_stack(4)
    torch.manual_seed(1)
    x0 = torch.randn(TOKENS // 4, WIDTH, device="cuda")

    def run(checkpoint_fn: Callable[..., Any]) -> list[torch.Tensor]:
        blocks.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        torch.cuda.manual_seed(2)
        loss = run_blocks(blocks, x * 1, checkpoint_fn).square().mean()
        params = list(blocks.parameters())
        if entry == "autograd.grad":
            return list(torch.autograd.grad(loss, [x, *params]))
        if entry == "create_graph":
            (grad_x,) = torch.autograd.grad(loss, [x], create_graph=True)
            grad_x.square().sum().backward()
            return [p.grad for p in params if p.grad is not None]
        loss.backward(inputs=[x, params[0]])
        assert all(p.grad is None for p in params[1:])
        assert x.grad is not None
        assert params[0].grad is not None
        return [x.grad, params[0].grad]

    reference = run(torch_ckpt)
    result = run(_mate(min_offload_bytes=0))
    assert matepoint.stats().offloads >= 3
    _equal(result, reference)
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == after["device_bytes_held"] == 0
    report(
        record_property,
        steps=2,
        after=after,
    )
