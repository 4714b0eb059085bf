"""Tests for the forward copy window (``matepoint._compiled.forward_window``).

The forward graphs are laid out by torch's own offloading functions, so the window is checked
against the layout the installed torch really produces: torch 2.11's stream ops around a
``device_put``, or torch 2.12+'s ``ao::offload`` / ``ao::wait_tensor`` pair. Stream and event
ids are plain numbers here (nothing runs: the graphs are only rearranged).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import matepoint_compat as compat
from matepoint._compiled import forward_window, scope

_STREAM_SETTINGS = (
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)

pytestmark = pytest.mark.skipif(
    not compat.COMPILED_OFFLOAD, reason="this torch has no compiled activation offloading"
)


def _offloading_module() -> Any:
    from torch._functorch._activation_offloading import activation_offloading

    return activation_offloading


@pytest.fixture
def numbered_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let torch 2.11's stream-op insertion run without a device: streams and events are ids."""
    module = _offloading_module()
    ids = itertools.count(100)
    for name in ("get_current_stream", "new_stream", "new_event"):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, lambda *args, **kwargs: next(ids))


def forward_graph(sizes: list[int]) -> tuple[torch.fx.Graph, list[torch.fx.Node]]:
    """A forward graph of ``len(sizes)`` values, each offloaded after its last use by torch.

    Value ``i`` (``sizes[i]`` float32 elements) feeds value ``i + 1``, so torch places its copy
    right after value ``i + 1`` is computed; every value but the last is saved for backward.
    Returns the graph, with torch's copies in it, and the copied values in order.
    """
    graph = torch.fx.Graph()
    current = graph.placeholder("x")
    current.meta["val"] = torch.zeros(sizes[0])
    values = []
    for size in sizes:
        value = graph.call_function(torch.ops.aten.new_ones.default, (current, [size]))
        value.meta["val"] = torch.zeros(size)
        value.meta["saved_for_offloading"] = True
        values.append(value)
        current = value
    last = graph.call_function(torch.ops.aten.sum.default, (current,))
    last.meta["val"] = torch.zeros(())
    graph.output((last, *values[:-1]))
    values = values[:-1]
    module = _offloading_module()
    if hasattr(module, "offload_activation_fw_async"):  # torch 2.12+
        module.offload_activation_fw_async(graph)
    else:  # torch 2.11
        module.offload_activation_fw(graph)
        module.add_forward_offload_stream_ops(graph)
    graph.lint()
    return graph, values


def copies_of(graph: torch.fx.Graph) -> list[Any]:
    nodes = list(graph.nodes)
    return sorted(forward_window.find_copies(nodes), key=lambda copy: nodes.index(copy.start))


_WAITS_AND_KEEP_ALIVES = {"streams::wait_event", "streams::record_stream", "ao::wait_tensor"}


def _is_stream_op(node: torch.fx.Node) -> bool:
    """A node that only orders streams (it allocates nothing a buffer could be reused for)."""
    return compat.op_name(node).split("::")[0] in ("streams", "ao")


def layout(graph: torch.fx.Graph, copies: list[Any]) -> dict[str, Any]:
    """Where each copy's wait is: ``("after", i)`` (torch's place), ``("before", j)`` (before copy
    ``j`` starts) or ``"end"``; and whether each copied value stays alive until its wait (no
    node that could reuse its buffer runs between its last use and the wait)."""
    nodes = list(graph.nodes)
    index = {node: position for position, node in enumerate(nodes)}
    starts = {index[copy.start]: number for number, copy in enumerate(copies)}
    places: list[Any] = []
    kept = []
    for number, copy in enumerate(copies):
        wait = index[copy.wait]
        following = wait + 1
        while compat.op_name(nodes[following]) in _WAITS_AND_KEEP_ALIVES:
            following += 1
        if nodes[following].op == "output":
            places.append("end")
        elif following in starts:
            places.append(("before", starts[following]))
        else:
            places.append(("after", number))
        last_use = max(index[user] for user in copy.value.users)
        kept.append(all(_is_stream_op(nodes[i]) for i in range(last_use + 1, wait)))
    # torch 2.11: the value is taken by a node before the event the transfer stream waits on.
    realized = [
        copy.record_stream is None or index[copy.record_stream] < index[copy.start]
        for copy in copies
    ]
    return {"waits": places, "kept_alive": kept, "realized_before_start": realized}


@pytest.mark.usefixtures("numbered_streams")
def test_torchs_placement_waits_for_each_copy_right_after_it() -> None:
    graph, _ = forward_graph([25, 25, 25, 25, 25])
    result = layout(graph, copies_of(graph))
    assert result["waits"] == [("after", i) for i in range(4)]
    assert all(result["kept_alive"])


