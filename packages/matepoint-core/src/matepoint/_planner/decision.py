"""The budget search's decision rule, over plain numbers: keep, offload or recompute a kind.

The search (``matepoint._planner.search``) plans candidate steps on the meta device and hands
their outcomes here as numbers: bytes, seconds, counts, and whether a step fits. Nothing in this
module plans a step or reads a plan, so each rule of Note [The budget search] and Note [Steps the
search spares] (both in ``matepoint._planner.search``) is a pure function that tests check on
numbers alone, as torch's activation-checkpointing knapsack solvers are pure functions over
plain lists.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from itertools import accumulate
from typing import NamedTuple

from matepoint._planner.policy import Decision
from matepoint._planner.trace import ALLOCATION_GRANULARITY

__all__ = [
    "Outcome",
    "batch_fraction",
    "cannot_fit_kept",
    "fastest",
    "fits",
    "fits_host",
    "holds_inputs_on_device",
    "improves",
    "inputs_on_device_min_offload_bytes",
    "kind_choice",
    "kind_tries",
    "kinds_to_try",
    "largest_stash",
    "region_counts",
    "starts_without_look_ahead",
    "stash_levels",
    "stash_pays",
    "surely_fits_kept",
    "tries_inputs_on_device",
    "unchecked_count",
]

# Outputs of one op call, each rounded up to the allocator's granularity, at most (attention
# returns its output, its log-sum-exp and its random state). See Note [Steps the search spares],
# rule 2.
OUTPUTS_PER_CALL = 4


class Outcome(NamedTuple):
    """One planned try of the search, as the rule compares tries: its time, and whether its
    bytes fit.

    Attributes:
        seconds: Its estimated step time, without the policy's host cost (Note [The budget
            search], rule 2).
        fits: Whether it fits the device and the host budget (:func:`fits`).
    """

    seconds: float
    fits: bool


def fits(
    peak_bytes: int,
    pinned_bytes: int,
    ranks_per_node: int,
    budget_bytes: int,
    host_budget_bytes: int | None,
    pool_would_raise: bool = False,
) -> bool:
    """Whether a step fits: its peak within the device budget, and its host side too
    (:func:`fits_host`). See Note [The budget search], rule 8."""
    host_fits = fits_host(pinned_bytes, ranks_per_node, host_budget_bytes, pool_would_raise)
    return peak_bytes <= budget_bytes and host_fits


def fits_host(
    pinned_bytes: int, ranks_per_node: int, host_budget_bytes: int | None, pool_would_raise: bool
) -> bool:
    """Whether a step's host side fits, whatever the device budget: the pinned host RAM of the
    node's ranks (each pins ``pinned_bytes``) within the host budget, if there is one, and a
    pool that would not raise (``on_pool_exhausted="raise"`` past its cap). A step whose host
    side does not fit fits no device budget: it never sets the smallest budget that would fit.
    See Note [The budget search], rule 8."""
    host = pinned_bytes * ranks_per_node
    within = host_budget_bytes is None or host <= host_budget_bytes
    return within and not pool_would_raise


def kinds_to_try(recomputed: Sequence[int]) -> list[int]:
    """The kinds worth a try, by index in their ranking: those backward's recomputation runs.

    ``recomputed[i]`` is how many calls of kind ``i`` backward runs again when nothing is kept.
    See Note [The budget search], rule 1.
    """
    return [index for index, calls in enumerate(recomputed) if calls > 0]


def starts_without_look_ahead(fits: bool, prefetch: int) -> bool:
    """Whether the search plans its starting step again without look-ahead: where it does not
    fit with records fetched ahead. See Note [The budget search], rule 3."""
    return not fits and prefetch > 0


def kind_tries(
    prefetch: int, offload_available: bool, keep_can_fit: bool
) -> list[tuple[Decision, int]]:
    """The tries of one kind, in order: each a decision and the look-ahead it is planned with.

    Kept with the look-ahead ``prefetch`` in force, unless the keep surely cannot fit (Note
    [Steps the search spares], rule 1); then offloaded with ``prefetch``, then with one record
    ahead if that is fewer. Torch without selective offload values has no offload tries. See
    Note [The budget search], rule 4.
    """
    tries: list[tuple[Decision, int]] = [("keep", prefetch)] if keep_can_fit else []
    if offload_available:
        tries.extend(("offload", ahead) for ahead in dict.fromkeys((prefetch, min(prefetch, 1))))
    return tries


def kind_choice(best_seconds: float, outcomes: Sequence[Outcome]) -> int | None:
    """Which of a kind's tries is taken, by index in ``outcomes``; None: the kind is recomputed.

    The first try that fits decides: it is taken if it is faster than ``best_seconds``, the best
    step so far, else the kind is recomputed, whatever the tries after it would give. See Note
    [The budget search], rule 4.
    """
    for index, outcome in enumerate(outcomes):
        if outcome.fits:
            return index if outcome.seconds < best_seconds else None
    return None


def improves(outcome: Outcome, best_seconds: float) -> bool:
    """Whether a try replaces the best step so far: it fits and is faster.

    See Note [The budget search], rule 5, and Note [Steps the search spares], rule 2.
    """
    return outcome.fits and outcome.seconds < best_seconds


def cannot_fit_kept(forward_end_bytes: int, output_bytes: int, budget_bytes: int) -> bool:
    """Whether keeping a kind whose outputs hold ``output_bytes`` surely exceeds the budget.

    ``forward_end_bytes`` is the device memory at the end of the best step's forward (before it,
    plus what forward leaves for backward). See Note [Steps the search spares], rule 1.
    """
    return forward_end_bytes + output_bytes > budget_bytes


def surely_fits_kept(
    peak_bytes: int, output_bytes: Sequence[int], calls: Sequence[int], budget_bytes: int
) -> bool:
    """Whether keeping every kind at once, on top of a step that peaks at ``peak_bytes``, surely
    fits the budget.

    Kind ``i``'s outputs hold ``output_bytes[i]`` over ``calls[i]`` calls, each of whose outputs
    the allocator may round up. See Note [Steps the search spares], rule 2.
    """
    rounding = OUTPUTS_PER_CALL * ALLOCATION_GRANULARITY
    added = sum(
        nbytes + count * rounding for nbytes, count in zip(output_bytes, calls, strict=True)
    )
    return peak_bytes + added <= budget_bytes


def region_counts(
    regions: int, room_bytes: int, calls: int, output_bytes: int, tries_left: int
) -> list[int]:
    """How many last regions to try keeping a kind in, in order, at most ``tries_left`` counts.

    As many as the room left suggests (``room_bytes``, the budget less the best peak, against
    the kind's ``output_bytes`` over its ``calls``, one per region or more), but fewer than all
    ``regions``; then half as many. None below one region. See Note [The budget search], rule 5.
    """
    last = min(regions - 1, room_bytes * calls // max(output_bytes, 1))
    counts = [count for count in dict.fromkeys((last, last // 2)) if count >= 1]
    return counts[: max(tries_left, 0)]


def unchecked_count(
    fitting: int, fitting_peak: int, over: int, over_peak: int | None, budget_bytes: int
) -> int:
    """How many last regions to plan without a checkpoint next, strictly between the most that
    fitted (``fitting``, its step peaking at ``fitting_peak``) and the least that did not
    (``over``; its peak, or None where it was not planned).

    Each region left unchecked holds its activations into backward, so the peak grows about
    linearly with the count: the count where the line through the two known peaks meets the
    budget, else halfway (Note [The budget search], rule 10).
    """
    if over_peak is None or over_peak <= fitting_peak:
        guess = (fitting + over) // 2
    else:
        slope = (over_peak - fitting_peak) / (over - fitting)
        guess = fitting + int((budget_bytes - fitting_peak) / slope)
    return min(max(guess, fitting + 1), over - 1)


def tries_inputs_on_device(
    decisions: Iterable[Decision], min_offload_bytes: int, holding_min_offload_bytes: int | None
) -> bool:
    """Whether a choice is also tried with the checkpoint inputs held on the device: where its
    policy offloads nothing, some input moves (``holding_min_offload_bytes``, from
    :func:`inputs_on_device_min_offload_bytes`, is not None) and the choice's own
    ``min_offload_bytes`` does not hold them already. See Note [The budget search], rule 6."""
    if holding_min_offload_bytes is None or min_offload_bytes >= holding_min_offload_bytes:
        return False
    return "offload" not in decisions


def inputs_on_device_min_offload_bytes(bytes_to_host: int) -> int | None:
    """The ``min_offload_bytes`` that holds every checkpoint input on the device, given the
    bytes the profiled step offloaded: above them all; None where it offloaded nothing, which
    no ``min_offload_bytes`` needs to hold. See Note [The budget search], rule 6."""
    return bytes_to_host + 1 if bytes_to_host > 0 else None


def holds_inputs_on_device(held: Outcome, offloading_seconds: float) -> bool:
    """Whether the try with the inputs held on the device is taken: it fits and is no slower
    than the same choice offloading them. See Note [The budget search], rule 6."""
    return held.fits and held.seconds <= offloading_seconds


def fastest(outcomes: Sequence[Outcome]) -> int | None:
    """Which candidate the search returns, by index in ``outcomes``: the fastest that fits, the
    first of those tied; None where none fits. Each outcome's time counts its policy's host
    cost, and the step without a policy comes first, so that a policy is kept only where it is
    faster with that cost. See Note [The budget search], rules 7 and 9."""
    fitting = [index for index, outcome in enumerate(outcomes) if outcome.fits]
    return min(fitting, key=lambda index: outcomes[index].seconds, default=None)


def stash_levels(offloaded_bytes: Sequence[int]) -> list[int]:
    """The ``stash_bytes`` worth planning, smallest first, given the bytes of each checkpoint
    input a step offloads, in order: 0, then the newest inputs' bytes added up, newest first.

    The newest input is always held until backward reads it, so the stash counts the ones
    before it; a value between two levels holds as many inputs as the lower one. See Note
    [The stash], rule 2 (in ``matepoint._planner.search``).
    """
    return [0, *accumulate(reversed(offloaded_bytes[:-1]))]


def largest_stash(levels: Sequence[int], fits: Callable[[int], bool]) -> int:
    """The largest of ``levels`` with which the step ``fits``, by binary search.

    A larger stash holds more inputs on the device, so a step's peak grows with it: ``fits``
    is true up to some level and false above. ``levels[0]`` is taken to fit (it is not asked).
    See Note [The stash], rule 2 (in ``matepoint._planner.conclusion``).
    """
    index = bisect.bisect_right(levels, False, lo=1, key=lambda level: not fits(level))
    return levels[index - 1]


def stash_pays(seconds: float, seconds_without_copies_back: float) -> bool:
    """Whether a step's copies back cost it time: the time model estimates it faster without
    them, so the link is its limit, and a stash, which spares copies back, can speed it. See
    Note [The stash] (``matepoint._planner.conclusion``), rule 1."""
    return seconds_without_copies_back < seconds


def batch_fraction(budget_bytes: int, least_peak_bytes: int, fixed_bytes: int) -> float | None:
    """The share of the example batch that would fit ``budget_bytes``, where nothing does.

    Activation memory (the least peak planned less ``fixed_bytes``, the parameters and their
    gradients, which a smaller batch does not shrink) is taken as proportional to the batch.
    0 where the fixed bytes alone exceed the budget; None where the step has no activation
    memory to shrink.
    """
    activations = least_peak_bytes - fixed_bytes
    if activations <= 0:
        return None
    return max(0.0, (budget_bytes - fixed_bytes) / activations)
