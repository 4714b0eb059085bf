"""Let a compiled forward's copies to the host run on under compute, within a byte bound.

Note [The forward copy window]
    torch's compiled offloading, on its transfer stream, makes the compute stream wait for each
    copy right after starting it; its other placement, ``activation_offload_sink_wait``, moves
    every wait to the end of the forward, which keeps every offloaded value on the device until
    then. matepoint's eager engine lets copies run on under compute, bounded by bytes
    (``max_inflight_bytes``); this does the same to a compiled forward.
    Rule 1. Walking the copies in graph order, a copy's wait moves to just before the start of
            the first later copy that would put more than ``max_inflight_bytes``, or more than
            ``copies_in_flight`` copies, in flight (oldest first); the waits still pending go
            just before the forward returns, so all it hands to backward is on the host by then.
            A copy larger than the bound on its own keeps torch's placement.
    Rule 2. One copy in flight by default (``COPIES_IN_FLIGHT``). The placement is static: a
            value stays on the device until its wait is reached, even when its copy ended long
            before. The copies share one transfer stream, so one copy running under the next
            block's compute is the overlap; more pending only hold more memory
            (docs/benchmarks.md, "The forward", measures one, two and every wait at the end).
    Rule 3. A copied value stays on the device until the compute stream has waited for its
            copy. torch 2.12+'s ``ao::wait_tensor`` takes it as a keep-alive argument. torch
            2.11's ``record_stream`` before the copy covers the caching allocator, not a
            compiler reusing the freed buffer in place for a later kernel, so a moved 2.11 wait
            is preceded by a second ``record_stream`` of the value, which keeps it live until
            there in every backend's lifetime analysis.
    Rule 4. A copied value is computed before the copy starts. torch 2.11's stream ops carry no
            data dependencies, and inductor emits a pointwise kernel where its result is first
            needed, which may be after the event the transfer stream waits on; so the value's
            ``record_stream``, which takes the value, moves to just before that event, whatever
            the window. torch 2.12+'s ``ao::offload`` takes the value and orders itself.
    Rule 5. Only the forward graph matepoint's joint pass asked a window for is changed: the
            wrapper of ``enable_activation_offloading`` in ``matepoint._compiled.scope`` moves
            its waits right after torch's offloading put the copies in. A graph whose copies are
            not laid out as the installed torch lays them out keeps torch's placement (correct,
            only slower), with a warning.
    The 2.11 parts (the ``device_put`` layout in :func:`find_copies`, ``_Copy.record_stream``:
    rules 3 and 4) can go when torch 2.12 is the oldest release the compiled path supports (gate
    ``TORCH_2_12_PLUS``); the window stays as long as torch places the waits as above.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

import matepoint_compat as compat

__all__ = [
    "COPIES_IN_FLIGHT",
    "FORWARD_WINDOW_COUNTS",
    "ForwardWindowCounts",
    "bound_forward_waits",
    "find_copies",
]


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


def _copied(copy: torch.fx.Node) -> tuple[torch.fx.Node, int]:
    """The value a copy node copies, and its bytes (raises unless it is a traced tensor)."""
    value = copy.args[0]
    if not isinstance(value, torch.fx.Node) or not isinstance(value.meta.get("val"), torch.Tensor):
        raise UnexpectedShape(f"the value {copy.name} copies has no tensor metadata")
    return value, compat.nbytes_hint(value.meta["val"])


def find_copies(nodes: list[torch.fx.Node]) -> list[_Copy]:
    """The copies in a forward graph's nodes, in either torch layout, in the order they start
    (raises if unexpected).

    torch 2.12+: ``ao::offload(value)`` then ``ao::wait_tensor(offload, value)``. torch 2.11:
    the copy sits at index 4 of ``STREAM_COPY_PATTERN``, the value's ``record_stream`` at 3, and
    the last is its wait.
    """
    copies = []
    for index, node in enumerate(nodes):
        name = compat.op_name(node)
        if name == compat.ASYNC_OFFLOAD_OP:
            wait = next(iter(node.users), node)  # its one user
            if compat.op_name(wait) != compat.ASYNC_WAIT_OP or wait.args[1:2] != node.args[:1]:
                raise UnexpectedShape(f"{node.name} has no wait that keeps its value alive")
            copies.append(_Copy(node, wait, *_copied(node)))
        elif name == "prims::device_put" and node.name.startswith(compat.OFFLOAD_PREFIX):
            group = nodes[max(index - 4, 0) : index + 4]
            if tuple(map(compat.op_name, group)) != compat.STREAM_COPY_PATTERN:
                raise UnexpectedShape(f"the stream ops around {node.name} are not torch 2.11's")
            if group[3].args[:1] != node.args[:1]:
                raise UnexpectedShape(f"{group[3].name} does not name what {node.name} copies")
            copies.append(_Copy(group[0], group[7], *_copied(node), group[3]))
    return copies


def _move_wait(copy: _Copy, before: torch.fx.Node) -> None:
    """Move ``copy``'s wait before ``before``; on 2.11 keep its value alive until the wait (see
    Note [The forward copy window], rule 3)."""
    before.prepend(copy.wait)
    if copy.record_stream is not None:
        copy.wait.prepend(copy.wait.graph.node_copy(copy.record_stream))


COPIES_IN_FLIGHT = 1
"""How many forward copies may run on under compute (see Note [The forward copy window], rule
2)."""


def bound_forward_waits(
    graph: torch.fx.Graph, max_inflight_bytes: int, copies_in_flight: int = COPIES_IN_FLIGHT
) -> int:
    """Move the waits for a forward graph's host copies later, within the window's bounds.

    See Note [The forward copy window], rule 1. Either every wait moves as the note says, or (on
    a graph whose copies are not laid out as the installed torch lays them out) none does. On
    torch 2.11's layout each copied value is also made to be computed before the transfer
    stream's wait (rule 4), whatever the bounds.

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
        if copy.record_stream is not None:  # See Note [The forward copy window], rule 4.
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
