"""A checkpoint call that moves nothing, on a CUDA device: torch's checkpoint without the hooks.

Note [A call that moves nothing] in ``matepoint._checkpoint``. The CPU suite
(``test_call_moves_nothing.py``) checks the counters and torch's version checks; this one that
such calls, on a user's stream, under a default-device context, from two threads at once, or
between calls that do offload on a delayed side stream, give gradients bitwise equal to torch's
checkpoint, and that a selective policy's outputs still cross to the host when no input moves.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from _cuda_helpers import (
    TOKENS,
    WIDTH,
    bitwise_equal,
    make_stack,
    run_blocks,
    torch_ckpt,
    train_step,
)
from test_cuda_offload_policy import sac

import matepoint
import matepoint_compat as compat
from matepoint.testing import delay_side_stream

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_start")]

DEPTH = 4
BLOCK_INPUT_BYTES = TOKENS * WIDTH * 4  # fp32
# Every block input is "small" under this: the calls move nothing.
NOTHING_MOVES = matepoint.OffloadOptions(min_offload_bytes=2 * BLOCK_INPUT_BYTES)
# About a millisecond before each side-stream copy: enough for a missing wait to lose the race.
DELAY_CYCLES = 2_000_000


def staying(block: torch.nn.Module, h: torch.Tensor) -> Any:
    """matepoint's checkpoint of one block whose input is below the minimum size to move."""
    return matepoint.checkpoint(block, h, offload=NOTHING_MOVES)


@contextlib.contextmanager
def _user_stream() -> Iterator[None]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        yield
    torch.cuda.current_stream().wait_stream(stream)


SURROUNDINGS: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
    "default-stream": contextlib.nullcontext,
    "user-stream": _user_stream,
    "default-device-cuda": lambda: torch.device("cuda"),
}


@pytest.mark.parametrize("surrounding", SURROUNDINGS)
def test_calls_that_move_nothing_match_torch(surrounding: str, hook_calls: list[Any]) -> None:
    # Under a default-device context the stack is made on the device, from the device's RNG:
    # the reference runs in the same surroundings.
    with SURROUNDINGS[surrounding]():
        expected = train_step(DEPTH, torch_ckpt)
    with delay_side_stream(DELAY_CYCLES), SURROUNDINGS[surrounding]():
        got = train_step(DEPTH, staying)
    assert bitwise_equal(got, expected)
    assert hook_calls == []
    stats = matepoint.stats(synchronize=True)
    assert (stats.offloads, stats.skipped_small) == (0, DEPTH)


def test_calls_that_move_nothing_between_calls_that_offload(hook_calls: list[Any]) -> None:
    """Look-ahead prefetch and the delayed side stream see only every other block's input."""

    def alternating() -> Callable[..., Any]:
        index = iter(range(2 * DEPTH))

        def call(block: torch.nn.Module, h: torch.Tensor) -> Any:
            if next(index) % 2:
                return staying(block, h)
            return matepoint.checkpoint(block, h)

        return call

    expected = train_step(2 * DEPTH, torch_ckpt)
    with delay_side_stream(DELAY_CYCLES), matepoint.options(max_inflight_bytes=0, prefetch=2):
        got = train_step(2 * DEPTH, alternating())
    assert bitwise_equal(got, expected)
    assert len(hook_calls) == DEPTH
    stats = matepoint.stats(synchronize=True)
    assert (stats.offloads, stats.skipped_small) == (DEPTH, DEPTH)


def test_two_threads_each_on_its_own_stream(hook_calls: list[Any]) -> None:
    """Two threads' calls at once, each on its stream: torch's gradients, every input counted.

    Without dropout, so that the two threads drawing from one generator cannot change the
    numbers; the stacks and inputs are made before the threads start, from the same seeds.
    """
    stacks = [make_stack(DEPTH, dropout=0.0) for _ in range(3)]
    torch.manual_seed(1)
    x = torch.randn(TOKENS, WIDTH, device="cuda")
    gradients: dict[int, list[torch.Tensor]] = {}
    failures: list[BaseException] = []

    def step(slot: int, checkpoint: Callable[..., Any]) -> None:
        try:
            with _user_stream():
                h = x.clone().requires_grad_()
                run_blocks(stacks[slot], h, checkpoint).square().mean().backward()
                assert h.grad is not None
                gradients[slot] = [h.grad] + [p.grad for p in stacks[slot].parameters()]
            torch.cuda.synchronize()
        except BaseException as error:  # the main thread reports it
            failures.append(error)

    step(0, torch_ckpt)
    threads = [threading.Thread(target=step, args=(slot, staying)) for slot in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert bitwise_equal(gradients[1], gradients[0])
    assert bitwise_equal(gradients[2], gradients[0])
    assert hook_calls == []
    assert matepoint.stats(synchronize=True).skipped_small == 2 * DEPTH


def test_an_input_written_in_place_after_forward_fails_backward(hook_calls: list[Any]) -> None:
    h = torch.randn(TOKENS, WIDTH, device="cuda", requires_grad=True) * 1
    out = matepoint.checkpoint(torch.sin, h, offload=NOTHING_MOVES)
    h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    assert hook_calls == []


@pytest.mark.skipif(
    not compat.SELECTIVE_OFFLOAD_POLICIES, reason="torch's offload policy values arrived in 2.11"
)
@pytest.mark.parametrize("pipeline", [True, False])
def test_a_policy_offloads_its_outputs_when_no_input_moves(
    pipeline: bool, hook_calls: list[Any]
) -> None:
    """Block inputs (16 MiB) stay; the up-projection's output (64 MiB) is the policy's to move."""

    saving = sac("MUST_SAVE")
    offloading = sac("MUST_CPU_OFFLOAD")

    def reference(block: torch.nn.Module, h: torch.Tensor) -> Any:
        return torch_checkpoint.checkpoint(block, h, use_reentrant=False, context_fn=saving)

    def offloaded(block: torch.nn.Module, h: torch.Tensor) -> Any:
        return matepoint.checkpoint(
            block, h, offload=NOTHING_MOVES, pipeline=pipeline, context_fn=offloading
        )

    expected = train_step(DEPTH, reference)
    with delay_side_stream(DELAY_CYCLES), matepoint.options(max_inflight_bytes=0, prefetch=2):
        got = train_step(DEPTH, offloaded)
    assert bitwise_equal(got, expected)
    assert hook_calls == []
    stats = matepoint.stats(synchronize=True)
    # The up projection's output moves; the down projection's (as large as the input) stays.
    assert stats.policy_offloads == DEPTH
    assert stats.bytes_offloaded_by_policy == DEPTH * 4 * BLOCK_INPUT_BYTES
