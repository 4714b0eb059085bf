"""Options that fit a device-memory budget with the least link traffic (``MemoryPlan.recommend``).

Three settings trade device memory against link traffic: ``min_offload_bytes``, ``stash_bytes``
and ``prefetch``; the search re-plans the step on the meta device for each candidate (see
:class:`Recommendation`). This is the options-only search, kept for its API: the budget search
(``MemoryPlan.fastest_under``) is the one answer to a budget, and chooses the look-ahead, the
inputs held, the stash (with the same rule as here, ``matepoint._planner.decision.
largest_stash``) and the batch share that would fit as well as keep, offload or recompute.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from functools import cache, partial

from matepoint._options import OffloadSettings
from matepoint._planner import decision
from matepoint._planner.step import Planned, SavedInput, StrategyPlan

__all__ = ["Recommendation", "recommend"]

_GIB = float(1 << 30)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB"


_MAX_THRESHOLDS = 6
_OFFLOADABLE = ("offloaded", "shared", "small")


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """Options proposed for a device-memory budget, or what would fit if nothing does.

    Three options trade device memory against link traffic: ``min_offload_bytes`` keeps small
    inputs on the device (no copy either way), ``stash_bytes`` keeps the newest inputs on the
    device (their copy to the host still happens, the copy back does not), and ``prefetch``
    holds copies back ahead of need (no traffic, only memory and overlap). The search re-plans
    the step on the meta device for each candidate.

    It first finds the deepest look-ahead (up to the current ``prefetch``) with which
    the most frugal options fit (every input offloaded, nothing stashed). It then tries each
    size class of checkpoint inputs as the ``min_offload_bytes`` threshold, from offloading
    everything up, and for each the largest stash that still fits (binary search over the
    newest inputs), and keeps the fitting candidate with the fewest link bytes.

    Attributes:
        budget_bytes: The device-memory budget.
        fits: Whether some options fit.
        options: The proposal (``None`` if nothing fits).
        plan: The matepoint step planned with the proposal, or with the most frugal options
            when nothing fits.
        minimum_peak_bytes: The peak of the most frugal options (every input offloaded,
            nothing stashed) at the chosen look-ahead, or without look-ahead if nothing fits.
        fixed_bytes: Parameters and their gradients: memory a smaller batch does not shrink.
        batch_fraction: When nothing fits, the estimated fraction of the example batch that
            would (activation memory taken as proportional to the batch); else ``None``.
        steps_planned: How many meta steps the search ran.
    """

    budget_bytes: int
    fits: bool
    options: OffloadSettings | None
    plan: StrategyPlan
    minimum_peak_bytes: int
    fixed_bytes: int
    batch_fraction: float | None
    steps_planned: int

    def __str__(self) -> str:
        options = self.options
        if options is None:
            scale = ""
            if self.batch_fraction == 0:
                scale = "; those alone exceed the budget, whatever the batch"
            elif self.batch_fraction is not None:
                scale = (
                    f"; about {self.batch_fraction:.2f}x the example batch would fit "
                    "(activations taken as proportional to the batch)"
                )
            return (
                f"nothing fits {_gib(self.budget_bytes)}: the most frugal options peak at "
                f"{_gib(self.minimum_peak_bytes)}, of which "
                f"{_gib(self.fixed_bytes)} are parameters and gradients{scale}"
            )
        what = f"{self.plan.link_bytes / 1e9:.2f} GB over the link per step"
        if not self.plan.link_bytes:
            what = "no offloading needed (torch's checkpoint fits)"
        return (
            f"fits {_gib(self.budget_bytes)} with stash_bytes={options.stash_bytes}, "
            f"prefetch={options.prefetch}, min_offload_bytes={options.min_offload_bytes}: peak "
            f"{_gib(self.plan.peak_bytes)}, {what}"
        )


def _threshold_classes(saves: tuple[SavedInput, ...], current: int) -> list[int]:
    """Candidate ``min_offload_bytes``, one per distinct set of inputs kept on the device.

    Thresholds between two size classes keep the same inputs and plan the same step, so each
    class is tried once: with the current value if it falls in the class, else with a round
    value: any value above the kept size and at most the moved one plans the same step, and
    the smallest power of two above the kept size reads best (1 when nothing is kept), else
    the size of the smallest input moved.
    """
    sizes = sorted({save.nbytes for save in saves if save.fate in _OFFLOADABLE})
    # A class's values lie above the kept size and at most the moved one (``sys.maxsize``:
    # nothing is moved above the largest input).
    classes = [
        current if kept < current <= moved else min(1 << kept.bit_length(), moved)
        for kept, moved in zip([0, *sizes], [*sizes, sys.maxsize], strict=True)
    ]
    if len(classes) > _MAX_THRESHOLDS:
        step = (len(classes) - 1) / (_MAX_THRESHOLDS - 1)
        classes = sorted({classes[round(i * step)] for i in range(_MAX_THRESHOLDS)})
    return classes


def _fits(peak: Callable[[int, int], int], min_offload: int, budget_bytes: int, stash: int) -> bool:
    """Whether the step with ``min_offload`` and ``stash`` peaks within ``budget_bytes``."""
    return peak(min_offload, stash) <= budget_bytes


def recommend(
    base: OffloadSettings, replan: Callable[[OffloadSettings], Planned], budget_bytes: int
) -> Recommendation:
    """Search offload options for ``budget_bytes``; see :class:`Recommendation`.

    Args:
        base: The options planned; the search changes three of them.
        replan: Plans the matepoint step with other options.
        budget_bytes: Device bytes the step may use.

    Returns:
        The recommendation.
    """

    evaluate = cache(replan)

    def options(min_offload: int, stash: int, prefetch: int) -> OffloadSettings:
        return dataclasses.replace(
            base, min_offload_bytes=min_offload, stash_bytes=stash, prefetch=prefetch
        )

    def peak(min_offload: int, stash: int) -> int:
        return evaluate(options(min_offload, stash, prefetch))[0].peak_bytes

    frugal, saves = evaluate(options(1, 0, base.prefetch))
    thresholds = _threshold_classes(saves, base.min_offload_bytes)
    fixed = 2 * frugal.parameter_bytes
    # The first class keeps the same inputs as 1 (none): the same step, so it is planned with 1.
    for prefetch in range(base.prefetch, -1, -1):
        frugal = evaluate(options(1, 0, prefetch))[0]
        if frugal.peak_bytes <= budget_bytes:
            break
    else:
        fraction = decision.batch_fraction(budget_bytes, frugal.peak_bytes, fixed)
        runs = evaluate.cache_info().misses
        return Recommendation(
            budget_bytes, False, None, frugal, frugal.peak_bytes, fixed, fraction, runs
        )

    candidates: list[tuple[StrategyPlan, OffloadSettings]] = []
    for threshold in thresholds:
        planned = 1 if threshold == thresholds[0] else threshold
        first, saves = evaluate(options(planned, 0, prefetch))
        if first.peak_bytes > budget_bytes:
            break  # larger thresholds keep more on the device
        levels = decision.stash_levels([s.nbytes for s in saves if s.fate == "offloaded"])
        # The largest stash that fits: peaks grow with the stash, and the first level fits.
        stash = decision.largest_stash(levels, partial(_fits, peak, planned, budget_bytes))
        candidates.append(
            (evaluate(options(planned, stash, prefetch))[0], options(threshold, stash, prefetch))
        )
    best, best_options = min(candidates, key=lambda pair: (pair[0].link_bytes, pair[0].peak_bytes))
    runs = evaluate.cache_info().misses
    return Recommendation(
        budget_bytes, True, best_options, best, frugal.peak_bytes, fixed, None, runs
    )
