"""Tests for ``matepoint-plan``: the table, JSON, PNG and budget advice on tiny meta models."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from matepoint_examples import _planning
from matepoint_examples import plan as plan_cli
from matepoint_examples._runtime import format_bytes
from matepoint_examples._workloads import build, get_workload
from matepoint_examples.models import GPTConfig, NanoGPT, no_checkpoint

# Budget plans choose through torch's selective checkpointing (2.5); before it, the CLI's one
# answer to --budget is the options search (``recommendation`` in the report).
BUDGET_PLANS = hasattr(torch.utils.checkpoint, "CheckpointPolicy")

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
    advice = _answer(json.loads(out_json.read_text()))
    assert advice["fits"]
    if BUDGET_PLANS:  # 1 GiB holds this model without any checkpoint
        assert advice["settings"]["stash_bytes"] == 0
    else:  # 1 GiB holds this model with plain checkpointing
        assert advice["link_bytes"] == 0
    # Nothing fits: the exit status says so (it was 0), and so does the share of the batch.
    small = [*TINY_LATENT, "--budget", "0.0005", "--optimizer", "none", "--json", str(out_json)]
    assert plan_cli.main(small) == 1
    report = json.loads(out_json.read_text())
    advice = _answer(report)
    assert not advice["fits"]
    assert not report["fits"]
    assert advice["batch_fraction"] is not None
    assert 0 <= advice["batch_fraction"] < 1
    printed = capsys.readouterr().out
    assert ("does NOT fit" if BUDGET_PLANS else "nothing fits") in printed
    assert "the example batch would fit" in printed or advice["batch_fraction"] == 0


def _answer(report: dict[str, Any]) -> dict[str, Any]:
    """The report's one answer to --budget: the budget plan, or before torch 2.5 the options."""
    if BUDGET_PLANS:
        assert "recommendation" not in report
        return report["budget_plan"]  # type: ignore[no-any-return]
    assert "budget_plan" not in report
    return report["recommendation"]  # type: ignore[no-any-return]


@pytest.mark.skipif(not BUDGET_PLANS, reason="torch's selective checkpointing arrived in 2.5")
def test_a_budget_prints_one_plan_and_no_recommend_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, a budget plan and a recommend line ("step budget ...: fits ... with stash_bytes=")
    # answered the same budget, and could disagree.
    out_json = tmp_path / "plan.json"
    for budget in ("1", "0.0005"):
        args = [*TINY_LATENT, "--budget", budget, "--optimizer", "none", "--json", str(out_json)]
        plan_cli.main(args)
        printed = capsys.readouterr().out
        assert printed.count("matepoint budget plan:") == 1
        assert "step budget" not in printed
        assert "largest batch" not in printed
        report = json.loads(out_json.read_text())
        assert "recommendation" not in report
        assert set(report["budget_plan"]["settings"]) >= {"stash_bytes", "prefetch"}


