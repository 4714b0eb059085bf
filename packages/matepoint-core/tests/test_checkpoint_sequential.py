"""Parity of ``matepoint.checkpoint_sequential`` with torch's ``checkpoint_sequential`` on the CPU.

Same method as ``test_checkpoint.py``: identically seeded twins, one step each, outputs and
gradients compared bitwise, warnings and exception types compared, and a check that matepoint
really offloaded each checkpointed segment's input.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils import _pytree as pytree

import matepoint
from matepoint.testing import CPUTestTransport
from matepoint_compat import ignore_torch_warnings

SEED = 4321
WIDTH = 16
LAYERS = 8

Sequential = Callable[..., Any]


class Outcome(NamedTuple):
    kind: str  # "ok" or "raised"
    value: Any
    warnings: list[tuple[type[Warning], str]]


def make_functions(container: str) -> tuple[Any, nn.Module]:
    """Eight layers with dropout; as an nn.Sequential, or a list mixing modules and functions."""
    layers: list[Any] = []
    for index in range(LAYERS // 2):
        layers.append(nn.Linear(WIDTH, WIDTH))
        layers.append(nn.Dropout(0.25) if index % 2 else nn.Tanh())
    holder = nn.ModuleList(layer for layer in layers if isinstance(layer, nn.Module))
    if container == "sequential":
        return nn.Sequential(*layers), holder
    # Plain functions are allowed in the list form.
    layers[1] = torch.tanh
    return layers, holder


def step_for(
    container: str, segments: int, input_requires_grad: bool = True
) -> Callable[[Sequential], Any]:
    def step(checkpoint_sequential: Sequential) -> Any:
        functions, holder = make_functions(container)
        x = torch.randn(4, WIDTH, requires_grad=input_requires_grad)
        out = checkpoint_sequential(functions, segments, x)
        out.square().sum().backward()
        return out.detach(), x.grad, [parameter.grad for parameter in holder.parameters()]

    return step


def outcome(step: Callable[[Sequential], Any], sequential: Sequential) -> Outcome:
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_torch_warnings()  # torch's own, on some releases (both sides would record them)
        try:
            result: tuple[str, Any] = ("ok", step(sequential))
        except Exception as error:  # parity covers the failure cases too
            result = ("raised", error)
    return Outcome(*result, [(w.category, str(w.message)) for w in caught])


def assert_same_outcome(mine: Outcome, reference: Outcome, *, same_warnings: bool = True) -> None:
    if same_warnings:
        assert mine.warnings == reference.warnings
    if reference.kind == "raised":
        assert mine.kind == "raised", f"torch raised {reference.value!r}, matepoint returned"
        assert isinstance(mine.value, type(reference.value)), (mine.value, reference.value)
        return
    if mine.kind == "raised":
        raise AssertionError("matepoint raised where torch did not") from mine.value
    mine_leaves, mine_spec = pytree.tree_flatten(mine.value)
    reference_leaves, reference_spec = pytree.tree_flatten(reference.value)
    assert mine_spec == reference_spec
    for index, (a, b) in enumerate(zip(mine_leaves, reference_leaves, strict=True)):
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"leaf {index} is not a tensor"
            assert torch.equal(a, b), f"leaf {index} differs"
        else:
            assert a == b, f"leaf {index}: {a!r} != {b!r}"


def ours(pipeline: bool, use_reentrant: bool | None, **extra: Any) -> Sequential:
    return functools.partial(
        matepoint.checkpoint_sequential, use_reentrant=use_reentrant, pipeline=pipeline, **extra
    )


def theirs(use_reentrant: bool | None, **extra: Any) -> Sequential:
    return functools.partial(
        torch_checkpoint.checkpoint_sequential, use_reentrant=use_reentrant, **extra
    )


@pytest.mark.parametrize("container", ["sequential", "list"])
@pytest.mark.parametrize("segments", [1, 2, 4])
def test_matches_torch(
    cpu_transport: CPUTestTransport,
    pipeline: bool,
    use_reentrant: bool,
    container: str,
    segments: int,
) -> None:
    step = step_for(container, segments)
    mine = outcome(step, ours(pipeline, use_reentrant))
    stats = matepoint.stats()
    reference = outcome(step, theirs(use_reentrant))
    assert reference.kind == "ok"
    assert_same_outcome(mine, reference)
    # Every segment but the last is checkpointed; each saves its one input tensor (segments=1
    # checkpoints nothing, in torch as here).
    assert stats.offloads == segments - 1
    assert cpu_transport.copies_out == segments - 1
    if segments == 4:
        # Segment inputs after the first are intermediates: they came back from the host.
        assert stats.fetches > 0


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_preserve_rng_state(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, preserve_rng_state: bool
) -> None:
    step = step_for("sequential", 4)
    mine = outcome(step, ours(pipeline, use_reentrant, preserve_rng_state=preserve_rng_state))
    stats = matepoint.stats()
    reference = outcome(step, theirs(use_reentrant, preserve_rng_state=preserve_rng_state))
    assert reference.kind == "ok"
    assert_same_outcome(mine, reference)
    assert stats.offloads == 3


def test_input_without_grad(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    """Data fed to the first layer needs no grad.

    Reentrant torch warns for each segment and, since no checkpoint input requires grad, gives
    no gradients to the checkpointed segments' parameters and saves nothing (torch's known
    limitation); matepoint must do exactly the same.
    """
    step = step_for("sequential", 4, input_requires_grad=False)
    mine = outcome(step, ours(pipeline, use_reentrant))
    stats = matepoint.stats()
    reference = outcome(step, theirs(use_reentrant))
    assert reference.kind == "ok"
    assert_same_outcome(mine, reference)
    if use_reentrant:
        assert len(reference.warnings) == 3
        assert stats.offloads == 0
    else:
        assert reference.warnings == []
        assert stats.offloads == 3


def test_use_reentrant_none_warns_and_means_true(
    cpu_transport: CPUTestTransport, pipeline: bool
) -> None:
    step = step_for("sequential", 4)
    mine = outcome(step, ours(pipeline, None))
    stats = matepoint.stats()
    reference = outcome(step, theirs(None))
    assert reference.kind == "ok"
    # matepoint words its own warning (it names matepoint.checkpoint_sequential), same category.
    assert_same_outcome(mine, reference, same_warnings=False)
    assert [category for category, _ in mine.warnings] == [UserWarning]
    assert "use_reentrant" in mine.warnings[0][1]
    assert stats.offloads == 3
    # ... and equal to an explicit use_reentrant=True run.
    assert_same_outcome(outcome(step, ours(pipeline, True)), outcome(step, theirs(True)))


def test_unexpected_keyword_raises_like_torch(pipeline: bool, use_reentrant: bool) -> None:
    step = step_for("sequential", 2)
    mine = outcome(step, ours(pipeline, use_reentrant, context_fn=None))
    reference = outcome(step, theirs(use_reentrant, context_fn=None))
    assert reference.kind == "raised"
    assert isinstance(reference.value, ValueError)
    assert_same_outcome(mine, reference)
    assert "Unexpected keyword arguments" in str(mine.value)


def test_more_segments_than_layers_raises_like_torch(pipeline: bool, use_reentrant: bool) -> None:
    step = step_for("sequential", 2 * LAYERS)
    mine = outcome(step, ours(pipeline, use_reentrant))
    reference = outcome(step, theirs(use_reentrant))
    assert reference.kind == "raised"
    assert_same_outcome(mine, reference)


def test_offload_false_and_per_call_options(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    step = step_for("list", 4)
    reference = outcome(step, theirs(use_reentrant))
    assert reference.kind == "ok"

    assert_same_outcome(outcome(step, ours(pipeline, use_reentrant, offload=False)), reference)
    assert matepoint.stats().offloads == 0
    assert cpu_transport.copies_out == 0

    per_call = matepoint.OffloadOptions(min_offload_bytes=0)
    with matepoint.options(prefetch=0, max_inflight_bytes=0):
        mine = outcome(step, ours(pipeline, use_reentrant, offload=per_call))
    assert_same_outcome(mine, reference)
    stats = matepoint.stats()
    assert stats.offloads == 3
    assert stats.prefetches == 0
    assert stats.fetches > 0
