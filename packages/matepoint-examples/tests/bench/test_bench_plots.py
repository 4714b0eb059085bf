"""Tests for matepoint_examples.bench._plots: PNG plots from fake rows."""

from __future__ import annotations

from pathlib import Path

from _report_rows import _paired_rows, _rows

from matepoint_examples.bench import _plots as plots


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = _rows()
    for path in (
        plots.plot_step_time_ratio(tmp_path / "ratio.png", _paired_rows()),
        plots.plot_memory_vs_depth(tmp_path / "depth.png", rows),
        *plots.plot_timelines(tmp_path, rows),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "timeline_deep48.png").exists()


def test_plots_without_data(tmp_path: Path) -> None:
    row = {"workload": "cpu-small", "strategy": "none", "status": "ok", "kind": "latent"}
    rows = [{**row, "depth": 8, "step_time_s": 0.1, "held_after_forward_bytes": None}]
    assert plots.plot_step_time_ratio(tmp_path / "a.png", rows).exists()
    assert plots.plot_memory_vs_depth(tmp_path / "b.png", rows).exists()
    assert plots.plot_timelines(tmp_path, rows) == []