def _meta_state_bytes(args: list[str], states_per_parameter: int) -> int:
    """The states counted by hand: each per parameter, rounded up to 512 bytes."""
    workload = plan_cli._workload(plan_cli._parser().parse_args(args))
    built = build(workload, no_checkpoint, torch.device("meta"))
    return states_per_parameter * sum(
        -(-p.numel() * p.element_size() // 512) * 512 for p in built.model.parameters()
    )


def test_the_optimizer_states_are_counted_against_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, the budget was the step's alone: AdamW's states (7.25 GiB for llama8) were not
    # counted, and a budget they do not leave room in was said to fit.
    out_json = tmp_path / "plan.json"
    adamw = _meta_state_bytes(TINY_LATENT, 2)
    assert adamw > 1 << 20
    # The smallest peak this step reaches, with nothing else on the device.
    tiny = [*TINY_LATENT, "--optimizer", "none", "--budget", "1B", "--json", str(out_json)]
    assert plan_cli.main(tiny) == 1
    report = json.loads(out_json.read_text())
    advice = _answer(report)
    smallest = advice.get("smallest_budget_bytes", advice.get("minimum_peak_bytes"))
    budget = smallest + adamw // 2
    capsys.readouterr()
    args = [*TINY_LATENT, "--budget", f"{budget}B", "--json", str(out_json)]
    assert plan_cli.main([*args, "--optimizer", "none"]) == 0
    printed = capsys.readouterr().out
    assert "peak with" not in printed
    assert (
        f"budget {format_bytes(budget)}: no optimizer states counted (--optimizer none), "
        f"{format_bytes(budget)} left for the step"
    ) in printed
    assert json.loads(out_json.read_text())["step_budget_bytes"] == budget
    assert plan_cli.main(args) == 1  # --optimizer adamw is the default
    printed = capsys.readouterr().out
    counted = f"AdamW states {format_bytes(adamw)} counted"
    assert counted in printed
    assert f"budget {format_bytes(budget)}: {counted}, " in printed
    assert "peak with AdamW states" in printed
    report = json.loads(out_json.read_text())
    assert report["optimizer"] == {"name": "adamw", "state_bytes": adamw}
    assert report["step_budget_bytes"] == budget - adamw
    assert not report["fits"]
    if "budget_plan" in report:
        assert report["budget_plan"]["budget_bytes"] == budget - adamw
    assert plan_cli.main([*args, "--optimizer", "sgd"]) == 0
    printed = capsys.readouterr().out
    assert f"SGD states {format_bytes(_meta_state_bytes(TINY_LATENT, 1))} counted" in printed


def test_states_that_fill_the_budget_leave_nothing_to_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    adamw = _meta_state_bytes(TINY_LATENT, 2)
    assert plan_cli.main([*TINY_LATENT, "--budget", f"{adamw}B"]) == 1
    assert "nothing left for the step: nothing fits" in capsys.readouterr().out


@pytest.mark.parametrize(
    "budget",
    ["inf", "1e400", "nan", "-5GiB", "0", "0GiB", "0.1B", "lots", "10XB", "1.2.3GB", "GB", ""],
)
def test_a_budget_that_is_no_size_is_a_usage_error(
    budget: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, inf and 1e400 ended in an OverflowError traceback, 0 and -5GiB were planned
    # against ("nothing fits -5.00 GiB"), and the others' error did not show the format.
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LATENT, f"--budget={budget}"])
    assert exit_info.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert f"argument --budget: {budget!r} is not" in error
    assert "--budget takes a size such as 40GiB, 12.5GB, 512MiB, 8e9B (bytes)" in error


def test_a_negative_budget_as_a_word_of_its_own_is_told_the_format(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Before: "argument --budget: expected one argument" (argparse takes it for an option).
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LATENT, "--budget", "-5GiB"])
    assert exit_info.value.code == 2
    error = " ".join(capsys.readouterr().err.split())
    assert "'-5GiB' is not above 0 bytes: --budget takes a size such as 40GiB" in error


def test_a_budget_in_two_words_is_told_the_format(capsys: pytest.CaptureFixture[str]) -> None:
    # Before: "unrecognized arguments: GB", and nothing on how to write it.
    for words in (["--budget", "10", "GB"], ["--budget=10", "GB"]):
        with pytest.raises(SystemExit) as exit_info:
            plan_cli.main([*TINY_LATENT, *words])
        assert exit_info.value.code == 2
        error = " ".join(capsys.readouterr().err.split())
        assert "unrecognized arguments: GB; --budget takes a size such as 40GiB" in error
        assert "in one word: --budget 10GB" in error
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LATENT, "--host-budget", "3", "TiB"])
    assert "in one word: --host-budget 3TiB" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cli.main([*TINY_LATENT, "--frobnicate"])
    assert "unrecognized arguments: --frobnicate\n" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("40GiB", 40 << 30),
        ("12.5GB", 12_500_000_000),
        ("8e9B", 8_000_000_000),
        ("8e9b", 8_000_000_000),
        ("24", 24 << 30),
        ("0.5", 1 << 29),
        ("512 MiB", 512 << 20),
        ("1e3kB", 1_000_000),
        ("2TiB", 2 << 40),
    ],
)
def test_sizes_in_any_unit(text: str, expected: int) -> None:
    assert plan_cli._size("--budget")(text) == expected


