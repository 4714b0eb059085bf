"""Turn benchmark results into a terminal table, a markdown table and PNG plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from matepoint_examples._runtime import format_bytes

__all__ = [
    "COLUMNS",
    "add_ratios",
    "notes",
    "plot_memory_vs_depth",
    "plot_step_time_ratio",
    "plot_timelines",
    "rich_table",
    "transfer_markdown",
    "write_json",
    "write_markdown",
]

REFERENCE = "torch"

Row = dict[str, Any]


def add_ratios(rows: Sequence[Row]) -> None:
    """Add ``ratio_to_torch`` (step time over torch checkpoint's, same workload) to each row.

    Args:
        rows: Train results from the workers; changed in place.
    """
    ref = {
        r["workload"]: r["step_time_s"]
        for r in rows
        if r.get("strategy") == REFERENCE and r.get("status") == "ok"
    }
    ref_host = {
        r["workload"]: r.get("host_rss_delta_bytes")
        for r in rows
        if r.get("strategy") == REFERENCE and r.get("status") == "ok"
    }
    for r in rows:
        base = ref.get(r.get("workload", ""))
        ok = r.get("status") == "ok" and base
        r["ratio_to_torch"] = r["step_time_s"] / base if ok else None
        # Host RSS also grows for reasons common to every strategy (allocator and library
        # state after the first steps); torch checkpoint's growth is that baseline.
        host, host_ref = r.get("host_rss_delta_bytes"), ref_host.get(r.get("workload", ""))
        offloaded = r.get("bytes_offloaded")
        if ok and host is not None and host_ref is not None:
            r["host_extra_vs_torch_bytes"] = host - host_ref
            if offloaded:
                r["host_per_offloaded"] = (host - host_ref) / offloaded


def _bytes(n: Any) -> str:
    """Format a byte count for a table cell, ``-`` when missing."""
    return "-" if n is None else format_bytes(n)


def _num(x: Any, fmt: str) -> str:
    """Format a number, ``-`` when missing."""
    return "-" if x is None else format(x, fmt)


def _cells(r: Row) -> list[str]:
    """Return the table cells of one result row (the note of a failed row goes in a footnote)."""
    status = str(r.get("status", "?"))
    head = [str(r.get("workload", "?")), str(r.get("strategy", "?")), status]
    if status != "ok":
        return head + ["-"] * (len(COLUMNS) - 3)
    t = r.get("step_time_s")
    return [
        *head,
        "-" if t is None else f"{t * 1e3:.1f}",
        _num(r.get("ratio_to_torch"), ".3f"),
        _bytes(r.get("held_after_forward_bytes")),
        _bytes(r.get("peak_bytes")),
        _bytes(r.get("host_extra_vs_torch_bytes", r.get("host_rss_delta_bytes"))),
        _bytes(r.get("bytes_offloaded")),
        _num(r.get("link_gbps"), ".1f"),
        _num(r.get("host_per_offloaded"), ".2f"),
    ]


def notes(rows: Sequence[Row]) -> list[str]:
    """Return one line per row that did not run, saying why.

    Args:
        rows: Train results.

    Returns:
        Lines like ``"gpt12 / torchtune: skipped: torchtune is not installed"``.
    """
    return [
        f"{r.get('workload', '?')} / {r.get('strategy', '?')}: "
        f"{r.get('status')}: {r.get('note', '')}"
        for r in rows
        if r.get("status") != "ok"
    ]


COLUMNS = [
    "workload",
    "strategy",
    "status",
    "step ms",
    "/ torch",
    "held after fwd",
    "peak",
    "host RAM vs torch",
    "offloaded",
    "link GB/s",
    "host / offloaded",
]


def rich_table(rows: Sequence[Row], title: str = "matepoint benchmark") -> Table:
    """Build the terminal table of train results.

    Args:
        rows: Train results (with ratios added).
        title: Table title.

    Returns:
        A rich table.
    """
    table = Table(title=title)
    for i, c in enumerate(COLUMNS):
        table.add_column(c, justify="left" if i < 3 else "right", no_wrap=i < 3)
    for r in rows:
        cells = _cells(r)
        ratio = r.get("ratio_to_torch")
        if ratio is not None and r.get("strategy", "").startswith("matepoint"):
            style = "green" if ratio <= 1.03 else "yellow" if ratio <= 1.1 else "red"
            cells[4] = f"[{style}]{cells[4]}[/]"
        table.add_row(*cells)
    return table


def transfer_markdown(t: Row) -> str:
    """Render the transfer micro-benchmark as a small markdown table.

    Args:
        t: The transfer result.

    Returns:
        Markdown text (a note if the run failed).
    """
    if t.get("status") != "ok":
        return f"Transfer micro-benchmark: {t.get('status')}: {t.get('note', '')}\n"
    lines = [
        "| direction | raw pinned copy GB/s | matepoint GB/s | fraction |",
        "| --- | ---: | ---: | ---: |",
        f"| device -> host (offload) | {t['raw_d2h_gbps']:.1f} | {t['matepoint_offload_gbps']:.1f} "
        f"| {_num(t.get('offload_fraction'), '.2f')} |",
        f"| host -> device (fetch) | {t['raw_h2d_gbps']:.1f} | {t['matepoint_fetch_gbps']:.1f} "
        f"| {_num(t.get('fetch_fraction'), '.2f')} |",
    ]
    if t.get("note"):
        lines.append(f"\n{t['note']}")
    return "\n".join(lines) + "\n"


def write_markdown(
    path: Path, rows: Sequence[Row], transfer: Row | None = None, header: str = ""
) -> Path:
    """Write the results as a markdown table (for docs/benchmarks).

    Args:
        path: File to write.
        rows: Train results (with ratios added).
        transfer: The transfer micro-benchmark result, if run. Default: ``None``.
        header: Text put above the table (environment, flags). Default: ``""``.

    Returns:
        ``path``.
    """
    out = [header.rstrip() + "\n"] if header else []
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("| " + " | ".join("---" if i < 3 else "---:" for i in range(len(COLUMNS))) + " |")
    for r in rows:
        out.append("| " + " | ".join(c.replace("|", "/") for c in _cells(r)) + " |")
    missing = notes(rows)
    if missing:
        out.append("")
        out += [f"- {line}" for line in missing]
    if transfer is not None:
        out.append("\n" + transfer_markdown(transfer))
    path.write_text("\n".join(out) + "\n")
    return path


def write_json(path: Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON.

    Args:
        path: File to write.
        payload: JSON-ready data.

    Returns:
        ``path``.
    """
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def _pyplot() -> Any:
    """Import pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _strategies(rows: Sequence[Row]) -> list[str]:
    """Return the strategies present in ``rows``, in first-seen order."""
    return list(dict.fromkeys(r.get("strategy", "?") for r in rows))


def _empty(ax: Any, text: str) -> None:
    """Write ``text`` in the middle of an otherwise empty axis."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_step_time_ratio(path: Path, rows: Sequence[Row]) -> Path:
    """Plot step time relative to torch checkpoint, grouped by workload, one bar per strategy.

    Args:
        path: PNG file to write.
        rows: Train results (with ratios added).

    Returns:
        ``path``.
    """
    plt = _pyplot()
    workloads = list(dict.fromkeys(r.get("workload", "?") for r in rows))
    strategies = _strategies(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5))
    width = 0.8 / max(1, len(strategies))
    plotted = False
    for j, s in enumerate(strategies):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            for r in rows:
                if r.get("workload") == w and r.get("strategy") == s and r.get("ratio_to_torch"):
                    xs.append(i + (j - (len(strategies) - 1) / 2) * width)
                    ys.append(r["ratio_to_torch"])
        if xs:
            ax.bar(xs, ys, width=width, label=s)
            plotted = True
    if plotted:
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.03, color="red", linewidth=0.8, linestyle="--", label="target 1.03")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("step time / torch.utils.checkpoint")
        ax.legend(fontsize="small", ncol=2)
    else:
        _empty(ax, "no step-time ratios (torch checkpoint did not run)")
    ax.set_title("Step time relative to torch.utils.checkpoint")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_memory_vs_depth(path: Path, rows: Sequence[Row]) -> Path:
    """Plot device bytes held after forward against depth, one line per strategy.

    Only latent-stack workloads are drawn (the GPT's residual stream is a different size); each
    point is labelled with its workload.

    Args:
        path: PNG file to write.
        rows: Train results.

    Returns:
        ``path``.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plotted = False
    for s in _strategies(rows):
        pts = sorted(
            (r["depth"], r["held_after_forward_bytes"] / 1e9, r["workload"])
            for r in rows
            if r.get("strategy") == s
            and r.get("kind") == "latent"
            and r.get("status") == "ok"
            and r.get("held_after_forward_bytes") is not None
        )
        if not pts:
            continue
        plotted = True
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        for d, gb, w in pts:
            ax.annotate(w, (d, gb), fontsize="x-small", xytext=(3, 3), textcoords="offset points")
    if plotted:
        ax.set_xlabel("blocks (depth)")
        ax.set_ylabel("device GB held after forward")
        ax.set_yscale("symlog", linthresh=0.1)
        ax.legend(fontsize="small")
    else:
        _empty(ax, "no device memory data (CPU run)")
    ax.set_title("Device memory held after forward vs depth")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timelines(out_dir: Path, rows: Sequence[Row]) -> list[Path]:
    """Plot, per workload, device memory over one step for each strategy.

    Args:
        out_dir: Folder for ``timeline_<workload>.png`` files.
        rows: Train results; rows with a ``timeline`` are drawn.

    Returns:
        The files written (none if no row has a timeline, e.g. on CPU).
    """
    plt = _pyplot()
    written = []
    for w in dict.fromkeys(r.get("workload", "?") for r in rows):
        series = [r for r in rows if r.get("workload") == w and r.get("timeline")]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for r in series:
            pts = [(t, b / 1e9) for t, b, _ in r["timeline"] if b is not None and math.isfinite(t)]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=r["strategy"], linewidth=1.2)
        ax.set_xlabel("ms since step start (host clock)")
        ax.set_ylabel("device GB allocated")
        ax.set_title(f"Device memory over one step: {w}")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out_dir / f"timeline_{w}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written
