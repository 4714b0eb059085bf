"""Draw the forward and backward stream timelines of docs/how-it-works.md as SVG files.

The pictures are schematic: they show which stream does what and which events order the streams
(see Note [Stream ordering] in ``matepoint/_engine/transport.py``), not measured durations. Run
from the repository root with matplotlib installed:

    python tools/draw_timelines.py

It writes ``docs/img/forward-timeline.svg`` and ``docs/img/backward-timeline.svg``. The output
is deterministic (fixed SVG ids, no date), so re-running it changes nothing unless this file did.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

OUT_DIR = Path(__file__).resolve().parent.parent / "docs" / "img"

COMPUTE = "#4c78a8"
RECOMPUTE = "#72b7b2"
D2H = "#f58518"
H2D = "#54a24b"
DEVICE = "#9d755d"
PINNED = "#b279a2"
EVENT = "#222222"
STALL = "#e45756"
GRID = "#dddddd"

LANE_HEIGHT = 0.62


def _style() -> None:
    matplotlib.rcParams.update(
        {
            "svg.fonttype": "none",  # keep text as text: smaller files, searchable pages
            "svg.hashsalt": "matepoint",  # stable element ids between runs
            "font.family": "sans-serif",
            "font.size": 9,
        }
    )


def _new_figure(lanes: list[str], width: float, span: float) -> tuple[Figure, Axes]:
    fig = Figure(figsize=(width, 0.78 * len(lanes) + 1.1))
    ax = fig.subplots()
    ax.set_xlim(-0.2, span)
    ax.set_ylim(-0.8, len(lanes) - 0.2)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels(list(reversed(lanes)), fontsize=9.5)
    ax.set_xticks([])
    for spine in ("top", "right", "left"):
        ax.spines[spine].set_visible(False)
    ax.spines["bottom"].set_color("#888888")
    ax.tick_params(axis="y", length=0)
    for y in range(len(lanes)):
        ax.axhline(y, color=GRID, linewidth=0.8, zorder=0)
    return fig, ax


def _lane(lanes: list[str], name: str) -> float:
    return float(len(lanes) - 1 - lanes.index(name))


def _box(
    ax: Axes,
    y: float,
    start: float,
    end: float,
    label: str,
    color: str,
    *,
    height: float = LANE_HEIGHT,
    text_color: str = "white",
    hatch: str | None = None,
    hatch_color: str | None = None,
    fontsize: float = 8.5,
) -> None:
    patch = FancyBboxPatch(
        (start, y - height / 2),
        end - start,
        height,
        boxstyle="round,pad=0,rounding_size=0.06",
        facecolor=color,
        edgecolor="white" if hatch is None else (hatch_color or color),
        linewidth=0.8,
        hatch=hatch,
        zorder=2,
    )
    ax.add_patch(patch)
    ax.text(
        (start + end) / 2,
        y,
        label,
        ha="center",
        va="center",
        color=text_color,
        fontsize=fontsize,
        zorder=3,
    )


def _event(ax: Axes, x: float, y: float, label: str, *, above: bool = True) -> None:
    ax.plot([x], [y], marker="D", markersize=6.5, color=EVENT, zorder=4)
    offset = 0.43 if above else -0.43
    ax.text(x, y + offset, label, ha="center", va="center", fontsize=8, color=EVENT, zorder=4)


def _arrow(
    ax: Axes,
    start: tuple[float, float],
    end: tuple[float, float],
    label: str = "",
    *,
    color: str = EVENT,
    style: str = "--",
    label_at: float = 0.5,
    label_dx: float = 0.08,
) -> None:
    ax.annotate(
        "",
        xy=end,
        xytext=start,
        arrowprops={
            "arrowstyle": "-|>",
            "color": color,
            "linestyle": style,
            "linewidth": 1.1,
            "shrinkA": 4,
            "shrinkB": 4,
            "mutation_scale": 10,
        },
        zorder=5,
    )
    if label:
        x = start[0] + (end[0] - start[0]) * label_at + label_dx
        y = start[1] + (end[1] - start[1]) * label_at
        ax.text(x, y, label, ha="left", va="center", fontsize=7.5, color=color, zorder=5)


def _note(ax: Axes, x: float, y: float, text: str, *, ha: str = "left") -> None:
    ax.text(
        x,
        y,
        text,
        ha=ha,
        va="center",
        fontsize=7.5,
        color="#333333",
        zorder=6,
        bbox={"boxstyle": "round,pad=0.25", "facecolor": "white", "edgecolor": "#bbbbbb"},
    )


def _save(fig: Figure, name: str) -> None:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(OUT_DIR / name, format="svg", metadata={"Date": None, "Creator": None})


def draw_forward() -> None:
    """Forward: pack records an event, the side stream copies, older originals are let go."""
    lanes = ["host thread", "compute stream", "side stream", "device memory", "pinned host"]
    fig, ax = _new_figure(lanes, width=11.5, span=12.4)
    host = _lane(lanes, "host thread")
    compute = _lane(lanes, "compute stream")
    side = _lane(lanes, "side stream")
    memory = _lane(lanes, "device memory")
    pinned = _lane(lanes, "pinned host")

    # Block 2 is short: its pack (x3) comes while the copy of x2 is still running.
    starts = [0.4, 4.1, 6.0]
    lengths = [3.5, 1.7, 3.5]
    copy = 2.4
    pack_labels = [
        "pack x1",
        "pack x2: C1 done\n→ drop x1",
        "pack x3: C2 running →\nrecord_stream(side),\nx2 to the allocator",
    ]
    side_free = 0.0  # copies on the one side stream run one after another
    copy_ends: list[float] = []
    rows = zip(starts, lengths, pack_labels, strict=True)
    for index, (start, length, pack_label) in enumerate(rows, 1):
        # Pack runs when torch saves the checkpoint's inputs, before the block's kernels.
        _box(ax, host, start - 0.05, start + 1.75, pack_label, "#666666", fontsize=7)
        _event(ax, start, compute, f"E{index}")
        _box(ax, compute, start + 0.1, start + length, f"forward block {index}", COMPUTE)
        copy_start = max(start + 0.25, side_free)
        side_free = copy_start + copy
        copy_ends.append(side_free)
        _box(ax, side, copy_start, copy_start + copy, f"copy x{index} → host", D2H)
        _event(ax, copy_start + copy, side, f"C{index}", above=False)
        _arrow(ax, (start, compute), (copy_start, side), "wait E" + str(index), label_at=0.45)
        _box(
            ax,
            pinned + 0.2 - 0.2 * (index - 1),
            copy_start + copy,
            12.3,
            f"x{index}: exact-size pinned block",
            PINNED,
            height=0.17,
            fontsize=7,
        )
        if index > 1:
            ax.axvline(start, ymin=0.0, ymax=1.0, color="#aaaaaa", linewidth=0.6, zorder=1)

    # Device originals. x1 is dropped at pack x2 (its copy is done). x2's copy still runs at
    # pack x3: matepoint lets go of it with record_stream(side), and the caching allocator
    # reuses its memory once C2 has completed. x3 is the newest, in use by block 3: kept.
    c2 = copy_ends[1]
    _box(ax, memory + 0.2, 0.0, starts[1], "x1", DEVICE, height=0.17, fontsize=7)
    _box(ax, memory, starts[0] + lengths[0] - 0.3, starts[2], "x2", DEVICE, height=0.17, fontsize=7)
    _box(
        ax,
        memory,
        starts[2],
        c2,
        "",
        "#e8dcd3",
        height=0.17,
        hatch="////",
        hatch_color=DEVICE,
    )
    _box(
        ax,
        memory - 0.2,
        starts[1] + lengths[1] - 0.3,
        12.3,
        "x3: the newest, still on the device (the tail)",
        DEVICE,
        height=0.17,
        fontsize=7,
    )
    _arrow(
        ax,
        (c2, side),
        (c2, memory + 0.08),
        "allocator may reuse x2",
        color="#888888",
        style=":",
        label_at=0.6,
    )
    _arrow(
        ax,
        (copy_ends[0], side),
        (starts[1], host - 0.2),
        "",
        color="#888888",
        style=":",
    )
    _note(
        ax,
        9.55,
        host,
        "each pack settles the older originals:\n"
        "copy done → dropped (version checked)\n"
        "copy running → record_stream(side),\n"
        "to the allocator (or watched while\n"
        "something else references it)\n"
        "the host waits only past max_inflight_bytes",
    )
    ax.set_title(
        "Forward: each checkpoint's input leaves the device on the side stream",
        fontsize=10.5,
        loc="left",
    )
    _save(fig, "forward-timeline.svg")


def draw_backward() -> None:
    """Backward: unpack i waits on its prefetch event, then prefetches i-1 .. i-k."""
    lanes = ["host thread", "compute stream", "side stream", "device memory"]
    fig, ax = _new_figure(lanes, width=11.5, span=13.4)
    host = _lane(lanes, "host thread")
    compute = _lane(lanes, "compute stream")
    side = _lane(lanes, "side stream")
    memory = _lane(lanes, "device memory")

    # Blocks 4, 3, 2 of a 4-block stack, prefetch=2.
    unpack4, unpack3, unpack2 = 0.3, 4.3, 8.6
    _box(
        ax,
        host,
        unpack4 - 0.1,
        unpack4 + 2.3,
        "unpack x4: still on device\nprefetch x3, x2",
        "#666666",
        fontsize=7.5,
    )
    _box(ax, compute, unpack4 + 0.1, unpack3 - 0.2, "recompute + backward block 4", RECOMPUTE)

    copy = 1.8
    p3_start = unpack4 + 0.3
    p2_start = p3_start + copy
    _box(ax, side, p3_start, p3_start + copy, "copy x3 → device", H2D)
    _event(ax, p3_start + copy, side, "P3", above=False)
    _box(ax, side, p2_start, p2_start + copy, "copy x2 → device", H2D)
    _event(ax, p2_start + copy, side, "P2", above=False)

    _box(
        ax,
        host,
        unpack3 - 0.1,
        unpack3 + 2.3,
        "unpack x3: compute waits P3,\nrecord_stream; prefetch x1",
        "#666666",
        fontsize=7.5,
    )
    _event(ax, unpack3, compute, "wait P3")
    _arrow(ax, (p3_start + copy, side), (unpack3, compute), "event P3", label_at=0.5, color=H2D)
    _box(ax, compute, unpack3 + 0.1, unpack2 - 0.2, "recompute + backward block 3", RECOMPUTE)
    p1_start = max(p2_start + copy, unpack3 + 0.25)
    _box(ax, side, p1_start, p1_start + copy, "copy x1 → device", H2D)
    _event(ax, p1_start + copy, side, "P1", above=False)

    _box(
        ax,
        host,
        unpack2 - 0.1,
        unpack2 + 2.3,
        "unpack x2: compute waits P2\n(x1 already on its way)",
        "#666666",
        fontsize=7.5,
    )
    _event(ax, unpack2, compute, "wait P2")
    _arrow(ax, (p2_start + copy, side), (unpack2, compute), "event P2", label_at=0.5, color=H2D)
    _box(ax, compute, unpack2 + 0.1, 13.2, "recompute + backward block 2   …", RECOMPUTE)

    # Device memory: the tail x4, then prefetched copies in side-stream memory.
    rows = [
        (0.0, unpack3, "x4 (tail, no copy back)"),
        (p3_start, unpack2, "x3: side-stream memory, record_stream(compute) at unpack"),
        (p2_start, 13.2, "x2"),
    ]
    for row, (begin, end, label) in enumerate(rows):
        _box(ax, memory + 0.2 - 0.2 * row, begin, end, label, DEVICE, height=0.17, fontsize=7)
    _box(ax, memory - 0.4 + 0.0, p1_start, 13.2, "x1", DEVICE, height=0.17, fontsize=7)
    _note(
        ax,
        11.0,
        host,
        "the host never blocks:\nevery wait is an event\nwait on the compute stream",
    )
    ax.set_title(
        "Backward (prefetch=2): inputs come back on the side stream one step ahead",
        fontsize=10.5,
        loc="left",
    )
    _save(fig, "backward-timeline.svg")


def main() -> None:
    _style()
    draw_forward()
    draw_backward()
    for name in ("forward-timeline.svg", "backward-timeline.svg"):
        print((OUT_DIR / name).relative_to(OUT_DIR.parent.parent))


if __name__ == "__main__":
    main()
