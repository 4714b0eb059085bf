"""torch's checkpoint tests, ported, on a CUDA device: the CPU parity suite's steps on the GPU.

The steps are the ones ``test_torch_parity*.py`` run on the CPU (they take a device), here with
their tensors on ``cuda``, through the real CUDA transport: copies on the side stream, originals
handed back to the caching allocator, pinned host blocks. Each step runs with torch's checkpoint
first (which also warms cuBLAS and the allocator), then with matepoint, in two modes: the
process defaults (small tensors stay on the device) and every saved input forced through host
memory (``OffloadOptions(min_offload_bytes=0)``). Results must be bitwise equal to torch's, the
same errors raised, and afterwards the device must be back where it was: every byte of
``torch.cuda.memory_allocated()``, no live record, no pinned block in use, no original held.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import test_torch_parity as base
import test_torch_parity_autograd as autograd
import test_torch_parity_inputs as inputs
import test_torch_parity_nested as nested
import torch
from test_torch_parity import (
    Checkpoint,
    Step,
    assert_same_outcome,
    mate,
    reference,
    run_seeded,
)
from torch import nn

import matepoint
import matepoint_compat as compat

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("clean_start", "undo_debug_logging")]

DEVICE = "cuda"
INPLACE = inputs.INPLACE
INCOMPATIBLE = "is incompatible"


@pytest.fixture(params=["default", "forced"])
def offload_mode(request: pytest.FixtureRequest) -> Iterator[str]:
    """The process defaults, or every saved input (however small) through pinned host memory."""
    if request.param == "default":
        yield "default"
        return
    with matepoint.options(min_offload_bytes=0):
        yield "forced"


def _device_level() -> int:
    """Device bytes of live tensors, once finished copies and their deferred frees are settled."""
    gc.collect()
    torch.cuda.synchronize()
    # Processes the caching allocator's pending record_stream frees (counted until then).
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def cuda_parity(
    step: Step,
    ours: Checkpoint,
    theirs: Checkpoint,
    *,
    mode: str,
    raises: str | None = None,
    offloads: bool = True,
) -> Any:
    """Run ``step`` with torch, then with matepoint; the same outcome, then the same memory.

    Returns torch's value. See ``test_torch_parity.parity`` for the arguments.
    """
    theirs_outcome = run_seeded(step, theirs)
    if theirs_outcome.error is not None:
        theirs_outcome.error.__traceback__ = None
    baseline = _device_level()
    matepoint.reset_stats()
    mine = run_seeded(step, ours)
    torch.cuda.synchronize()
    stats = matepoint.stats()
    assert_same_outcome(mine, theirs_outcome, stats, mode=mode, raises=raises, offloads=offloads)
    if mine.error is not None:
        mine.error.__traceback__ = None
    del mine
    after = _device_level()
    snapshot = matepoint.stats(synchronize=True)
    assert after == baseline, f"device memory {after - baseline:+d} bytes after the step"
    assert snapshot.live_records == 0, "an offloaded input outlived its graph"
    assert snapshot.pool_in_use_bytes == 0, "a pinned block is still in use"
    assert snapshot.device_bytes_held == 0, "matepoint still holds a device original"
    return theirs_outcome.value


@dataclasses.dataclass(frozen=True)
class Case:
    """One ported behaviour: its step on CUDA, the ``use_reentrant`` values it runs with, what
    torch raises (by ``use_reentrant``) and whether it saves anything to offload."""

    step: Callable[[], Step]
    reentrant: tuple[bool, ...] = (False, True)
    raises: Callable[[bool], str | None] = lambda reentrant: None
    offloads: Callable[[bool], bool] = lambda reentrant: True
    sequential: bool = False
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    needs: bool = True  # the installed torch has what the case uses


def _only_nonreentrant(pattern: str) -> Callable[[bool], str | None]:
    return lambda reentrant: pattern if reentrant else None


_NEVER_REENTRANT = (False,)

CASES: dict[str, Case] = {
    # TestCheckpoint
    **{
        f"sequential_{container}": Case(
            lambda container=container: base.sequential_step(DEVICE, container), sequential=True
        )
        for container in ("sequential", "children", "module_list")
    },
    "sequential_trigger": Case(lambda: base.sequential_trigger_step(DEVICE), sequential=True),
    "sequential_autograd_grad": Case(
        lambda: base.sequential_autograd_grad_step(DEVICE),
        sequential=True,
        raises=_only_nonreentrant(r"torch\.utils\.checkpoint is incompatible"),
    ),
    "dropout_rng": Case(lambda: base.dropout_step(DEVICE, True)),
    "dropout_rng_not_preserved": Case(lambda: base.dropout_step(DEVICE, False)),
    "none_argument": Case(lambda: base.none_argument_step(DEVICE)),
    "non_tensor_inputs_outputs": Case(lambda: base.mixed_inputs_outputs_step(DEVICE)),
    "partial_grad": Case(lambda: base.partial_grad_step(DEVICE, True)),
    "output_needs_no_grad": Case(
        lambda: base.partial_grad_step(DEVICE, False),
        raises=lambda reentrant: r"does not require grad|none of output",
    ),
    "default_device_context": Case(lambda: base.default_device_step(DEVICE, "context")),
    "set_default_device": Case(lambda: base.default_device_step(DEVICE, "set_default_device")),
    # TestAutograd
    "many_small_checkpoints": Case(lambda: autograd.many_checkpoints_step(DEVICE)),
    "keyword_module_input": Case(
        lambda: autograd.keyword_module_step(DEVICE, True),
        reentrant=_NEVER_REENTRANT,
        offloads=lambda reentrant: False,  # keyword tensors: torch holds them by reference
    ),
    "autocast_bf16": Case(
        lambda: autograd.autocast_step(DEVICE, True),
        needs=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    ),
    "custom_function_unpack_once": Case(
        lambda: autograd.custom_function_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "context_fn_recompute": Case(
        lambda: autograd.context_fn_step(DEVICE, True),
        raises=_only_nonreentrant("only supported when use_reentrant=False"),
        offloads=lambda reentrant: not reentrant,
    ),
    **{
        f"non_determinism_{case}": Case(
            lambda case=case: autograd.non_determinism_step(DEVICE, case),
            reentrant=_NEVER_REENTRANT,
            raises=lambda reentrant, case=case: autograd._NON_DETERMINISM[case][-1],
        )
        for case in autograd._NON_DETERMINISM
    },
    "saved_result_recomputes": Case(
        lambda: autograd.saved_result_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "no_grad_inside": Case(
        lambda: autograd.no_grad_inside_step(DEVICE),
        raises=_only_nonreentrant("none of output has requires_grad=True"),
    ),
    "saved_object_identity": Case(
        lambda: autograd.saved_identity_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "backward_and_autograd_grad": Case(
        lambda: autograd.backward_and_grad_step(DEVICE), raises=_only_nonreentrant(INCOMPATIBLE)
    ),
    "parameter_used_inside_and_outside": Case(lambda: autograd.hook_once_step(DEVICE)),
    "dict_input_output": Case(
        lambda: autograd.dict_io_step(DEVICE),
        raises=_only_nonreentrant("does not require grad"),
        offloads=lambda reentrant: not reentrant,
    ),
    # TestNestedCheckpoint and early stop
    "nested_f": Case(lambda: nested.nested_step(DEVICE, "f"), reentrant=_NEVER_REENTRANT),
    "nested_g": Case(lambda: nested.nested_step(DEVICE, "g"), reentrant=_NEVER_REENTRANT),
    "nested_two_children": Case(
        lambda: nested.two_children_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "nested_non_tensor_io": Case(
        lambda: nested.non_tensor_io_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "nested_kwargs": Case(lambda: nested.kwargs_step(DEVICE), reentrant=_NEVER_REENTRANT),
    "nested_hook_on_original_graph": Case(
        lambda: nested.hook_on_original_graph_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "nested_backward_in_hook": Case(
        lambda: nested.backward_in_hook_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    **{
        f"early_stop_{setting}": Case(
            lambda setting=setting: nested.early_stop_counts_step(DEVICE, setting),
            reentrant=_NEVER_REENTRANT,
            needs=compat.TORCH_2_9_PLUS,
        )
        for setting in ("default", "off", "context_off_beats_kwarg")
    },
    "early_stop_skips_kernel": Case(
        lambda: nested.early_stop_dispatch_step(DEVICE, True, True), reentrant=_NEVER_REENTRANT
    ),
    # TestSelectiveActivationCheckpoint
    **{
        f"sac_{policy}": Case(
            lambda policy=policy: nested.sac_step(DEVICE, policy),
            reentrant=_NEVER_REENTRANT,
            needs=compat.TORCH_2_5_PLUS,
        )
        for policy in ("op_list", "policy_fn", "bool_policy")
    },
    "sac_integer_view": Case(
        lambda: nested.sac_int_view_step(DEVICE),
        reentrant=_NEVER_REENTRANT,
        needs=compat.TORCH_2_5_PLUS,
    ),
    "sac_mutated_cache_entry": Case(
        lambda: nested.sac_mutation_step(DEVICE, False),
        reentrant=_NEVER_REENTRANT,
        raises=lambda reentrant: "has been mutated",
        needs=compat.TORCH_2_5_PLUS,
    ),
    "sac_two_output_op": Case(
        lambda: nested.sac_multi_output_step(DEVICE),
        reentrant=_NEVER_REENTRANT,
        needs=compat.TORCH_2_5_PLUS,
    ),
    "sac_recompute_once": Case(
        lambda: nested.sac_twice_step(DEVICE),
        reentrant=_NEVER_REENTRANT,
        raises=lambda reentrant: "Trying to backward an extra time",
        needs=compat.TORCH_2_5_PLUS,
    ),
    # arguments, outputs, in-place writes, unusual inputs
    "keyword_arguments": Case(
        lambda: inputs.keyword_step(DEVICE),
        raises=_only_nonreentrant("Unexpected keyword arguments"),
        offloads=lambda reentrant: not reentrant,
    ),
    **{
        f"keyword_only_dropout_{layout}_{'preserved' if preserve else 'not_preserved'}": Case(
            lambda layout=layout, preserve=preserve: inputs.keyword_dropout_step(
                DEVICE, layout, preserve
            ),
            reentrant=_NEVER_REENTRANT,
            offloads=lambda reentrant, layout=layout: layout == "mixed",
        )
        for layout in ("keywords", "mixed")
        for preserve in (True, False)
    },
    **{
        f"legacy_named_keyword_{name}": Case(
            lambda name=name: inputs.legacy_named_keyword_step(DEVICE, name),
            reentrant=_NEVER_REENTRANT,
        )
        for name in ("stream", "matepoint_ctx", "check_inplace_modifications")
    },
    "tuples_and_dicts": Case(lambda: inputs.containers_step(DEVICE)),
    "structured_outputs": Case(
        lambda: inputs.structured_output_step(DEVICE), reentrant=_NEVER_REENTRANT
    ),
    "inputs_without_grad": Case(
        lambda: inputs.no_grad_inputs_step(DEVICE), offloads=lambda reentrant: not reentrant
    ),
    "detached_outputs": Case(lambda: inputs.detached_output_step(DEVICE)),
    "retain_graph": Case(lambda: inputs.retain_graph_step(DEVICE)),
    "double_backward": Case(
        lambda: inputs.double_backward_step(DEVICE), raises=_only_nonreentrant(INCOMPATIBLE)
    ),
    "debug_mode": Case(
        lambda: inputs.debug_step(DEVICE),
        options={"debug": True},
        raises=_only_nonreentrant("only supported when use_reentrant=False"),
        offloads=lambda reentrant: not reentrant,
    ),
    "inplace_input": Case(lambda: inputs.inplace_input_step(DEVICE), raises=lambda r: INPLACE),
    "write_view_base_view_kept": Case(
        lambda: inputs.view_base_write_step(DEVICE, True), raises=lambda r: INPLACE
    ),
    "write_view_base_view_dropped": Case(
        lambda: inputs.view_base_write_step(DEVICE, False), raises=lambda r: INPLACE
    ),
    "write_parameter_of_row_slice": Case(
        lambda: inputs.parameter_slice_write_step(DEVICE, "rows"), raises=lambda r: INPLACE
    ),
    "write_parameter_of_transpose": Case(
        lambda: inputs.parameter_slice_write_step(DEVICE, "transpose"), raises=lambda r: INPLACE
    ),
    "inplace_after_backward": Case(lambda: inputs.inplace_after_backward_step(DEVICE)),
    "zero_dim_inputs": Case(lambda: inputs.scalar_chain_step(DEVICE)),
    "zero_size_inputs": Case(lambda: inputs.empty_chain_step(DEVICE)),
    "complex_inputs": Case(lambda: inputs.complex_step(DEVICE)),
    "conj_view_input": Case(lambda: inputs.conj_view_step(DEVICE, "conj")),
    "neg_view_input": Case(lambda: inputs.conj_view_step(DEVICE, "neg")),
    # 4 MiB: above the default offload threshold too.
    "conj_view_input_large": Case(lambda: inputs.conj_view_step(DEVICE, "conj", rows=1 << 16)),
    "neg_view_input_large": Case(lambda: inputs.conj_view_step(DEVICE, "neg", rows=1 << 16)),
}


def _params() -> list[Any]:
    params = []
    for name, case in CASES.items():
        for reentrant in case.reentrant:
            label = f"{name}-{'reentrant' if reentrant else 'nonreentrant'}"
            marks = () if case.needs else (pytest.mark.skip(reason="not in this torch"),)
            params.append(pytest.param(case, reentrant, id=label, marks=marks))
    return params


@pytest.mark.parametrize(("case", "use_reentrant"), _params())
def test_matches_torch_on_cuda(offload_mode: str, case: Case, use_reentrant: bool) -> None:
    """A ported torch checkpoint behaviour, on CUDA: torch's results and errors, no memory left."""
    if case.sequential:
        ours = base.mate_sequential(use_reentrant, **case.options)
        theirs = base.reference_sequential(use_reentrant, **case.options)
    else:
        ours = mate(use_reentrant, **case.options)
        theirs = reference(use_reentrant, **case.options)
    cuda_parity(
        case.step(),
        ours,
        theirs,
        mode=offload_mode,
        raises=case.raises(use_reentrant),
        offloads=case.offloads(use_reentrant),
    )


