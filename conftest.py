"""Skips shared by the three packages' tests.

``gpu`` tests need a CUDA device; ``slow`` tests run only with ``--run-slow``.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (long soak tests)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # Warnings torch's own code raises on the installed release (pytest.ini turns warnings into
    # errors); matepoint_compat lists them per release, behind its version gates.
    from matepoint_compat import TORCH_WARNING_FILTERS

    for entry in TORCH_WARNING_FILTERS:
        config.addinivalue_line("filterwarnings", entry)


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = bool(config.getoption("--run-slow"))
    devices: int | None = None
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow to run it")
    for item in items:
        if not run_slow and item.get_closest_marker("slow") is not None:
            item.add_marker(skip_slow)
        if item.get_closest_marker("gpu") is not None:
            if devices is None:
                devices = _cuda_devices()
            if devices < 1:
                item.add_marker(pytest.mark.skip(reason="gpu: needs a CUDA device, found none"))
