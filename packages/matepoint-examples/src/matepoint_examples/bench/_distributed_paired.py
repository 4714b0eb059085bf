"""``--checkpoint paired`` of :mod:`.distributed`: the switch, the schedule, the summary.

Torch's and matepoint's checkpoint alternate step by step on one model, so the ratio of their
step times is measured within one run, where separate runs differ by up to 10% on a GPU host.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch.utils.checkpoint

from matepoint.integrations import matepoint_checkpoint_fn
from matepoint_examples.bench._paired import quartiles, round_order

__all__ = ["PAIRED", "CheckpointSwitch", "paired_line", "paired_summary", "step_schedule"]

PAIRED = ("torch", "matepoint")
"""What ``--checkpoint paired`` alternates; the first is the reference of the ratio."""


class CheckpointSwitch:
    """A checkpoint function that runs torch's or matepoint's, whichever is current at call time.

    ``--checkpoint paired`` wraps every block in torch's ``CheckpointWrapper`` with this as its
    ``checkpoint_fn``; setting :attr:`current` changes how the blocks are checkpointed from the
    next call on. The two functions are exactly what ``--checkpoint torch`` and ``--checkpoint
    matepoint`` install: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and
    :func:`matepoint.integrations.matepoint_checkpoint_fn` (``matepoint.checkpoint``,
    non-reentrant).

    Args:
        current: The checkpoint to start with, one of :data:`PAIRED`.
    """

    def __init__(self, current: str = PAIRED[0]) -> None:
        self.functions: dict[str, Callable[..., Any]] = {
            "torch": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
            "matepoint": matepoint_checkpoint_fn(),
        }
        self.current = current
        self.calls = dict.fromkeys(self.functions, 0)

    @property
    def current(self) -> str:
        """The checkpoint the next call runs: ``"torch"`` or ``"matepoint"``."""
        return self._current

    @current.setter
    def current(self, name: str) -> None:
        if name not in self.functions:
            raise ValueError(
                f"unknown checkpoint {name!r}; expected one of {sorted(self.functions)}"
            )
        self._current = name

    def __call__(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` under the current checkpoint."""
        self.calls[self._current] += 1
        return self.functions[self._current](function, *args, **kwargs)


def step_schedule(args: argparse.Namespace) -> list[str]:
    """The checkpoint each step runs: ``--steps`` times the one asked, or paired warm-up + rounds.

    Paired: the warm-up alternates the two checkpoints; round ``r`` runs each once, in
    :func:`matepoint_examples.bench._paired.round_order` (rotated by one every round), so neither
    always runs first or always follows the other.
    """
    if args.checkpoint != "paired":
        return [args.checkpoint] * args.steps
    warmup = [PAIRED[i % len(PAIRED)] for i in range(args.warmup)]
    return warmup + [name for r in range(args.rounds) for name in round_order(PAIRED, r)]


def paired_summary(
    strategies: Sequence[str], seconds_per_rank: Sequence[Sequence[float]], warmup: int
) -> dict[str, Any]:
    """Summarize a paired run: per checkpoint the median step, and matepoint's ratio to torch.

    A step's time is the largest over ranks (see ``distributed._train``). The steps after the
    warm-up form rounds of one step per checkpoint in :data:`PAIRED`; the ratio is the median of
    the rounds' ``matepoint / torch``, with the first and third quartiles
    (``statistics.quantiles``, inclusive, as ``matepoint-bench`` reports them) and their
    difference ``iqr``.

    Args:
        strategies: The checkpoint of every step, warm-up included.
        seconds_per_rank: Per rank, every step's time in seconds, in the same order.
        warmup: How many steps at the start are warm-up (not timed into the summary).

    Returns:
        A JSON-ready dict: ``median_step_seconds``, ``ratio`` (``median``, ``q1``, ``q3``,
        ``iqr``, ``rounds``), ``per_round_ratios``, ``round_seconds`` and the schedule.

    Raises:
        ValueError: If a round is incomplete or runs a checkpoint twice, or no round was timed.
    """
    reference, measured = PAIRED
    seconds = [max(rank[i] for rank in seconds_per_rank) for i in range(len(strategies))]
    timed = list(zip(strategies[warmup:], seconds[warmup:], strict=True))
    if not timed or len(timed) % len(PAIRED):
        raise ValueError(f"{len(timed)} timed steps do not make whole rounds of {len(PAIRED)}")
    rounds: list[dict[str, Any]] = []
    for start in range(0, len(timed), len(PAIRED)):
        steps = timed[start : start + len(PAIRED)]
        if sorted(name for name, _ in steps) != sorted(PAIRED):
            raise ValueError(f"round {start // len(PAIRED)} ran {[n for n, _ in steps]}")
        rounds.append({"first": steps[0][0], **dict(steps)})
    ratios = [row[measured] / row[reference] for row in rounds]
    q1, median, q3 = quartiles(ratios)
    return {
        "strategies": list(PAIRED),
        "reference": reference,
        "warmup_steps": warmup,
        "rounds": len(rounds),
        "timing": (
            "forward + backward + optimizer step, between device synchronizes; under "
            "torchrun every rank starts the step after a barrier and the step's time is the "
            "largest over ranks"
        ),
        "step_strategy": list(strategies),
        "median_step_seconds": {
            name: statistics.median(row[name] for row in rounds) for name in PAIRED
        },
        "ratio": {
            "of": f"{measured}/{reference}",
            "median": median,
            "q1": q1,
            "q3": q3,
            "iqr": q3 - q1,
            "rounds": len(ratios),
        },
        "per_round_ratios": ratios,
        "round_seconds": rounds,
    }


def paired_line(paired: dict[str, Any]) -> str:
    """One line for a paired run: the ratio with its interquartile range, and the medians."""
    ratio = paired["ratio"]
    medians = ", ".join(
        f"{name} {seconds * 1e3:.2f} ms" for name, seconds in paired["median_step_seconds"].items()
    )
    return (
        f"paired {ratio['of']}: {ratio['median']:.4f} (IQR {ratio['q1']:.4f}-{ratio['q3']:.4f}, "
        f"{ratio['rounds']} rounds); median step: {medians}"
    )
