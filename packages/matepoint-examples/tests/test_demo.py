"""Tests for matepoint_examples.demo: the console script runs on CPU and checks equality."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import matepoint
from matepoint._engine.stats import format_bytes
from matepoint_examples import demo
from matepoint_examples.models import DeepLatentConfig

TINY_ARGS = [
    "--device",
    "cpu",
    "--depth",
    "2",
    "--width",
    "32",
    "--heads",
    "2",
    "--seq",
    "16",
    "--steps",
    "2",
]


def test_main_prints_legend_progress_table_and_one_summary_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.main(TINY_ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    # The legend says what each strategy name means, one line each.
    for name, meaning in demo.DEMO_STRATEGIES.items():
        assert any(line.split()[:1] == [name] and meaning in line for line in lines), name
    assert "no checkpoint" in demo.DEMO_STRATEGIES["none"]
    # Per-step progress ends with every strategy's steps done.
    for name in demo.DEMO_STRATEGIES:
        assert any(line.startswith(name) and "2/2" in line for line in lines), name
    # The output ends with one summary line: memory, timing, gradients.
    assert lines[-1].startswith("Summary: ")
    assert sum(line.startswith("Summary") for line in lines) == 1
    assert "moved to host memory" in lines[-1]
    assert "CPU times say nothing about a GPU's" in lines[-1]
    assert lines[-1].endswith("gradients bitwise equal.")
    # On the CPU nothing is printed that the CPU cannot measure: no step times, and no elapsed
    # time per strategy in the progress (before: "none ... 0:00:07" against "torch ... 0:00:01").
    assert not any("n/a" in line or " ms" in line for line in lines)
    assert not any(re.search(r"\d:\d\d:\d\d", line) for line in lines)


def test_on_a_cpu_it_says_what_a_cpu_shows_and_what_a_gpu_would_save(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert demo.main(TINY_ARGS) == 0
    lines = capsys.readouterr().out.splitlines()
    config = DeepLatentConfig(depth=2, width=32, heads=2, batch=2, tokens=16)
    every_input = dataclasses.replace(matepoint.get_options(), min_offload_bytes=0)
    here = demo.planned_on_gpu(config, every_input)
    on_gpu = demo.planned_on_gpu(demo.default_config(torch.device("cuda")))
    expected = demo.cpu_lines(here, on_gpu)
    assert [line for line in lines if line in expected] == expected
    assert expected[0].startswith(
        "What a CPU shows: gradients identical to torch's checkpoint: yes"
    )
    assert "Memory saved and speed: no, those need a GPU" in expected[0]
    assert f"planned on a GPU: {format_bytes(here.saved)} less held after forward" in lines[-1]
    assert "runs through its test transport" not in "\n".join(lines)


def test_the_planned_gpu_saving_is_the_block_inputs() -> None:
    config = demo.default_config(torch.device("cuda"))
    planned = demo.planned_on_gpu(config)
    block_input = config.batch * config.tokens * config.width * 2  # bf16
    # torch's checkpoint keeps every block's input on the device; matepoint moves them out.
    assert planned.torch_held >= config.depth * block_input
    assert planned.matepoint_held < planned.torch_held / 4
    assert planned.saved == planned.torch_held - planned.matepoint_held


def test_tokens_still_works_as_the_old_name_of_seq(capsys: pytest.CaptureFixture[str]) -> None:
    args = [a if a != "--seq" else "--tokens" for a in TINY_ARGS]
    assert demo.main([*args[:-2], "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "2x16 tokens" in out.splitlines()[0]
    assert "--tokens is now --seq" in out


def _result(name: str, seconds: float, held: int | None, offloaded: int | None) -> demo.DemoResult:
    grads = [torch.ones(2)]
    return demo.DemoResult(name, seconds, None, held, offloaded, grads, grads, [1.0])


def test_summary_line_on_a_gpu_gives_memory_saved_and_step_time_ratio() -> None:
    results = {
        "torch": _result("torch", 0.100, held=4 << 30, offloaded=None),
        "matepoint": _result("matepoint", 0.105, held=1 << 30, offloaded=12 << 30),
    }
    line = demo.summary_line(results, torch.device("cuda"), steps=3)
    assert line == (
        "Summary: matepoint holds 1.00 GiB after forward vs 4.00 GiB with torch's checkpoint "
        "(3.00 GiB saved); step time 1.05x torch's; gradients bitwise equal."
    )
    results["matepoint"].first_grads = [torch.zeros(2)]
    assert demo.summary_line(results, torch.device("cuda"), steps=3).endswith("gradients DIFFER.")


def test_run_strategy_is_reproducible_and_offloads() -> None:
    cfg = DeepLatentConfig(depth=2, width=32, heads=2, batch=1, tokens=8)
    cpu = torch.device("cpu")
    a = demo.run_strategy("torch", cfg, cpu, steps=2)
    b = demo.run_strategy("matepoint", cfg, cpu, steps=2)
    assert demo.bitwise_equal(a, b)
    assert a.peak_bytes is None
    assert a.held_after_forward is None
    assert a.bytes_offloaded is None
    assert b.bytes_offloaded is not None
    assert b.bytes_offloaded > 0
    assert len(a.losses) == 2


def test_default_config_is_small_on_cpu() -> None:
    cfg = demo.default_config(torch.device("cpu"))
    assert cfg.depth * cfg.width * cfg.tokens <= 8 * 256 * 256
