"""Offload options: validation, process defaults, the options() context, per-call overrides."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import matepoint
from matepoint.testing import CPUTestTransport

INT_FIELDS = (
    "min_offload_bytes",
    "stash_bytes",
    "prefetch",
    "max_inflight_bytes",
    "side_stream_delay_cycles",
)


def test_int_fields_reject_bad_values() -> None:
    # One test, not a parametrization: the shared autouse fixture collects garbage per test.
    for name in INT_FIELDS:
        for value in (-1, 1.5, "3", True, None):
            with pytest.raises(ValueError, match=name):
                matepoint.OffloadOptions(**{name: value})  # type: ignore[arg-type]


def test_pool_cap_rejects_bad_values() -> None:
    for value in (-1, 2.0, False, "1"):
        with pytest.raises(ValueError, match="pool_cap_bytes"):
            matepoint.OffloadOptions(pool_cap_bytes=value)  # type: ignore[arg-type]


def test_pool_exhausted_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="on_pool_exhausted"):
        matepoint.OffloadOptions(on_pool_exhausted="wait")  # type: ignore[arg-type]


def test_valid_values_are_accepted() -> None:
    opts = matepoint.OffloadOptions(
        min_offload_bytes=0,
        stash_bytes=0,
        prefetch=0,
        max_inflight_bytes=0,
        pool_cap_bytes=0,
        on_pool_exhausted="raise",
        measure_waits=False,
        side_stream_delay_cycles=10,
    )
    assert opts.pool_cap_bytes == 0
    assert matepoint.OffloadOptions(pool_cap_bytes=None).pool_cap_bytes is None


def test_options_are_frozen() -> None:
    opts = matepoint.OffloadOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.prefetch = 3  # type: ignore[misc]


def test_unknown_names_raise_type_error() -> None:
    with pytest.raises(TypeError, match="prefech"):
        matepoint.configure(prefech=3)
    with pytest.raises(TypeError, match="prefech"), matepoint.options(prefech=3):
        pass
    with pytest.raises(TypeError):
        matepoint.OffloadOptions(prefech=3)  # type: ignore[call-arg]


def test_bad_values_through_configure_and_options_leave_defaults_alone() -> None:
    before = matepoint.get_options()
    with pytest.raises(ValueError, match="prefetch"):
        matepoint.configure(prefetch=-1)
    with pytest.raises(ValueError, match="stash_bytes"), matepoint.options(stash_bytes=-5):
        pass
    assert matepoint.get_options() is before


def test_options_context_restores_defaults() -> None:
    before = matepoint.get_options()
    with matepoint.options(prefetch=7, stash_bytes=123) as inside:
        assert matepoint.get_options() is inside
        assert inside.prefetch == 7
        assert inside.stash_bytes == 123
        assert inside.min_offload_bytes == before.min_offload_bytes
        with matepoint.options(prefetch=1):
            assert matepoint.get_options().prefetch == 1
            assert matepoint.get_options().stash_bytes == 123
        assert matepoint.get_options().prefetch == 7
    assert matepoint.get_options() == before


def test_options_context_restores_after_an_exception() -> None:
    before = matepoint.get_options()
    with pytest.raises(KeyError), matepoint.options(prefetch=9):
        raise KeyError("x")
    assert matepoint.get_options() == before


def test_configure_changes_the_defaults() -> None:
    before = matepoint.get_options()
    try:
        result = matepoint.configure(prefetch=5)
        assert result.prefetch == 5
        assert matepoint.get_options().prefetch == 5
        assert matepoint.get_options().stash_bytes == before.stash_bytes
    finally:
        matepoint.configure(**dataclasses.asdict(before))
    assert matepoint.get_options() == before


def test_defaults_match_the_documentation() -> None:
    opts = matepoint.OffloadOptions()
    assert opts.min_offload_bytes == 1 << 20
    assert opts.stash_bytes == 0
    assert opts.prefetch == 2
    assert opts.max_inflight_bytes == 2 << 30
    assert opts.pool_cap_bytes is None
    assert opts.on_pool_exhausted == "pageable"


def test_per_call_options_override_the_defaults(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    strict = matepoint.OffloadOptions(min_offload_bytes=1 << 20)
    y = matepoint.checkpoint(torch.sin, x * 1, offload=strict)  # the fixture's default offloads all
    assert matepoint.stats().offloads == 0
    assert matepoint.stats().skipped_small == 1
    z = matepoint.checkpoint(torch.sin, y, offload=True)
    assert matepoint.stats().offloads == 1
    z.sum().backward()


def test_options_are_resolved_when_the_checkpoint_is_taken(transport: CPUTestTransport) -> None:
    # Changing the defaults between forward and backward does not change a taken checkpoint.
    x = torch.randn(4, 16, requires_grad=True)
    y = matepoint.checkpoint(torch.sin, x * 1)
    with matepoint.options(min_offload_bytes=1 << 30, on_pool_exhausted="raise", pool_cap_bytes=0):
        y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_checkpoint_rejects_a_bad_offload_argument() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    for bad in (1, "yes", {"prefetch": 1}):
        with pytest.raises(TypeError, match="offload="):
            matepoint.checkpoint(torch.sin, x, offload=bad)  # type: ignore[arg-type]
