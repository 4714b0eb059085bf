"""Tests for ``matepoint-plan``: the table, JSON, PNG and budget advice on tiny meta models."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from matepoint_examples import _planning
from matepoint_examples import plan as plan_cli
from matepoint_examples._workloads import get_workload
from matepoint_examples.models import GPTConfig, NanoGPT

TINY_LATENT = ["--model", "cpu-small", "--depth", "4", "--width", "64", "--heads", "2"]
TINY_LATENT += ["--batch", "2", "--seq", "512", "--min-offload", "0"]


def test_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "plan.json", tmp_path / "plan.png"
    assert plan_cli.main([*TINY_LATENT, "--json", str(out_json), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    for label in ("peak device memory", "held after forward", "pinned host RAM", "estimates"):
        assert label in printed
    report = json.loads(out_json.read_text())
    assert report["model"]["depth"] == 4
    strategies = report["plan"]["strategies"]
    assert set(strategies) == {"none", "torch", "matepoint"}
    block_input = 2 * 512 * 64 * 4  # batch x tokens x width, fp32
    assert strategies["matepoint"]["bytes_to_host"] == 4 * block_input
    assert strategies["matepoint"]["pinned_bytes"] == 4 * block_input
    assert strategies["torch"]["bytes_to_host"] == 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_budget_that_fits_and_one_that_does_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "plan.json"
    assert plan_cli.main([*TINY_LATENT, "--budget", "1", "--json", str(out_json)]) == 0
    advice = json.loads(out_json.read_text())["recommendation"]
    assert advice["fits"]
    assert advice["link_bytes"] == 0  # 1 GiB holds this model with plain checkpointing
    assert plan_cli.main([*TINY_LATENT, "--budget", "0.0005", "--json", str(out_json)]) == 0
    advice = json.loads(out_json.read_text())["recommendation"]
    assert not advice["fits"]
    assert advice["options"] is None
    assert 0 <= advice["largest_batch"] < 2
    assert "nothing fits" in capsys.readouterr().out


def test_largest_batch_is_the_largest_that_fits() -> None:
    import matepoint

    workload = get_workload("cpu-small").with_overrides(depth=4, width=64, batch=8, tokens=256)
    frugal = matepoint.OffloadSettings(min_offload_bytes=1, prefetch=0)
    peaks = {
        batch: _planning.plan_workload(
            workload.with_overrides(batch=batch), frugal, strategies=("matepoint",)
        )["matepoint"].peak_bytes
        for batch in (3, 4)
    }
    budget = (peaks[3] + peaks[4]) // 2
    assert _planning.largest_batch(workload, budget, frugal) == 3


def test_unknown_model_is_an_argument_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["--model", "nope"]) == 2
    assert "unknown workload" in capsys.readouterr().out


def test_seven_billion_gpt_two_blocks_plans_in_seconds(tmp_path: Path) -> None:
    # nanochat's GPT at width 4096 has 7.0B parameters at depth 32; two blocks here.
    args = ["--model", "gpt12", "--depth", "2", "--width", "4096", "--batch", "1"]
    out_json = tmp_path / "plan.json"
    started = time.perf_counter()
    assert plan_cli.main([*args, "--json", str(out_json)]) == 0
    assert time.perf_counter() - started < 30
    matepoint_plan = json.loads(out_json.read_text())["plan"]["strategies"]["matepoint"]
    assert matepoint_plan["bytes_to_host"] == 2 * 2048 * 4096 * 2  # two block inputs, bf16


def test_a_changed_gpt_is_described_and_reported_as_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, the line said "gpt12: nanochat-style GPT depth 12 ..." and the JSON "heads": 6
    # whatever --depth and --width planned.
    out_json = tmp_path / "plan.json"
    args = ["--model", "gpt12", "--depth", "3", "--width", "256", "--head-dim", "64"]
    args += ["--batch", "1", "--seq", "64", "--vocab", "512", "--json", str(out_json)]
    assert plan_cli.main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("gpt12 with depth 3 (not 12), width 256 (not 768), heads 4 (not 6),")
    assert "nanochat-style GPT, depth 3, width 256, 4 heads of 64, batch 1, seq 64" in first
    assert "depth 12" not in first
    config = GPTConfig(depth=3, width=256, head_dim=64, seq_len=64, vocab_size=512)
    with torch.device("meta"):
        parameters = sum(p.numel() for p in NanoGPT(config).parameters())
    assert f"{parameters / 1e9:.2f} B parameters" in first
    model = json.loads(out_json.read_text())["model"]
    assert (model["depth"], model["width"], model["heads"], model["head_dim"]) == (3, 256, 4, 64)
    assert model["parameters"] == parameters
    assert model["description"].startswith("nanochat-style GPT, depth 3, width 256, 4 heads")


def test_a_gpt_takes_its_head_dim_from_heads_and_rejects_a_mismatch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gpt = get_workload("gpt12")
    assert gpt.with_overrides(width=512, heads=8).head_dim == 64
    assert gpt.with_overrides(width=512).heads == 4
    with pytest.raises(ValueError, match=r"heads x head_dim must equal its width: 8 x 32 != 512"):
        gpt.with_overrides(width=512, heads=8, head_dim=32)
    assert plan_cli.main(["--model", "cpu-small", "--width", "250"]) == 2
    assert "heads (4) must divide width (250)" in capsys.readouterr().out


def test_help_gives_the_shape_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        plan_cli.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps to the terminal
    for flag, value in (("depth", 12), ("width", 768), ("batch", 8), ("seq", 2048)):
        assert re.search(rf"--{flag} \S+ [^-]*\(default: the model's; gpt12: {value}\)", text), flag
    assert "deep96 deep latent stack, 96 blocks, width 1536" in text


TINY_LLAMA = ["--model", "llama8", "--depth", "2", "--width", "512", "--heads", "4"]
# Compute at 1 TFLOP/s: this small stack's recompute then outweighs a policy's host time.
TINY_LLAMA += ["--seq", "2048", "--min-offload", "0", "--peak-tflops", "1"]


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "CheckpointPolicy"),
    reason="torch's selective checkpointing arrived in 2.5",
)
def test_budget_in_units_shows_the_fastest_step_within_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "plan.json"
    assert plan_cli.main([*TINY_LLAMA, "--budget", "2GiB", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    assert "matepoint budget plan: 2.00 GiB device budget, fits" in printed
    budget_plan = json.loads(out_json.read_text())["budget_plan"]
    assert budget_plan["budget_bytes"] == 2 << 30
    assert budget_plan["peak_bytes"] <= budget_plan["budget_bytes"]
    assert "keep" in budget_plan["decisions"].values()
    assert budget_plan["step_seconds"] < budget_plan["every_block_seconds"]
    assert plan_cli.main([*TINY_LLAMA, "--budget", "1MiB"]) == 0
    assert "does NOT fit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main([*TINY_LLAMA, "--budget", "lots"])
