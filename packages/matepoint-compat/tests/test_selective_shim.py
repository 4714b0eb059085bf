"""``offloading_selective_contexts``: torch's selective-checkpoint pair, with offloaded outputs.

See Note [Selective checkpointing's storage] in ``matepoint_compat._selective``. These tests use
torch alone (compat never imports core): the offload callback returns a stand-in entry that
records what it was given, so a release that changes the storage shows up here first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat

needs_offload_values = pytest.mark.skipif(
    not compat.SELECTIVE_OFFLOAD_POLICIES,
    reason="CheckpointPolicy has no CPU-offload values before torch 2.11",
)


class Entry:
    """Stands in for matepoint's entry: keeps the tensor, hands it back, counts the asks."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor.clone()
        self.asked = 0

    def get_val(self, allow_cache_entry_mutation: bool) -> torch.Tensor:
        self.asked += 1
        return self.tensor


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = torch_checkpoint.CheckpointPolicy
    if op == torch.ops.aten.sin.default:
        return policy.MUST_CPU_OFFLOAD
    if op == torch.ops.aten.cos.default:
        return policy.MUST_SAVE
    return policy.PREFER_RECOMPUTE


def _recorder(entries: list[Entry]) -> Callable[[torch.Tensor], Entry]:
    """An offload callback that keeps each entry it makes in ``entries``."""

    def offload(tensor: torch.Tensor) -> Entry:
        entries.append(Entry(tensor))
        return entries[-1]

    return offload


def _offloading(
    offload: Callable[[torch.Tensor], Any], policy: Callable[..., Any] = _policy
) -> Callable[[], Any]:
    """A ``context_fn``: torch's selective pair around ``policy``, offloaded by ``offload``."""
    return lambda: compat.offloading_selective_contexts(
        torch_checkpoint.create_selective_checkpoint_contexts(policy), offload
    )


def test_offload_values_are_the_two_cpu_ones() -> None:
    names = {value.name for value in compat.SELECTIVE_OFFLOAD_POLICIES}
    assert names in (set(), {"MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"})
    # torch 2.4 has no CheckpointPolicy at all (selective checkpointing came with 2.5).
    policy = getattr(torch_checkpoint, "CheckpointPolicy", None)
    assert bool(names) == hasattr(policy, "MUST_CPU_OFFLOAD")


@needs_offload_values
def test_other_contexts_are_left_to_torch() -> None:
    noop = torch_checkpoint.noop_context_fn()
    assert compat.offloading_selective_contexts(noop, Entry) is noop
    assert compat.offloading_selective_contexts(None, Entry) is None

    caching, cached = torch_checkpoint.create_selective_checkpoint_contexts(_policy)
    subclass = type("Caching", (type(caching),), {})
    custom = subclass.__new__(subclass)
    custom.__dict__.update(vars(caching))
    assert compat.offloading_selective_contexts((custom, cached), Entry) == (custom, cached)


@needs_offload_values
def test_offloaded_outputs_are_stored_as_the_callbacks_entries_and_not_recomputed() -> None:
    entries: list[Entry] = []
    offload = _recorder(entries)

    def context_fn() -> Any:
        contexts = torch_checkpoint.create_selective_checkpoint_contexts(_policy)
        original_policy = contexts[0].policy_fn
        wrapped = compat.offloading_selective_contexts(contexts, offload)
        assert wrapped is not contexts
        assert contexts[0].policy_fn is original_policy  # the user's objects stay untouched
        assert isinstance(wrapped[0], type(contexts[0]))
        return wrapped

    x = torch.randn(8, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        lambda t: t.sin().exp() * t.cos().exp(), x * 1, use_reentrant=False, context_fn=context_fn
    )
    # sin was offloaded (its entry made from the output); cos was saved as torch saves.
    assert len(entries) == 1
    assert torch.equal(entries[0].tensor, x.detach().sin())
    out.sum().backward()
    assert entries[0].asked == 1
    assert x.grad is not None
    expected = torch.autograd.grad((x.sin().exp() * x.cos().exp()).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)


