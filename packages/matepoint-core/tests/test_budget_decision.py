"""The budget search's decision rule, on numbers alone: no step is planned here.

Note [The budget search] and Note [Steps the search spares] in ``matepoint._planner.search``;
the rule is ``matepoint._planner.decision``.
"""

from __future__ import annotations

import pytest

from matepoint._planner import decision
from matepoint._planner.decision import Outcome
from matepoint._planner.trace import ALLOCATION_GRANULARITY

MIB = 1 << 20
# What one call's outputs may gain by the allocator's rounding, at most.
ROUNDING = decision.OUTPUTS_PER_CALL * ALLOCATION_GRANULARITY


def _outcome(seconds: float, fits: bool = True) -> Outcome:
    return Outcome(seconds=seconds, fits=fits)


@pytest.mark.parametrize(
    ("peak", "pinned", "ranks", "host_budget", "expected"),
    [
        (100, 0, 1, None, True),  # at the budget: fits
        (101, 0, 1, None, False),  # one byte over
        (100, 10**12, 8, None, True),  # no host budget: any pinned RAM
        (100, 30, 2, 60, True),  # two ranks of 30 at a node budget of 60
        (100, 30, 3, 60, False),  # a third rank's pool is over it
        (101, 0, 1, 60, False),  # the device budget still binds
    ],
)
def test_a_step_fits_where_its_peak_and_its_node_pinned_ram_are_within_the_budgets(
    peak: int, pinned: int, ranks: int, host_budget: int | None, expected: bool
) -> None:
    assert decision.fits(peak, pinned, ranks, 100, host_budget) is expected


def test_only_kinds_the_recomputation_runs_are_tried_in_their_ranked_order() -> None:
    assert decision.kinds_to_try([8, 0, 3, 0, 1]) == [0, 2, 4]
    assert decision.kinds_to_try([0, 0]) == []
    assert decision.kinds_to_try([]) == []


@pytest.mark.parametrize(
    ("fits", "prefetch", "expected"),
    [(False, 2, True), (False, 0, False), (True, 2, False), (True, 0, False)],
)
def test_the_start_is_planned_again_without_look_ahead_only_where_it_does_not_fit(
    fits: bool, prefetch: int, expected: bool
) -> None:
    assert decision.starts_without_look_ahead(fits, prefetch) is expected


def test_a_kind_is_tried_kept_then_offloaded_then_offloaded_with_one_record_ahead() -> None:
    assert decision.kind_tries(3, True, True) == [("keep", 3), ("offload", 3), ("offload", 1)]


def test_a_look_ahead_of_one_or_none_is_not_tried_twice() -> None:
    assert decision.kind_tries(1, True, True) == [("keep", 1), ("offload", 1)]
    assert decision.kind_tries(0, True, True) == [("keep", 0), ("offload", 0)]


def test_a_keep_that_cannot_fit_is_not_among_the_tries() -> None:
    assert decision.kind_tries(2, True, False) == [("offload", 2), ("offload", 1)]


def test_without_offload_values_a_kind_is_only_kept_or_recomputed() -> None:
    assert decision.kind_tries(2, False, True) == [("keep", 2)]
    assert decision.kind_tries(2, False, False) == []


def test_a_keep_that_fits_and_saves_time_is_taken() -> None:
    assert decision.kind_choice(1.0, [_outcome(0.9)]) == 0


def test_a_keep_that_fits_without_saving_time_rules_out_the_offloads() -> None:
    """The offload after it is faster, but the keep that fitted decided: recompute."""
    assert decision.kind_choice(1.0, [_outcome(1.0), _outcome(0.5)]) is None
    assert decision.kind_choice(1.0, [_outcome(1.2), _outcome(0.5)]) is None


def test_where_the_keep_does_not_fit_the_first_offload_that_fits_decides() -> None:
    over = _outcome(0.1, fits=False)
    assert decision.kind_choice(1.0, [over, _outcome(0.9)]) == 1
    assert decision.kind_choice(1.0, [over, over, _outcome(0.95)]) == 2
    # The first that fits is slower: recomputed, though a later one is faster.
    assert decision.kind_choice(1.0, [over, _outcome(1.1), _outcome(0.2)]) is None


def test_a_kind_none_of_whose_tries_fits_is_recomputed() -> None:
    over = _outcome(0.1, fits=False)
    assert decision.kind_choice(1.0, [over, over, over]) is None
    assert decision.kind_choice(1.0, []) is None


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (_outcome(0.9), True),
        (_outcome(1.0), False),  # as fast: not worth it
        (_outcome(1.1), False),
        (_outcome(0.1, fits=False), False),
    ],
)
def test_a_try_improves_on_the_best_where_it_fits_and_is_faster(
    outcome: Outcome, expected: bool
) -> None:
    assert decision.improves(outcome, 1.0) is expected


def test_a_keep_whose_outputs_beside_what_forward_leaves_exceed_the_budget_cannot_fit() -> None:
    assert decision.cannot_fit_kept(60 * MIB, 41 * MIB, 100 * MIB)
    assert not decision.cannot_fit_kept(60 * MIB, 40 * MIB, 100 * MIB)
    assert not decision.cannot_fit_kept(0, 0, 0)


