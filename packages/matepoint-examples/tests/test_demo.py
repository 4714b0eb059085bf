"""Tests for matepoint_examples.demo: the console script runs on CPU and checks equality."""

from __future__ import annotations

import pytest
import torch

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
    "--tokens",
    "16",
    "--steps",
    "2",
]


def test_main_returns_zero_and_prints_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(TINY_ARGS) == 0
    out = capsys.readouterr().out
    for name in demo.DEMO_STRATEGIES:
        assert name in out
    assert "bitwise equal" in out


def test_run_strategy_is_reproducible_and_offloads() -> None:
    cfg = DeepLatentConfig(depth=2, width=32, heads=2, batch=1, tokens=8)
    cpu = torch.device("cpu")
    a = demo.run_strategy("torch", cfg, cpu, steps=2)
    b = demo.run_strategy("matepoint", cfg, cpu, steps=2)
    assert demo.bitwise_equal(a, b)
    assert a.peak_bytes is None
    assert a.bytes_offloaded is None
    assert b.bytes_offloaded is not None
    assert b.bytes_offloaded > 0
    assert len(a.losses) == 2


def test_default_config_is_small_on_cpu() -> None:
    cfg = demo.default_config(torch.device("cpu"))
    assert cfg.depth * cfg.width * cfg.tokens <= 8 * 256 * 256
