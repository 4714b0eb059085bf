"""torch's ``TestAutograd`` checkpoint tests, ported to matepoint.

Same method as ``test_torch_parity.py`` (whose helpers this module uses): seeded twins through
matepoint and through torch, bitwise equal results, the same errors and warnings, in both offload
modes (matepoint's defaults, and every saved input forced through host memory).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from test_torch_parity import (
    Checkpoint,
    Step,
    assert_same,
    eager,
    grads,
    mate,
    param_grads,
    parity,
    reference,
    run_seeded,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import matepoint_compat as compat

# -- TestAutograd ----------------------------------------------------------------------------------


def many_checkpoints_step(device: str, count: int = 40) -> Step:
    """Many small checkpoints of one module, joined by a mean (torch's test_checkpointing)."""

    def step(checkpoint: Checkpoint) -> Any:
        module = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
        inputs = [torch.rand(1, 10, device=device, requires_grad=True) for _ in range(count)]
        features = [checkpoint(module, data) for data in inputs]
        torch.stack(features).mean().backward()
        return grads(*inputs), param_grads(module)

    return step


def test_many_small_checkpoints(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing."""
    parity(
        many_checkpoints_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )


class _Holder(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, data: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.module(data)
        return result


def keyword_module_step(device: str, input_requires_grad: bool, count: int = 20) -> Step:
    """A module checkpointed with its input as a keyword, next to an uncheckpointed twin."""

    def step(checkpoint: Checkpoint) -> Any:
        module = _Holder(nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 10)))
        module = module.to(device)
        twin = copy.deepcopy(module)
        checkpointed, plain = [], []
        for _ in range(count):
            data = torch.rand(1, 10, device=device).requires_grad_(input_requires_grad)
            checkpointed.append(checkpoint(module, data=data * 1))
            plain.append(twin(data * 1))
        torch.stack(checkpointed).mean().backward()
        torch.stack(plain).mean().backward()
        return param_grads(module), param_grads(twin)

    return step


@pytest.mark.parametrize("input_requires_grad", [True, False])
def test_module_with_keyword_input(offload_mode: str, input_requires_grad: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant: keyword input, eager gradients."""
    checkpointed, plain = parity(
        keyword_module_step("cpu", input_requires_grad),
        mate(False),
        reference(False),
        mode=offload_mode,
        offloads=False,  # torch holds keyword tensors by reference; moving them is optional
    )
    assert_same(checkpointed, plain)


def autocast_step(device: str, enabled: bool) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        dtypes: list[torch.dtype] = []

        def function(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
            x = torch.mm(x, y)
            # Recorded before the last saving op: early stop ends the recompute at that op.
            dtypes.append(x.dtype)
            y = torch.mm(x, z)
            return torch.mm(z, y)

        x, y, z = (torch.randn(3, 3, device=device, requires_grad=True) for _ in range(3))
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=enabled):
            loss = checkpoint(function, x * 1, y * 1, z * 1).sum()
        loss.backward()
        return dtypes, loss.detach(), grads(x, y, z)

    return step


@pytest.mark.parametrize("enabled", [True, False])
def test_autocast_state_is_replayed(offload_mode: str, use_reentrant: bool, enabled: bool) -> None:
    """Mirrors torch's test_checkpointing_non_reentrant_autocast_cpu: recompute in bf16 too."""
    dtypes, _, _ = parity(
        autocast_step("cpu", enabled),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )
    assert dtypes == [torch.bfloat16 if enabled else torch.float32] * 2


def custom_function_step(device: str) -> Step:
    """A custom Function inside the checkpoint reads its saved tensors twice in backward."""

    def step(checkpoint: Checkpoint) -> Any:
        second_access: list[str] = []

        class Product(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> Any:
                w = x * y * z
                out = w + w
                ctx.save_for_backward(x, y, z, w, out)
                return out

            @staticmethod
            def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
                x, y, z, _, _ = ctx.saved_tensors
                try:
                    ctx.saved_tensors
                    second_access.append("allowed")
                except RuntimeError as error:
                    second_access.append(
                        "unpacked once" if "already unpacked once" in str(error) else str(error)
                    )
                return x * grad_out, y * grad_out, z * grad_out

        def function(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> Any:
            return Product.apply(x * y * z, y * y * z, z * z)

        x, y, z = (
            torch.tensor(value, device=device, requires_grad=True) for value in (1.0, 2.0, 3.0)
        )
        out = checkpoint(function, x, y, z)
        out.sum().backward()
        return second_access, out.detach(), grads(x, y, z)

    return step


def test_custom_function_saved_tensors_unpack_once(offload_mode: str) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_custom_function_works."""
    second_access, _, _ = parity(
        custom_function_step("cpu"), mate(False), reference(False), mode=offload_mode
    )
    assert second_access == ["unpacked once"]


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.operators: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operators.append(func.__name__)
        return func(*args, **(kwargs or {}))


def context_fn_step(device: str, recompute: bool) -> Step:
    """A dispatch mode as the forward (or the recompute) context records the ops it sees."""

    def step(checkpoint: Checkpoint) -> Any:
        mode = _RecordOps()

        def context_fn() -> tuple[Any, Any]:
            if recompute:
                return contextlib.nullcontext(), mode
            return mode, contextlib.nullcontext()

        x = torch.tensor([1.0, 2.0], device=device, requires_grad=True)
        out = checkpoint(lambda t: t.exp(), x * 1, context_fn=context_fn)
        forward_ops = list(mode.operators)
        out.sum().backward()
        return forward_ops, mode.operators, grads(x)

    return step


@pytest.mark.parametrize("recompute", [False, True], ids=["forward_context", "recompute_context"])
def test_context_fn_contexts(offload_mode: str, use_reentrant: bool, recompute: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_with_context_fn.

    The forward context sees the forward's ops, the recompute context the recomputation's; the
    reentrant checkpoint refuses a context_fn.
    """
    value = parity(
        context_fn_step("cpu", recompute),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="only supported when use_reentrant=False" if use_reentrant else None,
        offloads=not use_reentrant,  # refused before anything is saved
    )
    if not use_reentrant:
        forward_ops, all_ops, _ = value
        if recompute:
            assert forward_ops == []
            # How many detaches torch's recomputation logs differs by release (2.4 logs two).
            assert all_ops[0] == "exp.default"
            assert set(all_ops[1:]) == {"detach.default"}
        else:
            assert forward_ops == all_ops == ["exp.default"]


# Checkpointed functions that save 3 or 2 tensors, or 2 of another shape.
def _saves_three(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def _saves_two(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp()


def _saves_two_other(x: torch.Tensor) -> torch.Tensor:
    return x.sin() * torch.tensor([1.0, 2.0], device=x.device)


_Saver = Callable[[torch.Tensor], torch.Tensor]
_Case = tuple[_Saver, _Saver, dict[str, Any], bool | None, bool, str | None]
_NON_DETERMINISM: dict[str, _Case] = {
    # case: (forward, recompute, checkpoint options, global debug flag, early stop, raises)
    "fewer_saved": (_saves_three, _saves_two, {}, None, True, "different number of tensors"),
    "more_saved": (_saves_two, _saves_three, {}, None, False, "save more tensors during recomp"),
    "more_saved_early_stop": (_saves_two, _saves_three, {}, None, True, None),
    "other_metadata": (_saves_two, _saves_two_other, {}, None, True, "different metadata"),
    "debug": (_saves_two, _saves_two_other, {"debug": True}, None, True, "passed `debug=True`"),
    "debug_global": (_saves_two, _saves_two_other, {}, True, True, "passed `debug=True`"),
    "debug_global_off": (
        _saves_two,
        _saves_two_other,
        {"debug": True},
        False,
        True,
        "Recomputed values for the following tensors have different",
    ),
    "check_none": (_saves_two, _saves_two_other, {"determinism_check": "none"}, None, True, None),
}


def non_determinism_step(device: str, case: str) -> Step:
    forward, recompute, options, debug, early_stop, _ = _NON_DETERMINISM[case]

    def step(checkpoint: Checkpoint) -> Any:
        calls = [0]

        def function(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return forward(x) if calls[0] == 1 else recompute(x)

        a = torch.randn(1, device=device, requires_grad=True)
        debug_flag = (
            contextlib.nullcontext()
            if debug is None
            else torch_checkpoint.set_checkpoint_debug_enabled(debug)
        )
        with torch_checkpoint.set_checkpoint_early_stop(early_stop), debug_flag:
            out = checkpoint(function, a * 1, **options)
            out.sum().backward()
        return grads(a)

    return step


@pytest.mark.usefixtures("undo_debug_logging")
@pytest.mark.parametrize("case", list(_NON_DETERMINISM))
def test_non_determinism_is_detected(offload_mode: str, case: str) -> None:
    """Mirrors torch's test_checkpoint_detects_non_determinism (and determinism_check="none")."""
    parity(
        non_determinism_step("cpu", case),
        mate(False),
        reference(False),
        mode=offload_mode,
        raises=_NON_DETERMINISM[case][-1],
    )


def saved_result_step(device: str) -> Step:
    """Reading a saved tensor of the checkpointed graph outside backward recomputes each time."""

    def step(checkpoint: Checkpoint) -> Any:
        count = [0]

        def function(a: torch.Tensor) -> torch.Tensor:
            count[0] += 1
            b = a * a
            c = a * b
            del c
            return torch.exp(a)

        a = torch.randn(5, device=device, requires_grad=True)
        d = checkpoint(function, a * 1)
        counts = [count[0]]
        first = d.grad_fn._saved_result.detach().clone()
        counts.append(count[0])
        second = d.grad_fn._saved_result.detach().clone()
        counts.append(count[0])
        d.sum().backward()
        counts.append(count[0])
        freed: bool | str
        try:
            d.grad_fn._saved_result
            freed = "readable"
        except RuntimeError as error:
            freed = "after they have already been freed" in str(error)
        return counts, first, second, freed, grads(a)

    return step


def test_saved_tensor_access_outside_backward_recomputes(offload_mode: str) -> None:
    """Mirrors torch's test_access_saved_tensor_twice_without_recomputation_works."""
    counts, _, _, freed, _ = parity(
        saved_result_step("cpu"), mate(False), reference(False), mode=offload_mode
    )
    assert counts == [1, 2, 3, 4]
    assert freed is True


def test_reentrant_autograd_grad_error_then_backward_works(offload_mode: str) -> None:
    """Mirrors torch's test_checkpoint_valid_reset_on_error."""

    def failing(checkpoint: Checkpoint) -> Any:
        a = torch.randn(2, 2, requires_grad=True)
        b = checkpoint(torch.exp, a * 1).sum()
        return torch.autograd.grad(b, (a,))

    def working(checkpoint: Checkpoint) -> Any:
        a = torch.randn(2, 2, requires_grad=True)
        checkpoint(torch.exp, a * 1).sum().backward()
        return grads(a)

    parity(failing, mate(True), reference(True), mode=offload_mode, raises="is incompatible")
    parity(working, mate(True), reference(True), mode=offload_mode)


class _NoGradInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2, bias=False)
        self.lin2 = nn.Linear(2, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            result: torch.Tensor = self.lin2(self.linear(x))
            return result


def no_grad_inside_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        module = _NoGradInside().to(device)
        a = torch.randn(2, 2, device=device, requires_grad=True)
        for _ in range(3):
            out = checkpoint(module, a * 1)
            out += a
            out.sum().backward()
        return grads(a)

    return step


def test_function_running_under_no_grad(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_detached_tensor.

    An output that does not require grad: fine without reentrancy; the reentrant checkpoint
    raises in backward.
    """
    parity(
        no_grad_inside_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="none of output has requires_grad=True" if use_reentrant else None,
    )


def saved_identity_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        seen: list[torch.Tensor] = []

        class SaveSecond(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(y)
                return x

            @staticmethod
            def backward(ctx: Any, grad: torch.Tensor) -> Any:
                seen.extend(ctx.saved_tensors)
                return grad, None

        a = torch.tensor(1.0, device=device, requires_grad=True)
        b = torch.tensor(1.0, device=device, requires_grad=False)
        checkpoint(SaveSecond.apply, a, b).backward()
        return [t is b for t in seen], grads(a)

    return step


def test_saved_tensor_keeps_its_identity(offload_mode: str) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_saved_object_identity."""
    identity, _ = parity(
        saved_identity_step("cpu"), mate(False), reference(False), mode=offload_mode
    )
    # parity() compared with torch on this release; older releases (2.4) do not keep identity.
    if compat.TORCH_2_13_PLUS:
        assert identity == [True]


def backward_and_grad_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        a = torch.randn(2, 2, device=device, requires_grad=True)
        checkpoint(torch.exp, a * 1).sum().backward()
        by_backward = grads(a)
        (by_grad,) = torch.autograd.grad(checkpoint(torch.exp, a * 1).sum(), (a,))
        return by_backward, by_grad

    return step


def test_backward_and_autograd_grad(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_correct_grad.

    backward() and autograd.grad() give the eager gradients; the reentrant checkpoint refuses
    autograd.grad().
    """
    step = backward_and_grad_step("cpu")
    value = parity(
        step,
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="is incompatible" if use_reentrant else None,
    )
    if not use_reentrant:
        assert_same(value, run_seeded(step, eager).value)


def hook_once_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        w = torch.randn(10, 10, device=device, requires_grad=True)
        count = [0]

        def hook(grad: torch.Tensor) -> None:
            count[0] += 1

        w.register_hook(hook)
        x = torch.rand(10, 10, device=device, requires_grad=True)
        out = checkpoint(lambda h: w * h, w * x)
        out.sum().backward()
        return count[0], grads(w, x)

    return step


def test_parameter_used_inside_and_outside(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_parameter_used_in_an_out."""
    count, _ = parity(
        hook_once_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )
    if not use_reentrant:
        assert count == 1


class _DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(5, 5, bias=False)

    def forward(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"result": self.layer(inputs["tensor"])}


def dict_io_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        model = _DictModel().to(device)
        x = torch.randn(5, 5, device=device, requires_grad=True)
        out = checkpoint(model, {"tensor": x * 1})["result"].sum()
        out.backward()
        return out.detach(), grads(x), param_grads(model)

    return step


def test_dict_input_and_output(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpointing_without_reentrant_arbitrary_input_output.

    The reentrant checkpoint does not see a tensor inside a dict: its output needs no grad and
    backward fails, as in torch.
    """
    step = dict_io_step("cpu")
    value = parity(
        step,
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="does not require grad" if use_reentrant else None,
        offloads=not use_reentrant,
    )
    if not use_reentrant:
        assert_same(value, run_seeded(step, eager).value)
