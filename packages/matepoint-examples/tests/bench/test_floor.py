"""Tests for matepoint_examples.bench._floor: the copies-only floor's traffic on CPU tiny models."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import matepoint
from matepoint_examples.bench._floor import CopyFloor, LinkBusy
from matepoint_examples.models import GPTConfig, NanoGPT
from matepoint_examples.strategies import get_strategy

CPU = torch.device("cpu")
DEPTH = 3
TINY_NANOCHAT = GPTConfig(
    depth=DEPTH, width=64, head_dim=32, seq_len=16, vocab_size=64, x0_mixing=True
)
STREAM_BYTES = 2 * 16 * TINY_NANOCHAT.width * 4  # one (batch 2, seq 16, width) fp32 tensor


def _step(floor: CopyFloor, model: NanoGPT, batch: tuple[Tensor, Tensor]) -> list[Tensor]:
    model.zero_grad(set_to_none=True)
    with floor.step():
        loss = model(*batch)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _nanochat(checkpoint_fn: Callable[..., Tensor]) -> tuple[NanoGPT, tuple[Tensor, Tensor]]:
    torch.manual_seed(0)
    model = NanoGPT(TINY_NANOCHAT, checkpoint_fn=checkpoint_fn)
    return model, model.example_batch(2)


@pytest.mark.parametrize(
    ("options", "copies_in"),
    [({}, DEPTH), ({"copy_in": False}, 0), ({"refetch": True}, 2 * DEPTH)],
)
def test_floor_moves_each_input_once_each_way(options: dict[str, bool], copies_in: int) -> None:
    floor = CopyFloor(**options)
    model, batch = _nanochat(floor.checkpoint)
    with floor.session(CPU):
        for _ in range(2):  # the second step reuses the slots and host buffers of the first
            floor.reset_stats()
            _step(floor, model, batch)
            stats = floor.stats()
            # x0 is an input of every block but crosses once: DEPTH tensors out (block 0's x is
            # x0 itself), and back once each, unless the variant copies x0 back again at each
            # of its later unpacks (once in block 1, twice in block 0).
            assert stats["copies_out"] == DEPTH
            assert stats["bytes_out"] == DEPTH * STREAM_BYTES
            assert stats["copies_in"] == copies_in
            assert stats["bytes_in"] == copies_in * STREAM_BYTES
    assert floor.device_type == "cuda"  # the session restored it


def test_floor_gradients_equal_torch_and_host_copies_hold_the_inputs() -> None:
    seen: list[Tensor] = []

    def recording(function: Callable[..., Tensor], /, *args: Tensor) -> Tensor:
        seen.extend(a.detach().clone() for a in args)
        out: Tensor = torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        return out

    model, batch = _nanochat(recording)
    ref = _step(CopyFloor(), model, batch)
    floor = CopyFloor()
    model, batch = _nanochat(floor.checkpoint)
    with floor.session(CPU):
        got = _step(floor, model, batch)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    distinct = [seen[0], *seen[2::2]]  # block 0: (x0, x0); block i: (x_i, x0)
    hosts = [entry[1] for entry in floor._host if entry is not None]
    assert len(hosts) == DEPTH
    assert all(torch.equal(h, s) for h, s in zip(hosts, distinct, strict=True))


def test_floor_leaves_small_and_parameter_inputs_alone() -> None:
    floor = CopyFloor()
    weight = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(4, 4, requires_grad=True)
    with floor.session(CPU), matepoint.options(min_offload_bytes=1 << 20), floor.step():
        floor.checkpoint(lambda a, w: a @ w, x, weight).sum().backward()
    assert floor.stats() == dict.fromkeys(("copies_out", "bytes_out", "copies_in", "bytes_in"), 0)


def test_floor_strategies_are_registered() -> None:
    for name in ("copies-floor", "copies-floor-out", "copies-floor-refetch"):
        strategy = get_strategy(name)
        assert strategy.unavailable_reason(CPU) is None
        assert strategy.stats is not None
        assert strategy.reset_stats is not None
    assert not get_strategy("copies-floor").probe


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_link_busy_needs_cuda() -> None:
    assert get_strategy("link-busy").unavailable_reason(CPU) == "needs a CUDA device"
    with pytest.raises(RuntimeError, match="CUDA"), LinkBusy().forward():
        pass
