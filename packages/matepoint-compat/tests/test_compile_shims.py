"""Tests for the compiled path's shims of torch internals (``matepoint_compat._compile``)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import matepoint_compat as compat


@pytest.mark.skipif(not compat.COMPILED_OFFLOAD, reason="this torch has no compiled offload path")
def test_the_record_stream_mend_makes_the_op_compile() -> None:
    compat.mend_record_stream()
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
