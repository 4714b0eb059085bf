"""The CPU test transport itself: deferred completion, poison, freed-source detection, limits."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

import matepoint
from matepoint import _side_stream_delay
from matepoint._engine import active_transport
from matepoint.testing import (
    POISON_BYTE,
    CopyReadFreedMemory,
    CPUTestTransport,
    delay_side_stream,
    use_transport,
)


def _channel(completion: str = "deferred", **kwargs: object):  # type: ignore[no-untyped-def]
    test_transport = CPUTestTransport(completion=completion, **kwargs)  # type: ignore[arg-type]
    return test_transport, test_transport.channel(torch.zeros(1))


def test_unknown_completion_mode() -> None:
    with pytest.raises(ValueError, match="completion"):
        CPUTestTransport(completion="eventually")  # type: ignore[arg-type]


def test_cpu_tensors_are_device_tensors_others_are_not() -> None:
    test_transport = CPUTestTransport()
    assert test_transport.channel_key(torch.zeros(1)) == ("cpu-test", id(test_transport))
    assert test_transport.channel_key(torch.zeros(1, device="meta")) is None


def test_deferred_copy_out_is_poison_until_synchronized() -> None:
    test_transport, channel = _channel()
    source = torch.arange(8, dtype=torch.float32)
    host = channel.allocate_host(32).view(torch.float32)
    assert (host.view(torch.uint8) == POISON_BYTE).all()
    event = channel.copy_out(source, host)
    assert test_transport.copies_out == 1
    assert torch.isnan(host).all()
    assert not channel.is_complete(event)  # polling never completes a deferred copy
    assert channel.synchronize(event) == 0.0
    assert channel.is_complete(event)
    torch.testing.assert_close(host, source)


def test_deferred_copy_in_is_poison_until_waited() -> None:
    test_transport, channel = _channel()
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    target, event = channel.copy_in(host)
    assert target.stride() == host.stride()
    assert torch.isnan(target).all()
    assert channel.hand_to_compute(target, event, True) is None
    torch.testing.assert_close(target, host)
    assert test_transport.copies_in == 1


def test_on_query_completes_when_polled() -> None:
    _, channel = _channel("on_query")
    source = torch.ones(4)
    host = channel.allocate_host(16).view(torch.float32)
    event = channel.copy_out(source, host)
    assert torch.isnan(host).all()
    assert channel.is_complete(event)
    torch.testing.assert_close(host, source)


def test_immediate_completes_at_once() -> None:
    _, channel = _channel("immediate")
    source = torch.ones(4)
    host = channel.allocate_host(16).view(torch.float32)
    event = channel.copy_out(source, host)
    assert event.done
    torch.testing.assert_close(host, source)


def test_copies_complete_in_order() -> None:
    _, channel = _channel()
    sources = [torch.full((4,), float(i)) for i in range(3)]
    hosts = [channel.allocate_host(16).view(torch.float32) for _ in range(3)]
    events = [channel.copy_out(s, h) for s, h in zip(sources, hosts, strict=True)]
    channel.synchronize(events[1])
    assert events[0].done
    assert events[1].done
    assert not events[2].done
    assert torch.isnan(hosts[2]).all()


def test_copy_of_a_freed_source_raises() -> None:
    _, channel = _channel()
    source = torch.randn(4)
    host = channel.allocate_host(16).view(torch.float32)
    event = channel.copy_out(source, host)
    del source
    gc.collect()
    with pytest.raises(CopyReadFreedMemory):
        channel.synchronize(event)


def test_release_mid_copy_keeps_the_memory_until_the_copy_ran() -> None:
    _, channel = _channel()
    source = torch.randn(4, requires_grad=True) * 2  # has an autograd graph
    expected = source.detach().clone()
    host = channel.allocate_host(16).view(torch.float32)
    event = channel.copy_out(source, host)
    probe = torch.utils.weak.WeakTensorKeyDictionary()
    probe[source] = True
    channel.release_original(source, None, copying=True)
    del source
    assert len(probe) == 0  # the tensor (and its graph) is let go; only its memory is kept
    channel.synchronize(event)
    torch.testing.assert_close(host, expected)


def test_copy_of_a_modified_source_is_poison() -> None:
    _, channel = _channel()
    source = torch.randn(4)
    host = channel.allocate_host(16).view(torch.float32)
    event = channel.copy_out(source, host)
    source.add_(1)
    channel.synchronize(event)
    assert torch.isnan(host).all()


def test_copies_run_without_recording_autograd() -> None:
    _, channel = _channel()
    source = torch.randn(4, requires_grad=True) * 1
    with torch.no_grad():
        host = channel.allocate_host(16)[:16].view(torch.float32)
    event = channel.copy_out(source, host)
    channel.synchronize(event)  # grad mode is on here
    assert host.grad_fn is None


def test_pinned_limit_raises_like_an_allocation_failure() -> None:
    test_transport, channel = _channel(pinned_limit_bytes=100)
    channel.allocate_host(60)
    with pytest.raises(RuntimeError, match="out of memory"):
        channel.allocate_host(60)
    assert test_transport.pinned_bytes == 60
    assert channel.allocate_pageable(60).numel() == 60


def test_drain_completes_everything() -> None:
    test_transport, channel = _channel()
    sources = [torch.randn(4) for _ in range(3)]
    hosts = [channel.allocate_host(16).view(torch.float32) for _ in range(3)]
    events = [channel.copy_out(s, h) for s, h in zip(sources, hosts, strict=True)]
    test_transport.drain()
    assert all(event.done for event in events)
    test_transport.drain()  # nothing queued: a no-op


def test_concurrent_waits_from_threads() -> None:
    _, channel = _channel()
    sources = [torch.randn(1024) for _ in range(64)]
    hosts = [channel.allocate_host(4096).view(torch.float32) for _ in range(64)]
    events = [channel.copy_out(s, h) for s, h in zip(sources, hosts, strict=True)]
    errors: list[BaseException] = []

    def wait_all(order: list[int]) -> None:
        try:
            for index in order:
                channel.synchronize(events[index])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=wait_all, args=(list(range(i, 64, 4)),)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for source, host in zip(sources, hosts, strict=True):
        torch.testing.assert_close(host, source)


def test_use_transport_restores_the_previous_one(fresh_stats: None) -> None:
    before = active_transport.transport()
    inner = CPUTestTransport()
    with use_transport(inner) as active:
        assert active is inner
        assert active_transport.transport() is inner
    assert active_transport.transport() is before
    with pytest.raises(KeyError), use_transport(CPUTestTransport()):
        raise KeyError("x")
    assert active_transport.transport() is before


def test_engine_under_the_transport_end_to_end(fresh_stats: None) -> None:
    with use_transport(CPUTestTransport()), matepoint.options(min_offload_bytes=0):
        x = torch.randn(64, 64, requires_grad=True)
        matepoint.checkpoint(torch.sin, x * 1).sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_a_transport_no_longer_used_is_freed_with_its_engine() -> None:
    """Switching transports forgets the idle engines of the old one, so nothing keeps it alive."""
    transport = CPUTestTransport()
    reference = weakref.ref(transport)
    with use_transport(transport), matepoint.options(min_offload_bytes=0):
        x = torch.randn(4, 16, requires_grad=True)
        matepoint.checkpoint(torch.sin, x * 1).sum().backward()
        assert matepoint.stats().offloads == 1
    del transport
    gc.collect()
    assert reference() is None


def test_an_engine_with_live_records_outlives_the_switch() -> None:
    """A graph still alive after its transport was swapped out keeps its engine, and frees it."""
    transport = CPUTestTransport(completion="immediate")
    with use_transport(transport), matepoint.options(min_offload_bytes=0):
        x = torch.randn(4, 16, requires_grad=True)
        out = matepoint.checkpoint(torch.sin, x * 1)
    assert matepoint.stats().live_records == 1
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))
    del out
    gc.collect()
    assert matepoint.stats().live_records == 0


def test_the_side_stream_delay_belongs_to_the_transport() -> None:
    """``delay_side_stream`` sets the transport's delay, which the CUDA channel reads per copy."""
    assert _side_stream_delay.side_stream_delay() == 0
    with delay_side_stream(1000) as cycles:
        assert cycles == 1000
        assert _side_stream_delay.side_stream_delay() == 1000
        with delay_side_stream(0):
            assert _side_stream_delay.side_stream_delay() == 0
        assert _side_stream_delay.side_stream_delay() == 1000
    assert _side_stream_delay.side_stream_delay() == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match=r"delay_side_stream\.cycles"):
            _side_stream_delay.set_side_stream_delay(bad)  # type: ignore[arg-type]
    assert _side_stream_delay.side_stream_delay() == 0
