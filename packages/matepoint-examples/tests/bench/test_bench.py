"""Tests for matepoint_examples.bench: the worker's JSON and a tiny end-to-end run on CPU."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from matepoint_examples._workloads import WORKLOADS, build, get_workload
from matepoint_examples.bench import _paired
from matepoint_examples.bench import _report as report
from matepoint_examples.bench import cli as bench
from matepoint_examples.bench._worker import write_partial
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
    # A memcpy through the test transport is no link, and the host RAM is the step's own: a
    # CPU row gives no throughput and no host RAM per offloaded byte (before: 0.0 and 10.09).
    assert result["link_gbps"] is None
    assert result["host_per_offloaded"] is None
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


def _partial_path(cmd: list[str]) -> Path:
    """Return the file the parent told a worker to keep its rows so far in."""
    return Path(cmd[cmd.index("--partial") + 1])


def test_a_worker_timed_out_in_its_compile_step_names_every_compile_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compiles = [f"deep96 / {s}: compile step 190.0 s" for s in ("torch-compile", "mp-compile")]
    warnings = [f"UserWarning: {i}" for i in range(7)]

    def hang(cmd: list[str], **kwargs: Any) -> None:
        assert not _partial_path(cmd).exists()
        stderr = "\n".join([*compiles, *warnings]).encode()
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=stderr)

    monkeypatch.setattr(bench.subprocess, "run", hang)
    result = bench.run_worker_subprocess(["--worker", "paired"], timeout=600)
    assert result["status"] == "error"
    reported = " / ".join([*compiles, *warnings[-6:]])
    assert result["note"] == f"timed out after 600 s; last reported: {reported}"


def test_a_timed_out_paired_worker_hands_over_its_partial_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    common = {"workload": "deep96", "rounds": 6, "warmup": 1}
    rows = [
        {**common, "strategy": "torch", "status": "ok", "ratio": 1.0, "times": [{}] * 4},
        {**common, "strategy": "matepoint", "status": "ok", "ratio": 1.02, "times": [{}] * 4},
        {**common, "strategy": "torchtune", "status": "skipped", "note": "not installed"},
    ]
    stderr = ["deep96 / torch-compile: compile step 190.0 s"]
    stderr += [f"deep96: round {i} of 7" for i in range(1, 6)] + ["UserWarning: x"] * 2

    def killed_after_round_five(cmd: list[str], **kwargs: Any) -> None:
        progress = {"rounds_done": 5, "counted_step": False}
        write_partial(_partial_path(cmd), {"mode": "paired", "rows": rows, "progress": progress})
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr="\n".join(stderr).encode())

    monkeypatch.setattr(bench.subprocess, "run", killed_after_round_five)
    result = bench.run_worker_subprocess(["--worker", "paired"], timeout=585)
    got = {r["strategy"]: r for r in result["rows"]}
    assert [got[s]["status"] for s in got] == ["partial", "partial", "skipped"]
    assert got["matepoint"]["ratio"] == 1.02  # the rounds it finished are kept
    assert got["torchtune"]["note"] == "not installed"
    reported = " / ".join(dict.fromkeys([stderr[0], *stderr[-6:]]))
    assert (
        got["torch"]["note"]
        == got["matepoint"]["note"]
        == (
            "timed out after 585 s after round 5 of 7 (of which 1 warm-up); counted step not run: "
            f"no held-after-forward; last reported: {reported}"
        )
    )


class _Killed(BaseException):
    """Stands for the SIGKILL of a timeout (no ``except Exception`` in the worker catches it)."""


def test_a_paired_run_cut_short_is_flagged_in_every_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real worker, killed after its second round: its rows are reported, never as ok."""
    real_write = _paired.write_partial

    def write_then_die_after_round_two(path: Path, payload: dict[str, Any]) -> None:
        real_write(path, payload)
        if payload["progress"]["rounds_done"] == 2:
            raise _Killed

    real_run = subprocess.run

    def run_in_process(cmd: list[str], **kwargs: Any) -> Any:
        if "--worker" not in cmd:  # the same module serves ``platform``'s own calls
            return real_run(cmd, **kwargs)
        monkeypatch.setattr(_paired, "write_partial", write_then_die_after_round_two)
        with pytest.raises(_Killed):
            bench.main(cmd[3:])  # after ``python -m matepoint_examples.bench``
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], stderr=b"cpu-small: round 2 of 4")

    monkeypatch.setattr(bench.subprocess, "run", run_in_process)
    out = tmp_path / "bench"
    rc = bench.main(
        ["--device", "cpu", "--mode", "paired", "--strategies", "matepoint", "--rounds", "3",
         "--warmup", "1", "--timeout", "600", "--out", str(out), *TINY]
    )  # fmt: skip
    assert rc == 1  # a run cut short did not finish
    paired = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["paired"]}
    assert paired["matepoint"]["status"] == "partial"
    assert paired["matepoint"]["ratios"]["step_s"]["rounds"] == 1
    note = (
        "timed out after 600 s after round 2 of 4 (of which 1 warm-up); counted step not run: "
        "no held-after-forward; last reported: cpu-small: round 2 of 4"
    )
    assert paired["torch"]["note"] == paired["matepoint"]["note"] == note
    md = (out / "results.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| cpu-small | matepoint |"))
    mp = paired["matepoint"]  # its figures over the rounds it finished, flagged in the status
    ratio = report.ratio_cell(mp["ratio"], mp["ratio_q1"], mp["ratio_q3"])
    assert line.split(" | ")[2:5] == ["partial", f"{mp['step_time_s'] * 1e3:.1f}", ratio]
    assert "| ok |" not in md
    assert f"- cpu-small / matepoint: partial: {note}" in md
    assert "partial" in capsys.readouterr().out  # the terminal table says so too


@pytest.mark.slow
def test_end_to_end_subprocesses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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
    # No device memory on a CPU: no plot of it (before, an empty box), and a line says so.
    assert not (out / "memory_vs_depth.png").exists()
    printed = capsys.readouterr().out
    assert "not plotted: memory_vs_depth.png (no device memory)" in printed
    # What was asked for ran; the notice names it.
    assert printed.startswith("No GPU: running --mode all, torch, copies-floor, torchtune on ")


def test_a_cpu_run_says_in_one_line_what_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a GPU the default run is the paired run of torch and matepoint, said once."""
    out = tmp_path / "bench"
    rc = bench.main(["--device", "cpu", "--quick", "--rounds", "1", "--out", str(out), *TINY])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    notice = [line for line in lines if "GPU" in line and "No GPU" in line]
    assert notice == [bench.cpu_notice("paired", ["torch", "matepoint"], ["cpu-small"])]
    assert notice[0] == lines[0]
    assert "not device memory, link speed or GPU step times" in notice[0]
    data = json.loads((out / "results.json").read_text())
    assert [r["strategy"] for r in data["paired"]] == ["torch", "matepoint"]
    assert data["memory"] == []  # before: one process per strategy, every memory cell "-"
    assert data["transfer"] is None  # before: a memcpy reported as a link at "fraction 0.08"
    table = "\n".join(lines)
    assert "/ torch [IQR]" in table
    assert "out / step" in table  # matepoint's bytes moved, which a CPU does count
    for unmeasured in ("fwd GPU / torch", "bwd GPU / torch", "held after fwd"):
        assert unmeasured not in table  # a column of dashes on a CPU
    assert sorted(p.name for p in out.iterdir()) == [
        "results.json",
        "results.md",
        "step_time_ratio.png",
    ]


def test_help_names_the_output_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # argparse would break "bench-results" at its hyphen
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--out OUT output folder, made if missing (default: ./bench-results" in text


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
