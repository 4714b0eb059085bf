"""Tests for the compiled path's shims of torch internals (``matepoint_compat._compile``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import matepoint_compat as compat

_STREAM_SETTINGS = (
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)


@pytest.fixture
def functorch_settings() -> Iterator[None]:
    """Leave the AOTAutograd settings the test changes as they were; skip where torch lacks them."""
    import torch._functorch.config as config

    if not all(hasattr(config, name) for name in _STREAM_SETTINGS):
        pytest.skip("this torch has no compiled activation offloading")
    saved = {name: getattr(config, name) for name in _STREAM_SETTINGS}
    yield
    for name, value in saved.items():
        setattr(config, name, value)


@pytest.mark.skipif(not compat.COMPILED_OFFLOAD, reason="this torch has no compiled offload path")
@pytest.mark.usefixtures("functorch_settings")
def test_choosing_the_transfer_stream_makes_record_stream_compile() -> None:
    import torch._functorch.config as config

    compat.compiled_offload_config(pipelined=True)
    assert config.activation_offload_separate_stream is True
    assert config.activation_reload_prefetch is True
    assert config.activation_offload_sink_wait is False
    record_stream = torch.ops.streams.record_stream.default
    # What inductor does with the op: run its fake implementation on a fake tensor.
    with FakeTensorMode():
        assert record_stream(torch.empty(4), 0) is None
    # And a graph pass must not drop it as unused: it returns nothing but has an effect.
    graph = torch.fx.Graph()
    value = graph.placeholder("value")
    graph.call_function(record_stream, (value, 0))
    graph.output(value)
    graph.eliminate_dead_code()
    assert [node.target for node in graph.nodes if node.op == "call_function"] == [record_stream]


@pytest.mark.usefixtures("functorch_settings")
def test_synchronous_copies_leave_the_stream_settings_off() -> None:
    import torch._functorch.config as config

    compat.compiled_offload_config(pipelined=False)
    assert not any(getattr(config, name) for name in _STREAM_SETTINGS)
