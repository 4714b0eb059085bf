"""adapt_checkpoint_kwargs on the installed torch: what it rewrites, adds, refuses."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat


def _enter(context: contextlib.AbstractContextManager[None]) -> None:
    with context:
        pass


def test_plain_options_pass_through_unchanged() -> None:
    kwargs = {"preserve_rng_state": False, "determinism_check": "none", "debug": False}
    context = compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    assert kwargs == {"preserve_rng_state": False, "determinism_check": "none", "debug": False}
    _enter(context)


@pytest.mark.skipif(compat.TORCH_2_14_PLUS, reason="torch >= 2.14 has respect_saved_tensors_hooks")
@pytest.mark.parametrize("value", [True, False])
def test_respect_saved_tensors_hooks_needs_torch_2_14(value: bool) -> None:
    kwargs = {"respect_saved_tensors_hooks": value}
    with pytest.raises(TypeError, match=r"torch>=2\.14") as caught:
        compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    installed = ".".join(str(part) for part in compat.TORCH_VERSION)
    assert installed in str(caught.value)


@pytest.mark.skipif(not compat.TORCH_2_14_PLUS, reason="needs torch >= 2.14")
def test_respect_saved_tensors_hooks_passes_through_on_2_14() -> None:
    kwargs = {"respect_saved_tensors_hooks": True, "context_fn": contextlib.nullcontext}
    compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    assert kwargs["respect_saved_tensors_hooks"] is True


def test_context_fn_without_explicit_choice() -> None:
    kwargs = {"context_fn": torch_checkpoint.noop_context_fn}
    compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    if compat.TORCH_2_14_PLUS:
        assert kwargs["respect_saved_tensors_hooks"] is False
    else:
        assert "respect_saved_tensors_hooks" not in kwargs


def test_reentrant_context_fn_is_left_alone() -> None:
    kwargs = {"context_fn": torch_checkpoint.noop_context_fn}
    compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=True)
    assert kwargs == {"context_fn": torch_checkpoint.noop_context_fn}


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_early_stop(use_reentrant: bool) -> None:
    kwargs = {"early_stop": False}
    context = compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=use_reentrant)
    if compat.TORCH_2_9_PLUS:
        assert kwargs == {"early_stop": False}  # torch takes the keyword itself
    else:
        assert "early_stop" not in kwargs  # the shim applies it around the call instead
    _enter(context)


@pytest.mark.skipif(compat.TORCH_2_9_PLUS, reason="torch >= 2.9 takes early_stop= itself")
def test_early_stop_shim_sets_torch_global_inside_the_context() -> None:
    kwargs = {"early_stop": False}
    before = torch_checkpoint._enable_checkpoint_early_stop  # True on torch 2.4-2.8
    context = compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    with context:
        assert torch_checkpoint._enable_checkpoint_early_stop is False
    assert torch_checkpoint._enable_checkpoint_early_stop is before


def test_adapted_kwargs_are_accepted_by_torch_checkpoint() -> None:
    kwargs: dict[str, object] = {"early_stop": True, "context_fn": torch_checkpoint.noop_context_fn}
    context = compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    x = torch.randn(4, requires_grad=True)
    with context:
        y = torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False, **kwargs)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def test_empty_kwargs_give_a_usable_context() -> None:
    kwargs: dict[str, object] = {}
    context = compat.adapt_checkpoint_kwargs(kwargs, use_reentrant=False)
    assert kwargs == {}
    _enter(context)


# -- unwind_failed_checkpoint -----------------------------------------------------------------


def _fail(tensor: torch.Tensor) -> torch.Tensor:
    raise ValueError("the checkpointed function failed")


def _failed_checkpoint_under_outer_hooks(*, unwind: bool) -> BaseException:
    """A raising non-reentrant checkpoint inside a hook context; the error is kept alive."""
    x = torch.randn(3, requires_grad=True) * 1
    caught: list[BaseException] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        context = compat.unwind_failed_checkpoint() if unwind else contextlib.nullcontext()
        try:
            with context:
                torch_checkpoint.checkpoint(_fail, x, use_reentrant=False)
        except ValueError as error:
            caught.append(error)  # its traceback keeps torch's checkpoint frame alive
    assert len(caught) == 1
    return caught[0]


def test_failed_checkpoint_leaves_no_saved_tensor_hooks() -> None:
    error = _failed_checkpoint_under_outer_hooks(unwind=True)
    assert not compat.saved_tensors_hooks_active()
    assert error.__traceback__ is not None  # the exception reaches the caller unchanged
    assert "failed" in str(error)


@pytest.mark.skipif(compat.TORCH_2_13_PLUS, reason="torch >= 2.13 unwinds a failed forward itself")
def test_torch_before_2_13_leaves_hooks_pushed_without_the_shim() -> None:
    error = _failed_checkpoint_under_outer_hooks(unwind=False)
    try:
        # The outer context popped torch's checkpoint hooks; its own are still pushed.
        assert compat.saved_tensors_hooks_active()
    finally:
        del error  # with the cycle through the helper's frame gone, torch's generator closes
        gc.collect()  # and pops the outer context's hooks
    assert not compat.saved_tensors_hooks_active()
