"""Let a compiled forward's copies to the host run on under compute, within a byte bound.

Note [The forward copy window]
    torch's compiled activation offloading, on its transfer stream, makes the compute stream
    wait for each copy right after starting it; its other placement,
    ``activation_offload_sink_wait``, moves every wait to the end of the forward, which keeps
    every offloaded value on the device until then (no device memory saved by a whole-model
    compile). matepoint's eager engine lets copies run on under compute, bounded by bytes
    (``max_inflight_bytes``); this does the same to a compiled forward. Walking the copies in
    graph order, a copy's wait moves to just before the start of the first later copy that
    would put more than ``max_inflight_bytes``, or more than ``copies_in_flight`` copies, in
    flight (oldest first), and the waits still pending at the end go just before the forward
    returns, so everything the forward hands to backward is on the host by then. A copy larger
    than the bound on its own keeps torch's placement.

    Why one copy in flight by default (``COPIES_IN_FLIGHT``): the placement is static, so a
    value stays on the device until its wait is reached even when its copy ended long before
    (the eager engine frees it when the copy ends). The copies share one transfer stream, so
    letting a copy run under the next block's compute is what overlaps them; more copies
    pending only hold more memory. Measured on an H200 (torch 2.11, 16 blocks of width 1024,
    8,192 tokens, bf16, 10 paired rounds, step time of torch's checkpoint under compile): one
    copy in flight 1.122, two 1.133, every wait at the end of forward 1.136, torch's placement
    1.365. On the benchmark's deep stacks inductor then moved every copy to the end of the
    forward, which undid the window (Note [Inductor's peak-memory reorder] in
    ``matepoint_compat._compile._inductor_order`` says why and how matepoint's graphs avoid it).

    Lifetime: the value being copied must stay on the device until the compute stream has
    waited for its copy. torch 2.12+'s ``ao::wait_tensor`` takes it as a keep-alive argument.
    torch 2.11's stream ops do not: its ``record_stream`` before the copy covers the caching
    allocator, but not a compiler reusing the freed buffer in place for a later kernel. So a
    moved 2.11 wait is preceded by a second ``record_stream`` of the value, which makes the value
    live until there in every backend's lifetime analysis.

    Ordering on torch 2.11: its stream ops carry no data dependencies, and inductor emits a
    pointwise kernel where its result is first needed (lazy realization), which may be after
    the compute stream's event that the transfer stream waits on before copying (seen in
    inductor's generated code: a block's residual add emitted between ``fork`` and ``join``).
    A copied value first needed by the copy itself would then be copied before it is computed.
    So its ``record_stream``, which takes the value and so realizes it, moves to just before
    that event: the value is computed before the event, whatever the window. torch 2.12+'s
    ``ao::offload`` takes the value as an argument and orders its copy itself.

    Where: torch's partitioner calls ``enable_activation_offloading`` (looked up in its module at
    each call) right after matepoint's joint-graph pass has marked the values; the wrapper
    installed by ``matepoint_compat._compile._scope`` runs it, then moves the waits of that
    one forward graph when matepoint asked for a window while marking it. A graph whose copies
    do not have the shape expected of the installed torch keeps torch's placement (correct,
    only slower), with a warning.

    The 2.11 parts (the ``device_put`` layout in :func:`find_copies`, ``_Copy.record_stream``:
    the keep-alive and the moved ``record_stream``) can go when torch 2.12 is the oldest release
    the compiled path supports (gate ``TORCH_2_12_PLUS``); the window itself stays as long as
    torch places the waits as above.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from matepoint_compat._compile import _torch_names
from matepoint_compat._compile._regions import nbytes_hint

__all__ = ["FORWARD_WINDOW_COUNTS", "ForwardWindowCounts", "bound_forward_waits"]


@dataclass
class _Copy:
    """One copy of a forward value to the host, as torch's offloading put it in the graph."""

    start: torch.fx.Node
    wait: torch.fx.Node
    value: torch.fx.Node
    nbytes: int
    record_stream: torch.fx.Node | None = None
    """torch 2.11: the ``record_stream`` of the value before its copy (2.12+: none)."""


class UnexpectedShape(Exception):
    """The copies in a forward graph are not laid out as the installed torch lays them out."""


def _op_name(node: torch.fx.Node) -> str:
    schema = getattr(node.target, "_schema", None)
    return "" if node.op != "call_function" or schema is None else str(schema.name)


