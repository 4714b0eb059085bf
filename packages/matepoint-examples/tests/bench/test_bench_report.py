"""Tests for matepoint_examples.bench._report: tables, markdown and JSON from fake rows."""

from __future__ import annotations

import json
from pathlib import Path

from _report_rows import _paired_rows, _rows
from rich.console import Console

from matepoint_examples.bench import _report as report


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
