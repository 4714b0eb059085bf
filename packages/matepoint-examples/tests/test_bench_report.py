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
        for strategy, held in (("torch", 4.5e9), ("matepoint", 0.1e9)):
            rows.append(
                {
                    "workload": workload, "strategy": strategy, "status": "ok", "kind": "latent",
                    "depth": depth, "step_time_s": depth / 48,
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


def _paired_rows() -> list[dict[str, Any]]:
    def ratios(median: float) -> dict[str, Any]:
        return {"median": median, "q1": median - 0.01, "q3": median + 0.02, "rounds": 15}

    rows: list[dict[str, Any]] = []
    for workload in ("nanochat12", "deep96"):
        for strategy, ratio in (("torch", 1.0), ("copies-floor", 1.035), ("matepoint", 1.068)):
            rows.append(
                {
                    "workload": workload, "strategy": strategy, "status": "ok",
                    "step_time_s": 0.1 * ratio, "ratio": ratio, "ratio_q1": ratio - 0.01,
                    "ratio_q3": ratio + 0.02,
                    "ratios": {m: ratios(ratio) for m in ("step_s", "forward_host_s")},
                    "stats": {"bytes_out": 3 << 20, "bytes_in": 3 << 20}
                    if strategy == "copies-floor" else None,
                }
            )  # fmt: skip
    rows.append({"workload": "deep96", "strategy": "none", "status": "oom", "note": "CUDA OOM"})
    return rows


def test_ratio_cell() -> None:
    assert report.ratio_cell(1.0683, 1.0601, 1.0722) == "1.068 [1.060-1.072]"
    assert report.ratio_cell(1.5) == "1.500"
    assert report.ratio_cell(None) == "-"


def test_add_host_baselines() -> None:
    rows = _rows()
    report.add_host_baselines(rows)
    mp = next(r for r in rows if r["strategy"] == "matepoint")
    assert abs(mp["host_per_offloaded"] - 4.6 / 4.5) < 1e-9
    assert mp["host_extra_vs_torch_bytes"] == 4.6e9
    assert not any("ratio_to_torch" in r for r in rows)


def test_markdown_and_json(tmp_path: Path) -> None:
    rows = _rows()
    report.add_host_baselines(rows)
    transfer = {
        "status": "ok", "raw_d2h_gbps": 55.0, "raw_h2d_gbps": 56.0, "matepoint_offload_gbps": 52.0,
        "matepoint_fetch_gbps": 51.0, "offload_fraction": 52 / 55, "fetch_fraction": 51 / 56,
    }  # fmt: skip
    paired = _paired_rows()
    md = report.write_markdown(
        tmp_path / "r.md", paired, rows, transfer, header="hello"
    ).read_text()
    assert md.startswith("hello")
    assert "| nanochat12 | matepoint | ok | 106.8 | 1.068 [1.058-1.088] | 1.068 |" in md
    assert "| nanochat12 | copies-floor | ok |" in md
    assert "3.00 MiB" in md
    assert "| deep96 | matepoint | ok | 190.73 MiB |" in md
    assert "torchtune: skipped: not installed" in md
    assert "deep96 / none: oom: CUDA OOM" in md
    assert "device -> host" in md
    for columns, prefix in (
        (report.PAIRED_COLUMNS, "| nanochat"),
        (report.MEMORY_COLUMNS, "| deep48"),
    ):
        lines = [line for line in md.splitlines() if line.startswith(prefix)]
        assert lines
        assert all(line.count("|") == len(columns) + 1 for line in lines)
    data = json.loads(report.write_json(tmp_path / "r.json", {"memory": rows}).read_text())
    assert len(data["memory"]) == len(rows)


def test_rich_tables_render() -> None:
    console = Console(width=200, record=True)
    console.print(report.rich_paired_table(_paired_rows()))
    console.print(report.rich_memory_table(_rows()))
    text = console.export_text()
    assert "1.068 [1.058-1.088]" in text
    assert "190.73 MiB" in text


def test_plots_write_pngs(tmp_path: Path) -> None:
    rows = _rows()
    for path in (
        report.plot_step_time_ratio(tmp_path / "ratio.png", _paired_rows()),
        report.plot_memory_vs_depth(tmp_path / "depth.png", rows),
        *report.plot_timelines(tmp_path, rows),
    ):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "timeline_deep48.png").exists()


def test_plots_without_data(tmp_path: Path) -> None:
    row = {"workload": "cpu-small", "strategy": "none", "status": "ok", "kind": "latent"}
    rows = [{**row, "depth": 8, "step_time_s": 0.1, "held_after_forward_bytes": None}]
    assert report.plot_step_time_ratio(tmp_path / "a.png", rows).exists()
    assert report.plot_memory_vs_depth(tmp_path / "b.png", rows).exists()
    assert report.plot_timelines(tmp_path, rows) == []
