"""Tests for matepoint_examples.bench: the worker's JSON and a tiny end-to-end run on CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from matepoint_examples import bench
from matepoint_examples._workloads import WORKLOADS, build, get_workload
from matepoint_examples.models import no_checkpoint

TINY = ["--depth", "2", "--width", "32", "--heads", "2", "--batch", "1", "--tokens", "16"]


def _worker_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert bench.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_workload_registry_matches_design() -> None:
    deep96 = get_workload("deep96")
    shape = (deep96.depth, deep96.width, deep96.batch, deep96.tokens, deep96.dtype)
    assert shape == (96, 1536, 8, 4096, "bf16")
    assert deep96.block_input_bytes() == 96 << 20
    assert get_workload("deep192").depth == 192
    gpt = get_workload("gpt12")
    shape_gpt = (gpt.kind, gpt.depth, gpt.width, gpt.vocab_size, gpt.tokens)
    assert shape_gpt == ("gpt", 12, 768, 65536, 2048)
    nanochat = get_workload("nanochat12")
    shape_nanochat = (nanochat.depth, nanochat.batch, nanochat.tokens, nanochat.dtype)
    assert shape_nanochat == (12, 8, 2048, "bf16")
    assert (nanochat.vocab_size, nanochat.x0_mixing, gpt.x0_mixing) == (65536, True, False)
    assert set(WORKLOADS) >= {
        "deep96", "deep48", "light48", "deep192", "gpt12", "nanochat12", "cpu-small"
    }  # fmt: skip
    with pytest.raises(KeyError):
        get_workload("nope")


@pytest.mark.parametrize("name", ["cpu-small", "gpt12", "nanochat12"])
def test_build_tiny_workloads(name: str) -> None:
    w = get_workload(name).with_overrides(
        depth=1, width=32, heads=2, batch=1, tokens=8, vocab_size=32, head_dim=16
    )
    built = build(w, no_checkpoint, torch.device("cpu"))
    loss = built.loss()
    loss.backward()
    assert loss.ndim == 0
    assert len(built.blocks) == 1


@pytest.mark.parametrize("strategy", ["matepoint", "torchtune"])
def test_worker_train_json(capsys: pytest.CaptureFixture[str], strategy: str) -> None:
    args = [
        "--worker",
        "train",
        "--workload",
        "cpu-small",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    result = _worker_json(capsys, [*args, "--strategy", strategy, *TINY])
    assert result["workload"] == "cpu-small"
    assert result["strategy"] == strategy
    if strategy == "torchtune":
        assert result["status"] == "skipped"
        assert result["note"]
        return
    assert result["status"] == "ok", result
    assert result["depth"] == 2
    assert len(result["step_times_s"]) == 2
    assert result["step_time_s"] > 0
    assert result["held_after_forward_bytes"] is None  # no device memory counter on CPU
    assert result["bytes_offloaded"] > 0
    assert "bytes_fetched" in result["matepoint_stats"]


def test_worker_transfer_json(capsys: pytest.CaptureFixture[str]) -> None:
    result = _worker_json(capsys, ["--worker", "transfer", "--device", "cpu", "--quick"])
    assert result["mode"] == "transfer"
    assert result["status"] == "ok", result
    assert result["raw_d2h_gbps"] > 0
    assert result["matepoint_offload_gbps"] > 0
    # The chain's blocks save their inputs, so every offloaded byte comes back in backward
    # (fetched, or served from the device original while its copy was still deferred).
    stats = result["matepoint_stats"]
    assert stats["bytes_fetched"] + stats["bytes_served_from_stash"] == stats["bytes_offloaded"]


def test_unknown_workload_is_an_argument_error() -> None:
    assert bench.main(["--device", "cpu", "--workloads", "nope", "--out", "unused"]) == 2


def test_worker_paired_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--worker", "paired", "--workload", "cpu-small", "--device", "cpu", "--rounds", "2"]
    args += ["--warmup", "0", "--strategies", "torch,copies-floor,torchtune", *TINY]
    result = _worker_json(capsys, args)
    assert result["mode"] == "paired"
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["torch"]["ratio"] == 1.0
    assert rows["torch"]["depth"] == 2  # the overrides reached the worker
    assert rows["copies-floor"]["status"] == "ok"
    assert len(rows["copies-floor"]["times"]) == 2
    assert rows["torchtune"]["status"] == "skipped"


def test_worker_paired_reports_its_progress_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--worker", "paired", "--workload", "cpu-small", "--device", "cpu", "--rounds", "2"]
    assert bench.main([*args, "--warmup", "1", "--strategies", "torch", *TINY]) == 0
    assert "cpu-small: round 3 of 3" in capsys.readouterr().err


def test_a_timed_out_worker_says_how_far_it_got(monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(cmd: list[str], **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(
            cmd, kwargs["timeout"], stderr=b"deep96 / torch-compile: compile step 190.0 s"
        )

    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench.run_worker_subprocess(["--worker", "paired"], timeout=5)
    assert result["status"] == "error"
    assert result["note"] == (
        "timed out after 5 s; last reported: deep96 / torch-compile: compile step 190.0 s"
    )


def test_end_to_end_subprocesses(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    rc = bench.main(
        ["--device", "cpu", "--mode", "all", "--strategies", "copies-floor,torchtune",
         "--rounds", "2", "--steps", "1", "--warmup", "0", "--out", str(out), "--quick", *TINY]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    paired = {r["strategy"]: r for r in data["paired"]}
    # torch's checkpoint is the reference, so a paired run adds it.
    assert list(paired) == ["torch", "copies-floor", "torchtune"]
    assert paired["torch"]["ratio"] == 1.0
    assert paired["copies-floor"]["ratio_q1"] <= paired["copies-floor"]["ratio"]
    assert paired["copies-floor"]["ratio"] <= paired["copies-floor"]["ratio_q3"]
    memory = {r["strategy"]: r for r in data["memory"]}
    assert set(memory) == {"copies-floor", "torchtune"}  # memory runs only what was asked
    assert memory["copies-floor"]["status"] == "ok", memory
    assert memory["copies-floor"]["depth"] == 2
    assert "ratio_to_torch" not in memory["copies-floor"]  # no per-process ratio any more
    assert memory["torchtune"]["status"] == "skipped"
    assert data["transfer"]["status"] == "ok"
    md = (out / "results.md").read_text()
    assert md.count("| cpu-small | copies-floor | ok |") == 2  # paired and memory tables
    assert "[" in md.split("| cpu-small | copies-floor | ok |")[1].splitlines()[0]  # the IQR
    assert (out / "step_time_ratio.png").stat().st_size > 0
    assert (out / "memory_vs_depth.png").stat().st_size > 0


@pytest.mark.gpu
def test_worker_on_cuda_holds_less_than_torch(capsys: pytest.CaptureFixture[str]) -> None:
    held = {}
    for strategy in ("torch", "matepoint"):
        args = [
            "--worker",
            "train",
            "--workload",
            "deep48",
            "--device",
            "cuda",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--depth",
            "8",
        ]
        result = _worker_json(
            capsys, [*args, "--depth", "8", "--batch", "1", "--strategy", strategy]
        )
        assert result["status"] == "ok", f"{result.get('note')}\n{result.get('traceback')}"
        assert result["timeline"]
        held[strategy] = result["held_after_forward_bytes"]
    assert held["matepoint"] < held["torch"]
