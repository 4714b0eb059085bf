"""Tests for matepoint_examples.bench._plots: PNG plots from fake rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _report_rows import _paired_rows, _rows

from matepoint_examples.bench import _plots as plots

plt = plots._pyplot()  # pyplot on the Agg backend


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = _rows()
    for path in (
        plots.plot_step_time_ratio(tmp_path / "ratio.png", _paired_rows()),
        plots.plot_memory_vs_depth(tmp_path / "depth.png", rows),
        *plots.plot_timelines(tmp_path, rows),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "timeline_deep48.png").exists()


def test_plots_without_data_are_not_written(tmp_path: Path) -> None:
    # A CPU run measures no device memory and, here, no ratio: before, each plot was written as
    # an empty box holding one line of text.
    row = {"workload": "cpu-small", "strategy": "none", "status": "ok", "kind": "latent"}
    rows = [{**row, "depth": 8, "step_time_s": 0.1, "held_after_forward_bytes": None}]
    assert plots.plot_step_time_ratio(tmp_path / "a.png", rows) is None
    assert plots.plot_memory_vs_depth(tmp_path / "b.png", rows) is None
    assert plots.plot_timelines(tmp_path, rows) == []
    assert list(tmp_path.iterdir()) == []


def _inside(inner: Any, outer: Any) -> bool:
    return bool(outer.x0 <= inner.x0 and inner.x1 <= outer.x1 and outer.y0 <= inner.y0)


def _many_strategies() -> list[dict[str, Any]]:
    """Paired rows of seven strategies on one workload: the widest legend a run makes."""
    names = ["torch", "none", "save_on_cpu", "matepoint", "matepoint-nopipeline"]
    names += ["copies-floor", "matepoint-compile"]
    return [
        {"workload": "gpt12", "strategy": s, "status": "ok", "ratio": 1.0 + i / 50}
        for i, s in enumerate(names)
    ]


def test_titles_fit_their_figure_and_legends_cover_no_bars() -> None:
    # Before, the ratio plot's title ran past the figure's edge ("... IQR whi") and its legend
    # sat inside the axes, over the bars.
    for figure in (
        plots.step_time_ratio_figure(_many_strategies()),
        plots.step_time_ratio_figure(_paired_rows()),
        plots.memory_vs_depth_figure(_rows()),
    ):
        assert figure is not None
        figure.tight_layout()
        renderer = figure.canvas.get_renderer()
        (ax,) = figure.axes
        page = figure.get_window_extent(renderer)
        assert _inside(ax.title.get_window_extent(renderer), page), ax.title.get_text()
        legend = ax.get_legend().get_window_extent(renderer)
        for artist in [*ax.patches, *ax.lines]:
            if artist.get_label().startswith("_") and artist in ax.lines:
                continue  # the reference lines span the axes; only data is checked
            box = artist.get_window_extent(renderer)
            assert not legend.overlaps(box), artist
        plt.close(figure)


def test_a_long_title_is_wrapped_to_the_figure() -> None:
    figure, ax = plt.subplots(figsize=(4, 3))
    title = plots.fit_title(figure, ax, "word " * 40)
    renderer = figure.canvas.get_renderer()
    assert "\n" in title.get_text()
    assert title.get_window_extent(renderer).width <= figure.get_window_extent(renderer).width
    plt.close(figure)
