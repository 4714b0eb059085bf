"""Fake benchmark rows shared by the report and plot tests."""

from __future__ import annotations

from typing import Any


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
