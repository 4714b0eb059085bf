"""Turn benchmark results into terminal tables, markdown tables and JSON (plots: _bench_plots)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from matepoint_examples._runtime import format_bytes

__all__ = [
    "MEMORY_COLUMNS",
    "PAIRED_COLUMNS",
    "add_host_baselines",
    "compile_notes",
    "measured_columns",
    "notes",
    "ratio_cell",
    "rich_memory_table",
    "rich_paired_table",
    "transfer_markdown",
    "write_json",
    "write_markdown",
]

REFERENCE = "torch"

Row = dict[str, Any]


def add_host_baselines(rows: Sequence[Row]) -> None:
    """Add host RAM beyond torch checkpoint's (same workload) to each one-process-per-strategy row.

    Host RSS also grows for reasons common to every strategy (allocator and library state after
    the first steps); torch checkpoint's growth is that baseline. No step-time ratio is taken
    here: separate processes differ by more than the effects measured (the paired rows carry
    the ratios).

    Args:
        rows: Memory results from the workers; changed in place.
    """
    ref_host = {
        r["workload"]: r.get("host_rss_delta_bytes")
        for r in rows
        if r.get("strategy") == REFERENCE and r.get("status") == "ok"
    }
    for r in rows:
        host, host_ref = r.get("host_rss_delta_bytes"), ref_host.get(r.get("workload", ""))
        offloaded = r.get("bytes_offloaded")
        if r.get("status") == "ok" and host is not None and host_ref is not None:
            r["host_extra_vs_torch_bytes"] = host - host_ref
            if offloaded and not str(r.get("device", "")).startswith("cpu"):  # see _worker
                r["host_per_offloaded"] = (host - host_ref) / offloaded


def _bytes(n: Any) -> str:
    """Format a byte count for a table cell, ``-`` when missing."""
    return "-" if n is None else format_bytes(n)


def _num(x: Any, fmt: str) -> str:
    """Format a number, ``-`` when missing."""
    return "-" if x is None else format(x, fmt)


def ratio_cell(median: Any, q1: Any = None, q3: Any = None) -> str:
    """Format a paired ratio as ``median [q1-q3]`` (``-`` when missing).

    Args:
        median: The median per-round ratio.
        q1: Its first quartile. Default: ``None`` (no range shown).
        q3: Its third quartile. Default: ``None``.

    Returns:
        E.g. ``"1.068 [1.060-1.072]"``.
    """
    if median is None:
        return "-"
    if q1 is None or q3 is None:
        return f"{median:.3f}"
    return f"{median:.3f} [{q1:.3f}-{q3:.3f}]"


def _metric_ratio(r: Row, metric: str) -> str:
    """Return the median per-round ratio of one metric of a paired row (no range)."""
    summary = r.get("ratios", {}).get(metric)
    return "-" if not summary else f"{summary['median']:.3f}"


def _moved(r: Row) -> tuple[Any, Any]:
    """Return the bytes a strategy copied out and back in its counted step (or ``None``)."""
    stats = r.get("stats") or {}
    out = stats.get("bytes_offloaded", stats.get("bytes_out"))
    back = stats.get("bytes_fetched", stats.get("bytes_in"))
    return out, back


PAIRED_COLUMNS = [
    "workload",
    "strategy",
    "status",
    "step ms",
    "/ torch [IQR]",
    "fwd host / torch",
    "fwd GPU / torch",
    "bwd GPU / torch",
    "held after fwd",
    "out / step",
    "back / step",
]

MEMORY_COLUMNS = [
    "workload",
    "strategy",
    "status",
    "held after fwd",
    "peak",
    "host RAM vs torch",
    "offloaded",
    "link GB/s",
    "host / offloaded",
]


def _paired_cells(r: Row) -> list[str]:
    """Return the paired table's cells of one row (a failed row's note goes in a footnote).

    A ``partial`` row (its worker timed out; the note says after which round) shows the figures
    of the rounds it finished, with its status in its own column as for any row.
    """
    status = str(r.get("status", "?"))
    head = [str(r.get("workload", "?")), str(r.get("strategy", "?")), status]
    if status not in ("ok", "partial"):
        return head + ["-"] * (len(PAIRED_COLUMNS) - 3)
    t = r.get("step_time_s")
    out, back = _moved(r)
    return [
        *head,
        "-" if t is None else f"{t * 1e3:.1f}",
        ratio_cell(r.get("ratio"), r.get("ratio_q1"), r.get("ratio_q3")),
        _metric_ratio(r, "forward_host_s"),
        _metric_ratio(r, "forward_gpu_s"),
        _metric_ratio(r, "backward_gpu_s"),
        _bytes(r.get("held_after_forward_bytes")),
        _bytes(out),
        _bytes(back),
    ]


def _memory_cells(r: Row) -> list[str]:
    """Return the memory table's cells of one row."""
    status = str(r.get("status", "?"))
    head = [str(r.get("workload", "?")), str(r.get("strategy", "?")), status]
    if status != "ok":
        return head + ["-"] * (len(MEMORY_COLUMNS) - 3)
    return [
        *head,
        _bytes(r.get("held_after_forward_bytes")),
        _bytes(r.get("peak_bytes")),
        _bytes(r.get("host_extra_vs_torch_bytes", r.get("host_rss_delta_bytes"))),
        _bytes(r.get("bytes_offloaded")),
        _num(r.get("link_gbps"), ".1f"),
        _num(r.get("host_per_offloaded"), ".2f"),
    ]


