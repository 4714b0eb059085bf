"""Draw benchmark results as PNG plots (matplotlib, on the non-interactive Agg backend)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matepoint_examples.bench._report import Row

__all__ = ["plot_memory_vs_depth", "plot_step_time_ratio", "plot_timelines"]


def _pyplot() -> Any:
    """Import pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _strategies(rows: Sequence[Row]) -> list[str]:
    """Return the strategies present in ``rows``, in first-seen order."""
    return list(dict.fromkeys(r.get("strategy", "?") for r in rows))


def _save(plt: Any, fig: Any, ax: Any, title: str, path: Path) -> Path:
    """Title the plot, write it to ``path`` as a PNG and free the figure."""
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _empty(ax: Any, text: str) -> None:
    """Write ``text`` in the middle of an otherwise empty axis."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_step_time_ratio(path: Path, rows: Sequence[Row]) -> Path:
    """Plot the paired step-time ratio to torch checkpoint, per workload, one bar per strategy.

    Each bar is the median per-round ratio; its whisker spans the interquartile range. A bar of
    a ``partial`` row (its worker timed out) is labelled so.

    Args:
        path: PNG file to write.
        rows: Paired results.

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
        xs, ys, lo, hi = [], [], [], []
        for i, w in enumerate(workloads):
            for r in rows:
                if r.get("workload") == w and r.get("strategy") == s and r.get("ratio"):
                    xs.append(i + (j - (len(strategies) - 1) / 2) * width)
                    ys.append(r["ratio"])
                    lo.append(r["ratio"] - (r.get("ratio_q1") or r["ratio"]))
                    hi.append((r.get("ratio_q3") or r["ratio"]) - r["ratio"])
                    if r.get("status") == "partial":
                        ax.annotate("partial", (xs[-1], ys[-1]), fontsize="x-small", rotation=90)
        if xs:
            ax.bar(xs, ys, width=width, label=s, yerr=[lo, hi], capsize=2)
            plotted = True
    if plotted:
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(1.03, color="red", linewidth=0.8, linestyle="--", label="target 1.03")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel("step time / torch.utils.checkpoint (paired)")
        ax.legend(fontsize="small", ncol=2)
    else:
        _empty(ax, "no step-time ratios (torch checkpoint did not run)")
    title = "Step time relative to torch.utils.checkpoint: median per round, IQR whiskers"
    return _save(plt, fig, ax, title, path)


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
    return _save(plt, fig, ax, "Device memory held after forward vs depth", path)


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
        ax.legend(fontsize="small")
        title = f"Device memory over one step: {w}"
        written.append(_save(plt, fig, ax, title, out_dir / f"timeline_{w}.png"))
    return written
