"""The alias and stream matrix on a GPU: each case matches torch's checkpoint or raises as it does.

Each case checkpoints one input of a given kind (an activation, a view, a base, a parameter and
its views, expanded, strided, 0-dim, zero-size, conj/neg, several dtypes), produced on the
current stream, on a user stream or in another thread, with the side stream delayed or not, and
then writes it in place after forward through one alias, or not. torch's checkpoint and
matepoint's (every input forced through the host) run the same seeded step; outputs, gradients
and strides must be equal bit for bit, or both must raise. After each case device memory,
matepoint's records and pinned bytes in use are back to where they were.

The checkpointed function first sleeps on the compute stream, so its reads of the input run late:
if matepoint let an input's memory go without ordering against that stream, a user stream that
reuses the memory (the junk writes below) would change the result.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint.testing import delay_side_stream

pytestmark = pytest.mark.gpu

ROWS, WIDTH = 256, 512
COMPUTE_DELAY_CYCLES = 5_000_000
SIDE_DELAYS = {"undelayed": 0, "delayed": 20_000_000}

Made = tuple[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Kind:
    """How a checkpoint input is made from the step's leaf ``x`` and parameter ``weight``."""

    make: Callable[[torch.Tensor, torch.nn.Parameter], Made]
    writes: tuple[str, ...]