@needs_offload_values
def test_allowed_mutation_keeps_the_output_as_torch_would() -> None:
    entries: list[Entry] = []

    def context_fn() -> Any:
        contexts = torch_checkpoint.create_selective_checkpoint_contexts(
            _policy, allow_cache_entry_mutation=True
        )
        wrapped = compat.offloading_selective_contexts(contexts, entries.append)
        assert wrapped is not contexts
        return wrapped

    x = torch.randn(8, requires_grad=True)
    out = torch_checkpoint.checkpoint(
        lambda t: t.sin().exp(), x * 1, use_reentrant=False, context_fn=context_fn
    )
    out.sum().backward()
    assert entries == []


@needs_offload_values
def test_offload_callback_sees_the_outputs_version_counter() -> None:
    """The callback runs with ADInplaceOrView enabled: an alias it takes sees later writes."""
    seen: list[tuple[torch.Tensor, int]] = []

    def offload(tensor: torch.Tensor) -> Entry:
        alias = tensor.detach()
        seen.append((alias, alias._version))
        return Entry(tensor)

    x = torch.randn(8, requires_grad=True)
    torch_checkpoint.checkpoint(
        lambda t: t.sin().mul_(2), x * 1, use_reentrant=False, context_fn=_offloading(offload)
    )
    ((alias, version),) = seen
    assert alias._version == version + 1


@needs_offload_values
@pytest.mark.parametrize("region", ["sin last", "sin then sin"])
def test_an_offloaded_last_op_is_replaced_when_the_forward_ends(region: str) -> None:
    """Note [Offloading an entry once it is stored]: the mode's exit replaces the last entry."""
    entries: list[Entry] = []

    def function(t: torch.Tensor) -> torch.Tensor:
        return t.sin() if region == "sin last" else t.sin().sin()

    x = torch.randn(8, requires_grad=True)
    context_fn = _offloading(_recorder(entries))
    out = torch_checkpoint.checkpoint(function, x * 1, use_reentrant=False, context_fn=context_fn)
    # Two sins of one key: each entry replaced, the second at the exit.
    assert len(entries) == (1 if region == "sin last" else 2)
    assert torch.equal(entries[0].tensor, x.detach().sin())
    out.sum().backward()
    # The recomputation stops once it has what backward needs: the last output is never asked.
    assert [entry.asked for entry in entries] == ([0] if region == "sin last" else [1, 0])
    torch.testing.assert_close(x.grad, torch.autograd.grad(function(x).sum(), x)[0])


@needs_offload_values
def test_a_forward_that_raises_offloads_nothing_more() -> None:
    """An exception right after an offloaded op: its entry is not replaced, nothing runs late."""
    entries: list[Entry] = []

    def failing(t: torch.Tensor) -> torch.Tensor:
        t.sin()
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        torch_checkpoint.checkpoint(
            failing,
            torch.randn(8, requires_grad=True) * 1,
            use_reentrant=False,
            context_fn=_offloading(_recorder(entries)),
        )
    assert entries == []


@needs_offload_values
def test_a_policy_marked_never_offloading_is_left_to_torch() -> None:
    def keep_cos(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        policy = torch_checkpoint.CheckpointPolicy
        return policy.MUST_SAVE if op == torch.ops.aten.cos.default else policy.PREFER_RECOMPUTE

    assert compat.never_offloading(keep_cos) is keep_cos
    contexts = torch_checkpoint.create_selective_checkpoint_contexts(keep_cos)
    assert compat.offloading_selective_contexts(contexts, Entry) is contexts
    unmarked = torch_checkpoint.create_selective_checkpoint_contexts(_policy)
    assert compat.offloading_selective_contexts(unmarked, Entry) is not unmarked


@needs_offload_values
def test_the_offload_at_the_forwards_end_runs_outside_the_region() -> None:
    """The offload callback's own ops are not asked about by the region's policy."""
    asked: list[Any] = []

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        asked.append(op)
        return _policy(ctx, op, *args, **kwargs)

    def offload(tensor: torch.Tensor) -> Entry:
        return Entry(tensor.cos())  # an op of the callback's own

    x = torch.randn(8, requires_grad=True)
    context_fn = _offloading(offload, policy)
    torch_checkpoint.checkpoint(torch.sin, x * 1, use_reentrant=False, context_fn=context_fn)
    assert asked == [torch.ops.aten.sin.default]