# -- CUDA only -------------------------------------------------------------------------------------

SLEEP_CYCLES = 20_000_000  # about 10 ms: the user stream lags far behind the host


@functools.cache
def _user_stream() -> torch.cuda.Stream:
    # One stream for both twins: cuBLAS keeps a workspace per stream for good, so a new stream
    # in the second run would look like a leak.
    return torch.cuda.Stream()


def user_stream_step(device: str) -> Step:
    """Inputs made on the default stream, checkpointed on a user stream that lags behind.

    The checkpointed function first stalls its stream, then reads its input. The host meanwhile
    drops its own reference to the input and makes new tensors of the same size on the default
    stream. An input released to the allocator ordered only against the side stream's copy
    would be handed to those new tensors (and overwritten) before the user stream reads it.
    """

    def step(checkpoint: Checkpoint) -> Any:
        layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4)).to(device)
        x = torch.randn(2048, 256, device=device, requires_grad=True)
        user = _user_stream()

        def slow(layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
            torch.cuda._sleep(SLEEP_CYCLES)
            return torch.tanh(layer(h)) + h

        outputs = []
        clutter = []
        for index, layer in enumerate(layers):
            h = x * (index + 1.0)  # on the default stream
            user.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(user):
                outputs.append(checkpoint(slow, layer, h))
            del h
            # New tensors on the default stream, which does not wait for the user stream.
            clutter.append(torch.full((2048, 256), float("nan"), device=device))
        torch.cuda.current_stream().wait_stream(user)
        loss = sum(out.square().sum() for out in outputs)
        loss.backward()
        torch.cuda.synchronize()
        del clutter
        return [out.detach() for out in outputs], x.grad.clone(), base.param_grads(layers)

    return step


def test_inputs_on_a_user_stream(offload_mode: str) -> None:
    """An input produced on one stream and consumed on another is never released under a reader.

    (torch's stream tests check the autograd engine's stream semantics; a checkpoint that frees
    its inputs early must keep them.)
    """
    cuda_parity(user_stream_step(DEVICE), mate(False), reference(False), mode=offload_mode)


def memory_step(device: str, depth: int = 8) -> Callable[[Checkpoint | None], int]:
    """Peak device bytes of one forward and backward of a stack of three-Linear blocks."""

    def step(checkpoint: Checkpoint | None) -> int:
        torch.manual_seed(0)
        layers = nn.ModuleList(
            nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
            for _ in range(depth)
        ).to(device)
        for parameter in layers.parameters():  # gradients allocated up front
            parameter.grad = torch.zeros_like(parameter)
        x = torch.randn(4096, 256, device=device, requires_grad=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        h = x * 1
        for layer in layers:
            h = layer(h) if checkpoint is None else checkpoint(layer, h)
        h.sum().backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    return step


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_memory_savings(use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_memory_savings: less peak memory
    than no checkpoint, and no more than torch's checkpoint."""
    step = memory_step(DEVICE)
    plain = step(None)
    theirs = step(reference(use_reentrant))
    ours = step(mate(use_reentrant))
    print(f"\n[gpu] peak bytes: no checkpoint {plain}, torch {theirs}, matepoint {ours}")
    assert theirs < plain
    assert ours <= theirs
    gc.collect()
    snapshot = matepoint.stats(synchronize=True)
    assert snapshot.live_records == 0
    assert snapshot.pool_in_use_bytes == 0