def notes(rows: Sequence[Row]) -> list[str]:
    """Return one line per row that did not run or did not finish (``partial``), saying why.

    Args:
        rows: Paired or memory results.

    Returns:
        Lines like ``"gpt12 / torchtune: skipped: torchtune is not installed"``.
    """
    return list(
        dict.fromkeys(
            f"{r.get('workload', '?')} / {r.get('strategy', '?')}: "
            f"{r.get('status')}: {r.get('note', '')}"
            for r in rows
            if r.get("status") != "ok"
        )
    )


_COMPILE_FIELDS = ("backend", "calls", "first_forward_s", "graphs", "graph_breaks")


def compile_notes(rows: Sequence[Row]) -> list[str]:
    """Return one line per compiled strategy's row saying what the compiler did.

    Args:
        rows: Paired or memory results; rows with a ``compile`` entry are described.

    Returns:
        Lines like ``"gpt12 / torch-compile (paired): inductor, 1 graphs, 0 graph breaks,
        first step (compiling) 61.0 s, of which forward 41.0 s, 0 graphs compiled after it"``.
    """
    lines = []
    for r in rows:
        c = r.get("compile")
        if not c:
            continue
        after = c.get("graphs_after_first_forward")
        extra = "".join(
            f", {key} {value}"
            for key, value in c.items()
            if key not in _COMPILE_FIELDS and key != "graphs_after_first_forward"
        )
        same = r.get("ratio_to_torch_compile")
        if same:
            extra += ", step / torch-compile " + ratio_cell(same["median"], same["q1"], same["q3"])
        lines.append(
            f"{r.get('workload', '?')} / {r.get('strategy', '?')} ({r.get('mode', '?')}): "
            f"{c.get('backend')}, {c.get('graphs')} graphs, {c.get('graph_breaks')} graph "
            f"breaks, first step (compiling) {_num(r.get('compile_step_s'), '.1f')} s, of "
            f"which forward {_num(c.get('first_forward_s'), '.1f')} s, {after} graphs compiled "
            f"after it{extra}"
        )
    return lines


