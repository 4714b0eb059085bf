"""Runnable examples for matepoint: models, the strategy registry, the demo and the planner.

Public: :mod:`matepoint_examples.models`, :mod:`matepoint_examples.strategies`,
:mod:`matepoint_examples.integrations`, and the console scripts ``matepoint-demo``
(:func:`matepoint_examples.demo.main`) and ``matepoint-plan``
(:func:`matepoint_examples.plan.main`). The benchmark harness behind ``matepoint-bench``
(:func:`matepoint_examples.bench.cli.main`) is its own subpackage, :mod:`matepoint_examples.bench`.
"""

from matepoint_examples.models import (
    CheckpointFn,
    DeepLatentConfig,
    DeepLatentStack,
    GPTConfig,
    NanoGPT,
    no_checkpoint,
)
from matepoint_examples.strategies import STRATEGIES, Strategy, get_strategy, strategy_names

__all__ = [
    "STRATEGIES",
    "CheckpointFn",
    "DeepLatentConfig",
    "DeepLatentStack",
    "GPTConfig",
    "NanoGPT",
    "Strategy",
    "get_strategy",
    "no_checkpoint",
    "strategy_names",
]
