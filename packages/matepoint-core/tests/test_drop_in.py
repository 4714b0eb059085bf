"""Cases where matepoint once differed from torch's checkpoint: each matches torch or raises.

Every test runs the same step through torch's checkpoint and matepoint's on identically seeded
inputs, with every saved input offloaded through the CPU test transport (``cpu_transport``: each
completion mode, so the host copy has finished, or not, when the alias is written).
"""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import matepoint
from matepoint import _checkpoint
from matepoint.testing import CPUTestTransport
from matepoint_compat import MatepointDeprecationWarning, version_witness

Checkpoint = Callable[..., Any]


def _torch(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def _mine(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return matepoint.checkpoint(function, *args, **kwargs)


def _outcome(step: Callable[[Checkpoint], Any], ckpt: Checkpoint) -> tuple[str, Any]:
    torch.manual_seed(0)
    try:
        return "ok", step(ckpt)
    except RuntimeError as error:
        return "raised", str(error)
    finally:
        gc.collect()


def _assert_same(step: Callable[[Checkpoint], Any]) -> str:
    """Run ``step`` under both checkpoints; results equal bitwise, or both raise. Return which."""
    reference = _outcome(step, _torch)
    mine = _outcome(step, _mine)
    assert mine[0] == reference[0], f"torch {reference}, matepoint {mine}"
    if reference[0] == "raised":
        assert "modified by an inplace operation" in reference[1]
        assert "modified by an inplace operation" in mine[1]
        return "raised"
    for got, want in zip(mine[1], reference[1], strict=True):
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=False)
    return "ok"


# -- 1. default-device contexts -----------------------------------------------------------------


def _linear_step(ckpt: Checkpoint) -> list[torch.Tensor]:
    layer = torch.nn.Linear(16, 16, device="cpu")
    x = torch.randn(4, 16, device="cpu", requires_grad=True)
    h = ckpt(lambda a: torch.tanh(layer(a)), x * 1)
    h = ckpt(lambda a: torch.sin(a) * 2, h)
    h.square().sum().backward()
    assert x.grad is not None
    assert layer.weight.grad is not None
    return [h.detach(), x.grad, layer.weight.grad]


def test_default_device_context_allocates_host_blocks_on_the_host(
    cpu_transport: CPUTestTransport,
) -> None:
    """Under ``with torch.device(...)`` host blocks and copies still live on the CPU."""
    with torch.device("meta"):
        assert _assert_same(_linear_step) == "ok"
    assert matepoint.stats().offloads >= 2
    assert cpu_transport.copies_out >= 2


def test_set_default_device_allocates_host_blocks_on_the_host(
    cpu_transport: CPUTestTransport,
) -> None:
    """After ``torch.set_default_device(...)`` host blocks and copies still live on the CPU."""
    torch.set_default_device("meta")
    try:
        assert _assert_same(_linear_step) == "ok"
    finally:
        torch.set_default_device(None)
    assert matepoint.stats().offloads >= 2


# -- 2. in-place writes through another alias ---------------------------------------------------


def _next_block(ckpt: Checkpoint, h: torch.Tensor) -> torch.Tensor:
    """A second checkpoint: its pack lets the first one's device original go (stash 0)."""
    return ckpt(torch.sin, h * 1)


def _write_base_of_view(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(8, 16, requires_grad=True)
    base = x * 1
    h = ckpt(lambda a: torch.tanh(a) * a, base[:4])  # the view itself dies after the call
    h = _next_block(ckpt, h)
    with torch.no_grad():
        base.add_(1)
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _write_view_of_input(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(8, 16, requires_grad=True)
    base = x * 1
    h = ckpt(lambda a: torch.tanh(a) * a, base)
    h = _next_block(ckpt, h)
    alias = base.view(-1)
    del base
    with torch.no_grad():
        alias[3] = 7.0
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _write_through_detached_alias(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(8, 16, requires_grad=True)
    h0 = x * 1
    alias = h0.detach()  # shares the version counter, not a view
    h = ckpt(lambda a: torch.tanh(a) * a, h0)
    h = _next_block(ckpt, h)
    del h0
    alias.mul_(2)
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _write_parameter_of_transposed_view(ckpt: Checkpoint) -> list[torch.Tensor]:
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    h = ckpt(lambda a, w: torch.tanh(a @ w), x * 1, layer.weight.t())
    h = _next_block(ckpt, h)
    with torch.no_grad():
        layer.weight.mul_(0.5)
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _write_parameter_of_slice(ckpt: Checkpoint) -> list[torch.Tensor]:
    table = torch.nn.Parameter(torch.randn(32, 16))
    x = torch.randn(4, 16, requires_grad=True)
    h = ckpt(lambda a, rows: torch.tanh(a * rows), x * 1, table[:4])
    h = _next_block(ckpt, h)
    with torch.no_grad():
        table[:2].zero_()
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _write_other_view_of_same_base(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(8, 16, requires_grad=True)
    base = x * 1
    first, second = base[:4], base[4:]
    h = ckpt(lambda a: torch.tanh(a) * a, first)
    h = _next_block(ckpt, h)
    del first, base
    with torch.no_grad():
        second.fill_(0.5)  # other memory, same counter: torch raises all the same
    h.sum().backward()
    assert x.grad is not None
    return [x.grad]


def _no_write(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(8, 16, requires_grad=True)
    base = x * 1
    h = ckpt(lambda a, b: torch.tanh(a) * b.t(), base[:4], base[4:].t())
    h = _next_block(ckpt, h)
    del base
    h.sum().backward()
    assert x.grad is not None
    return [x.grad, h.detach()]


ALIAS_WRITES: dict[str, tuple[Callable[[Checkpoint], Any], str]] = {
    "base of a view input": (_write_base_of_view, "raised"),
    "view of the input, input dropped": (_write_view_of_input, "raised"),
    "detached alias, input dropped": (_write_through_detached_alias, "raised"),
    "parameter of a transposed view": (_write_parameter_of_transposed_view, "raised"),
    "parameter of a slice": (_write_parameter_of_slice, "raised"),
    "other chunk of the same base": (_write_other_view_of_same_base, "raised"),
    "views, no write": (_no_write, "ok"),
}


@pytest.mark.parametrize("case", list(ALIAS_WRITES))
def test_writes_through_any_alias_raise_as_in_torch(
    cpu_transport: CPUTestTransport, case: str
) -> None:
    step, expected = ALIAS_WRITES[case]
    assert _assert_same(step) == expected


def test_version_witness_follows_every_alias_and_holds_no_memory() -> None:
    base = torch.randn(64, 64)
    view = base[:8]
    witness = version_witness(view)
    assert witness.untyped_storage().nbytes() == 0
    assert (base._version, view._version) == (0, 0), "making a witness must not bump versions"
    base.add_(1)
    assert witness._version == view._version == 1
    base.detach().mul_(2)
    assert witness._version == 2


# -- 3. inputs read on another stream ------------------------------------------------------------


def test_every_released_original_is_ordered_against_its_compute_stream(
    cpu_transport: CPUTestTransport,
) -> None:
    """Each original the engine lets go is released through the compute-stream ordering call.

    On a device, that call is ``record_stream`` on the stream the checkpoint ran on: an input
    allocated on a user's stream and read on another must not be reused under that read.
    """
    _linear_step(_mine)
    gc.collect()
    snapshot = matepoint.stats()
    assert snapshot.offloads == 2
    assert cpu_transport.originals_released == snapshot.offloads


# -- 4. conj and neg views -----------------------------------------------------------------------


def _lazy_bit_views(ckpt: Checkpoint) -> list[torch.Tensor]:
    x = torch.randn(4, 16, dtype=torch.complex64, requires_grad=True)
    y = torch.randn(4, 16, requires_grad=True)
    conj = (x * 1).conj()
    negative = torch._neg_view(y * 1)
    assert conj.is_conj()
    assert negative.is_neg()
    h = ckpt(lambda a, b: (a * 2j).real * a.imag + torch.tanh(b), conj, negative)
    h = ckpt(torch.sin, h * 1)
    h.square().sum().backward()
    assert x.grad is not None
    assert y.grad is not None
    return [h.detach(), x.grad, y.grad]


def test_conj_and_neg_views_stay_on_the_device(cpu_transport: CPUTestTransport) -> None:
    assert _assert_same(_lazy_bit_views) == "ok"
    gc.collect()
    snapshot = matepoint.stats()
    assert snapshot.offloads == 1  # only h * 1: the conj and neg views stay where they are
    assert snapshot.live_records == 0


# -- 5. tensors passed only by keyword -------------------------------------------------------------


def test_keyword_tensors_on_devices_no_positional_tensor_is_on_stay_keywords() -> None:
    """torch infers RNG and autocast devices from positional tensors only; keep what it sees."""
    calls: list[tuple[Any, ...]] = []

    def function(a: torch.Tensor, *, extra: torch.Tensor, host: torch.Tensor) -> None:
        calls.append((a, extra, host))

    cpu = torch.ones(2)
    meta = torch.ones(2, device="meta")
    run, lifted, _ = _checkpoint._flattened_call(function, (cpu,), {"extra": meta, "host": cpu * 2})
    assert [tensor.device.type for tensor in lifted] == ["cpu", "cpu"]
    run(*lifted)
    assert calls[-1][1] is meta

    run, lifted, _ = _checkpoint._flattened_call(
        function, ((meta * 1, cpu),), {"extra": meta, "host": cpu}
    )
    assert [tensor.device.type for tensor in lifted] == ["meta", "cpu", "meta", "cpu"]


def test_keyword_tensors_still_offload_and_match_torch(cpu_transport: CPUTestTransport) -> None:
    def step(ckpt: Checkpoint) -> list[torch.Tensor]:
        x = torch.randn(4, 16, requires_grad=True)
        scale = torch.randn(16, requires_grad=True)
        h = ckpt(
            lambda a, *, s: torch.nn.functional.dropout(torch.tanh(a) * s, 0.5), x * 1, s=scale * 1
        )
        h.square().sum().backward()
        assert x.grad is not None
        assert scale.grad is not None
        return [h.detach(), x.grad, scale.grad]

    assert _assert_same(step) == "ok"
    assert matepoint.stats().offloads == 2  # both tensors, the keyword one too


# -- 6. 0-dim inputs ---------------------------------------------------------------------------


def test_zero_dim_inputs_offload_and_match_torch(cpu_transport: CPUTestTransport) -> None:
    def step(ckpt: Checkpoint) -> list[torch.Tensor]:
        x = torch.randn(4, 16, requires_grad=True)
        scalar = torch.tensor(1.5, requires_grad=True)
        h = ckpt(lambda a, s: torch.tanh(a) * s, x * 1, scalar * 1)
        h = ckpt(lambda a, s: torch.sin(a) + s, h, (scalar * 2).sum())
        h.square().sum().backward()
        assert x.grad is not None
        assert scalar.grad is not None
        return [h.detach(), x.grad, scalar.grad]

    assert _assert_same(step) == "ok"


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ]
    + [getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)],
    ids=str,
)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (4, 5)], ids=str)
def test_every_dtype_and_shape_comes_back_bitwise(
    cpu_transport: CPUTestTransport, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """The recomputation sees the exact bytes, shape and strides that were saved."""
    source = torch.randn(shape).mul(4)
    value = source.to(dtype) if not dtype.is_complex else (source + 1j * source).to(dtype)
    seen: list[torch.Tensor] = []

    def function(x: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        seen.append(data.clone())
        return torch.sin(x)  # saves x: backward recomputes

    x = torch.randn(3, requires_grad=True)
    out = matepoint.checkpoint(function, x * 1, value.clone())
    out.sum().backward()
    assert len(seen) == 2
    forward, recomputed = seen
    assert recomputed.dtype == dtype
    assert recomputed.shape == value.shape
    assert (
        recomputed.view(torch.uint8).equal(forward.view(torch.uint8))
        if value.dim()
        else (recomputed.reshape(1).view(torch.uint8).equal(forward.reshape(1).view(torch.uint8)))
    )


# -- 7. keyword arguments matepoint consumes ----------------------------------------------------


def test_legacy_keywords_reach_a_function_that_declares_them() -> None:
    received: dict[str, Any] = {}

    def function(x: torch.Tensor, stream: Any = None, matepoint_ctx: Any = None) -> torch.Tensor:
        received.update(stream=stream, matepoint_ctx=matepoint_ctx)
        return x * 2

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = matepoint.checkpoint(
            function, torch.ones(2, requires_grad=True), stream="s", matepoint_ctx=[1]
        )
    out.sum().backward()
    assert received == {"stream": "s", "matepoint_ctx": [1]}


def test_legacy_keywords_reach_a_function_that_takes_var_keywords() -> None:
    received: dict[str, Any] = {}

    def function(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        received.update(kwargs)
        return x * 2

    matepoint.checkpoint(function, torch.ones(2, requires_grad=True), check_inplace_modifications=1)
    assert received == {"check_inplace_modifications": 1}


def test_legacy_keywords_a_function_cannot_take_are_dropped_with_a_warning() -> None:
    layer = torch.nn.Linear(2, 2)
    with pytest.warns(MatepointDeprecationWarning, match="stream="):
        out = matepoint.checkpoint(layer, torch.ones(2, requires_grad=True), stream=None)
    out.sum().backward()
