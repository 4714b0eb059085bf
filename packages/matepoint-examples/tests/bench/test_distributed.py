"""``python -m matepoint_examples.bench.distributed``: DDP and FSDP2 runs match a single process.

Each distributed test launches two CPU processes with gloo through torchrun (tiny model, three
steps) and compares the final parameters with a single-process run over the full batch, trained
with torch's checkpoint. The gradient all-reduce sums in another order, so the comparison is
``torch.allclose(rtol=1e-5, atol=1e-6)``; the measured gap is in the report and the test output.

``--checkpoint paired`` (torch's and matepoint's checkpoint alternating on one model) is checked
for its report: the ratio, its interquartile range and round count, one process and two.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import matepoint
import matepoint_compat
from matepoint_examples.bench import distributed
from matepoint_examples.strategies import get_strategy

TINY = shlex.split("--depth 3 --width 32 --heads 4 --tokens 16 --batch 4 --vocab-size 64 --steps 3")

requires_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # One thread per rank: two ranks share the runner's cores, and torchrun would set it anyway.
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Single-process runs with torch's checkpoint: the parameters every other run must match."""
    folder = tmp_path_factory.mktemp("reference")
    saved = {}
    for model in ("latent", "gpt"):
        saved[model] = folder / f"{model}.pt"
        args = distributed.parse_args(
            [
                "--model",
                model,
                "--mode",
                "single",
                "--checkpoint",
                "torch",
                "--device",
                "cpu",
                *TINY,
                "--save-params",
                str(saved[model]),
            ]
        )
        distributed.run(args)
    return saved


def _aborted_at_exit(stderr: str) -> bool:
    return "terminate called without an active exception" in stderr


def _torchrun(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "report.json"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "matepoint_examples.bench.distributed",
        *args,
        "--out",
        str(out),
    ]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and _aborted_at_exit(done.stderr) and out.exists():
        # A gloo rank has been seen, rarely and only on a loaded machine, to abort in a C++
        # thread destructor at interpreter exit after finishing its work. One retry tells that
        # teardown flake apart from a real failure; a second abort fails the test.
        out.unlink()
        done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return report


@pytest.mark.parametrize("model", ["latent", "gpt"])
def test_single_process_matepoint_matches_torch_bitwise(
    reference: dict[str, Path], model: str, tmp_path: Path
) -> None:
    args = distributed.parse_args(
        [
            "--model",
            model,
            "--mode",
            "single",
            "--device",
            "cpu",
            *TINY,
            "--compare-to",
            str(reference[model]),
            "--out",
            str(tmp_path / "r.json"),
        ]
    )
    report = distributed.run(args)
    assert report is not None
    assert report["comparison"]["bitwise_equal"], report["comparison"]
    assert report["ranks"][0]["matepoint_stats"]["offloads"] >= 9  # 3 blocks x 3 steps
    assert json.loads((tmp_path / "r.json").read_text())["losses"] == report["losses"]


def _skip_unless_cpu_mode_trains(mode: str) -> None:
    """Skip where this torch's FSDP2 is missing or does not train correctly on CPU with gloo."""
    if mode == "fsdp2" and distributed.fully_shard_fn() is None:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 fully_shard")
    if mode == "fsdp2" and not matepoint_compat.TORCH_2_9_PLUS:
        # torch's own FSDP2 on CPU with gloo, under torch's own checkpoint: 2.4 creates CUDA
        # streams, 2.6 calls Stream.record_event (absent on CPU), 2.7 and 2.8 run but end 1e-2
        # away from the single-process run. Skip can go when 2.9 is the oldest supported release.
        pytest.skip(f"torch {torch.__version__}'s FSDP2 does not train correctly on CPU/gloo")


def _two_cpu_ranks(tmp_path: Path, mode: str, *args: str) -> dict[str, Any]:
    """Run ``mode`` on two CPU ranks over gloo (skipped where this torch cannot train it)."""
    _skip_unless_cpu_mode_trains(mode)
    return _torchrun(tmp_path, "--mode", mode, "--backend", "gloo", "--device", "cpu", *args)


