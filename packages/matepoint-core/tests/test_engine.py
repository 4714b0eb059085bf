"""The offload engine's bookkeeping, run on the CPU through CPUTestTransport.

Which tensors move and which stay, the strides they come back with, dedupe, the stash, the
look-ahead order, when originals are released, and release of everything when the graph dies.
"""

from __future__ import annotations

import gc
import time
from typing import Any

import pytest
import torch
from _helpers import (
    Stack,
    assert_grads_equal,
    assert_nothing_leaked,
    engine_of,
    grads_of,
    mate_ckpt,
    settle,
    torch_ckpt,
)

import matepoint
from matepoint._engine import active_transport
from matepoint._engine.transport import CudaTransport
from matepoint.testing import CopyReadFreedMemory, CPUTestTransport, use_transport


def _mul(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weight)


# -- what is offloaded and what stays -------------------------------------------------------


def test_activation_input_is_offloaded(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 2
    y = matepoint.checkpoint(torch.sin, h)
    snapshot = matepoint.stats()
    assert snapshot.offloads == 1
    assert snapshot.bytes_offloaded == h.numel() * h.element_size()
    assert transport.copies_out == 1
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(2 * x.detach()))


def test_parameters_stay_in_place(transport: CPUTestTransport) -> None:
    weight = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(4, 16, requires_grad=True) * 1
    y = matepoint.checkpoint(_mul, weight, x)
    snapshot = matepoint.stats()
    assert snapshot.skipped_parameters == 1
    assert snapshot.offloads == 1
    y.sum().backward()
    assert weight.grad is not None


def test_small_tensors_stay_in_place(transport: CPUTestTransport) -> None:
    small = torch.randn(4, requires_grad=True) * 1  # 16 bytes
    large = torch.randn(64, requires_grad=True) * 1  # 256 bytes
    with matepoint.options(min_offload_bytes=64):
        y = matepoint.checkpoint(lambda a, b: a.sum() * b, small, large)
    snapshot = matepoint.stats()
    assert snapshot.skipped_small == 1
    assert snapshot.offloads == 1
    assert snapshot.bytes_offloaded == 256
    y.sum().backward()


def test_empty_tensor_stays_in_place(transport: CPUTestTransport) -> None:
    empty = torch.zeros(0, 3, requires_grad=True) * 1
    x = torch.randn(8, requires_grad=True) * 1
    y = matepoint.checkpoint(lambda a, b: a.sum() + b, empty, x)
    assert matepoint.stats().offloads == 1
    y.sum().backward()


def test_sparse_tensors_stay_in_place(transport: CPUTestTransport) -> None:
    sparse = torch.eye(8).to_sparse()
    x = torch.randn(8, 4, requires_grad=True)
    h = x * 1
    y = matepoint.checkpoint(torch.sparse.mm, sparse, h)
    snapshot = matepoint.stats()
    assert snapshot.skipped_other == 1
    assert snapshot.offloads == 1
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(8, 4))


def test_overlapping_strides_stay_in_place(transport: CPUTestTransport) -> None:
    row = torch.randn(1, 16, requires_grad=True)
    expanded = (row * 1).expand(8, 16)  # stride 0: 8 elements share one slot
    assert expanded.stride() == (0, 1)
    y = matepoint.checkpoint(torch.sin, expanded)
    snapshot = matepoint.stats()
    assert snapshot.skipped_other == 1
    assert snapshot.offloads == 0
    y.sum().backward()
    torch.testing.assert_close(row.grad, 8 * torch.cos(row.detach()))


def test_cpu_tensors_never_offload_under_the_cuda_transport(fresh_stats: None) -> None:
    # On a machine without a GPU the default transport is the CUDA one: CPU tensors stay put.
    assert isinstance(active_transport.transport(), CudaTransport)
    model = Stack(depth=3)
    x = torch.randn(4, 16)
    with matepoint.options(min_offload_bytes=0):
        got = grads_of(model, x, mate_ckpt)
    assert_grads_equal(got, grads_of(model, x, torch_ckpt))
    snapshot = matepoint.stats()
    assert snapshot.offloads == 0
    assert snapshot.skipped_other == 3
    assert snapshot.pool_pinned_bytes == 0