def _activation(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    value = x * 1
    return value, {"input": value, "detached": value.detach()}


def _row_view(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    base = torch.cat([x, x]) * 1
    return base[ROWS // 2 : ROWS // 2 + ROWS], {"base": base}


def _base_with_view_kept(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    base = x * 1
    return base, {"view": base[:, : WIDTH // 2]}


def _transposed(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    base = (x * 1).t().contiguous()
    return base.t(), {"base": base}


def _parameter(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    return weight, {"parameter": weight}


def _parameter_transposed(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    return weight.t(), {"parameter": weight}


def _parameter_slice(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    return weight[:ROWS], {"parameter": weight}


def _expanded(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    row = x[:1] * 1
    return row.expand(ROWS, WIDTH), {"base": row}


def _step_sliced(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    base = torch.cat([x, x], dim=1) * 1
    return base[:, ::2], {"base": base}


def _zero_dim(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    value = x.sum() * 1
    return value, {"input": value}


def _zero_size(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    value = x[:0] * 1
    return value, {"input": value}


def _conj(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    value = torch.complex(x, x.flip(0)) * 1
    return value.conj(), {"base": value}


def _neg(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
    value = x * 1
    return torch._neg_view(value), {"base": value}


def _cast(dtype: torch.dtype) -> Callable[[torch.Tensor, torch.nn.Parameter], Made]:
    def make(x: torch.Tensor, weight: torch.nn.Parameter) -> Made:
        if dtype is torch.bool:
            value = x > 0
        elif dtype.is_floating_point or dtype.is_complex:
            value = (x * 4).to(dtype)
        else:
            value = (x * 8).to(dtype)
        return value, {"input": value}

    return make


KINDS: dict[str, Kind] = {
    "activation": Kind(_activation, ("none", "input", "detached")),
    "row view, base kept": Kind(_row_view, ("none", "base")),
    "base, view kept": Kind(_base_with_view_kept, ("none", "view")),
    "transposed (dense, non-contiguous)": Kind(_transposed, ("none", "base")),
    "parameter": Kind(_parameter, ("none", "parameter")),
    "parameter transposed": Kind(_parameter_transposed, ("none", "parameter")),
    "parameter slice": Kind(_parameter_slice, ("none", "parameter")),
    "expanded": Kind(_expanded, ("none", "base")),
    "step-sliced": Kind(_step_sliced, ("none", "base")),
    "0-dim": Kind(_zero_dim, ("none", "input")),
    "zero-size": Kind(_zero_size, ("none", "input")),
    "conj view": Kind(_conj, ("none", "base")),
    "neg view": Kind(_neg, ("none", "base")),
    "bfloat16": Kind(_cast(torch.bfloat16), ("none", "input")),
    "float16": Kind(_cast(torch.float16), ("none", "input")),
    "complex64": Kind(_cast(torch.complex64), ("none", "input")),
    "int64": Kind(_cast(torch.int64), ("none", "input")),
    "bool": Kind(_cast(torch.bool), ("none", "input")),
}
if hasattr(torch, "float8_e4m3fn"):
    KINDS["float8_e4m3fn"] = Kind(_cast(torch.float8_e4m3fn), ("none", "input"))

PRODUCERS = ("current stream", "user stream", "other thread")


def _as_float(value: torch.Tensor) -> torch.Tensor:
    if value.is_complex():
        return value.real * value.imag + value.abs()
    return value.to(torch.float32)


def _block(value: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The checkpointed function: reads ``value`` late (after a sleep), with dropout."""
    torch.cuda._sleep(COMPUTE_DELAY_CYCLES)
    mixed = _as_float(value)
    mixed = mixed.sum() if mixed.numel() and mixed.shape != x.shape else mixed
    h = torch.tanh((x + mixed) @ weight.t()) if mixed.numel() else torch.tanh(x @ weight.t())
    return F.dropout(h, 0.25)


def _follow(h: torch.Tensor) -> torch.Tensor:
    return torch.sin(h) * h


def _produce(producer: str, make: Callable[[], Made]) -> tuple[Made, Any]:
    """Make the input on the producer's stream; return it and the stream that allocated it."""
    if producer == "current stream":
        return make(), torch.cuda.current_stream()
    if producer == "user stream":
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            made = make()
        torch.cuda.current_stream().wait_stream(stream)
        return made, stream
    box: list[Made] = []
    worker = threading.Thread(target=lambda: box.append(make()))
    worker.start()
    worker.join()
    return box[0], torch.cuda.current_stream()


def _write(alias: torch.Tensor | None) -> None:
    if alias is None:
        return
    with torch.no_grad():
        alias.copy_(alias.clone().flip(0) if alias.dim() else alias.clone())


def _step(ckpt: Callable[..., Any], kind: Kind, producer: str, write: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(WIDTH, WIDTH, device="cuda") / WIDTH**0.5)
    x = torch.randn(ROWS, WIDTH, device="cuda", requires_grad=True)
    torch.cuda.manual_seed(1)
    (value, aliases), producer_stream = _produce(producer, lambda: kind.make(x, weight))
    h = ckpt(_block, value, x * 1, weight)
    # Keep only the alias to write through: the input's memory is the user's to drop.
    alias = aliases.get(write)
    del value, aliases
    h = ckpt(_follow, h * 1)  # its pack lets the first checkpoint's originals go
    h = ckpt(_follow, h * 1)
    # Reuse, on the stream that allocated the input, whatever memory was just released.
    with torch.cuda.stream(producer_stream):
        junk = [
            torch.full(shape, float("nan"), device="cuda")
            for shape in ((ROWS, WIDTH), (2 * ROWS, WIDTH), (WIDTH, 2 * ROWS), (WIDTH, WIDTH))
            for _ in range(2)
        ]
    del junk
    _write(alias)
    del alias
    h.square().sum().backward()
    torch.cuda.synchronize()
    assert x.grad is not None
    assert weight.grad is not None
    return [h.detach(), x.grad, weight.grad]


def _outcome(ckpt: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", _step(ckpt, *args)
    except RuntimeError as error:
        message = str(error)
        torch.cuda.synchronize()
        return "raised", message
    finally:
        gc.collect()


def _levels() -> tuple[int, int, int]:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    snapshot = matepoint.stats(synchronize=True)
    return (torch.cuda.memory_allocated(), snapshot.live_records, snapshot.pool_in_use_bytes)


def _levels_back_to(before: tuple[int, int, int]) -> tuple[int, int, int]:
    """The levels, once back to ``before`` or after two seconds.

    A backward that raised returns to the caller while autograd's device thread still drops the
    rest of the failed graph (and the records in it), so the levels settle a moment later.
    """
    deadline = time.monotonic() + 2.0
    levels = _levels()
    while levels != before and time.monotonic() < deadline:
        time.sleep(0.01)
        levels = _levels()
    return levels


def _assert_same_values(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for actual, wanted in zip(got, expected, strict=True):
        assert actual.stride() == wanted.stride()
        assert torch.equal(actual, wanted), "values differ from torch's checkpoint"


@pytest.fixture
def _cleared() -> None:
    # pytest keeps the last failed test's traceback; its frames would keep graphs alive.
    sys.last_type = sys.last_value = sys.last_traceback = None
    # cuBLAS keeps a workspace per stream from the first product on: make it before measuring.
    (
        torch.ones(8, 8, device="cuda", requires_grad=True) @ torch.ones(8, 8, device="cuda")
    ).sum().backward()
    gc.collect()
    torch.cuda.synchronize()
    matepoint.reset_stats()


def _cases() -> list[Any]:
    return [
        pytest.param(kind, producer, delay, write, id=f"{kind}-{producer}-{delay}-{write}")
        for kind, spec in KINDS.items()
        for producer in PRODUCERS
        for delay in SIDE_DELAYS
        for write in spec.writes
    ]


@pytest.mark.usefixtures("_cleared")
# torch warns when a leaf made on a user stream gets its gradient on another; both twins do.
@pytest.mark.filterwarnings("ignore:The AccumulateGrad node's stream does not match")
@pytest.mark.parametrize(("kind", "producer", "delay", "write"), _cases())
def test_matches_torch_or_raises_and_leaks_nothing(
    kind: str, producer: str, delay: str, write: str
) -> None:
    spec = KINDS[kind]
    everything = matepoint.OffloadOptions(min_offload_bytes=0)

    def reference(function: Callable[..., Any], *args: Any) -> Any:
        return torch_checkpoint.checkpoint(function, *args, use_reentrant=False)

    def mine(function: Callable[..., Any], *args: Any) -> Any:
        return matepoint.checkpoint(function, *args, offload=everything)

    before = _levels()
    with (
        delay_side_stream(SIDE_DELAYS[delay]),
        matepoint.options(stash_bytes=0, max_inflight_bytes=0),
    ):
        got = _outcome(mine, spec, producer, write)
    expected = _outcome(reference, spec, producer, write)
    assert got[0] == expected[0], f"torch: {expected}; matepoint: {got}"
    if expected[0] == "raised":
        assert "inplace" in expected[1], expected[1]
        assert "inplace" in got[1], got[1]
    else:
        _assert_same_values(got[1], expected[1])
    assert matepoint.stats().offloads >= 2  # the two follow-up checkpoints at least
    del got, expected
    after = _levels_back_to(before)
    assert after == before, f"(allocated, live records, pool in use) {before} -> {after}"


@pytest.mark.usefixtures("_cleared")
@pytest.mark.parametrize("checkpoint_on", ["default stream", "user stream"])
def test_input_released_only_after_the_stream_that_reads_it(checkpoint_on: str) -> None:
    """An input allocated on one stream and read late on another is not reused under the read.

    The input is made on one stream, the checkpoint runs on the other and reads it after a long
    sleep; the user drops the input, and the allocating stream at once fills every block of that
    size with NaN. The release must wait for the reading stream (torch's checkpoint keeps the
    input alive until backward, so it never sees this).
    """
    user = torch.cuda.Stream()
    default = torch.cuda.current_stream()
    allocate_on, read_on = (user, default) if checkpoint_on == "default stream" else (default, user)
    everything = matepoint.OffloadOptions(min_offload_bytes=0)
    settings = matepoint.options(stash_bytes=0, max_inflight_bytes=0)

    def slow(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(100_000_000)  # ~50 ms: the read comes long after the host moves on
        return torch.sin(a) * a * weight

    torch.manual_seed(0)
    expected = torch.randn(ROWS, WIDTH, device="cuda")
    torch.manual_seed(0)
    allocate_on.wait_stream(default)
    with torch.cuda.stream(allocate_on):
        value = torch.randn(ROWS, WIDTH, device="cuda")
    read_on.wait_stream(allocate_on)
    with torch.cuda.stream(read_on):
        weight = torch.ones((), device="cuda", requires_grad=True)
        with settings:
            h = matepoint.checkpoint(slow, value, weight, offload=everything)
            del value
            h2 = matepoint.checkpoint(torch.cos, h * 1, offload=everything)  # lets the first go
    with torch.cuda.stream(allocate_on):
        junk = [torch.full((ROWS, WIDTH), float("nan"), device="cuda") for _ in range(16)]
    del junk
    default.wait_stream(read_on)
    torch.cuda.synchronize()
    assert torch.equal(h.detach(), torch.sin(expected) * expected)
    h2.sum().backward()
    torch.cuda.synchronize()
