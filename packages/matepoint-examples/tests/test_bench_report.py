"""Tests for matepoint_examples._bench_report: tables, markdown, JSON and plots from fake rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from matepoint_examples import _bench_report as report


def _rows() -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for workload, depth in (("deep48", 48), ("deep96", 96)):
        for strategy, time_s, held in (("torch", 1.0, 4.5e9), ("matepoint", 1.02, 0.1e9)):
            rows.append(
                {
                    "workload": workload, "strategy": strategy, "status": "ok", "kind": "latent",
                    "depth": depth, "step_time_s": time_s * depth / 48,
                    "held_after_forward_bytes": held * depth / 48, "peak_bytes": 20e9,
                    "host_rss_delta_bytes": 4.6e9 if strategy == "matepoint" else 0,
                    "bytes_offloaded": 4.5e9 if strategy == "matepoint" else None,
                    "link_gbps": 9.0 if strategy == "matepoint" else None,
                    "timeline": [[0.0, 1e9, "start"], [5.0, 3e9, "fwd 0"], [9.0, 1e9, "bwd 0"]],
                }
            )  # fmt: skip
    skipped = {"workload": "deep96", "strategy": "torchtune", "status": "skipped"}
    rows.append({**skipped, "note": "not installed"})
    return rows


def test_add_ratios() -> None:
    rows = _rows()
    report.add_ratios(rows)
    by = {(r["workload"], r["strategy"]): r["ratio_to_torch"] for r in rows}
    assert by[("deep48", "torch")] == 1.0
    assert abs(by[("deep96", "matepoint")] - 1.02) < 1e-9
    assert by[("deep96", "torchtune")] is None
    mp = next(r for r in rows if r["strategy"] == "matepoint")
    assert abs(mp["host_per_offloaded"] - 4.6 / 4.5) < 1e-9


def test_markdown_and_json(tmp_path: Path) -> None:
    rows = _rows()
    report.add_ratios(rows)
    transfer = {
        "status": "ok", "raw_d2h_gbps": 55.0, "raw_h2d_gbps": 56.0, "matepoint_offload_gbps": 52.0,
        "matepoint_fetch_gbps": 51.0, "offload_fraction": 52 / 55, "fetch_fraction": 51 / 56,
    }  # fmt: skip
    md = report.write_markdown(tmp_path / "r.md", rows, transfer, header="hello").read_text()
    assert md.startswith("hello")
    assert "| deep96 | matepoint | ok |" in md
    assert "torchtune: skipped: not installed" in md
    assert "device -> host" in md
    table_lines = [line for line in md.splitlines() if line.startswith("| deep")]
    assert all(line.count("|") == len(report.COLUMNS) + 1 for line in table_lines)
    data = json.loads(report.write_json(tmp_path / "r.json", {"train": rows}).read_text())
    assert len(data["train"]) == len(rows)


def test_rich_table_renders() -> None:
    rows = _rows()
    report.add_ratios(rows)
    console = Console(width=200, record=True)
    console.print(report.rich_table(rows))
    assert "matepoint" in console.export_text()


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = _rows()
    report.add_ratios(rows)
    for path in (
        report.plot_step_time_ratio(tmp_path / "ratio.png", rows),
        report.plot_memory_vs_depth(tmp_path / "depth.png", rows),
        *report.plot_timelines(tmp_path, rows),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "timeline_deep48.png").exists()


def test_plots_without_data(tmp_path: Path) -> None:
    row = {"workload": "cpu-small", "strategy": "none", "status": "ok", "kind": "latent"}
    rows = [{**row, "depth": 8, "step_time_s": 0.1, "held_after_forward_bytes": None}]
    report.add_ratios(rows)
    assert report.plot_step_time_ratio(tmp_path / "a.png", rows).exists()
    assert report.plot_memory_vs_depth(tmp_path / "b.png", rows).exists()
    assert report.plot_timelines(tmp_path, rows) == []
