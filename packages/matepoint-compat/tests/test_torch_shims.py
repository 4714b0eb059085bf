"""The per-release shims of matepoint_compat, pinned on the releases where each one applies.

Each test is skipped (by gate) where its shim is not in force, so when a gate's release becomes
the oldest supported one, its shim and these tests go together.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks

import matepoint_compat as compat
from matepoint_compat import _hooks


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


# --- saved-tensor hook depth counter (torch 2.4-2.7, gate TORCH_2_8_PLUS) -----------------------


@pytest.mark.skipif(compat.TORCH_2_8_PLUS, reason="torch >= 2.8 reads the hook stack itself")
def test_hook_depth_counter_wraps_torchs_push_and_pop() -> None:
    autograd = torch._C._autograd
    assert not hasattr(autograd, "_top_saved_tensors_default_hooks")
    assert getattr(autograd._push_saved_tensors_default_hooks, "_matepoint_counts_depth", False)
    assert getattr(autograd._pop_saved_tensors_default_hooks, "_matepoint_counts_depth", False)
    _hooks._install_hook_depth_counter()  # idempotent: never wraps twice
    assert _hooks._HOOK_DEPTH.depth == 0


@pytest.mark.skipif(compat.TORCH_2_8_PLUS, reason="torch >= 2.8 reads the hook stack itself")
def test_hook_depth_counts_nested_contexts() -> None:
    with saved_tensors_hooks(_identity, _identity):
        assert _hooks._HOOK_DEPTH.depth == 1
        with save_on_cpu():
            assert _hooks._HOOK_DEPTH.depth == 2
        assert _hooks._HOOK_DEPTH.depth == 1
    assert _hooks._HOOK_DEPTH.depth == 0


@pytest.mark.skipif(compat.TORCH_2_8_PLUS, reason="torch >= 2.8 reads the hook stack itself")
def test_hook_depth_sees_torch_checkpoint_forward_and_recompute() -> None:
    depths: list[int] = []

    def function(x: torch.Tensor) -> torch.Tensor:
        depths.append(_hooks._HOOK_DEPTH.depth)
        return torch.sin(x)

    x = torch.randn(4, requires_grad=True)
    torch_checkpoint.checkpoint(function, x, use_reentrant=False).sum().backward()
    assert len(depths) == 2  # forward, then recomputation in backward
    assert all(depth >= 1 for depth in depths)
    assert _hooks._HOOK_DEPTH.depth == 0


@pytest.mark.skipif(compat.TORCH_2_8_PLUS, reason="torch >= 2.8 reads the hook stack itself")
def test_hook_depth_never_goes_negative() -> None:
    # A context pushed before the counter existed pops one more than was counted.
    torch._C._autograd._push_saved_tensors_default_hooks(_identity, _identity)
    _hooks._HOOK_DEPTH.depth = 0
    torch._C._autograd._pop_saved_tensors_default_hooks()
    assert _hooks._HOOK_DEPTH.depth == 0
    assert compat.saved_tensors_hooks_active() is False


@pytest.mark.skipif(not compat.TORCH_2_8_PLUS, reason="torch < 2.8 has no hook-stack query")
def test_torch_reads_the_hook_stack_and_push_is_not_wrapped() -> None:
    autograd = torch._C._autograd
    assert callable(autograd._top_saved_tensors_default_hooks)
    assert not hasattr(autograd._push_saved_tensors_default_hooks, "_matepoint_counts_depth")
    with saved_tensors_hooks(_identity, _identity):
        assert autograd._top_saved_tensors_default_hooks(False) is not None
    assert autograd._top_saved_tensors_default_hooks(False) is None


# --- torch's own warnings (torch 2.4, gate TORCH_2_5_PLUS) ----------------------------------------


def _checkpoint_backward_warnings() -> list[warnings.WarningMessage]:
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    return caught


@pytest.mark.skipif(compat.TORCH_2_5_PLUS, reason="torch >= 2.5 recomputes without the warning")
def test_torch_2_4_checkpoint_warns_about_its_own_autocast_call() -> None:
    assert len(compat.TORCH_WARNING_FILTERS) == 1
    caught = [w for w in _checkpoint_backward_warnings() if issubclass(w.category, FutureWarning)]
    assert caught, "torch 2.4's checkpoint no longer warns: drop the filter"
    message = str(caught[0].message)
    assert message.startswith("`torch.cpu.amp.autocast(args...)` is deprecated")
    action, pattern, category = compat.TORCH_WARNING_FILTERS[0].split(":")
    assert (action, category) == ("ignore", "FutureWarning")
    assert re.match(pattern, message)


@pytest.mark.skipif(not compat.TORCH_2_5_PLUS, reason="torch 2.4 warns in its own checkpoint")
def test_no_torch_warning_filters_from_2_5() -> None:
    assert compat.TORCH_WARNING_FILTERS == ()
    caught = [w for w in _checkpoint_backward_warnings() if issubclass(w.category, FutureWarning)]
    assert caught == []


# --- pytree (every release; no gate) -----------------------------------------------------------


def test_tree_flatten_reaches_tensors_in_every_container_core_flattens() -> None:
    import collections

    point = collections.namedtuple("point", "x y")
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    tree = ((a, [b, {"c": c}], point(d, 1)), {"scale": 2.0, "od": collections.OrderedDict(k=a)})
    leaves, spec = compat.tree_flatten(tree)
    assert sum(isinstance(leaf, torch.Tensor) for leaf in leaves) == 5
    rebuilt = compat.tree_unflatten(leaves, spec)
    assert rebuilt[0][2] == point(d, 1)
    assert type(rebuilt[1]["od"]) is collections.OrderedDict
    assert rebuilt[0][1][1]["c"] is c


def test_ignore_torch_warnings_drops_only_torchs_own() -> None:
    x = torch.randn(4, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.ignore_torch_warnings()
        torch_checkpoint.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
        warnings.warn("raised by matepoint itself", FutureWarning, stacklevel=1)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert future == ["raised by matepoint itself"]


# --- no-op checkpoint context (dynamo before torch 2.8) ------------------------------------------


def test_no_op_checkpoint_context_is_nullcontext() -> None:
    # dynamo before 2.8 fails on a live @contextmanager generator across matepoint's graph break
    # ("NYI: Returning a @contextmanager object from a torch.compile function").
    import contextlib

    context = compat.adapt_checkpoint_kwargs({}, use_reentrant=False)
    assert isinstance(context, contextlib.nullcontext)


# --- torch's checkpoint wrapper (a private module, same API on every release) ------------------


def test_checkpoint_wrapper_shims_reach_torchs_wrapper() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    calls: list[torch.nn.Module] = []

    def checkpoint_fn(function: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
        calls.append(function)
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    compat.torch_apply_activation_checkpointing(
        model,
        lambda module: compat.torch_checkpoint_wrapper(module, checkpoint_fn),
        check_fn=lambda module: isinstance(module, torch.nn.Linear),
        auto_wrap_policy=None,
    )
    assert isinstance(model[0], CheckpointWrapper)
    assert not isinstance(model[1], CheckpointWrapper)
    model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert len(calls) == 1


# --- private tensor attributes the core reads directly (every release) ------------------------


def test_private_tensor_attributes_the_core_reads_keep_their_meaning() -> None:
    # See Note [Private tensor attributes read directly] in matepoint_compat.
    parameter = torch.nn.Parameter(torch.zeros(4, 4))
    view = parameter[1:]
    assert view._is_view()
    assert view._base is parameter
    assert not parameter._is_view()
    assert parameter._base is None
    base = torch.zeros(4)
    alias = base[:2]
    before = base._version
    alias.add_(1)  # a write through a view bumps the counter the base shares
    assert base._version == alias._version == before + 1
