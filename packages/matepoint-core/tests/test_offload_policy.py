"""Selective checkpointing's CPU-offload values: what a policy offloads goes to the host and back.

See Note [Offloading what a selective policy saves] (matepoint/_selective.py). The reference is
torch's selective checkpoint with ``MUST_SAVE`` for the same ops: the op is not recomputed and
the gradients are bitwise equal; matepoint only keeps the saved outputs on the host in between.
Every test runs through the CPU test transport, whose copies complete only at sync points.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import matepoint
import matepoint_compat as compat
from matepoint._engine.stats import format_bytes
from matepoint.testing import CPUTestTransport, use_transport

pytestmark = pytest.mark.skipif(
    not compat.SELECTIVE_OFFLOAD_POLICIES,
    reason="CheckpointPolicy has no CPU-offload values before torch 2.11",
)

WIDTH = 8
ROWS = 4
DEPTH = 3
OFFLOADED_OP = torch.ops.aten.addmm.default
# Each block runs two addmm (up and down projection): ROWS x 2*WIDTH and ROWS x WIDTH, fp32.
POLICY_BYTES_PER_BLOCK = ROWS * 2 * WIDTH * 4 + ROWS * WIDTH * 4

# Every original is let go as soon as its copy has finished: backward reads the host copies.
THROUGH_THE_HOST = {
    "min_offload_bytes": 0,
    "stash_bytes": 0,
    "max_inflight_bytes": 0,
    "prefetch": 2,
}


def policy_of(decision_name: str, chosen: Any) -> Callable[..., Any]:
    """A policy that answers ``decision_name`` for ``chosen`` and recompute for the rest."""
    decision = torch_checkpoint.CheckpointPolicy[decision_name]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op == chosen:
            return decision
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def sac(decision_name: str, chosen: Any = OFFLOADED_OP, **kwargs: Any) -> Callable[[], Any]:
    return functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts,
        policy_of(decision_name, chosen),
        **kwargs,
    )


class Block(nn.Module):
    """An MLP block with dropout: two addmm, a random op between them."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # tanh saves its result, so the recomputation needs the down projection too.
        return h + self.mlp(h)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        hidden = nn.functional.dropout(nn.functional.gelu(self.up(h)), p=0.25, training=True)
        return torch.tanh(self.down(hidden))


class Stack(nn.Module):
    def __init__(self, depth: int = DEPTH, residual: bool = True) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(7)
        self.blocks = nn.ModuleList(Block(generator) for _ in range(depth))
        self.residual = residual

    def forward(self, x: torch.Tensor, checkpoint: Callable[..., Any]) -> torch.Tensor:
        h = x * 1
        for block in self.blocks:
            h = checkpoint(block if self.residual else block.mlp, h)
        return h


class OpCounter(TorchDispatchMode):
    """Counts calls of ``OFFLOADED_OP`` that reach the dispatcher (recomputations included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == OFFLOADED_OP:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def torch_ckpt(decision_name: str, **sac_kwargs: Any) -> Callable[..., Any]:
    """torch's selective checkpoint with ``decision_name`` for the chosen op (addmm)."""

    def run(function: Callable[..., Any], *args: Any) -> Any:
        return torch_checkpoint.checkpoint(
            function, *args, use_reentrant=False, context_fn=sac(decision_name, **sac_kwargs)
        )

    return run


def mate_ckpt(decision_name: str, offload: Any = None, **sac_kwargs: Any) -> Callable[..., Any]:
    """matepoint's, with the same policy; ``offload=`` as in ``matepoint.checkpoint``."""

    def run(function: Callable[..., Any], *args: Any) -> Any:
        return matepoint.checkpoint(
            function, *args, context_fn=sac(decision_name, **sac_kwargs), offload=offload
        )

    return run


def step(
    checkpoint: Callable[..., Any], *, residual: bool = True
) -> tuple[list[torch.Tensor], int]:
    """One seeded forward and backward; the gradients and the addmm calls made in backward."""
    torch.manual_seed(1234)
    model = Stack(residual=residual)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    out = model(x, checkpoint)
    counter = OpCounter()
    with counter:
        out.square().sum().backward()
    assert x.grad is not None
    gradients = [x.grad] + [p.grad for p in model.parameters() if p.grad is not None]
    return [g.clone() for g in gradients], counter.calls


