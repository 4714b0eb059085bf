"""The matepoint 0.1.x surface through ``import matepoint``: it warns at the user's line and
still trains right.

``matepoint.NOPIPELINE = True`` must really switch pipelining off (no prefetches, no side-stream
copies); the old names import with one warning each; the old keyword arguments are dropped with a
warning and the gradients stay equal to torch's. ``test_monitor`` runs ``matepoint_pipeline``.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _helpers import Stack, assert_grads_equal, grads_of, mate_ckpt, torch_ckpt

import matepoint
from matepoint.testing import CPUTestTransport
from matepoint_compat import MatepointDeprecationWarning

LEGACY_KWARGS: dict[str, Any] = {
    "stream": None,
    "matepoint_ctx": [],
    "check_inplace_modifications": 1,
}


def test_nopipeline_warns_at_the_assignment_and_disables_pipelining(
    cpu_transport: CPUTestTransport,
) -> None:
    model, x = Stack(depth=6), torch.randn(4, 16)
    reference = grads_of(model, x, torch_ckpt)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    pipelined = matepoint.stats()
    assert pipelined.prefetches > 0

    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning, match=r"NOPIPELINE.*pipeline=False") as caught:
        matepoint.NOPIPELINE = True
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
    assert matepoint.NOPIPELINE is True

    # Read at call time, and stronger than the call's pipeline=True: copies are synchronous.
    matepoint.reset_stats()
    queued_before = len(cpu_transport.pending)
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    synchronous = matepoint.stats()
    assert synchronous.offloads == pipelined.offloads
    assert (synchronous.prefetches, synchronous.prefetch_hits) == (0, 0)
    assert len(cpu_transport.pending) == queued_before

    with pytest.warns(MatepointDeprecationWarning, match="NOPIPELINE"):
        matepoint.NOPIPELINE = False
    matepoint.reset_stats()
    assert_grads_equal(grads_of(model, x, mate_ckpt), reference)
    assert matepoint.stats().prefetches > 0

    del matepoint.NOPIPELINE  # never set again: reading warns and gives the default
    with pytest.warns(MatepointDeprecationWarning, match="pipeline=False"):
        assert matepoint.NOPIPELINE is False


def test_old_names_import_with_one_warning_each_at_the_users_line() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own action for a FutureWarning
        line = sys._getframe().f_lineno + 1
        from matepoint import NOPIPELINE, Gmatepoint_ctx, Gmatepoint_stream, matepoint_pipeline
    names = ["NOPIPELINE", "Gmatepoint_ctx", "Gmatepoint_stream", "matepoint_pipeline"]
    assert [str(w.message).split("`")[1] for w in caught] == [f"matepoint.{n}" for n in names]
    assert all(issubclass(w.category, MatepointDeprecationWarning) for w in caught)
    assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
    assert "prefetch_now" in str(caught[3].message)
    assert (NOPIPELINE, Gmatepoint_stream, Gmatepoint_ctx) == (False, None, [])
    assert callable(matepoint_pipeline)
    with pytest.warns(MatepointDeprecationWarning):
        assert matepoint.Gmatepoint_ctx is Gmatepoint_ctx  # one list, whoever imported it


def test_other_names_behave_as_on_a_plain_module() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="module 'matepoint' has no attribute 'nope'"):
            _ = matepoint.nope  # type: ignore[attr-defined]
        assert not hasattr(matepoint, "NoPipeline")
        matepoint.answer = 42  # type: ignore[attr-defined]
        del matepoint.answer  # type: ignore[attr-defined]


@pytest.mark.parametrize("names", [*([name] for name in LEGACY_KWARGS), list(LEGACY_KWARGS)])
def test_legacy_kwargs_warn_at_the_call_and_give_torch_gradients(
    cpu_transport: CPUTestTransport, names: list[str]
) -> None:
    def legacy_checkpoint(function: Callable[..., Any], *args: Any) -> Any:
        line = sys._getframe().f_lineno + 2
        with pytest.warns(MatepointDeprecationWarning) as caught:
            out = matepoint.checkpoint(function, *args, **{n: LEGACY_KWARGS[n] for n in names})
        assert [str(w.message).split("=")[0].strip("`") for w in caught] == names
        assert {(w.filename, w.lineno) for w in caught} == {(__file__, line)}
        return out

    model, x = Stack(), torch.randn(4, 16)
    assert_grads_equal(grads_of(model, x, legacy_checkpoint), grads_of(model, x, torch_ckpt))
    assert matepoint.stats().offloads > 0


def test_legacy_kwarg_in_checkpoint_sequential(cpu_transport: CPUTestTransport) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    x = torch.randn(4, 16, requires_grad=True)
    line = sys._getframe().f_lineno + 2
    with pytest.warns(MatepointDeprecationWarning, match="`stream=`") as caught:
        out = matepoint.checkpoint_sequential(model, 4, x, stream=None)
    assert [(w.filename, w.lineno) for w in caught] == [(__file__, line)]
    out.sum().backward()
    assert matepoint.stats().offloads == 3
