"""Tests for matepoint_examples.models: shapes, gradients and checkpoint equivalence on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import matepoint
from matepoint.testing import CPUTestTransport, use_transport
from matepoint_examples.models import (
    CheckpointFn,
    DeepLatentConfig,
    DeepLatentStack,
    GPTConfig,
    NanoGPT,
    no_checkpoint,
)
from matepoint_examples.strategies import get_strategy

TINY_LATENT = DeepLatentConfig(depth=3, width=32, heads=4, batch=2, tokens=16)
TINY_GPT = GPTConfig.from_depth(2, head_dim=32, seq_len=16, vocab_size=64)


def _grads(model: nn.Module) -> list[Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _latent_grads(
    checkpoint_fn: CheckpointFn, config: DeepLatentConfig = TINY_LATENT
) -> list[Tensor]:
    torch.manual_seed(0)
    model = DeepLatentStack(config, checkpoint_fn=checkpoint_fn)
    x = model.example_input()
    model(x).square().mean().backward()
    return _grads(model)


def _gpt_grads(checkpoint_fn: CheckpointFn) -> list[Tensor]:
    torch.manual_seed(0)
    model = NanoGPT(TINY_GPT, checkpoint_fn=checkpoint_fn)
    idx, targets = model.example_batch(2)
    model(idx, targets).backward()
    return _grads(model)


def _counting(calls: list[tuple[Any, ...]]) -> CheckpointFn:
    def fn(function: Callable[..., Tensor], /, *args: Tensor) -> Tensor:
        calls.append(args)
        return function(*args)

    return fn


def test_latent_stack_forward_backward() -> None:
    calls: list[tuple[Any, ...]] = []
    model = DeepLatentStack(TINY_LATENT, checkpoint_fn=_counting(calls))
    x = model.example_input()
    out = model(x)
    assert out.shape == x.shape == TINY_LATENT.latent_shape()
    out.square().mean().backward()
    assert len(calls) == TINY_LATENT.depth
    assert all(len(args) == 1 and args[0].shape == x.shape for args in calls)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("bad", [{"width": 30, "heads": 4}, {"depth": 0}])
def test_latent_config_rejects_bad_shapes(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must"):
        DeepLatentConfig(**{**TINY_LATENT.__dict__, **bad})


def test_latent_torch_checkpoint_matches_no_checkpoint() -> None:
    ref = _latent_grads(no_checkpoint)
    got = _latent_grads(get_strategy("torch").checkpoint_fn)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_latent_dropout_matepoint_matches_torch() -> None:
    config = DeepLatentConfig(**{**TINY_LATENT.__dict__, "dropout": 0.2})
    ref = _latent_grads(get_strategy("torch").checkpoint_fn, config)
    with use_transport(CPUTestTransport()), matepoint.options(min_offload_bytes=0):
        got = _latent_grads(get_strategy("matepoint").checkpoint_fn, config)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    # Dropout is live, so the equality above really tests RNG replay in recompute.
    without = _latent_grads(get_strategy("torch").checkpoint_fn)
    assert not all(torch.equal(a, b) for a, b in zip(ref, without, strict=True))


def test_gpt_config_from_depth() -> None:
    cfg = GPTConfig.from_depth(12)
    shape = (cfg.width, cfg.head_dim, cfg.heads, cfg.seq_len, cfg.vocab_size)
    assert shape == (768, 128, 6, 2048, 65536)
    assert GPTConfig.from_depth(4, vocab_size=100).vocab_size == 100
    with pytest.raises(ValueError, match="head_dim"):
        GPTConfig(width=100, head_dim=64)


def test_gpt_forward_backward() -> None:
    calls: list[tuple[Any, ...]] = []
    model = NanoGPT(TINY_GPT, checkpoint_fn=_counting(calls))
    idx, targets = model.example_batch(2)
    logits = model(idx)
    assert logits.shape == (2, TINY_GPT.seq_len, TINY_GPT.vocab_size)
    assert logits.abs().max() <= TINY_GPT.softcap
    calls.clear()
    loss = model(idx, targets)
    assert loss.ndim == 0
    loss.backward()
    # One checkpoint per block, saving only the residual stream.
    assert len(calls) == TINY_GPT.depth
    assert all(len(args) == 1 and args[0].shape == (2, 16, TINY_GPT.width) for args in calls)
    assert all(p.grad is not None for p in model.parameters())
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, nn.Linear))


def test_gpt_is_causal() -> None:
    torch.manual_seed(0)
    model = NanoGPT(TINY_GPT)
    idx, _ = model.example_batch(1)
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % TINY_GPT.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_gpt_matepoint_matches_torch() -> None:
    ref = _gpt_grads(get_strategy("torch").checkpoint_fn)
    with use_transport(CPUTestTransport()), matepoint.options(min_offload_bytes=0):
        got = _gpt_grads(get_strategy("matepoint").checkpoint_fn)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


TINY_NANOCHAT = GPTConfig(depth=3, width=64, head_dim=32, seq_len=16, vocab_size=64, x0_mixing=True)


def test_nanochat_mixing_passes_x0_to_every_checkpoint() -> None:
    calls: list[tuple[Any, ...]] = []
    torch.manual_seed(0)
    model = NanoGPT(TINY_NANOCHAT, checkpoint_fn=_counting(calls))
    idx, targets = model.example_batch(2)
    model(idx, targets).backward()
    assert len(calls) == TINY_NANOCHAT.depth
    assert all(len(args) == 2 for args in calls)
    x0 = calls[0][1]
    assert calls[0][0] is x0  # block 0 mixes x0 with itself
    assert all(args[1] is x0 for args in calls)  # one tensor, shared by every checkpoint
    assert len({id(args[0]) for args in calls}) == TINY_NANOCHAT.depth
    assert model.resid_lambdas is not None
    assert model.x0_lambdas is not None
    for scalars in (model.resid_lambdas, model.x0_lambdas):
        assert scalars.grad is not None
        assert scalars.grad.shape == (TINY_NANOCHAT.depth,)
        assert bool((scalars.grad != 0).all())
    assert NanoGPT(TINY_GPT).resid_lambdas is None


def test_nanochat_matepoint_matches_torch() -> None:
    def grads(checkpoint_fn: CheckpointFn) -> list[Tensor]:
        torch.manual_seed(0)
        model = NanoGPT(TINY_NANOCHAT, checkpoint_fn=checkpoint_fn)
        model(*model.example_batch(2)).backward()
        return _grads(model)

    ref = grads(get_strategy("torch").checkpoint_fn)
    with use_transport(CPUTestTransport()), matepoint.options(min_offload_bytes=0):
        matepoint.reset_stats()
        got = grads(get_strategy("matepoint").checkpoint_fn)
        stats = matepoint.stats()
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    # x0 is offloaded once, however many checkpoints save it.
    assert stats.offloads == TINY_NANOCHAT.depth
    assert stats.dedupe_hits >= TINY_NANOCHAT.depth - 1
