"""Reliability cases of the "Reliability" issue that the other test files do not cover.

Faults (KeyboardInterrupt between forward and backward and during backward, an out-of-memory
error while a saved input is copied back, pinned cap / host RAM exhausted under both policies,
and every fault repeated against one long-lived engine), bad inputs (complex and conjugate views,
sparse, strided and zero-size tensors, tensors without grad, integer and bf16 tensors, mixed
device and host arguments, unknown keyword arguments) and autograd variety (anomaly mode, tensor
hooks, threads running ``autograd.grad`` with ``create_graph``).

Each test records its numbers with ``record_property`` (steps, faults injected, live records /
pool bytes / device bytes / RSS before and after; see _recording.py). After a fault the memory
levels must be back where they were before it, and the next step must match torch bitwise.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from _helpers import (
    Stack,
    assert_grads_equal,
    assert_nothing_leaked,
    engine_of,
    grads_of,
    mate_ckpt,
    run_in_threads,
    torch_ckpt,
)
from _recording import Record, report, rss_bytes
from torch.utils import _pytree as pytree

import matepoint
from matepoint._engine import engines as _engines_table
from matepoint.testing import CPUTestTransport, use_transport

DEPTH = 4
ONE = 4 * 16 * 4  # bytes of one (4, 16) float32 block input

# -- numbers for the report ----------------------------------------------------------------------


def levels() -> dict[str, int]:
    """Collect garbage; return the memory levels a fault must leave unchanged (and RSS)."""
    gc.collect()
    snapshot = matepoint.stats()
    return {
        "live_records": snapshot.live_records,
        "pool_in_use_bytes": snapshot.pool_in_use_bytes,
        "pool_pinned_bytes": snapshot.pool_pinned_bytes,
        "device_bytes_held": snapshot.device_bytes_held,
        "rss_bytes": rss_bytes(),
    }


def assert_levels_restored(before: dict[str, int], after: dict[str, int]) -> None:
    """Everything but RSS (which the interpreter owns) is back at its level before the fault."""
    for name, value in before.items():
        if name != "rss_bytes":
            assert after[name] == value, f"{name}: {value} before the fault, {after[name]} after"


@pytest.fixture(autouse=True)
def _own_pool() -> None:
    """Free the idle blocks earlier tests' engines keep, so pool numbers are this test's own."""
    gc.collect()
    matepoint.release_pool()


# -- a transport whose copy back can fail --------------------------------------------------------

CopyBackSite = Literal["prefetch", "on_demand"]
# The engine methods that call Channel.copy_in, by kind of fetch.
_CALLERS: dict[CopyBackSite, str] = {"prefetch": "_start_prefetches", "on_demand": "restore"}


class FlakyTransport(CPUTestTransport):
    """A CPU test transport whose next copy back from ``fail_next``'s call site raises OOM."""

    def __init__(self, completion: Literal["deferred", "on_query", "immediate"]) -> None:
        super().__init__(completion=completion)
        self.fail_next: CopyBackSite | None = None
        self.faults = 0

    def copy_in(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        site = self.fail_next
        if site is not None and sys._getframe(1).f_code.co_name == _CALLERS[site]:
            self.fail_next = None
            self.faults += 1
            # What the caching allocator raises when the copy's device tensor cannot be allocated.
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {host.numel() * host.element_size()} "
                "bytes (simulated: copy back to the device)"
            )
        return super().copy_in(host)


@pytest.fixture(params=["deferred", "on_query", "immediate"])
def flaky(request: pytest.FixtureRequest, fresh_stats: None) -> Iterator[FlakyTransport]:
    test_transport = FlakyTransport(request.param)
    with (
        use_transport(test_transport),
        # Small enough that some originals are released and come back from the host.
        matepoint.options(min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=2 * ONE),
    ):
        yield test_transport
    gc.collect()
    test_transport.drain()


# -- faults --------------------------------------------------------------------------------------