def test_a_host_budget_may_be_zero_but_not_negative(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli._size("--host-budget", zero=True)("0") == 0
    with pytest.raises(SystemExit):
        plan_cli.main([*TINY_LATENT, "--host-budget=-1GiB"])
    assert "'-1GiB' is not a size of 0 bytes or more" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--ranks-per-node", "0", "--ranks-per-node takes a whole number of processes, 1 or more"),
        ("--ranks-per-node", "1.5", "--ranks-per-node takes a whole number"),
        ("--bandwidth", "0", "--bandwidth takes a number above 0"),
        ("--peak-tflops", "-1", "--peak-tflops takes a number above 0"),
        ("--stash", "inf", "--stash takes a number of MiB, 0 or more"),
        ("--min-offload", "nan", "--min-offload takes a number of MiB, 0 or more"),
    ],
)
def test_other_bad_numbers_are_usage_errors(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, --ranks-per-node 0 ended in a ValueError traceback from the search.
    with pytest.raises(SystemExit) as exit_info:
        plan_cli.main([*TINY_LATENT, "--budget", "1", f"{flag}={value}"])
    assert exit_info.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_planned_in_is_the_time_all_the_planning_took(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the clock stopped before the budget search, the options search and the largest
    # batch: "planned in 0.2 s" for a 4.6 s command.
    import matepoint

    name = "fastest_under" if BUDGET_PLANS else "recommend"
    search = getattr(matepoint.MemoryPlan, name)

    def slow_search(self: matepoint.MemoryPlan, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return search(self, *args, **kwargs)

    monkeypatch.setattr(matepoint.MemoryPlan, name, slow_search)
    out_json = tmp_path / "plan.json"
    started = time.perf_counter()
    plan_cli.main([*TINY_LATENT, "--budget", "1", "--json", str(out_json)])
    elapsed = time.perf_counter() - started
    seconds = float(re.findall(r"planned in ([0-9.]+) s", capsys.readouterr().out)[-1])
    assert 1.0 <= seconds <= elapsed + 0.05
    assert 1.0 <= json.loads(out_json.read_text())["planning_seconds"] <= elapsed


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
# Compute at 0.1 TFLOP/s: this small stack's recompute then outweighs a policy's host time.
TINY_LLAMA += ["--seq", "2048", "--min-offload", "0", "--peak-tflops", "0.1"]


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
    report = json.loads(out_json.read_text())
    step_budget = (2 << 30) - report["optimizer"]["state_bytes"]  # less AdamW's states
    assert f"matepoint budget plan: {step_budget / 2**30:.2f} GiB device budget, fits" in printed
    budget_plan = report["budget_plan"]
    assert budget_plan["budget_bytes"] == step_budget
    assert budget_plan["peak_bytes"] <= budget_plan["budget_bytes"]
    # Room for the step without any checkpoint, which recomputes nothing and pays no policy.
    assert budget_plan["checkpoint"] is False
    assert "no checkpoint needed" in printed
    assert budget_plan["step_seconds"] < budget_plan["every_block_seconds"]
    assert plan_cli.main([*TINY_LLAMA, "--budget", "1MiB", "--optimizer", "none"]) == 1
    assert "does NOT fit" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plan_cli.main([*TINY_LLAMA, "--budget", "lots"])


@pytest.mark.skipif(
    not hasattr(torch.utils.checkpoint, "CheckpointPolicy"),
    reason="torch's selective checkpointing arrived in 2.5",
)
def test_a_budget_under_the_optimizer_step_fits_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two wide blocks over a short sequence: the parameters, not the activations, make the
    # step's peak.
    small = ["--model", "llama8", "--depth", "2", "--seq", "16"]
    out_json = tmp_path / "plan.json"
    assert plan_cli.main([*small, "--budget", "16GiB", "--json", str(out_json)]) == 0
    report = json.loads(out_json.read_text())
    budget_plan = report["budget_plan"]
    step_bytes = budget_plan["optimizer_step_bytes"]
    assert budget_plan["peak_bytes"] < step_bytes
    # Room for forward and backward beside the states, not for the optimizer step.
    tight = report["optimizer"]["state_bytes"] + budget_plan["peak_bytes"]
    capsys.readouterr()
    assert plan_cli.main([*small, "--budget", f"{tight}B"]) == 1
    printed = capsys.readouterr().out
    assert "does NOT fit" in printed
    assert "the optimizer step alone exceeds the budget" in printed
