"""``python -m matepoint_examples.distributed``: DDP and FSDP2 runs match a single process.

Each distributed test launches two CPU processes with gloo through torchrun (tiny model, three
steps) and compares the final parameters with a single-process run over the full batch, trained
with torch's checkpoint. The gradient all-reduce sums in another order, so the comparison is
``torch.allclose(rtol=1e-5, atol=1e-6)``; the measured gap is in the report and the test output.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import matepoint_compat
from matepoint_examples import distributed

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
        "matepoint_examples.distributed",
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


@requires_gloo
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
@pytest.mark.parametrize("model", ["latent", "gpt"])
def test_two_ranks_match_single_process(
    reference: dict[str, Path], model: str, mode: str, tmp_path: Path
) -> None:
    if mode == "fsdp2" and distributed.fully_shard_fn() is None:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 fully_shard")
    if mode == "fsdp2" and not matepoint_compat.TORCH_2_9_PLUS:
        # torch's own FSDP2 on CPU with gloo, under torch's own checkpoint: 2.4 creates CUDA
        # streams, 2.6 calls Stream.record_event (absent on CPU), 2.7 and 2.8 run but end 1e-2
        # away from the single-process run. Skip can go when 2.9 is the oldest supported release.
        pytest.skip(f"torch {torch.__version__}'s FSDP2 does not train correctly on CPU/gloo")
    report = _torchrun(
        tmp_path,
        "--model",
        model,
        "--mode",
        mode,
        "--backend",
        "gloo",
        "--device",
        "cpu",
        *TINY,
        "--compare-to",
        str(reference[model]),
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