def test_offload_false_offloads_nothing(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    y = matepoint.checkpoint(torch.sin, x * 1, offload=False)
    y.sum().backward()
    assert matepoint.stats().offloads == 0
    assert transport.copies_out == 0


def test_no_grad_offloads_nothing(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    with torch.no_grad():
        matepoint.checkpoint(torch.sin, x * 1)
    assert matepoint.stats().offloads == 0


def test_nested_tensors_are_offloaded(transport: CPUTestTransport) -> None:
    a = torch.randn(4, 16, requires_grad=True)
    b = torch.randn(4, 16, requires_grad=True)

    def function(pair: tuple[torch.Tensor, torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        return torch.sin(pair[0]) * pair[1] * scale

    scale = torch.full((4, 16), 3.0)
    y = matepoint.checkpoint(function, (a * 1, b * 1), scale=scale)
    assert matepoint.stats().offloads == 3
    y.sum().backward()
    torch.testing.assert_close(a.grad, torch.cos(a.detach()) * b.detach() * 3)
    torch.testing.assert_close(b.grad, torch.sin(a.detach()) * 3)


# -- layout of what comes back -------------------------------------------------------------


def test_flattened_call_does_not_keep_inputs_alive(fast_transport: CPUTestTransport) -> None:
    # A non-tensor argument (a module) makes matepoint pass every tensor leaf to torch's checkpoint
    # through a wrapper; the wrapper torch keeps for recomputation must not pin the inputs.
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    # torch's first checkpoint in a process imports lazily, and the import keeps that call's
    # frames (and so its arguments) alive in a cycle: warm up first.
    torch_ckpt(torch.sin, x).sum().backward()
    matepoint.reset_stats()
    with matepoint.options(stash_bytes=0):
        h = x * 1
        probe = torch.utils.weak.WeakTensorKeyDictionary()
        probe[h] = True
        y = matepoint.checkpoint(lambda module, a, *, scale: module(a) * scale, layer, h, scale=2.0)
        del h
        matepoint.checkpoint(torch.sin, y * 1)  # a further offload settles the first one
        # Freed by reference counting at once, as device memory must be; no gc pass needed.
        assert len(probe) == 0, "the checkpoint input outlived its offload"
        assert matepoint.stats().offloads_freed_nothing == 0


def test_transposed_input_comes_back_with_its_strides(fast_transport: CPUTestTransport) -> None:
    weight = torch.randn(16, 16, requires_grad=True)
    base = torch.randn(16, 8, requires_grad=True)
    seen: list[tuple[tuple[int, ...], bool]] = []

    def function(h: torch.Tensor) -> torch.Tensor:
        seen.append((h.stride(), h.is_contiguous()))
        return torch.tanh(h @ weight)

    with matepoint.options(stash_bytes=0, prefetch=0):
        transposed = (base * 1).t()  # 8 x 16, dense but not contiguous; dies after the call
        assert not transposed.is_contiguous()
        y = matepoint.checkpoint(function, transposed)
        del transposed
        # The newest original stays held until the next offload; add one so the first is released.
        y = matepoint.checkpoint(torch.sin, y)
        loss = y.square().sum()
        loss.backward()
    snapshot = matepoint.stats()
    assert snapshot.offloads == 2
    assert snapshot.fetches == 1  # the original died: the value came from the host copy
    assert snapshot.stash_hits == 1  # the trailing checkpoint's input, still held
    assert seen[0] == seen[1] == ((1, 8), False)

    reference_weight = weight.detach().clone().requires_grad_(True)
    reference_base = base.detach().clone().requires_grad_(True)
    reference = torch_ckpt(lambda h: torch.tanh(h @ reference_weight), (reference_base * 1).t())
    torch_ckpt(torch.sin, reference).square().sum().backward()
    torch.testing.assert_close(base.grad, reference_base.grad, rtol=0, atol=0)
    torch.testing.assert_close(weight.grad, reference_weight.grad, rtol=0, atol=0)


def test_offset_view_comes_back_intact(fast_transport: CPUTestTransport) -> None:
    base = torch.randn(10, 16, requires_grad=True)
    with matepoint.options(stash_bytes=0, prefetch=0):
        rows = (base * 1)[3:7]  # a view at a storage offset; its base dies with it
        y = matepoint.checkpoint(torch.sin, rows)
        del rows
        y = matepoint.checkpoint(torch.exp, y)
        y.sum().backward()
    assert matepoint.stats().fetches == 1
    expected = torch.zeros(10, 16)
    middle = base.detach()[3:7]
    expected[3:7] = torch.exp(torch.sin(middle)) * torch.cos(middle)
    torch.testing.assert_close(base.grad, expected, rtol=0, atol=0)


# -- dedupe ---------------------------------------------------------------------------------


def test_shared_input_is_offloaded_once(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    first = matepoint.checkpoint(torch.sin, h)
    second = matepoint.checkpoint(torch.cos, h)
    snapshot = matepoint.stats()
    assert snapshot.offloads == 1
    assert snapshot.dedupe_hits == 1
    assert transport.copies_out == 1
    del h
    (first + second).sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) - torch.sin(x.detach()))
    assert_nothing_leaked()


@pytest.mark.parametrize("prefetch", [0, 2])
def test_shared_input_after_release_is_fetched_once_per_backward(
    fast_transport: CPUTestTransport, prefetch: int
) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    with matepoint.options(stash_bytes=0, prefetch=prefetch):
        h = x * 1
        first = matepoint.checkpoint(torch.sin, h)
        second = matepoint.checkpoint(torch.cos, h)
        del h
        # A later offload lets the shared original go (stash 0), so backward must fetch it.
        third = matepoint.checkpoint(torch.tanh, first * second)
        third.sum().backward()
    snapshot = matepoint.stats()
    assert snapshot.offloads == 2
    assert snapshot.dedupe_hits == 1
    assert snapshot.fetches == 1  # one copy back serves both checkpoints
    assert snapshot.shared_fetch_hits == 1
    sin, cos = torch.sin(x.detach()), torch.cos(x.detach())
    outer = 1 - torch.tanh(sin * cos) ** 2
    torch.testing.assert_close(x.grad, outer * (cos * cos - sin * sin))
    assert_nothing_leaked()


def test_modified_tensor_is_not_deduped(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    first = matepoint.checkpoint(torch.sin, h)
    h2 = h.detach()  # another name for the same storage, no autograd link
    first_value = first.detach().clone()
    h2 = h * 1  # a new tensor: not the same storage
    second = matepoint.checkpoint(torch.sin, h2)
    snapshot = matepoint.stats()
    assert snapshot.offloads == 2
    assert snapshot.dedupe_hits == 0
    (first + second).sum().backward()
    torch.testing.assert_close(first.detach(), first_value)


# -- stash -------------------------------------------------------------------------------


@pytest.mark.parametrize("stash_bytes", [0, 1 << 30])
def test_stash_serves_the_tail_without_copies(
    fast_transport: CPUTestTransport, stash_bytes: int
) -> None:
    model = Stack(depth=5)
    x = torch.randn(4, 16)
    with matepoint.options(stash_bytes=stash_bytes, prefetch=2):
        got = grads_of(model, x, mate_ckpt)
    assert_grads_equal(got, grads_of(model, x, torch_ckpt))
    snapshot = settle()
    assert snapshot.offloads == 5
    one = 4 * 16 * 4
    if stash_bytes:
        assert snapshot.stash_hits == 5
        assert snapshot.bytes_served_from_stash == snapshot.bytes_offloaded
        assert snapshot.fetches == 0
        assert fast_transport.copies_in == 0
    else:
        # Only the newest input is still on the device when backward starts.
        assert snapshot.stash_hits == 1
        assert snapshot.fetches == 4
        assert snapshot.bytes_fetched == 4 * one
        assert fast_transport.copies_in == 4
    assert_nothing_leaked()


def test_stash_keeps_only_its_budget(fast_transport: CPUTestTransport) -> None:
    model = Stack(depth=6)
    x = torch.randn(4, 16)
    one = 4 * 16 * 4
    with matepoint.options(stash_bytes=2 * one, prefetch=0):
        leaf = x.clone().requires_grad_(True)
        out = model(leaf, mate_ckpt)
        # The stash, plus the newest input whose copy was only just queued.
        assert matepoint.stats().device_bytes_held == 3 * one
        out.square().sum().backward()
    snapshot = matepoint.stats()
    assert snapshot.stash_hits == 3
    assert snapshot.fetches == 3


# -- look-ahead -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefetch", [0, 1, 2, 3])
def test_first_unpack_prefetches_exactly_the_preceding_records(
    prefetch: int, fresh_stats: None
) -> None:
    depth = 6
    transport = CPUTestTransport(completion="deferred")
    calls = [0] * depth
    observed: dict[str, object] = {}

    def make_block(index: int, layer: torch.nn.Module):  # type: ignore[no-untyped-def]
        def block(h: torch.Tensor) -> torch.Tensor:
            calls[index] += 1
            if calls[index] == 2 and "prefetched" not in observed:
                # The first recomputation of backward: look at what the engine started.
                engine = engine_of(transport)
                live = dict(engine._records.items())
                observed["prefetched"] = sorted(
                    seq for seq, record in live.items() if record.prefetched is not None
                )
                observed["unpacked"] = sorted(seq for seq, record in live.items() if record.unpacks)
                observed["prefetches"] = matepoint.stats().prefetches
                observed["copies_in"] = transport.copies_in
            return torch.tanh(layer(h))

        return block

    layers = [torch.nn.Linear(16, 16) for _ in range(depth)]
    x = torch.randn(4, 16, requires_grad=True)
    with (
        use_transport(transport),
        matepoint.options(
            min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=0, prefetch=prefetch
        ),
    ):
        h = x * 1
        for index, layer in enumerate(layers):
            h = matepoint.checkpoint(make_block(index, layer), h)
        loss = h.sum()
        del h
        first_sequence = min(engine_of(transport)._records)
        loss.backward()
    last = first_sequence + depth - 1
    assert observed["unpacked"] == [last]
    assert observed["prefetched"] == list(range(last - prefetch, last))
    assert observed["prefetches"] == prefetch
    # The newest input is still held on the device: its unpack copies nothing.
    assert observed["copies_in"] == prefetch
    snapshot = matepoint.stats()
    assert snapshot.stash_hits == 1
    assert snapshot.prefetch_hits == min(prefetch, 1) * (depth - 1)
    assert snapshot.fetches == depth - 1
    assert transport.copies_in == depth - 1  # nothing fetched twice


@pytest.mark.parametrize("prefetch", [1, 2])
def test_shared_input_is_prefetched_where_backward_first_needs_it(
    prefetch: int, fresh_stats: None
) -> None:
    """x0 mixed into every block (a GPT's embedding) is packed first but needed first in backward.

    The look-ahead in pack order never reaches it; it is prefetched with the newest blocks
    instead, so every unpack of it is served by that one prefetched copy, and nothing crosses the
    link twice.
    """
    depth = 6
    transport = CPUTestTransport(completion="deferred")
    layers = [torch.nn.Linear(16, 16) for _ in range(depth)]

    def block(layer: torch.nn.Module, h: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        return torch.tanh(layer(h + x0))

    x = torch.randn(4, 16, requires_grad=True)
    with (
        use_transport(transport),
        matepoint.options(
            min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=0, prefetch=prefetch
        ),
    ):
        x0 = x * 1
        h = x0 * 2
        for layer in layers:
            h = matepoint.checkpoint(block, layer, h, x0)
        loss = h.sum()
        del h, x0
        loss.backward()
    snapshot = matepoint.stats()
    assert snapshot.offloads == depth + 1
    assert snapshot.dedupe_hits == depth - 1
    # Every record but the newest block input (still on the device) comes back exactly once.
    assert snapshot.fetches == depth
    assert transport.copies_in == depth
    assert snapshot.shared_fetch_hits == depth - 1
    # x0 itself came from a prefetch, not an on-demand copy; so did every older block input.
    assert snapshot.prefetch_hits == depth
    assert_nothing_leaked()


def test_shared_records_are_forgotten_with_their_graph(transport: CPUTestTransport) -> None:
    """Without look-ahead nothing scans the shared list; dead entries still go with the graph."""
    x = torch.randn(4, 16, requires_grad=True)
    with matepoint.options(prefetch=0):
        for _ in range(5):
            h = x * 1
            out = matepoint.checkpoint(torch.sin, h) + matepoint.checkpoint(torch.cos, h)
            del h
            out.sum().backward()
            del out
    assert_nothing_leaked()
    assert engine_of(transport)._shared == []


def test_prefetch_skips_records_still_on_the_device(fast_transport: CPUTestTransport) -> None:
    # Inputs that something else keeps alive are served from the device: no copy back, and
    # the look-ahead does not fetch them either.
    layers = [torch.nn.Linear(16, 16) for _ in range(4)]
    x = torch.randn(4, 16, requires_grad=True)
    kept: list[torch.Tensor] = []
    with matepoint.options(stash_bytes=0, prefetch=2):
        h = x * 1
        for layer in layers:
            kept.append(h)
            h = matepoint.checkpoint(lambda a, layer=layer: torch.tanh(layer(a)), h)
        h.sum().backward()
    snapshot = matepoint.stats()
    assert snapshot.offloads == 4
    assert snapshot.stash_hits == 4
    assert snapshot.prefetches == 0
    assert snapshot.offloads_freed_nothing == 3  # released, but the test kept them alive
    assert fast_transport.copies_in == 0


# -- releasing originals ------------------------------------------------------------------------


def test_originals_released_only_after_their_copy(transport: CPUTestTransport) -> None:
    model = Stack(depth=8)
    x = torch.randn(4, 16)
    one = 4 * 16 * 4
    with matepoint.options(stash_bytes=0, max_inflight_bytes=2 * one, prefetch=2):
        leaf = x.clone().requires_grad_(True)
        out = model(leaf, mate_ckpt)
        held = matepoint.stats().device_bytes_held
        assert 0 < held <= 3 * one  # the in-flight budget plus the newest input
        assert transport.copies_out == 8
        out.square().sum().backward()
        got = [leaf.grad] + [p.grad for p in model.parameters()]
    snapshot = matepoint.stats()
    assert snapshot.throttled_waits >= 8 - 3
    assert_grads_equal(got, grads_of(model, x, torch_ckpt))
    transport.drain()  # would raise CopyReadFreedMemory if a source had been let go early
    assert_nothing_leaked()


@pytest.mark.parametrize("finishes_late", [False, True])
def test_throttle_counts_only_copies_it_waited_for(
    transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch, finishes_late: bool
) -> None:
    """With no bytes allowed in flight the host waits for each copy, unless it has finished.

    The originals stay referenced by the test, so the engine watches them (the path where it
    must wait before letting go). With ``finishes_late`` each copy is still running when the
    engine first looks and has finished by the time the throttle looks again, as happens on a
    GPU: the throttle must not wait, nor count a wait.
    """
    channel = transport
    looked: set[int] = set()
    is_complete = channel.is_complete

    def finishing_late(event: Any) -> bool:
        if id(event) not in looked:
            looked.add(id(event))
            return False
        channel.run_until(event)
        return is_complete(event)

    if finishes_late:
        monkeypatch.setattr(channel, "is_complete", finishing_late)
    model = Stack(depth=6)
    with matepoint.options(stash_bytes=0, max_inflight_bytes=0, prefetch=0):
        leaf = torch.randn(4, 16).requires_grad_(True)
        kept = []
        h = leaf * 1
        for layer in model.blocks:
            kept.append(h)
            h = matepoint.checkpoint(lambda a, layer=layer: torch.tanh(layer(a)) + a, h)
        h.sum().backward()
    throttled = matepoint.stats().throttled_waits
    if finishes_late:
        assert throttled == 0
    else:
        assert throttled >= 5  # every copy but the newest was waited for


def test_graph_dropped_with_copies_in_flight_keeps_sources_alive(
    transport: CPUTestTransport,
) -> None:
    model = Stack(depth=4)
    leaf = torch.randn(4, 16, requires_grad=True)
    out = model(leaf, mate_ckpt)
    assert matepoint.stats().device_bytes_held > 0
    del out
    gc.collect()
    transport.drain()  # the queued copies run now: their sources must still exist
    assert_nothing_leaked()


def test_transport_detects_a_source_released_too_early(fresh_stats: None) -> None:
    # The guard the engine tests rely on: a deferred copy of a freed source fails loudly.
    test_transport = CPUTestTransport()
    channel = test_transport.channel(torch.zeros(1))
    source = torch.randn(8)
    host = channel.allocate_host(32).view(torch.float32)
    event = channel.copy_out(source, host)
    del source
    gc.collect()
    with pytest.raises(CopyReadFreedMemory):
        channel.synchronize(event)


# -- lifetime -------------------------------------------------------------------------------


@pytest.mark.parametrize("completion", ["deferred", "on_query", "immediate"])
def test_everything_released_when_the_graph_dies(completion: str, fresh_stats: None) -> None:
    test_transport = CPUTestTransport(completion=completion)  # type: ignore[arg-type]
    model = Stack(depth=5)
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        leaf = torch.randn(4, 16, requires_grad=True)
        loss = model(leaf, mate_ckpt).sum()
        assert matepoint.stats().live_records == 5
        assert matepoint.stats().pool_in_use_bytes == 5 * 4 * 16 * 4
        del loss
        gc.collect()
        snapshot = matepoint.stats()
        assert snapshot.live_records == 0
        assert snapshot.pool_in_use_bytes == 0
        assert snapshot.device_bytes_held == 0
        assert snapshot.pool_pinned_bytes == 5 * 4 * 16 * 4  # idle, kept for the next step
        test_transport.drain()


def test_retain_graph_backward_twice(fast_transport: CPUTestTransport) -> None:
    model = Stack(depth=4)
    x = torch.randn(4, 16)
    leaf = x.clone().requires_grad_(True)
    with matepoint.options(stash_bytes=0, prefetch=2):
        loss = model(leaf, mate_ckpt).square().sum()
        loss.backward(retain_graph=True)
        first = leaf.grad.clone()
        loss.backward()
    torch.testing.assert_close(leaf.grad, 2 * first, rtol=0, atol=0)
    reference = grads_of(model, x, torch_ckpt)[0]
    torch.testing.assert_close(first, reference, rtol=0, atol=0)
    del loss
    assert_nothing_leaked()


@pytest.mark.parametrize(("completion", "steps"), [("deferred", 1000), ("on_query", 200)])
def test_no_growth_over_1000_steps(completion: str, steps: int, fresh_stats: None) -> None:
    test_transport = CPUTestTransport(completion=completion)  # type: ignore[arg-type]
    model = Stack(depth=3, width=8)
    x = torch.randn(2, 8)
    start = time.perf_counter()
    with (
        use_transport(test_transport),
        matepoint.options(min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=64),
    ):
        pinned_after_first = None
        for step in range(steps):
            leaf = x.clone().requires_grad_(True)
            model(leaf, mate_ckpt).sum().backward()
            if step == 0:
                pinned_after_first = matepoint.stats().pool_pinned_bytes
        snapshot = settle()
        engine = engine_of(test_transport)  # forgotten once the transport is swapped out
    assert time.perf_counter() - start < 20
    assert pinned_after_first == 3 * 2 * 8 * 4
    assert snapshot.pool_pinned_bytes == pinned_after_first
    assert snapshot.pool_blocks_allocated == 3
    assert snapshot.pool_blocks_reused == 3 * (steps - 1)
    assert snapshot.live_records == 0
    assert snapshot.pool_in_use_bytes == 0
    assert len(engine._records) == 0
    assert len(engine._by_key) == 0
    assert len(engine._order) <= 16 + 3
    assert len(engine._held) <= 3
    assert len(test_transport.pending) <= 3
    test_transport.drain()