def measured_columns(
    columns: Sequence[str], body: Sequence[list[str]]
) -> tuple[list[str], list[list[str]]]:
    """Drop the columns no row measured (every cell ``-``), keeping the first three.

    A CPU run has no GPU spans, no device memory and no link: a table of those columns is a
    grid of dashes that reads as if something had failed. The JSON keeps every field.

    Args:
        columns: Column names.
        body: Rows of cells, as many as ``columns``.

    Returns:
        The columns kept and the rows' cells in them.
    """
    keep = [i for i in range(len(columns)) if i < 3 or any(cells[i] != "-" for cells in body)]
    return [columns[i] for i in keep], [[cells[i] for i in keep] for cells in body]


def _rich(title: str, columns: Sequence[str], body: Sequence[list[str]]) -> Table:
    """Build a rich table of the measured columns, the first three left-aligned."""
    columns, body = measured_columns(columns, body)
    table = Table(title=title)
    for i, c in enumerate(columns):
        table.add_column(c, justify="left" if i < 3 else "right", no_wrap=i < 3)
    for cells in body:
        table.add_row(*cells)
    return table


def rich_paired_table(rows: Sequence[Row], title: str = "step time, paired") -> Table:
    """Build the terminal table of paired step times.

    Args:
        rows: Paired results.
        title: Table title.

    Returns:
        A rich table; matepoint's ratio is green up to 1.03, yellow up to 1.1, red above; a
        ``partial`` status (a worker cut short by its timeout) is red.
    """
    body = []
    for r in rows:
        cells = _paired_cells(r)
        if cells[2] == "partial":
            cells[2] = "[bold red]partial[/]"
        ratio = r.get("ratio")
        matepoint = str(r.get("strategy", "")).startswith("matepoint")
        if ratio is not None and matepoint and cells[4] != "-":
            style = "green" if ratio <= 1.03 else "yellow" if ratio <= 1.1 else "red"
            cells[4] = f"[{style}]{cells[4]}[/]"
        body.append(cells)
    return _rich(title, PAIRED_COLUMNS, body)


def rich_memory_table(rows: Sequence[Row], title: str = "memory, one process each") -> Table:
    """Build the terminal table of the one-process-per-strategy memory results.

    Args:
        rows: Memory results (with host baselines added).
        title: Table title.

    Returns:
        A rich table.
    """
    return _rich(title, MEMORY_COLUMNS, [_memory_cells(r) for r in rows])


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


def _markdown_table(columns: Sequence[str], body: Sequence[list[str]]) -> list[str]:
    """Render a markdown table (the first three columns left-aligned).

    Every column stays, measured or not, so that tables of different runs line up (the
    terminal drops the unmeasured ones; see :func:`measured_columns`).
    """
    out = ["| " + " | ".join(columns) + " |"]
    out.append("| " + " | ".join("---" if i < 3 else "---:" for i in range(len(columns))) + " |")
    out += ["| " + " | ".join(c.replace("|", "/") for c in cells) + " |" for cells in body]
    return out


def write_markdown(
    path: Path,
    paired: Sequence[Row],
    memory: Sequence[Row] = (),
    transfer: Row | None = None,
    header: str = "",
) -> Path:
    """Write the results as markdown tables (for docs/benchmarks).

    Args:
        path: File to write.
        paired: Paired step-time results.
        memory: One-process-per-strategy memory results (with host baselines added).
            Default: none.
        transfer: The transfer micro-benchmark result, if run. Default: ``None``.
        header: Text put above the tables (environment, flags). Default: ``""``.

    Returns:
        ``path``.
    """
    out = [header.rstrip() + "\n"] if header else []
    if paired:
        out.append("Step time, paired (median per-round ratio to torch checkpoint [IQR]):\n")
        out += _markdown_table(PAIRED_COLUMNS, [_paired_cells(r) for r in paired])
        out.append("")
    if memory:
        out.append("Memory, one process per strategy:\n")
        out += _markdown_table(MEMORY_COLUMNS, [_memory_cells(r) for r in memory])
        out.append("")
    missing = notes([*paired, *memory]) + compile_notes([*paired, *memory])
    if missing:
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
