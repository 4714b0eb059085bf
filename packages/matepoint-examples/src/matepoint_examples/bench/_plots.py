"""Draw benchmark results as PNG plots (matplotlib, on the non-interactive Agg backend)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matepoint_examples.bench._report import Row

__all__ = [
    "fit_title",
    "memory_vs_depth_figure",
    "outside_legend",
    "plot_memory_vs_depth",
    "plot_step_time_ratio",
    "plot_timelines",
    "step_time_ratio_figure",
]


def _pyplot() -> Any:
    """Import pyplot on the non-interactive Agg backend (works without a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _strategies(rows: Sequence[Row]) -> list[str]:
    """Return the strategies present in ``rows``, in first-seen order."""
    return list(dict.fromkeys(r.get("strategy", "?") for r in rows))


# Note [Plots that fit]
# A plot is read as a picture, so nothing in it may be cut or hidden: a title wider than its
# figure was cut at the figure's edge ("... median per round, IQR whi"), and a legend drawn
# inside the axes covered the bars of the first workload. So a title is wrapped until the
# renderer says it fits the figure's width (fit_title), a legend goes to the right of the axes,
# outside them (outside_legend), and the PNG is saved with the bounding box of everything drawn.
# A plot with no data is not drawn at all (an empty box with a line of text tells nothing a
# line on the terminal does not): its function returns None and the caller says so.


def fit_title(fig: Any, ax: Any, title: str) -> Any:
    """Title ``ax`` with ``title``, wrapped at word boundaries until it fits over the axes.

    Call it last, once everything else is drawn: the figure is laid out first (a legend outside
    the axes narrows them), and the title is wrapped to the axes' width, over which it is
    centred, so it stays inside the figure. See Note [Plots that fit].

    Args:
        fig: The figure.
        ax: The axes to title.
        title: The text.

    Returns:
        The title's text artist.
    """
    artist = ax.set_title(title)
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    limit = ax.get_window_extent(renderer).width
    for width in range(len(title), 10, -4):
        artist.set_text("\n".join(textwrap.wrap(title, width)))
        if artist.get_window_extent(renderer).width <= limit:
            break
    fig.tight_layout()
    return artist


def outside_legend(ax: Any) -> Any:
    """Put ``ax``'s legend to the right of the axes, where it covers no data.

    See Note [Plots that fit].

    Returns:
        The legend.
    """
    return ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(plt: Any, fig: Any, path: Path) -> Path:
    """Write ``fig`` to ``path`` as a PNG, everything drawn inside it, and free the figure."""
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _has_ratio(r: Row) -> bool:
    return bool(r.get("ratio"))


def step_time_ratio_figure(rows: Sequence[Row]) -> Any | None:
    """Draw the paired step-time ratios (see :func:`plot_step_time_ratio`) without saving.

    Returns:
        The figure, or ``None`` if no row has a ratio.
    """
    if not any(_has_ratio(r) for r in rows):
        return None
    plt = _pyplot()
    rows = [r for r in rows if _has_ratio(r)]
    workloads = list(dict.fromkeys(r.get("workload", "?") for r in rows))
    strategies = _strategies(rows)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.5))
    width = 0.8 / max(1, len(strategies))
    for j, s in enumerate(strategies):
        xs, ys, lo, hi = [], [], [], []
        for i, w in enumerate(workloads):
            for r in rows:
                if r.get("workload") == w and r.get("strategy") == s:
                    xs.append(i + (j - (len(strategies) - 1) / 2) * width)
                    ys.append(r["ratio"])
                    lo.append(r["ratio"] - (r.get("ratio_q1") or r["ratio"]))
                    hi.append((r.get("ratio_q3") or r["ratio"]) - r["ratio"])
                    if r.get("status") == "partial":
                        ax.annotate("partial", (xs[-1], ys[-1]), fontsize="x-small", rotation=90)
        ax.bar(xs, ys, width=width, label=s, yerr=[lo, hi], capsize=2)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.03, color="red", linewidth=0.8, linestyle="--", label="target 1.03")
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("step time / torch.utils.checkpoint")
    outside_legend(ax)
    title = "Step time / torch.utils.checkpoint, paired: median per round, whiskers the IQR"
    fit_title(fig, ax, title)
    return fig


def plot_step_time_ratio(path: Path, rows: Sequence[Row]) -> Path | None:
    """Plot the paired step-time ratio to torch checkpoint, per workload, one bar per strategy.

    Each bar is the median per-round ratio; its whisker spans the interquartile range. A bar of
    a ``partial`` row (its worker timed out) is labelled so.

    Args:
        path: PNG file to write.
        rows: Paired results.

    Returns:
        ``path``, or ``None`` (nothing written) if no row has a ratio.
    """
    fig = step_time_ratio_figure(rows)
    return None if fig is None else _save(_pyplot(), fig, path)


def _depth_points(rows: Sequence[Row], strategy: str) -> list[tuple[int, float, str]]:
    return sorted(
        (r["depth"], r["held_after_forward_bytes"] / 1e9, r["workload"])
        for r in rows
        if r.get("strategy") == strategy
        and r.get("kind") == "latent"
        and r.get("status") == "ok"
        and r.get("held_after_forward_bytes") is not None
    )


def memory_vs_depth_figure(rows: Sequence[Row]) -> Any | None:
    """Draw device memory held after forward against depth (see :func:`plot_memory_vs_depth`).

    Returns:
        The figure, or ``None`` if no row measured device memory (a CPU run).
    """
    points = {s: _depth_points(rows, s) for s in _strategies(rows)}
    points = {s: pts for s, pts in points.items() if pts}
    if not points:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for s, pts in points.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        for d, gb, w in pts:
            ax.annotate(w, (d, gb), fontsize="x-small", xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("blocks (depth)")
    ax.set_ylabel("device GB held after forward")
    ax.set_yscale("symlog", linthresh=0.1)
    outside_legend(ax)
    fit_title(fig, ax, "Device memory held after forward vs depth")
    return fig


def plot_memory_vs_depth(path: Path, rows: Sequence[Row]) -> Path | None:
    """Plot device bytes held after forward against depth, one line per strategy.

    Only latent-stack workloads are drawn (the GPT's residual stream is a different size); each
    point is labelled with its workload.

    Args:
        path: PNG file to write.
        rows: Train results.

    Returns:
        ``path``, or ``None`` (nothing written) if no row measured device memory.
    """
    fig = memory_vs_depth_figure(rows)
    return None if fig is None else _save(_pyplot(), fig, path)


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
        outside_legend(ax)
        fit_title(fig, ax, f"Device memory over one step: {w}")
        written.append(_save(plt, fig, out_dir / f"timeline_{w}.png"))
    return written
