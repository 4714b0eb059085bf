"""Offload options that fit a device-memory budget with the least link traffic.

Three options trade device memory against traffic: ``min_offload_bytes`` keeps small inputs on
the device (no copy either way), ``stash_bytes`` keeps the newest inputs on the device (their
copy to the host still happens, the copy back does not), and ``prefetch`` holds copies back
ahead of need (no traffic, only memory and overlap). The search re-plans the step on the meta
device for each candidate and keeps the one with the fewest link bytes among those that fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from itertools import accumulate

from matepoint._options import OffloadSettings
from matepoint._plan_engine import SavedInput
from matepoint._plan_step import StrategyPlan

__all__ = ["Recommendation", "recommend"]

_MAX_THRESHOLDS = 6
_OFFLOADABLE = ("offloaded", "shared", "small")
_GIB = float(1 << 30)


@dataclasses.dataclass(frozen=True)
class Recommendation:
    """Options proposed for a device-memory budget, or what would fit if nothing does.

    The search first finds the deepest look-ahead (up to the current ``prefetch``) with which
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
        budget = f"{self.budget_bytes / _GIB:.2f} GiB"
        if not self.fits or self.options is None:
            if self.batch_fraction is None:
                scale = ""
            elif self.batch_fraction == 0:
                scale = "; those alone exceed the budget, whatever the batch"
            else:
                scale = (
                    f"; about {self.batch_fraction:.2f}x the example batch would fit "
                    "(activations taken as proportional to the batch)"
                )
            return (
                f"nothing fits {budget}: the most frugal options peak at "
                f"{self.minimum_peak_bytes / _GIB:.2f} GiB, of which "
                f"{self.fixed_bytes / _GIB:.2f} GiB are parameters and gradients{scale}"
            )
        opts = self.options
        traffic = self.plan.link_bytes
        what = (
            "no offloading needed (torch's checkpoint fits)"
            if traffic == 0
            else f"{traffic / 1e9:.2f} GB over the link per step"
        )
        return (
            f"fits {budget} with stash_bytes={opts.stash_bytes}, prefetch={opts.prefetch}, "
            f"min_offload_bytes={opts.min_offload_bytes}: peak "
            f"{self.plan.peak_bytes / _GIB:.2f} GiB, {what}"
        )


def _round_threshold(kept: int, moved: int | None) -> int:
    """A round ``min_offload_bytes`` that keeps inputs of ``kept`` bytes and moves ``moved``.

    Any value above ``kept`` and at most ``moved`` plans the same step; the smallest power of two
    above ``kept`` reads best (1 when nothing is kept), else the size of the smallest input moved.
    """
    power = 1 << kept.bit_length()
    return power if moved is None or power <= moved else moved


def _threshold_classes(saves: tuple[SavedInput, ...], current: int) -> list[int]:
    """Candidate ``min_offload_bytes``, one per distinct set of inputs kept on the device.

    Thresholds between two size classes keep the same inputs and plan the same step, so each
    class is tried once: with the current value if it falls in the class, else with a round
    value of it (see :func:`_round_threshold`).
    """
    sizes = sorted({save.nbytes for save in saves if save.fate in _OFFLOADABLE})
    classes = [
        current
        if kept < current and (moved is None or current <= moved)
        else _round_threshold(kept, moved)
        for kept, moved in zip([0, *sizes], [*sizes, None], strict=True)
    ]
    if len(classes) > _MAX_THRESHOLDS:
        step = (len(classes) - 1) / (_MAX_THRESHOLDS - 1)
        classes = sorted({classes[round(i * step)] for i in range(_MAX_THRESHOLDS)})
    return classes


def recommend(
    base: OffloadSettings,
    replan: Callable[[OffloadSettings], tuple[StrategyPlan, tuple[SavedInput, ...]]],
    budget_bytes: int,
) -> Recommendation:
    """Search offload options for ``budget_bytes``; see :class:`Recommendation`.

    Args:
        base: The options planned; the search changes three of them.
        replan: Plans the matepoint step with other options.
        budget_bytes: Device bytes the step may use.

    Returns:
        The recommendation.
    """
    cache: dict[tuple[int, int, int], tuple[StrategyPlan, tuple[SavedInput, ...]]] = {}
    runs = 0

    def evaluate(
        min_offload: int, stash: int, prefetch: int
    ) -> tuple[StrategyPlan, tuple[SavedInput, ...]]:
        nonlocal runs
        key = (min_offload, stash, prefetch)
        if key not in cache:
            runs += 1
            options = dataclasses.replace(
                base, min_offload_bytes=min_offload, stash_bytes=stash, prefetch=prefetch
            )
            cache[key] = replan(options)
        return cache[key]

    prefetch = None
    frugal, saves = evaluate(1, 0, base.prefetch)
    thresholds = _threshold_classes(saves, base.min_offload_bytes)
    if thresholds[0] != 1:  # the current value keeps the same inputs as 1: same step
        for depth in range(base.prefetch + 1):
            if (1, 0, depth) in cache:
                cache[(thresholds[0], 0, depth)] = cache[(1, 0, depth)]
    for depth in range(base.prefetch, -1, -1):
        frugal, saves = evaluate(thresholds[0], 0, depth)
        if frugal.peak_bytes <= budget_bytes:
            prefetch = depth
            break
    fixed = 2 * frugal.parameter_bytes
    if prefetch is None:
        activations = frugal.peak_bytes - fixed
        fraction = max(0.0, (budget_bytes - fixed) / activations) if activations > 0 else None
        return Recommendation(
            budget_bytes, False, None, frugal, frugal.peak_bytes, fixed, fraction, runs
        )

    best: tuple[StrategyPlan, OffloadSettings] | None = None
    for threshold in thresholds:
        first, first_saves = evaluate(threshold, 0, prefetch)
        if first.peak_bytes > budget_bytes:
            break  # larger thresholds keep more on the device
        offloaded = [save.nbytes for save in first_saves if save.fate == "offloaded"]
        # The newest input is always held; the stash counts the ones before it, newest first.
        levels = [0, *accumulate(reversed(offloaded[:-1]))]
        low, high = 0, len(levels) - 1
        while low < high:
            middle = (low + high + 1) // 2
            if evaluate(threshold, levels[middle], prefetch)[0].peak_bytes <= budget_bytes:
                low = middle
            else:
                high = middle - 1
        candidate, _ = evaluate(threshold, levels[low], prefetch)
        if best is None or (candidate.link_bytes, candidate.peak_bytes) < (
            best[0].link_bytes,
            best[0].peak_bytes,
        ):
            options = dataclasses.replace(
                base, min_offload_bytes=threshold, stash_bytes=levels[low], prefetch=prefetch
            )
            best = (candidate, options)
    assert best is not None  # the frugal options fit, and their threshold is the first tried
    return Recommendation(
        budget_bytes, True, best[1], best[0], frugal.peak_bytes, fixed, None, runs
    )