def assert_bitwise_equal(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert not torch.isnan(got).any(), "NaN: a host copy was read before it completed"
        assert torch.equal(got, want)


def assert_released() -> None:
    gc.collect()
    snapshot = matepoint.stats()
    assert snapshot.live_records == 0, "an offloaded tensor outlived its graph"
    assert snapshot.pool_in_use_bytes == 0
    assert snapshot.device_bytes_held == 0


@pytest.fixture(params=["deferred", "on_query", "immediate"])
def through_host(request: pytest.FixtureRequest) -> Iterator[CPUTestTransport]:
    """A CPU test transport in each completion mode; every original released after its copy."""
    transport = CPUTestTransport(completion=request.param)
    with use_transport(transport), matepoint.options(**THROUGH_THE_HOST):
        yield transport
        gc.collect()
        transport.drain()


@pytest.mark.parametrize("decision", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
@pytest.mark.parametrize("pipeline", [True, False], ids=["pipeline", "nopipeline"])
def test_offloaded_outputs_cross_to_the_host_and_match_torch_save(
    through_host: CPUTestTransport, decision: str, pipeline: bool
) -> None:
    """Gradients bitwise those of torch's MUST_SAVE; the outputs crossed to the host instead."""
    expected, torch_calls = step(torch_ckpt("MUST_SAVE"))
    assert torch_calls == 0
    matepoint.reset_stats()
    copies_out = through_host.copies_out
    actual, calls = step(mate_ckpt(decision, offload=matepoint.OffloadOptions(pipeline=pipeline)))
    assert_bitwise_equal(actual, expected)
    assert calls == 0, "an offloaded op was recomputed"
    stats = matepoint.stats()
    assert stats.policy_offloads == 2 * DEPTH
    assert stats.bytes_offloaded_by_policy == DEPTH * POLICY_BYTES_PER_BLOCK
    # Plus each checkpoint's input.
    assert stats.offloads == 3 * DEPTH
    assert through_host.copies_out - copies_out == stats.offloads
    # Nothing held them on the device: every one came back from its host copy.
    assert stats.bytes_fetched >= stats.bytes_offloaded_by_policy
    assert_released()


def test_torch_recomputes_what_its_eager_policy_offloads() -> None:
    """Why matepoint steps in: torch's eager checkpoint runs the op again in backward."""
    _, calls = step(torch_ckpt("MUST_CPU_OFFLOAD"))
    assert calls == 2 * DEPTH


def test_outputs_held_as_records_until_backward(through_host: CPUTestTransport) -> None:
    """After forward the policy's outputs are offloaded records, not device tensors."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    out = model(x, mate_ckpt("MUST_CPU_OFFLOAD"))
    through_host.drain()
    stats = matepoint.stats()
    assert stats.live_records == 3 * DEPTH
    assert stats.policy_offloads == 2 * DEPTH
    out.sum().backward()
    del out
    assert_released()


@pytest.mark.parametrize("decision", ["MUST_SAVE", "PREFER_SAVE"])
def test_save_values_stay_on_the_device(through_host: CPUTestTransport, decision: str) -> None:
    expected, _ = step(torch_ckpt(decision))
    matepoint.reset_stats()
    actual, calls = step(mate_ckpt(decision))
    assert_bitwise_equal(actual, expected)
    assert calls == 0
    stats = matepoint.stats()
    assert stats.policy_offloads == 0
    assert stats.offloads == DEPTH


def test_block_output_shared_with_next_checkpoint(through_host: CPUTestTransport) -> None:
    """An offloaded output that is the next checkpoint's input is offloaded once (dedupe)."""
    tanh = torch.ops.aten.tanh.default
    expected, _ = step(torch_ckpt("MUST_SAVE", chosen=tanh), residual=False)
    matepoint.reset_stats()
    actual, _ = step(mate_ckpt("MUST_CPU_OFFLOAD", chosen=tanh), residual=False)
    assert_bitwise_equal(actual, expected)
    stats = matepoint.stats()
    # Each block's tanh output, the next block's input: offloaded once for both.
    assert stats.policy_offloads == DEPTH
    assert stats.dedupe_hits == DEPTH - 1
    assert stats.offloads == DEPTH + 1
    assert_released()


@pytest.mark.parametrize("offload", [False, matepoint.OffloadOptions(enabled=False)])
def test_offload_off_is_torch(through_host: CPUTestTransport, offload: Any) -> None:
    """With offloading off the call is torch's: the same calls, the same gradients."""
    expected, torch_calls = step(torch_ckpt("MUST_CPU_OFFLOAD"))
    matepoint.reset_stats()
    actual, calls = step(mate_ckpt("MUST_CPU_OFFLOAD", offload=offload))
    assert_bitwise_equal(actual, expected)
    assert calls == torch_calls
    stats = matepoint.stats()
    assert stats.offloads == 0
    assert through_host.copies_out == 0


def test_allowed_cache_mutation_saves_on_device(through_host: CPUTestTransport) -> None:
    """With allow_cache_entry_mutation a host copy would miss the mutation: saved on device."""
    expected, _ = step(torch_ckpt("MUST_SAVE", allow_cache_entry_mutation=True))
    matepoint.reset_stats()
    actual, calls = step(mate_ckpt("MUST_CPU_OFFLOAD", allow_cache_entry_mutation=True))
    assert_bitwise_equal(actual, expected)
    assert calls == 0
    assert matepoint.stats().policy_offloads == 0


SIN = torch.ops.aten.sin.default


def _mutation_step(checkpoint: Callable[..., Any], decision_name: str, where: str) -> None:
    x = torch.randn(16, requires_grad=True)
    if where == "in forward":
        context_fn = sac(decision_name, chosen=SIN)
        out = checkpoint(lambda t: t.sin().mul_(2).cos(), x * 1, context_fn=context_fn)
    else:
        # exp's backward needs its output, so the recomputation asks for the saved one.
        context_fn = sac(decision_name, chosen=torch.ops.aten.exp.default)
        out = checkpoint(lambda t: t.exp(), x * 1, context_fn=context_fn)
        out.mul_(2)
    out.sum().backward()


@pytest.mark.parametrize("where", ["in forward", "after forward"])
def test_inplace_modification_raises_as_torch(through_host: CPUTestTransport, where: str) -> None:
    """An offloaded output modified in place before backward raises torch's error."""

    def torch_run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    with pytest.raises(RuntimeError, match="has been mutated") as torch_error:
        _mutation_step(torch_run, "MUST_SAVE", where)
    torch_error.value.__traceback__ = None
    del torch_error
    matepoint.reset_stats()
    with pytest.raises(matepoint.InplaceModificationError, match="has been mutated") as error:
        _mutation_step(matepoint.checkpoint, "MUST_CPU_OFFLOAD", where)
    assert matepoint.stats().policy_offloads == 1
    error.value.__traceback__ = None
    del error
    assert_released()


def test_exception_in_function_leaks_nothing(through_host: CPUTestTransport) -> None:
    """A function that raises after an offload frees it; the next step works."""

    def failing(t: torch.Tensor) -> torch.Tensor:
        # cos's policy call offloads sin's output (Note [Offloading an entry once it is
        # stored] in matepoint_compat._selective); then the function raises.
        t.sin().cos()
        raise ValueError("boom")

    x = torch.randn(16, requires_grad=True)
    context_fn = sac("MUST_CPU_OFFLOAD", chosen=SIN)
    with pytest.raises(ValueError, match="boom") as error:
        matepoint.checkpoint(failing, x * 1, context_fn=context_fn)
    error.value.__traceback__ = None
    del error
    assert matepoint.stats().policy_offloads == 1
    assert_released()
    assert not compat.saved_tensors_hooks_active()
    expected, _ = step(torch_ckpt("MUST_SAVE"))
    actual, calls = step(mate_ckpt("MUST_CPU_OFFLOAD"))
    assert_bitwise_equal(actual, expected)
    assert calls == 0
    assert_released()


def test_second_backward_refused_as_torch(through_host: CPUTestTransport) -> None:
    """torch refuses a second backward through a selective region (retain_graph); so does
    matepoint, with torch's error, and it frees the host copies when the graph goes."""
    first_gradients = []
    for checkpoint, decision in [(matepoint.checkpoint, "MUST_CPU_OFFLOAD"), (None, "MUST_SAVE")]:
        torch.manual_seed(3)
        x = torch.randn(16, requires_grad=True)
        context_fn = sac(decision, chosen=SIN)
        if checkpoint is None:
            out = torch_checkpoint.checkpoint(
                lambda t: t.sin().cos(), x * 1, use_reentrant=False, context_fn=context_fn
            )
        else:
            out = checkpoint(lambda t: t.sin().cos(), x * 1, context_fn=context_fn)
        out.sum().backward(retain_graph=True)
        assert x.grad is not None
        first_gradients.append(x.grad.clone())
        with pytest.raises(RuntimeError, match="Trying to backward an extra time") as error:
            out.sum().backward(retain_graph=True)
        error.value.__traceback__ = None
        del out, error
        assert_released()
    assert matepoint.stats().policy_offloads == 1
    assert torch.equal(first_gradients[0], first_gradients[1])


def test_retain_graph_keeps_only_the_inputs(through_host: CPUTestTransport) -> None:
    """After a backward with retain_graph only the checkpoint inputs stay saved: torch drops each
    selective entry the recomputation consumed, and with it the host copy."""
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    out = model(x, mate_ckpt("MUST_CPU_OFFLOAD"))
    out.sum().backward(retain_graph=True)
    gc.collect()
    assert matepoint.stats().live_records == DEPTH
    del out
    assert_released()


def test_report_splits_bytes_by_kind(through_host: CPUTestTransport) -> None:
    step(mate_ckpt("MUST_CPU_OFFLOAD"))
    report = matepoint.report()
    inputs_bytes = matepoint.stats().bytes_offloaded - DEPTH * POLICY_BYTES_PER_BLOCK
    assert (
        f"{DEPTH} checkpoint inputs, {format_bytes(inputs_bytes)}; "
        f"{2 * DEPTH} policy outputs, {format_bytes(DEPTH * POLICY_BYTES_PER_BLOCK)}"
    ) in report
    matepoint.reset_stats()
    stats = matepoint.stats()
    assert (stats.policy_offloads, stats.bytes_offloaded_by_policy) == (0, 0)