@pytest.mark.slow
@requires_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("model", ["latent", "gpt"])
def test_two_ranks_match_single_process(
    reference: dict[str, Path], model: str, mode: str, tmp_path: Path
) -> None:
    report = _two_cpu_ranks(
        tmp_path, mode, "--model", model, *TINY, "--compare-to", str(reference[model])
    )
    comparison = report["comparison"]
    print(f"{model}/{mode}: max |param diff| vs single = {comparison['max_abs_diff']:.3g}")
    assert report["world_size"] == 2
    assert comparison["allclose"], comparison
    assert [rank["rank"] for rank in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert rank["matepoint_stats"]["offloads"] >= 9, rank["matepoint_stats"]
        assert rank["host_rss_bytes"] is None or rank["host_rss_bytes"] > 0
        assert len(rank["step_seconds"]) == 3


PAIRED_ROUNDS = ("--warmup", "2", "--rounds", "4")


def _check_paired(report: dict[str, Any], world: int) -> None:
    """A paired report: the ratio, its IQR and round count, and every step accounted for."""
    paired = report["paired"]
    ratio = paired["ratio"]
    assert report["checkpoint"] == "paired"
    assert ratio["of"] == "matepoint/torch"
    assert ratio["rounds"] == paired["rounds"] == 4
    assert 0 < ratio["median"] < math.inf, ratio
    assert 0 < ratio["q1"] <= ratio["median"] <= ratio["q3"] < math.inf, ratio
    assert ratio["iqr"] == pytest.approx(ratio["q3"] - ratio["q1"])
    assert len(paired["per_round_ratios"]) == 4
    assert set(paired["median_step_seconds"]) == {"torch", "matepoint"}
    assert all(0 < t < math.inf for t in paired["median_step_seconds"].values())
    schedule = paired["step_strategy"]
    assert schedule == ["torch", "matepoint"] + ["torch", "matepoint", "matepoint", "torch"] * 2
    assert [row["first"] for row in paired["round_seconds"]] == ["torch", "matepoint"] * 2
    assert len(report["losses"]) == len(schedule)
    assert all(math.isfinite(loss) for loss in report["losses"])
    assert report["world_size"] == world
    for rank in report["ranks"]:
        assert len(rank["step_seconds"]) == len(schedule)
        # 3 blocks x 5 matepoint steps; torch's steps do not go through matepoint.
        assert rank["matepoint_stats"]["offloads"] >= 15, rank["matepoint_stats"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["latent", "gpt"])
def test_paired_single_process(
    model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "paired.json"
    argv = ["--model", model, "--mode", "single", "--device", "cpu", "--checkpoint", "paired"]
    assert distributed.main([*argv, *TINY, *PAIRED_ROUNDS, "--out", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    _check_paired(report, world=1)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("paired ")]
    assert len(lines) == 1, lines
    assert "IQR" in lines[0]
    assert "4 rounds" in lines[0]


def _other(name: str) -> str:
    return "matepoint" if name == "torch" else "torch"


@pytest.mark.slow
@requires_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_paired_two_ranks(mode: str, tmp_path: Path) -> None:
    report = _two_cpu_ranks(
        tmp_path, mode, "--model", "gpt", "--checkpoint", "paired", *TINY, *PAIRED_ROUNDS
    )
    _check_paired(report, world=2)
    # Each step's time is the largest over the ranks.
    steps = list(zip(*(rank["step_seconds"] for rank in report["ranks"]), strict=True))
    timed = [max(times) for times in steps[2:]]
    rounds = report["paired"]["round_seconds"]
    assert [t for row in rounds for t in (row[row["first"]], row[_other(row["first"])])] == timed


@pytest.mark.parametrize("model", ["latent", "gpt"])
def test_paired_checkpoints_give_identical_gradients(model: str) -> None:
    """The switch really switches, and both checkpoints give the same gradients, bitwise."""
    args = distributed.parse_args(
        ["--model", model, "--mode", "single", "--device", "cpu", "--checkpoint", "paired", *TINY]
    )
    module, block_type = distributed._build_model(args)
    switch = distributed._checkpoint_blocks(module, block_type, "paired")
    assert switch is not None
    inputs, target = distributed._global_batch(args, torch.Generator().manual_seed(1))
    grads = {}
    offloads = {}
    with get_strategy("matepoint").session(torch.device("cpu")):
        for name in distributed.PAIRED:
            switch.current = name
            matepoint.reset_stats()
            distributed._loss(module, args, inputs, target).backward()
            offloads[name] = matepoint.stats().offloads
            grads[name] = {
                n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None
            }
            module.zero_grad(set_to_none=True)
    assert offloads["torch"] == 0
    assert offloads["matepoint"] >= 3  # one block input per block at least
    assert switch.calls == {"torch": 3, "matepoint": 3}
    assert grads["torch"]
    assert grads["torch"].keys() == grads["matepoint"].keys()
    for name, grad in grads["torch"].items():
        assert torch.equal(grad, grads["matepoint"][name]), name
    with pytest.raises(ValueError, match="unknown checkpoint"):
        switch.current = "none"


def test_paired_summary_takes_the_slowest_rank_per_step() -> None:
    schedule = ["torch", "matepoint", "torch", "matepoint", "matepoint", "torch"]
    rank0 = [9.0, 9.0, 1.0, 2.0, 3.0, 2.0]
    rank1 = [9.0, 9.0, 2.0, 1.0, 1.0, 1.0]
    paired = distributed.paired_summary(schedule, [rank0, rank1], warmup=2)
    assert paired["round_seconds"] == [
        {"first": "torch", "torch": 2.0, "matepoint": 2.0},
        {"first": "matepoint", "matepoint": 3.0, "torch": 2.0},
    ]
    assert paired["per_round_ratios"] == [1.0, 1.5]
    assert paired["ratio"]["median"] == pytest.approx(1.25)
    assert paired["ratio"]["rounds"] == 2
    assert paired["median_step_seconds"] == {"torch": 2.0, "matepoint": 2.5}
    with pytest.raises(ValueError, match="whole rounds"):
        distributed.paired_summary(schedule[:5], [rank0[:5]], warmup=2)
    with pytest.raises(ValueError, match="round 0 ran"):
        distributed.paired_summary(["torch", "torch"], [[1.0, 1.0]], warmup=0)


def test_paired_options() -> None:
    args = distributed.parse_args(["--checkpoint", "paired"])
    assert (args.warmup, args.rounds, args.steps) == (2, 10, 3)
    with pytest.raises(SystemExit):
        distributed.parse_args(["--checkpoint", "paired", "--warmup", "-1"])
    with pytest.raises(SystemExit):
        distributed.parse_args(["--checkpoint", "paired", "--rounds", "0"])


def test_distributed_modes_need_torchrun() -> None:
    with pytest.raises(SystemExit, match="torchrun"):
        distributed.run(distributed.parse_args(["--mode", "ddp", "--device", "cpu"]))


def test_batch_must_split_evenly() -> None:
    args = distributed.parse_args(["--mode", "single", "--device", "cpu", "--batch", "3"])
    assert distributed.run(args) is not None  # one rank: any batch splits


def test_compare_params_reports_the_gap() -> None:
    want = {"w": torch.tensor([1.0, 2.0])}
    got = {"w": torch.tensor([1.0, 2.0 + 1e-3])}
    result = distributed.compare_params(got, want, rtol=1e-5, atol=1e-6)
    assert not result["allclose"]
    assert result["worst_parameter"] == "w"
    assert result["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    with pytest.raises(ValueError, match="names differ"):
        distributed.compare_params({"v": want["w"]}, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_gpus_nccl_match_single_gpu(tmp_path: Path, mode: str) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    if mode == "fsdp2" and distributed.fully_shard_fn() is None:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 fully_shard")
    saved = tmp_path / "single.pt"
    reference = distributed.parse_args(
        [
            "--mode",
            "single",
            "--checkpoint",
            "torch",
            "--device",
            "cuda",
            *TINY,
            "--save-params",
            str(saved),
        ]
    )
    distributed.run(reference)
    report = _torchrun(
        tmp_path,
        "--mode",
        mode,
        "--backend",
        "nccl",
        "--device",
        "cuda",
        *TINY,
        "--compare-to",
        str(saved),
    )
    # TF32 and reduction order differ between one GPU and two: a looser bound than on the CPU.
    assert report["comparison"]["max_abs_diff"] < 1e-4, report["comparison"]
    for rank in report["ranks"]:
        assert rank["matepoint_stats"]["offloads"] >= 0
        assert rank["device"] == f"cuda:{rank['rank']}"