def test_keeping_every_kind_surely_fits_where_the_peak_and_their_rounded_outputs_do() -> None:
    outputs, calls = [10 * MIB, 6 * MIB], [4, 2]
    exact = 50 * MIB + 16 * MIB + 6 * ROUNDING  # every call's outputs rounded up
    assert decision.surely_fits_kept(50 * MIB, outputs, calls, exact)
    assert not decision.surely_fits_kept(50 * MIB, outputs, calls, exact - 1)
    # Without the rounding the outputs alone would seem to fit.
    assert not decision.surely_fits_kept(50 * MIB, outputs, calls, 66 * MIB)
    assert decision.surely_fits_kept(50 * MIB, [], [], 50 * MIB)


def test_a_kind_is_tried_in_as_many_last_regions_as_the_room_holds_then_half() -> None:
    # 8 calls of 1 MiB each over 8 regions; 5 MiB of room hold 5 regions' outputs.
    assert decision.region_counts(8, 5 * MIB, 8, 8 * MIB, 2) == [5, 2]
    # Room for all of them: every region but one, then half.
    assert decision.region_counts(8, 100 * MIB, 8, 8 * MIB, 2) == [7, 3]


def test_region_counts_are_never_below_one_nor_tried_twice() -> None:
    assert decision.region_counts(8, MIB, 8, 8 * MIB, 2) == [1]  # half of one is none
    assert decision.region_counts(8, MIB - 1, 8, 8 * MIB, 2) == []  # no region's worth of room
    assert decision.region_counts(8, 0, 8, 8 * MIB, 2) == []
    assert decision.region_counts(2, 100 * MIB, 2, 2 * MIB, 2) == [1]  # 1 and its half, 0


def test_a_single_region_is_never_kept_in_its_last_regions() -> None:
    assert decision.region_counts(1, 100 * MIB, 1, MIB, 2) == []


def test_region_counts_stop_at_the_tries_left() -> None:
    assert decision.region_counts(8, 5 * MIB, 8, 8 * MIB, 1) == [5]
    assert decision.region_counts(8, 5 * MIB, 8, 8 * MIB, 0) == []


def test_a_kind_with_no_output_bytes_is_tried_in_every_region_but_one() -> None:
    assert decision.region_counts(4, 1, 4, 0, 2) == [3, 1]


def test_inputs_are_tried_on_the_device_only_where_the_policy_offloads_nothing() -> None:
    holding = 96 * MIB + 1
    assert decision.tries_inputs_on_device([], MIB, holding)
    assert decision.tries_inputs_on_device(["keep", "recompute"], MIB, holding)
    assert not decision.tries_inputs_on_device(["keep", "offload"], MIB, holding)


def test_inputs_are_not_tried_on_the_device_where_none_moves_or_all_are_held() -> None:
    """Defect 7: a step that moves no input never has offloading switched on."""
    assert not decision.tries_inputs_on_device([], 1 << 40, None)
    assert not decision.tries_inputs_on_device([], 0, None)
    assert not decision.tries_inputs_on_device([], 96 * MIB + 1, 96 * MIB + 1)


def test_inputs_held_on_the_device_take_a_threshold_above_every_offloaded_byte() -> None:
    assert decision.inputs_on_device_min_offload_bytes(96 * MIB) == 96 * MIB + 1
    assert decision.inputs_on_device_min_offload_bytes(0) is None


def test_a_step_whose_pool_would_raise_or_whose_pins_exceed_the_host_fits_nothing() -> None:
    """Defects 4 and 8/9: the host side is judged apart from the device budget."""
    assert decision.fits(10, 4, 2, 10, 8)
    assert not decision.fits(10, 4, 2, 10, 8, pool_would_raise=True)
    assert not decision.fits(10, 5, 2, 10, 8)
    assert decision.fits_host(0, 4, 0, False)
    assert not decision.fits_host(1, 1, 0, False)
    assert not decision.fits_host(0, 1, None, True)
    assert decision.fits_host(1 << 40, 8, None, False)


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        (_outcome(0.9), True),
        (_outcome(1.0), True),  # no slower is enough: the link's copies cost what the model
        (_outcome(1.1), False),  # does not see
        (_outcome(0.5, fits=False), False),
    ],
)
def test_inputs_are_held_on_the_device_where_that_fits_and_is_no_slower(
    held: Outcome, expected: bool
) -> None:
    assert decision.holds_inputs_on_device(held, 1.0) is expected


@pytest.mark.parametrize(("with_policy", "expected"), [(0.9, True), (1.0, False), (1.1, False)])
def test_a_policy_is_kept_only_where_it_is_faster_with_its_host_cost(
    with_policy: float, expected: bool
) -> None:
    # The step without a policy first: a tie goes to it.
    assert decision.fastest([_outcome(1.0), _outcome(with_policy)]) == int(expected)


# --- Note [The budget search], rule 9: the fastest candidate that fits -------------------------


def test_the_fastest_candidate_that_fits_is_returned_the_first_on_a_tie() -> None:
    assert decision.fastest([_outcome(1.0), _outcome(0.8), _outcome(0.9)]) == 1
    assert decision.fastest([_outcome(1.0), _outcome(0.5, fits=False), _outcome(0.9)]) == 2
    assert decision.fastest([_outcome(0.9), _outcome(0.9)]) == 0
    assert decision.fastest([_outcome(0.5, fits=False)]) is None
    assert decision.fastest([]) is None