@pytest.mark.usefixtures("numbered_streams")
@pytest.mark.parametrize(
    ("sizes", "bound", "copies", "moved", "waits"),
    [
        # The default: one copy runs on; each wait goes before the next start.
        ([25] * 5, 1 << 30, 1, 4, [("before", 1), ("before", 2), ("before", 3), "end"]),
        # 100 bytes each, 250 in flight: two copies run on; the third start waits for the oldest.
        ([25] * 5, 250, 4, 4, [("before", 2), ("before", 3), "end", "end"]),
        # Two copies at most, whatever their bytes.
        ([25] * 5, 1 << 30, 2, 4, [("before", 2), ("before", 3), "end", "end"]),
        # Everything fits: every wait goes to the end (what torch's sink does, bounded).
        ([25] * 5, 1 << 30, 8, 4, ["end"] * 4),
        # Exactly one copy's bytes fit: each wait goes before the next start.
        ([25] * 5, 100, 4, 4, [("before", 1), ("before", 2), ("before", 3), "end"]),
        # A copy larger than the bound alone keeps torch's placement; the one before it must be
        # done before it starts.
        ([25, 100, 25, 25], 250, 4, 2, [("before", 1), ("after", 1), "end"]),
        # Bound 0: torch's placement.
        ([25] * 5, 0, 4, 0, [("after", i) for i in range(4)]),
    ],
    ids=[
        "default",
        "two-by-bytes",
        "two-by-count",
        "all-fit",
        "one-by-bytes",
        "one-too-large",
        "zero",
    ],
)
def test_waits_move_as_far_as_the_bounds_allow(
    sizes: list[int], bound: int, copies: int, moved: int, waits: list[Any]
) -> None:
    graph, _ = forward_graph(sizes)
    copied = copies_of(graph)
    before = dataclasses.replace(forward_window.FORWARD_WINDOW_COUNTS)
    assert forward_window.bound_forward_waits(graph, bound, copies) == moved
    # The process's counts add the graph, its copies and the waits moved.
    after = forward_window.FORWARD_WINDOW_COUNTS
    added = (after.graphs - before.graphs, after.copies - before.copies)
    assert (*added, after.waits_moved - before.waits_moved) == (1, len(copied), moved)
    graph.lint()
    result = layout(graph, copied)
    assert result["waits"] == waits
    # Every copied value stays alive (in the graph's own lifetime) until its copy is waited for.
    assert all(result["kept_alive"])
    # And is computed before the transfer stream's wait, whatever the bounds (torch 2.11).
    assert all(result["realized_before_start"])


@pytest.mark.usefixtures("numbered_streams")
def test_a_graph_of_unexpected_shape_keeps_torchs_placement() -> None:
    graph, _ = forward_graph([25] * 4)
    # Break the layout torch 2.11 uses (the record_stream before a copy) or 2.12+'s (the
    # keep-alive argument of a wait).
    for node in graph.nodes:
        name = compat.op_name(node)
        if name == "streams::record_stream":
            graph.erase_node(node)
            break
        if name == "ao::wait_tensor":
            node.args = node.args[:1]
            break
    before = [node.name for node in graph.nodes]
    with pytest.warns(RuntimeWarning, match="keep torch's placement"):
        assert forward_window.bound_forward_waits(graph, 1 << 30) == 0
    assert [node.name for node in graph.nodes] == before


def empty_graph() -> torch.fx.GraphModule:
    return torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())


@pytest.fixture
def fake_offloading(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """torch's ``enable_activation_offloading`` replaced by one that records the window asked;
    the AOTAutograd settings that ``compiled_offload_config`` sets restored afterwards."""
    import torch._functorch.config as config

    module = _offloading_module()
    seen: list[int] = []
    monkeypatch.setattr(module, "enable_activation_offloading", lambda *args, **kwargs: None)
    monkeypatch.setattr(
        forward_window,
        "bound_forward_waits",
        lambda graph, bound: seen.append(bound) or 0,
    )
    saved = {name: getattr(config, name) for name in _STREAM_SETTINGS}
    yield seen
    for name, value in saved.items():
        setattr(config, name, value)
    scope._REQUEST.copies = None


def test_a_window_asked_for_reaches_only_the_next_graph(fake_offloading: list[int]) -> None:
    module = _offloading_module()
    forward = empty_graph()
    scope.compiled_offload_config(pipelined=True, max_inflight_bytes=1234)
    wrapped = module.enable_activation_offloading
    assert wrapped.matepoint_wrapper
    scope.compiled_offload_config(pipelined=True, max_inflight_bytes=1234)  # wraps it once only
    assert module.enable_activation_offloading is wrapped
    wrapped(forward, empty_graph(), 0, set())
    wrapped(forward, empty_graph(), 0, set())
    assert fake_offloading == [1234]


def test_a_window_asked_for_in_one_thread_does_not_reach_another(
    fake_offloading: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    module = _offloading_module()
    reached: list[torch.fx.Graph] = []
    monkeypatch.setattr(
        forward_window, "bound_forward_waits", lambda graph, bound: reached.append(graph) or 0
    )
    mine, theirs = empty_graph(), empty_graph()
    scope.compiled_offload_config(pipelined=True, max_inflight_bytes=1234)
    other = threading.Thread(
        target=module.enable_activation_offloading, args=(theirs, empty_graph(), 0, set())
    )
    other.start()
    other.join()
    module.enable_activation_offloading(mine, empty_graph(), 0, set())
    assert reached == [mine.graph]  # the graph of the thread that asked


def test_the_config_asks_for_the_window_with_the_transfer_stream_only(
    fake_offloading: list[int],
) -> None:
    forward = empty_graph()
    for pipelined, bound in [(False, 4096), (True, 0), (True, 4096)]:
        scope.compiled_offload_config(pipelined=pipelined, max_inflight_bytes=bound)
        _offloading_module().enable_activation_offloading(forward, empty_graph(), 0, set())
    # Synchronous copies: torch's graph as it is; with the stream, bound 0 too (torch's
    # placement, with 2.11's copies made safe).
    assert fake_offloading == [0, 4096]