def _copied(copy: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """The value a copy node copies, and its bytes (raises unless it is a traced tensor)."""
    value = copy.args[0]
    if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        raise UnexpectedShape(f"the value {copy.name} copies has no tensor metadata")
    return value, nbytes_hint(value.meta["val"])


def find_copies(nodes: list[torch.fx.Node]) -> list[_Copy]:
    """The copies in a forward graph's nodes, in either torch layout, in the order they start
    (raises if unexpected).

    torch 2.12+: ``ao::offload(value)`` then ``ao::wait_tensor(offload, value)``. torch 2.11:
    the copy sits at index 4 of ``STREAM_COPY_PATTERN``, the value's ``record_stream`` at 3, and
    the last is its wait.
    """
    copies = []
    for index, node in enumerate(nodes):
        name = _op_name(node)
        if name == _torch_names.ASYNC_OFFLOAD_OP:
            wait = next(iter(node.users), node)  # its one user
            if _op_name(wait) != _torch_names.ASYNC_WAIT_OP or wait.args[1:2] != node.args[:1]:
                raise UnexpectedShape(f"{node.name} has no wait that keeps its value alive")
            copies.append(_Copy(node, wait, *_copied(node)))
        elif name == "prims::device_put" and node.name.startswith(_torch_names.OFFLOAD_PREFIX):
            group = nodes[max(index - 4, 0) : index + 4]
            if tuple(map(_op_name, group)) != _torch_names.STREAM_COPY_PATTERN:
                raise UnexpectedShape(f"the stream ops around {node.name} are not torch 2.11's")
            if group[3].args[:1] != node.args[:1]:
                raise UnexpectedShape(f"{group[3].name} does not name what {node.name} copies")
            copies.append(_Copy(group[0], group[7], *_copied(node), group[3]))
    return copies


def _move_wait(copy: _Copy, before: torch.fx.Node) -> None:
    """Move ``copy``'s wait before ``before``; on 2.11 keep its value alive until the wait."""
    before.prepend(copy.wait)
    if copy.record_stream is not None:
        copy.wait.prepend(copy.wait.graph.node_copy(copy.record_stream))


COPIES_IN_FLIGHT = 1
"""How many forward copies may run on under compute (see Note [The forward copy window])."""


def bound_forward_waits(
    graph: torch.fx.Graph, max_inflight_bytes: int, copies_in_flight: int = COPIES_IN_FLIGHT
) -> int:
    """Move the waits for a forward graph's host copies later, within the window's bounds.

    See Note [The forward copy window]. Either every wait moves as the note says, or (on a graph
    whose copies are not laid out as the installed torch lays them out) none does. On torch
    2.11's layout each copied value is also made to be computed before the transfer stream's
    wait (the note's "Ordering"), whatever the bounds.

    Args:
        graph: A partitioned forward graph, after torch's activation offloading put its copies
            (on the transfer stream) in it.
        max_inflight_bytes: Most bytes of copied values whose copies may still be running when
            a new copy starts; ``0`` keeps torch's placement.
        copies_in_flight: Most copies that may still be running when a new copy starts.

    Returns:
        How many waits moved: every copy within the bytes bound (each waits for it either before
        a later copy starts or at the end). A graph left as it is gets a ``RuntimeWarning``
        naming what was unexpected. The graph, its copies and the waits moved are added to
        :data:`FORWARD_WINDOW_COUNTS`.
    """
    FORWARD_WINDOW_COUNTS.graphs += 1
    nodes = list(graph.nodes)
    try:
        copies = find_copies(nodes)
    except UnexpectedShape as error:
        warnings.warn(
            f"matepoint: the compiled forward's copies to the host keep torch's placement (the "
            f"compute stream waits for each right after it starts): {error}",
            RuntimeWarning,
            stacklevel=2,
        )
        return 0
    FORWARD_WINDOW_COUNTS.copies += len(copies)
    for copy in copies:
        if copy.record_stream is not None:
            copy.start.prepend(copy.record_stream)
    if max_inflight_bytes <= 0 or copies_in_flight <= 0:
        return 0
    pending: list[_Copy] = []  # oldest first
    for copy in copies:
        while pending and (
            sum(waiting.nbytes for waiting in pending) + copy.nbytes > max_inflight_bytes
            or len(pending) >= copies_in_flight
        ):
            _move_wait(pending.pop(0), copy.start)
        if copy.nbytes <= max_inflight_bytes:
            pending.append(copy)
    output = next(node for node in reversed(nodes) if node.op == "output")
    for copy in pending:
        _move_wait(copy, output)
    moved = sum(copy.nbytes <= max_inflight_bytes for copy in copies)
    FORWARD_WINDOW_COUNTS.waits_moved += moved
    return moved


@dataclass
class ForwardWindowCounts:
    """What the forward copy window did in this process (for reports and tests).

    Args:
        graphs: Forward graphs matepoint asked a window for (bound 0 included).
        copies: Copies to the host found in them.
        waits_moved: Waits moved later (see Note [The forward copy window]).
    """

    graphs: int = 0
    copies: int = 0
    waits_moved: int = 0


FORWARD_WINDOW_COUNTS = ForwardWindowCounts()
"""The process's running counts (reset by assigning fresh values to the fields)."""
