"""saved_tensors_hooks_active / _enabled: reading torch's saved-tensor hook stack."""

from __future__ import annotations

import threading

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

import matepoint_compat as compat


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def test_inactive_outside_any_context() -> None:
    assert compat.saved_tensors_hooks_active() is False


def test_active_inside_a_context_and_restored_after() -> None:
    with saved_tensors_hooks(_identity, _identity):
        assert compat.saved_tensors_hooks_active() is True
        with saved_tensors_hooks(_identity, _identity):
            assert compat.saved_tensors_hooks_active() is True
        assert compat.saved_tensors_hooks_active() is True
    assert compat.saved_tensors_hooks_active() is False


def test_active_inside_save_on_cpu() -> None:
    with save_on_cpu():
        assert compat.saved_tensors_hooks_active() is True
    assert compat.saved_tensors_hooks_active() is False


def test_inactive_after_an_exception_in_the_context() -> None:
    try:
        with saved_tensors_hooks(_identity, _identity):
            raise KeyError("x")
    except KeyError:
        pass
    assert compat.saved_tensors_hooks_active() is False


def test_hook_stack_is_per_thread() -> None:
    seen: list[bool] = []
    with saved_tensors_hooks(_identity, _identity):
        thread = threading.Thread(target=lambda: seen.append(compat.saved_tensors_hooks_active()))
        thread.start()
        thread.join()
        assert compat.saved_tensors_hooks_active() is True
    assert seen == [False]


def test_active_inside_a_checkpointed_function() -> None:
    # torch's checkpoint installs its own hooks while running the function.
    seen: list[bool] = []

    def function(x: torch.Tensor) -> torch.Tensor:
        seen.append(compat.saved_tensors_hooks_active())
        return torch.sin(x)

    x = torch.randn(4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(function, x, use_reentrant=False).sum().backward()
    assert seen
    assert all(seen)


def test_enabled_by_default() -> None:
    assert compat.saved_tensors_hooks_enabled() is True


def test_disabled_when_torch_disables_hooks() -> None:
    disable = getattr(torch._C._autograd, "_saved_tensors_hooks_disable", None)
    enable = getattr(torch._C._autograd, "_saved_tensors_hooks_enable", None)
    if disable is None or enable is None:
        return
    disable("disabled for the test")
    try:
        assert compat.saved_tensors_hooks_enabled() is False
    finally:
        enable()
    assert compat.saved_tensors_hooks_enabled() is True
