"""Offload options and settings: validation, inheritance, the options() context, the old spellings.

A call's :class:`matepoint.OffloadOptions` holds only what can differ per call; the device
settings (:class:`matepoint.OffloadSettings`) are set with configure()/options(). See
Note [Options and settings] in ``matepoint._options``.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import warnings

import pytest
import torch

import matepoint
from matepoint import _options, _side_stream_delay
from matepoint.testing import CPUTestTransport, delay_side_stream
from matepoint_compat import MatepointDeprecationWarning

COUNT_SETTINGS = ("min_offload_bytes", "stash_bytes", "prefetch", "max_inflight_bytes")


def test_settings_reject_bad_counts() -> None:
    # One test, not a parametrization: the shared autouse fixture collects garbage per test.
    for name in COUNT_SETTINGS:
        for value in (-1, 1.5, "3", True, None):
            with pytest.raises(ValueError, match=name):
                matepoint.OffloadSettings(**{name: value})  # type: ignore[arg-type]


def test_pool_cap_and_policy_are_checked() -> None:
    for value in (-1, 2.0, False, "1"):
        with pytest.raises(ValueError, match="pool_cap_bytes"):
            matepoint.OffloadSettings(pool_cap_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_pool_exhausted"):
        matepoint.OffloadSettings(on_pool_exhausted="wait")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pipeline"):
        matepoint.OffloadSettings(pipeline=1)  # type: ignore[arg-type]


def test_per_call_options_reject_bad_values() -> None:
    for value in (-1, 1.5, "3", True):
        with pytest.raises(ValueError, match="min_offload_bytes"):
            matepoint.OffloadOptions(min_offload_bytes=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="enabled"):
        matepoint.OffloadOptions(enabled=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="prefech"):
        matepoint.OffloadOptions(prefech=3)


def test_settings_defaults_match_the_documentation() -> None:
    settings = matepoint.OffloadSettings()
    assert settings.min_offload_bytes == 1 << 20
    assert settings.pipeline is True
    assert settings.stash_bytes == 0
    assert settings.prefetch == 2
    assert settings.max_inflight_bytes == 2 << 30
    assert settings.pool_cap_bytes is None
    assert settings.on_pool_exhausted == "pageable"
    assert settings.measure_waits is True
    assert not hasattr(settings, "side_stream_delay_cycles")  # a test knob, in matepoint.testing


def test_unset_per_call_fields_inherit_the_settings_in_force() -> None:
    """OffloadOptions(min_offload_bytes=0) no longer resets a cap set through configure."""
    call = matepoint.OffloadOptions(min_offload_bytes=0)
    with matepoint.options(pool_cap_bytes=1234, prefetch=5):
        resolved = _options.resolve(call)
    assert resolved is not None
    assert (resolved.pool_cap_bytes, resolved.prefetch, resolved.min_offload_bytes) == (1234, 5, 0)
    with matepoint.options(min_offload_bytes=77, pipeline=False):
        inherited = _options.resolve(matepoint.OffloadOptions())
    assert inherited is not None
    assert (inherited.min_offload_bytes, inherited.pipeline) == (77, False)


def test_options_are_frozen() -> None:
    opts = matepoint.OffloadOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.min_offload_bytes = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        matepoint.get_options().prefetch = 3  # type: ignore[misc]


def test_unknown_names_raise_type_error() -> None:
    with pytest.raises(TypeError, match="prefech"):
        matepoint.configure(prefech=3)
    with pytest.raises(TypeError, match="prefech"), matepoint.options(prefech=3):
        pass


def test_bad_values_through_configure_and_options_leave_settings_alone() -> None:
    before = matepoint.get_options()
    with pytest.raises(ValueError, match="prefetch"):
        matepoint.configure(prefetch=-1)
    with pytest.raises(ValueError, match="stash_bytes"), matepoint.options(stash_bytes=-5):
        pass
    assert matepoint.get_options() is before


def test_options_context_restores_settings() -> None:
    before = matepoint.get_options()
    with matepoint.options(prefetch=7, stash_bytes=123) as inside:
        assert matepoint.get_options() is inside
        assert (inside.prefetch, inside.stash_bytes) == (7, 123)
        assert inside.min_offload_bytes == before.min_offload_bytes
        with matepoint.options(prefetch=1):
            assert matepoint.get_options().prefetch == 1
            assert matepoint.get_options().stash_bytes == 123
        assert matepoint.get_options().prefetch == 7
    assert matepoint.get_options() == before
    with pytest.raises(KeyError), matepoint.options(prefetch=9):
        raise KeyError("x")
    assert matepoint.get_options() == before


def test_configure_changes_the_settings() -> None:
    before = matepoint.get_options()
    try:
        result = matepoint.configure(prefetch=5)
        assert result.prefetch == 5
        assert matepoint.get_options().prefetch == 5
        assert matepoint.get_options().stash_bytes == before.stash_bytes
    finally:
        matepoint.configure(**dataclasses.asdict(before))
    assert matepoint.get_options() == before


def test_per_call_options_override_the_settings(transport: CPUTestTransport) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    strict = matepoint.OffloadOptions(min_offload_bytes=1 << 20)
    y = matepoint.checkpoint(torch.sin, x * 1, offload=strict)  # the fixture's setting moves all
    assert matepoint.stats().offloads == 0
    assert matepoint.stats().skipped_small == 1
    z = matepoint.checkpoint(torch.sin, y, offload=True)
    assert matepoint.stats().offloads == 1
    off = matepoint.checkpoint(torch.sin, z * 1, offload=matepoint.OffloadOptions(enabled=False))
    assert matepoint.stats().offloads == 1
    off.sum().backward()
    torch.testing.assert_close(
        x.grad, torch.cos(torch.sin(torch.sin(x))) * torch.cos(torch.sin(x)) * torch.cos(x)
    )


def test_a_call_can_choose_synchronous_copies(transport: CPUTestTransport) -> None:
    """pipeline=False per call: the copy is done on return (no side-stream event)."""
    x = torch.randn(4, 16, requires_grad=True)
    y = matepoint.checkpoint(torch.sin, x * 1, offload=matepoint.OffloadOptions(pipeline=False))
    assert transport.copies_out == 1
    assert not transport.pending  # nothing queued on the stand-in side stream
    y.sum().backward()


def test_options_are_resolved_when_the_checkpoint_is_taken(transport: CPUTestTransport) -> None:
    # Changing the settings between forward and backward does not change a taken checkpoint.
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
    with pytest.raises(TypeError, match=r"matepoint\.configure"):
        matepoint.checkpoint(torch.sin, x, offload=matepoint.get_options())  # type: ignore[arg-type]


def test_device_settings_per_call_still_work_with_a_warning(transport: CPUTestTransport) -> None:
    """The 0.2.0 spelling OffloadOptions(prefetch=0, ...) applies to its call, and warns."""
    with pytest.warns(MatepointDeprecationWarning, match="prefetch="):
        old = matepoint.OffloadOptions(min_offload_bytes=0, prefetch=0, max_inflight_bytes=0)
    resolved = _options.resolve(old)
    assert resolved is not None
    assert (resolved.prefetch, resolved.max_inflight_bytes) == (0, 0)
    x = torch.randn(4, 16, requires_grad=True)
    h = matepoint.checkpoint(torch.sin, x * 1, offload=old)
    h = matepoint.checkpoint(torch.sin, h * 1, offload=old)
    h.sum().backward()
    assert matepoint.stats().prefetches == 0
    with pytest.warns(MatepointDeprecationWarning):
        matepoint.OffloadOptions(pool_cap_bytes=1)
    with pytest.raises(ValueError, match="stash_bytes"):
        matepoint.OffloadOptions(stash_bytes=-1)


def test_side_stream_delay_is_a_test_knob_of_the_transport() -> None:
    resolved = _options.resolve(None)
    with delay_side_stream(1000):
        assert _side_stream_delay.side_stream_delay() == 1000
        # Not an option of a call: the resolution does not change with it.
        assert _options.resolve(None) is resolved
        assert not hasattr(resolved, "side_stream_delay_cycles")
    assert _side_stream_delay.side_stream_delay() == 0
    with (
        pytest.warns(MatepointDeprecationWarning, match="delay_side_stream"),
        matepoint.options(side_stream_delay_cycles=5),
    ):
        assert _side_stream_delay.side_stream_delay() == 5
    assert _side_stream_delay.side_stream_delay() == 0
    with pytest.warns(MatepointDeprecationWarning, match="per call it has no effect"):
        per_call = matepoint.OffloadOptions(side_stream_delay_cycles=5)
    assert _options.resolve(per_call) is not None
    assert _side_stream_delay.side_stream_delay() == 0


def test_the_deprecated_delay_warns_at_the_callers_line_and_is_checked_first() -> None:
    with pytest.warns(MatepointDeprecationWarning) as configured:
        matepoint.configure(side_stream_delay_cycles=0)
    with (
        pytest.warns(MatepointDeprecationWarning) as entered,
        matepoint.options(side_stream_delay_cycles=0),
    ):
        pass
    assert [caught[0].filename for caught in (configured, entered)] == [__file__, __file__]
    # A bad value anywhere changes nothing, the delay included (options() restores nothing).
    with (
        pytest.warns(MatepointDeprecationWarning),
        pytest.raises(ValueError, match="prefetch"),
        matepoint.options(side_stream_delay_cycles=5, prefetch=-1),
    ):
        pass
    with (
        pytest.raises(TypeError, match="bogus"),
        matepoint.options(side_stream_delay_cycles=5, bogus=1),
    ):
        pass
    assert _side_stream_delay.side_stream_delay() == 0
    with (
        pytest.warns(MatepointDeprecationWarning),
        pytest.raises(ValueError, match=r"settings\.side_stream_delay_cycles"),
    ):
        matepoint.configure(side_stream_delay_cycles=-1)
    assert _side_stream_delay.side_stream_delay() == 0


def test_resolution_is_reused_while_nothing_changes() -> None:
    call = matepoint.OffloadOptions(min_offload_bytes=0)
    first = _options.resolve(call)
    assert _options.resolve(call) is first
    with matepoint.options(prefetch=3):
        changed = _options.resolve(call)
        assert changed is not first
        assert changed is not None
        assert changed.prefetch == 3


def test_replace_keeps_options_and_their_deprecated_settings_without_a_new_warning() -> None:
    """dataclasses.replace passed the hidden field back to __init__, which refused it by name."""
    base = matepoint.OffloadOptions(min_offload_bytes=0)
    changed = dataclasses.replace(base, min_offload_bytes=4096)
    assert (changed.min_offload_bytes, changed.enabled, changed.pipeline) == (4096, True, None)
    with pytest.warns(MatepointDeprecationWarning):
        old = matepoint.OffloadOptions(prefetch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dataclasses.replace(old, pipeline=False)
    assert again.deprecated_settings == (("prefetch", 0),)
    resolved = _options.resolve(again)
    assert resolved is not None
    assert (resolved.prefetch, resolved.pipelined) == (0, False)
    with pytest.raises(TypeError, match="deprecated_settings"):
        matepoint.OffloadOptions(deprecated_settings=(("bogus", 1),))


def test_options_blocks_overlapping_in_two_threads_undo_only_their_own_fields() -> None:
    """A enters, B enters, A leaves, B leaves: each block restores exactly what it set."""
    before = matepoint.get_options()
    a_entered, b_entered, a_left = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, tuple[int, bool]] = {}
    failures: list[BaseException] = []

    def snapshot(label: str) -> None:
        current = matepoint.get_options()
        seen[label] = (current.prefetch, current.measure_waits)

    def thread_a() -> None:
        try:
            with matepoint.options(prefetch=5):
                a_entered.set()
                assert b_entered.wait(10)
            a_left.set()
        except BaseException as error:  # reported by the main thread
            failures.append(error)
            a_left.set()

    def thread_b() -> None:
        try:
            assert a_entered.wait(10)
            with matepoint.options(measure_waits=False):
                b_entered.set()
                assert a_left.wait(10)
                snapshot("b after a left")
        except BaseException as error:
            failures.append(error)
            b_entered.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert not failures, failures
    assert seen["b after a left"] == (before.prefetch, False)
    assert matepoint.get_options() == before


def test_configure_inside_a_block_stays_after_it() -> None:
    before = matepoint.get_options()
    try:
        with matepoint.options(prefetch=7, stash_bytes=11):
            assert matepoint.configure(prefetch=3).prefetch == 3
            assert matepoint.get_options().stash_bytes == 11
        assert (matepoint.get_options().prefetch, matepoint.get_options().stash_bytes) == (
            3,
            before.stash_bytes,
        )
    finally:
        matepoint.configure(**dataclasses.asdict(before))


def test_a_pipeline_that_is_not_a_bool_is_refused_everywhere() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(TypeError, match=r"pipeline= must be True or False, got 'no'"):
        matepoint.checkpoint(torch.sin, x, pipeline="no")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="pipeline="):
        matepoint.checkpoint(pipeline="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"OffloadOptions\.pipeline must be True, False or None"):
        matepoint.OffloadOptions(pipeline="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"OffloadOptions\.enabled must be True or False"):
        matepoint.OffloadOptions(enabled="no")  # type: ignore[arg-type]


def test_a_decorated_function_warns_about_0_1_keywords_at_the_callers_line() -> None:
    block = matepoint.checkpoint()(torch.sin)
    x = torch.randn(4, 16, requires_grad=True)
    line = inspect.currentframe().f_lineno + 2  # type: ignore[union-attr]
    with pytest.warns(MatepointDeprecationWarning, match="stream=") as caught:
        block(x, stream=None)
    assert (caught[0].filename, caught[0].lineno) == (__file__, line)


def test_settings_errors_name_the_call_and_the_unit() -> None:
    with pytest.raises(ValueError, match=r"matepoint\.configure: .*stash_bytes.*number of bytes"):
        matepoint.configure(stash_bytes="1GB")
    with (
        pytest.raises(ValueError, match=r"matepoint\.options: .*prefetch must be an int >= 0"),
        matepoint.options(prefetch=-1),
    ):
        pass


def test_a_setting_passed_to_checkpoint_says_where_it_belongs() -> None:
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(TypeError, match=r"'prefetch'.*matepoint\.configure\(prefetch=4\)"):
        matepoint.checkpoint(torch.sin, x, prefetch=4)
    with pytest.raises(TypeError, match=r"OffloadOptions\(min_offload_bytes=0\)"):
        matepoint.checkpoint(torch.sin, x, min_offload_bytes=0)

    def takes_prefetch(h: torch.Tensor, prefetch: int) -> torch.Tensor:
        return h * prefetch

    y = matepoint.checkpoint(takes_prefetch, x, prefetch=4)  # its own keyword: passed on
    torch.testing.assert_close(y, x * 4)
