"""Skips and hygiene shared by the three packages' tests.

``gpu`` tests need a CUDA device; ``slow`` tests (compile-heavy, multi-process, soak) run only
with ``--run-slow``, which keeps the default run of ``nox -s tests`` a few minutes on two CPUs.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (compile-heavy, multi-process and soak tests)",
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


# Note [Freeze what outlives a test]
# Tests call gc.collect() often (offload records die with their autograd graphs), and a collection
# scans every tracked object not frozen. Dynamo and inductor leave millions of long-lived objects
# behind the first test that compiles; without freezing them, every later collection scans them
# all, and a file of small tests that ran in a second took minutes after one inductor test.
# Freezing after each test (after the tests' own collections in teardown) keeps collections as
# cheap as the first test's. A frozen object is still freed when its last reference goes; only a
# reference cycle through it that becomes garbage later is never collected, which costs memory,
# not correctness.


@pytest.fixture(autouse=True)
def _freeze_what_outlives_a_test() -> Iterator[None]:
    """Freeze the objects alive after each test; see Note [Freeze what outlives a test]."""
    yield
    if getattr(sys, "last_value", None) is not None:
        # The test failed: pytest keeps its traceback (sys.last_traceback) until the next test
        # runs, and with it the test's frames. Frozen, a cycle through them would outlive that.
        return
    gc.collect()  # so that no garbage cycle is frozen, never to be collected
    gc.freeze()