def test_keyboard_interrupt_between_forward_and_backward(
    cpu_transport: CPUTestTransport, record_property: Record
) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)  # the pool holds one step
    before = levels()
    alive_at_fault = 0

    def interrupted_step() -> None:
        nonlocal alive_at_fault
        leaf = x.clone().requires_grad_(True)
        loss = model(leaf, mate_ckpt).square().sum()
        alive_at_fault = matepoint.stats().live_records
        assert loss.requires_grad
        raise KeyboardInterrupt  # Ctrl-C after the forward, before loss.backward()

    with pytest.raises(KeyboardInterrupt) as caught:
        interrupted_step()
    del caught  # its traceback holds the step's frames, and so the graph
    assert alive_at_fault == DEPTH
    cpu_transport.drain()  # raises CopyReadFreedMemory if a queued copy lost its source
    at_fault = levels()
    assert_levels_restored(before, at_fault)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    after = levels()
    assert_levels_restored(before, after)
    report(
        record_property,
        steps=3,
        faults=1,
        before=before,
        after=after,
        records_alive_at_fault=alive_at_fault,
    )


def test_keyboard_interrupt_during_backward(
    cpu_transport: CPUTestTransport, record_property: Record
) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    before = levels()
    unpacked_at_fault = 0

    def interrupt(grad: torch.Tensor) -> torch.Tensor:
        nonlocal unpacked_at_fault
        unpacked_at_fault = matepoint.stats().fetches + matepoint.stats().stash_hits
        raise KeyboardInterrupt

    def interrupted_step() -> None:
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1
        for index, block in enumerate(model.blocks):
            h = mate_ckpt(lambda layer, a: torch.tanh(layer(a)) + a, block, h)
            if index == 1:
                h.register_hook(interrupt)  # fires halfway through backward
        h.square().sum().backward()

    matepoint.reset_stats()
    with pytest.raises(KeyboardInterrupt) as caught:
        interrupted_step()
    del caught
    assert unpacked_at_fault > 0, "the interrupt came before backward touched any saved input"
    cpu_transport.drain()
    assert_levels_restored(before, levels())
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    after = levels()
    assert_levels_restored(before, after)
    report(
        record_property,
        steps=3,
        faults=1,
        before=before,
        after=after,
        saved_inputs_unpacked_at_fault=unpacked_at_fault,
    )


@pytest.mark.parametrize("site", ["prefetch", "on_demand"])
def test_out_of_memory_while_copying_back(
    flaky: FlakyTransport, site: CopyBackSite, record_property: Record
) -> None:
    model = Stack(depth=6)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    prefetch = 2 if site == "prefetch" else 0  # on demand only: every fetch is in restore
    with matepoint.options(prefetch=prefetch):
        assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
        before = levels()
        flaky.fail_next = site
        if site == "prefetch":
            # A prefetch is speculative: without room for it the input is fetched on demand.
            assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
            assert matepoint.stats().prefetches_skipped == 1
        else:
            with pytest.raises(torch.cuda.OutOfMemoryError, match="CUDA out of memory") as caught:
                grads_of(model, x, mate_ckpt)
            # The allocator's own error type and message reach the caller of backward unchanged.
            assert "copy back" in str(caught.value)
            del caught
        assert flaky.faults == 1, f"no copy back from the {site} path was attempted"
        flaky.drain()
        at_fault = levels()
        assert_levels_restored(before, at_fault)
        assert engine_of(flaky).held_bytes() == 0
        assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
        assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    after = levels()
    assert_levels_restored(before, after)
    assert matepoint.stats().fetches > 0
    report(
        record_property,
        steps=4,
        faults=flaky.faults,
        before=before,
        after=after,
    )


@pytest.mark.parametrize("policy", ["pageable", "raise"])
@pytest.mark.parametrize("limit", ["pool_cap", "host_ram"])
def test_pinned_memory_exhausted(
    transport: CPUTestTransport, limit: str, policy: str, record_property: Record
) -> None:
    model = Stack(depth=DEPTH)
    x = torch.randn(4, 16)
    wide = torch.randn(6, 16)  # new block sizes: the pool must allocate, and cannot
    reference = grads_of(model, x, torch_ckpt)
    wide_reference = grads_of(model, wide, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    before = levels()
    assert before["pool_pinned_bytes"] == DEPTH * ONE
    cap = {"pool_cap_bytes": 2 * ONE} if limit == "pool_cap" else {}
    if limit == "host_ram":
        transport.pinned_limit_bytes = transport.pinned_bytes  # no more page-locked memory
    with matepoint.options(on_pool_exhausted=policy, **cap):
        if policy == "raise":
            with pytest.raises(matepoint.PinnedMemoryExhausted) as caught:
                grads_of(model, wide, mate_ckpt)
            message = str(caught.value)
            assert ("pool_cap_bytes" if limit == "pool_cap" else "pinned host memory failed") in (
                message
            )
            assert "on_pool_exhausted='pageable'" in message  # the way out is named
            del caught
        else:
            with pytest.warns(ResourceWarning, match="pageable"):
                assert_grads_equal(grads_of(model, wide, mate_ckpt), wide_reference)
        at_fault = levels()
        fallbacks = matepoint.stats().pageable_fallbacks
    assert at_fault["live_records"] == at_fault["pool_in_use_bytes"] == 0
    assert at_fault["device_bytes_held"] == 0
    assert engine_of(transport).pool.pageable_bytes == 0  # pageable blocks are freed, not pooled
    assert at_fault["pool_pinned_bytes"] <= (2 * ONE if limit == "pool_cap" else DEPTH * ONE)
    # The pressure goes (cap lifted, RAM freed): the next step is exact. The pool still holds the
    # idle blocks of the fault step's sizes (kept for reuse, trimmed once new sizes need room);
    # release_pool() frees them, and the pool is back at its size before the fault.
    transport.pinned_limit_bytes = None
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    leftover = levels()["pool_pinned_bytes"] - before["pool_pinned_bytes"]
    assert 0 <= leftover <= at_fault["pool_pinned_bytes"]
    matepoint.release_pool()
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    after = levels()
    assert_levels_restored(before, after)
    report(
        record_property,
        steps=4,
        faults=1,
        before=before,
        after=after,
        pageable_fallbacks=fallbacks,
        pool_pinned_at_fault_bytes=at_fault["pool_pinned_bytes"],
        idle_leftover_bytes=leftover,
    )


_FAULT_KINDS = (
    "exception in forward",
    "exception in recompute",
    "graph dropped without backward",
    "KeyboardInterrupt between forward and backward",
    "OOM in prefetch",
    "OOM in on-demand fetch",
)


class _Injected(Exception):
    pass


def test_repeated_faults_return_to_the_same_levels(
    fresh_stats: None, record_property: Record
) -> None:
    """Every fault kind, four rounds, against one engine: levels never drift, steps stay exact."""
    flaky = FlakyTransport("deferred")
    model = Stack(depth=5)
    x = torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    fail = {"forward": False, "recompute": False}
    calls = {"count": 0}

    def fragile(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
        calls["count"] += 1
        if fail["forward"] and calls["count"] == 3:
            raise _Injected("forward")
        if fail["recompute"] and calls["count"] > 5:
            raise _Injected("recompute")
        return torch.tanh(layer(h)) + h

    def faulty_step(kind: str) -> None:
        calls["count"] = 0
        fail["forward"] = kind == "exception in forward"
        fail["recompute"] = kind == "exception in recompute"
        if kind.startswith("OOM"):
            flaky.fail_next = "prefetch" if kind == "OOM in prefetch" else "on_demand"
        leaf = x.clone().requires_grad_(True)
        h = leaf * 1
        for block in model.blocks:
            h = matepoint.checkpoint(fragile, block, h)
        loss = h.square().sum()
        if kind == "graph dropped without backward":
            return
        if kind == "KeyboardInterrupt between forward and backward":
            raise KeyboardInterrupt
        loss.backward()

    faults = steps = 0
    peak_rss = 0
    with (
        use_transport(flaky),
        matepoint.options(min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=2 * ONE),
    ):
        assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
        steps += 1
        before = levels()
        for _ in range(4):
            for kind in _FAULT_KINDS:
                prefetch = 0 if kind == "OOM in on-demand fetch" else 2
                with matepoint.options(prefetch=prefetch):
                    try:
                        faulty_step(kind)
                    except (_Injected, KeyboardInterrupt, torch.cuda.OutOfMemoryError):
                        pass
                    else:
                        assert kind in ("graph dropped without backward", "OOM in prefetch"), (
                            f"{kind}: no fault"
                        )
                faults += 1
                steps += 1
                fail["forward"] = fail["recompute"] = False
                assert flaky.fail_next is None, f"{kind}: the copy back never failed"
                flaky.drain()
                assert_levels_restored(before, levels())
                assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
                steps += 1
                current = levels()
                assert_levels_restored(before, current)
                peak_rss = max(peak_rss, current["rss_bytes"])
        after = levels()
    flaky.drain()
    assert flaky.faults == 8
    assert_nothing_leaked()
    report(
        record_property,
        steps=steps,
        faults=faults,
        before=before,
        after=after,
        peak_rss_bytes=peak_rss,
    )


# -- bad or unusual inputs -----------------------------------------------------------------------

Checkpoint = Callable[..., Any]


def _run(step: Callable[[Checkpoint], Any], checkpoint: Checkpoint) -> tuple[str, Any]:
    torch.manual_seed(0)
    try:
        return "ok", step(checkpoint)
    except Exception as error:
        return "raised", error


def _assert_same(mine: tuple[str, Any], reference: tuple[str, Any]) -> None:
    if reference[0] == "raised":
        assert mine[0] == "raised", f"torch raised {reference[1]!r}; matepoint did not"
        assert type(mine[1]) is type(reference[1]) or isinstance(mine[1], type(reference[1]))
        return
    if mine[0] == "raised":
        raise AssertionError("matepoint raised where torch did not") from mine[1]
    mine_leaves, mine_spec = pytree.tree_flatten(mine[1])
    reference_leaves, reference_spec = pytree.tree_flatten(reference[1])
    assert mine_spec == reference_spec
    for got, want in zip(mine_leaves, reference_leaves, strict=True):
        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype
            assert got.shape == want.shape
            assert torch.equal(got, want), "differs from torch's checkpoint"
        else:
            assert got == want


def _twice(step: Callable[[Checkpoint], Any]) -> tuple[tuple[str, Any], tuple[str, Any]]:
    mine = _run(step, mate_ckpt)
    return mine, _run(step, torch_ckpt)


def _grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    return [tensor.grad for tensor in tensors]


def _complex(ckpt: Checkpoint) -> Any:
    x = torch.randn(4, 16, dtype=torch.complex64, requires_grad=True)
    h = ckpt(lambda a: torch.sin(a) * a, x * 1)
    h = ckpt(torch.tanh, h * (1 - 0.5j))
    h.abs().square().sum().backward()
    return h.detach(), _grads(x)


def _conjugate_view(ckpt: Checkpoint) -> Any:
    x = torch.randn(4, 16, dtype=torch.complex64, requires_grad=True)
    view = (x * 1).conj()  # a lazy conjugate: the conj bit, no copy
    assert view.is_conj()
    h = ckpt(lambda a: (a * 2j).real * a.imag, view)
    h = ckpt(torch.sin, h * 1)
    h.square().sum().backward()
    return h.detach(), _grads(x)


def _sparse(ckpt: Checkpoint) -> Any:
    dense = torch.zeros(8, 8)
    dense[[0, 1, 2, 5, 7], [3, 1, 0, 5, 6]] = torch.randn(5)
    sparse = dense.to_sparse()
    x = torch.randn(8, 16, requires_grad=True)
    h = ckpt(torch.sparse.mm, sparse, x * 1)
    h = ckpt(torch.tanh, h * 1)
    h.square().sum().backward()
    return h.detach(), _grads(x)


def _step_sliced_view(ckpt: Checkpoint) -> Any:
    x = torch.randn(8, 32, requires_grad=True)
    view = (x * 1)[:, ::2]  # gaps between elements: not dense, stays in place
    h = ckpt(torch.sin, view)
    h = ckpt(torch.tanh, h * 1)
    h.square().sum().backward()
    return h.detach(), _grads(x)


def _permuted_view(ckpt: Checkpoint) -> Any:
    x = torch.randn(2, 4, 16, requires_grad=True)
    view = (x * 1).permute(2, 0, 1)  # dense but not contiguous: offloaded with its strides
    assert not view.is_contiguous()
    h = ckpt(lambda a: torch.tanh(a) * a.sum(0, keepdim=True), view)
    h = ckpt(torch.sin, h * 1)
    h.square().sum().backward()
    return h.detach(), _grads(x)


def _expanded_view(ckpt: Checkpoint) -> Any:
    x = torch.randn(1, 16, requires_grad=True)
    h = ckpt(torch.sin, (x * 1).expand(8, 16))  # stride 0: overlapping, stays in place
    h = ckpt(torch.tanh, h * 1)
    h.square().sum().backward()
    return h.detach(), _grads(x)


def _zero_size(ckpt: Checkpoint) -> Any:
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(0, 16, requires_grad=True)
    h = ckpt(layer, x * 1)
    big = torch.randn(4, 16, requires_grad=True)
    out = ckpt(lambda a, b: torch.tanh(b) + a.sum(), h, big * 1)
    out.square().sum().backward()
    return out.detach(), _grads(x, big, layer.weight)


def _input_without_grad(ckpt: Checkpoint) -> Any:
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16)  # data: requires no grad, saved (and offloaded) all the same
    h = ckpt(lambda a: torch.tanh(layer(a)), x * 1)
    h = ckpt(torch.sin, h)
    h.square().sum().backward()
    return h.detach(), _grads(layer.weight, layer.bias)


def _nothing_requires_grad(ckpt: Checkpoint) -> Any:
    layer = torch.nn.Linear(16, 16).requires_grad_(False)
    h = ckpt(layer, torch.randn(4, 16) * 1)
    assert not h.requires_grad
    return h


def _integer_and_bf16(ckpt: Checkpoint) -> Any:
    table = torch.randn(32, 16, dtype=torch.bfloat16, requires_grad=True)
    index = torch.randint(0, 32, (8,)) * 1  # int64: never requires grad, offloaded intact
    h = ckpt(lambda t, i: torch.tanh(t.index_select(0, i)), table * 1, index)
    h = ckpt(lambda a, i: a * (i.unsqueeze(1) % 3).to(a.dtype), h, index)
    h.float().square().sum().backward()
    return h.detach(), _grads(table)


_INPUTS: dict[str, tuple[Callable[[Checkpoint], Any], tuple[int, ...], str]] = {
    # kind: (step, how many tensors it may offload, what is checked)
    "complex": (_complex, (2,), "complex64 activations, offloaded"),
    "conjugate view": (_conjugate_view, (1,), "a lazy .conj() view (conj bit set) stays put"),
    "sparse COO": (_sparse, (2,), "a sparse COO operand stays put, its dense partner moves"),
    "step-sliced view": (_step_sliced_view, (1,), "x[:, ::2] is not dense: stays in place"),
    "permuted view": (_permuted_view, (2,), "dense non-contiguous: offloaded, strides kept"),
    "expanded view": (_expanded_view, (1,), "stride-0 view: stays in place"),
    "zero-size": (_zero_size, (1,), "a 0-row batch stays in place beside a real input"),
    "input without grad": (_input_without_grad, (2,), "a data tensor, offloaded; params get grads"),
    # torch 2.12+ saves the inputs even when nothing needs grad (copied once, freed with the
    # output); older torch saves nothing.
    "nothing requires grad": (_nothing_requires_grad, (0, 1), "no graph: nothing kept alive"),
    "int64 and bf16": (_integer_and_bf16, (3,), "an index tensor (shared, offloaded once), bf16"),
}


@pytest.mark.parametrize("kind", list(_INPUTS))
def test_unusual_inputs_match_torch(
    cpu_transport: CPUTestTransport, kind: str, record_property: Record
) -> None:
    step, offloads, _ = _INPUTS[kind]  # the third item says what the case checks
    mine, reference = _twice(step)
    assert reference[0] == "ok", f"torch's own checkpoint failed: {reference[1]!r}"
    _assert_same(mine, reference)
    snapshot = matepoint.stats()
    assert snapshot.offloads in offloads
    assert cpu_transport.copies_out == snapshot.offloads
    del mine, reference
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == 0
    assert after["device_bytes_held"] == 0
    report(
        record_property,
        steps=2,
        after=after,
        offloads=snapshot.offloads,
        kept_in_place=snapshot.skipped_other,
    )


class _MarkingTransport(CPUTestTransport):
    """A deferred CPU test transport whose tests mark some storages as living somewhere else.

    The CUDA transport tells devices apart by ``tensor.device``; here every tensor is a CPU
    tensor, so a test marks the storages that stand for another place (the host, a second
    device) and the subclass routes them.
    """

    def __init__(self) -> None:
        super().__init__(completion="deferred")
        self.marked_storages: set[int] = set()

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        self.marked_storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def is_marked(self, tensor: torch.Tensor) -> bool:
        return tensor.untyped_storage().data_ptr() in self.marked_storages


class _HostAwareTransport(_MarkingTransport):
    """Stands in for a GPU machine: tensors marked as host tensors stay where they are."""

    def channel_key(self, tensor: torch.Tensor) -> Any:
        if self.is_marked(tensor):
            return None
        return super().channel_key(tensor)


def test_mixed_device_and_host_arguments(fresh_stats: None, record_property: Record) -> None:
    mixed = _HostAwareTransport()

    def step(ckpt: Checkpoint) -> Any:
        layer = torch.nn.Linear(16, 16)
        x = torch.randn(4, 16, requires_grad=True)
        on_host = mixed.mark(torch.randn(4, 16, requires_grad=True) * 1)
        on_device = x * 1
        h = ckpt(lambda a, b: torch.tanh(layer(a)) * b, on_device, on_host)
        h = ckpt(lambda a, scale: a * scale, h, {"scale": on_host})
        h.square().sum().backward()
        return h.detach(), _grads(x, layer.weight)

    with use_transport(mixed), matepoint.options(min_offload_bytes=0):
        mine, reference = _twice(step)
        snapshot = matepoint.stats()
    _assert_same(mine, reference)
    assert snapshot.offloads == 2  # the device activation, and the first checkpoint's output
    assert snapshot.skipped_other == 2  # the host tensor, passed to both checkpoints
    del mine, reference
    mixed.drain()
    after = levels()
    assert_nothing_leaked()
    report(
        record_property,
        steps=2,
        after=after,
        offloads=snapshot.offloads,
        kept_in_place=snapshot.skipped_other,
    )


class _TwoDeviceTransport(_MarkingTransport):
    """Stands in for a machine with two devices: marked storages live on a second "device".

    Tensors of the second device go through a channel of their own (a second CPU test transport
    with deferred copies), so matepoint keeps one engine, one pool and one copy queue per device,
    as the CUDA transport does per ``cuda:N``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.second = CPUTestTransport(completion="deferred")

    def channel_key(self, tensor: torch.Tensor) -> Any:
        if self.is_marked(tensor):
            return ("cpu-test-second", id(self))
        return super().channel_key(tensor)

    def channel(self, tensor: torch.Tensor) -> Any:
        if self.is_marked(tensor):
            return self.second.channel(tensor)
        return super().channel(tensor)

    def drain(self) -> None:
        super().drain()
        self.second.drain()


def test_arguments_on_two_devices(fresh_stats: None, record_property: Record) -> None:
    two = _TwoDeviceTransport()

    def step(ckpt: Checkpoint) -> Any:
        layer = torch.nn.Linear(16, 16)
        x = torch.randn(4, 16, requires_grad=True)
        y = torch.randn(4, 16, requires_grad=True)
        first, second = x * 1, two.mark(y * 1)
        h = ckpt(lambda a, b: torch.tanh(layer(a)) * b, first, second)
        h.square().sum().backward()
        return h.detach(), _grads(x, y, layer.weight)

    with use_transport(two), matepoint.options(min_offload_bytes=0):
        mine, reference = _twice(step)
        snapshot = matepoint.stats()
        engines = set(_engines_table._engines)  # channel keys
        first_engine_offloads = engine_of(two).counters.offloads
    _assert_same(mine, reference)
    assert snapshot.offloads == 2
    assert {("cpu-test", id(two)), ("cpu-test-second", id(two))} <= engines
    assert first_engine_offloads == 1
    del mine, reference
    two.drain()
    after = levels()
    assert_nothing_leaked()
    report(
        record_property,
        steps=2,
        after=after,
        offloads=snapshot.offloads,
        engines=2,
    )


def _call(**kwargs: Any) -> Callable[[Checkpoint], Any]:
    def step(ckpt: Checkpoint) -> Any:
        layer = torch.nn.Linear(16, 16)
        x = torch.randn(4, 16, requires_grad=True)
        return ckpt(layer, x * 1, **kwargs)

    return step


def _mate_reentrant(function: Any, *args: Any, **kwargs: Any) -> Any:
    return matepoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def _torch_reentrant(function: Any, *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def _inference_tensor(ckpt: Checkpoint) -> Any:
    layer = torch.nn.Linear(16, 16)
    with torch.inference_mode():
        x = torch.randn(4, 16)
    return ckpt(layer, x)


_ERRORS: dict[str, tuple[Callable[[], tuple[str, Any]], Callable[[], tuple[str, Any]], str]] = {
    # case: (matepoint, torch, a string the error must contain)
    "unknown keyword argument": (
        lambda: _run(_call(bogus=1), mate_ckpt),
        lambda: _run(_call(bogus=1), torch_ckpt),
        "'bogus'",
    ),
    "misspelled checkpoint option": (
        lambda: _run(_call(use_reentrent=False), mate_ckpt),
        lambda: _run(_call(use_reentrent=False), torch_ckpt),
        "'use_reentrent'",
    ),
    "unknown keyword argument, reentrant": (
        lambda: _run(_call(bogus=1), _mate_reentrant),
        lambda: _run(_call(bogus=1), _torch_reentrant),
        "bogus",
    ),
    "unknown keyword of checkpoint_sequential": (
        lambda: _run(
            lambda _: matepoint.checkpoint_sequential(
                torch.nn.Sequential(torch.nn.Linear(16, 16)), 1, torch.randn(4, 16), bogus=1
            ),
            mate_ckpt,
        ),
        lambda: _run(
            lambda _: torch_checkpoint.checkpoint_sequential(
                torch.nn.Sequential(torch.nn.Linear(16, 16)),
                1,
                torch.randn(4, 16),
                use_reentrant=False,
                bogus=1,
            ),
            torch_ckpt,
        ),
        "bogus",
    ),
    "inference-mode tensor": (
        lambda: _run(_inference_tensor, mate_ckpt),
        lambda: _run(_inference_tensor, torch_ckpt),
        "Inference tensors",
    ),
}


@pytest.mark.parametrize("case", list(_ERRORS))
def test_bad_calls_raise_a_clear_error(
    cpu_transport: CPUTestTransport, case: str, record_property: Record
) -> None:
    ours, theirs, named = _ERRORS[case]
    mine, reference = ours(), theirs()
    assert reference[0] == "raised", "torch accepted the call"
    _assert_same(mine, reference)
    error = mine[1]
    error_type = type(error).__name__
    assert named in str(error), f"{error_type}: {error} does not name {named}"
    del mine, reference, error
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == after["device_bytes_held"] == 0
    report(
        record_property,
        steps=1,
        faults=1,
        after=after,
    )


def test_unknown_offload_option_is_a_type_error(record_property: Record) -> None:
    with pytest.raises(TypeError, match="prefetchh"), matepoint.options(prefetchh=1):
        pass
    with pytest.raises(TypeError, match="prefetchh"):
        matepoint.configure(prefetchh=1)
    with pytest.raises(TypeError, match="prefetchh"):
        matepoint.OffloadOptions(prefetchh=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="prefetch"):
        matepoint.OffloadOptions(prefetch=-1)
    report(
        record_property,
        faults=4,
    )


# -- autograd variety ----------------------------------------------------------------------------


def _stack_step(ckpt: Checkpoint, nan: bool = False) -> Any:
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    x = torch.randn(4, 16, requires_grad=True)
    h = x * 1
    for layer in layers:
        h = ckpt(lambda module, a: torch.tanh(module(a)) + a, layer, h)
    if nan:
        h = ckpt(torch.sqrt, h - 10.0)  # negative: NaN in forward and backward
    loss = h.square().sum()
    loss.backward()
    return loss.detach(), x.grad, [layer.weight.grad for layer in layers]


def _anomaly(ckpt: Checkpoint, nan: bool) -> Any:
    with warnings.catch_warnings():
        # detect_anomaly announces itself, and prints the forward trace of a failing node.
        warnings.simplefilter("ignore", UserWarning)
        with torch.autograd.detect_anomaly():
            return _stack_step(ckpt, nan)


@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_anomaly_mode(cpu_transport: CPUTestTransport, nan: bool, record_property: Record) -> None:
    mine, reference = _twice(lambda ckpt: _anomaly(ckpt, nan))
    if nan:
        assert reference[0] == "raised"
        assert "returned nan values" in str(reference[1])
        assert "returned nan values" in str(mine[1])
    _assert_same(mine, reference)
    assert matepoint.stats().offloads > 0
    del mine, reference
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == 0
    report(
        record_property,
        steps=1,
        after=after,
    )


def _hooked_step(ckpt: Checkpoint) -> Any:
    calls: dict[str, int] = {"leaf": 0, "offloaded": 0, "inside": 0, "output": 0, "param": 0}
    layers = [torch.nn.Linear(16, 16) for _ in range(3)]
    x = torch.randn(4, 16, requires_grad=True)

    def count(name: str, scale: float = 1.0) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            calls[name] += 1
            return grad * scale

        return hook

    def block(layer: torch.nn.Module, a: torch.Tensor) -> torch.Tensor:
        inner = layer(a)
        if inner.requires_grad:
            inner.register_hook(count("inside", 0.5))  # registered again at recomputation
        return torch.tanh(inner) + a

    def on_param(parameter: torch.Tensor) -> None:
        calls["param"] += 1

    x.register_hook(count("leaf"))
    layers[1].weight.register_post_accumulate_grad_hook(on_param)
    h = x * 1
    for index, layer in enumerate(layers):
        h = ckpt(block, layer, h)
        if index == 0:
            h.register_hook(count("offloaded", 2.0))  # an offloaded input of the next checkpoint
    h.register_hook(count("output"))
    h.square().sum().backward()
    return x.grad, [layer.weight.grad for layer in layers], calls


def test_tensor_hooks(cpu_transport: CPUTestTransport, record_property: Record) -> None:
    mine, reference = _twice(_hooked_step)
    _assert_same(mine, reference)
    calls = mine[1][2]
    assert calls["leaf"] == calls["offloaded"] == calls["output"] == calls["param"] == 1
    assert matepoint.stats().offloads > 0
    del mine, reference
    after = levels()
    assert after["live_records"] == after["pool_in_use_bytes"] == 0
    report(
        record_property,
        steps=1,
        after=after,
        hook_calls=sum(calls.values()),
    )


def test_threads_with_autograd_grad_and_create_graph(
    fresh_stats: None, record_property: Record
) -> None:
    threads_count, steps = 3, 5
    test_transport = CPUTestTransport(completion="on_query")
    models = [Stack(depth=3, seed=seed) for seed in range(threads_count)]
    inputs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def second_order(model: Stack, x: torch.Tensor, ckpt: Checkpoint) -> list[torch.Tensor]:
        leaf = x.clone().requires_grad_(True)
        out = model(leaf, ckpt)
        (grad_x,) = torch.autograd.grad(out.pow(3).sum(), leaf, create_graph=True)
        return list(torch.autograd.grad(grad_x.square().sum(), [leaf, *model.parameters()]))

    references = [second_order(m, x, torch_ckpt) for m, x in zip(models, inputs, strict=True)]

    def train(index: int) -> list[torch.Tensor]:
        return second_order(models[index], inputs[index], mate_ckpt)

    with (
        use_transport(test_transport),
        matepoint.options(min_offload_bytes=0, stash_bytes=0, max_inflight_bytes=ONE),
    ):
        before = levels()
        results = run_in_threads(train, threads_count, steps)
        after = levels()
    for index in range(threads_count):
        assert len(results[index]) == steps
        for got in results[index]:
            assert_grads_equal(got, references[index])
    offloads = matepoint.stats().offloads
    assert offloads == threads_count * steps * 3
    test_transport.drain()
    assert_nothing_leaked()
    report(
        record_property,
        steps=threads_count * steps,
        before=before,
        after=after,
        offloads=offloads,
    )
