"""torch's nested-checkpoint, early-stop and selective-checkpoint tests, ported to matepoint.

Same method as ``test_torch_parity.py`` (whose helpers this module uses): seeded twins through
matepoint and through torch, bitwise equal results, the same errors, in both offload modes.
Nesting follows torch's ``TestNestedCheckpoint``: functions wrapped in checkpoints, gradients
and checkpoints in every order (``grad(c(grad(c(f))))``...), each result equal to torch's for the
same wrapping and close to the uncheckpointed function's, and each graph freed when dropped.
"""

from __future__ import annotations

import collections
import functools
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from test_torch_parity import (
    SEED,
    Checkpoint,
    Step,
    assert_released,
    assert_same,
    eager,
    grads,
    mate,
    parity,
    reference,
    run_seeded,
)
from torch.utils._python_dispatch import TorchDispatchMode

import matepoint_compat as compat

Function = Callable[[torch.Tensor], torch.Tensor]

# -- TestNestedCheckpoint's vocabulary -------------------------------------------------------------


def grad_of(fn: Function) -> Function:
    """``x -> d fn(x) / dx``, with a graph (so it can be differentiated again)."""

    def wrapper(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            out = fn(x)
            (grad_input,) = torch.autograd.grad(out, inputs=(x,), create_graph=True)
        return grad_input

    return wrapper


def sum_of(fn: Function) -> Function:
    def wrapper(x: torch.Tensor) -> torch.Tensor:
        return fn(x).sum()

    return wrapper


def checkpointed(checkpoint: Checkpoint) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``c``: wrap a function in ``checkpoint`` (non-reentrant)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return checkpoint(fn, *args, **kwargs)

        return wrapped

    return wrap


def nestings(
    fn: Function, c: Callable[[Function], Function]
) -> list[tuple[Function, list[Function]]]:
    """Each uncheckpointed function with the checkpointed wrappings that must compute the same."""
    g = grad_of
    return [
        (fn, [c(fn), c(c(fn))]),
        (g(fn), [g(c(fn)), g(c(c(fn)))]),
        (g(g(fn)), [g(c(g(fn))), c(g(g(c(fn)))), g(c(g(c(fn))))]),
        (g(g(g(fn))), [g(c(g(g(c(fn))))), g(c(g(c(g(c(fn))))))]),
    ]


def graph_dies(fn: Function, device: str = "cpu") -> bool:
    """Whether every node of ``fn(a)``'s graph is freed once the output is dropped.

    ``a`` is a new scalar leaf, dropped with the output: a leaf's gradient accumulator is shared
    by every graph that uses the leaf, so a leaf kept elsewhere would keep it alive.
    """

    class Handle:
        pass

    def build() -> list[weakref.ref[Handle]]:
        out = fn(torch.randn((), device=device, requires_grad=True))
        refs = []
        seen: set[Any] = set()
        queue = collections.deque([out.grad_fn])
        while queue:
            node = queue.popleft()
            if node is None or node in seen:
                continue
            seen.add(node)
            handle = Handle()
            node.metadata["handle"] = handle
            refs.append(weakref.ref(handle))
            queue.extend(next_node for next_node, _ in node.next_functions)
        return refs

    refs = build()
    gc.collect()
    return all(ref() is None for ref in refs)


def _f(x: torch.Tensor) -> torch.Tensor:
    return x.sin().exp().sin()


def _g(x: torch.Tensor) -> torch.Tensor:
    # Differentiates inside itself, twice, then returns something simple.
    a = x.sin().exp().sin()
    b = x.sin().exp().sin()
    torch.autograd.grad(a, x)
    torch.autograd.grad(b, x)
    return x.sin()


@pytest.fixture(params=[True, False], ids=["early_stop", "no_early_stop"])
def early_stop(request: pytest.FixtureRequest) -> Iterator[bool]:
    """Run under ``set_checkpoint_early_stop(True/False)``, as torch's nested tests do."""
    with torch_checkpoint.set_checkpoint_early_stop(request.param):
        yield bool(request.param)


def nested_step(device: str, which: str) -> Step:
    """Evaluate every wrapping of ``f`` (or ``g``) from :func:`nestings` at one scalar."""
    fn = {"f": _f, "g": _g}[which]

    def step(checkpoint: Checkpoint) -> Any:
        x = torch.randn((), device=device, requires_grad=True)
        results = []
        for _, actual_fns in nestings(fn, checkpointed(checkpoint)):
            results.append([actual(x).detach() for actual in actual_fns])
        return results

    return step


@pytest.mark.usefixtures("early_stop")
@pytest.mark.parametrize("which", ["f", "g"])
def test_nested_checkpoint(offload_mode: str, which: str) -> None:
    """Mirrors torch's test_nested_checkpoint: every nesting equals torch's and the eager value;
    every nesting's graph (and every record in it) is freed when dropped."""
    results = parity(nested_step("cpu", which), mate(), reference(), mode=offload_mode)
    fn = {"f": _f, "g": _g}[which]
    torch.manual_seed(SEED)  # the step's ``x``
    x = torch.randn((), requires_grad=True)
    for (expected_fn, actual_fns), values in zip(
        nestings(fn, checkpointed(mate())), results, strict=True
    ):
        expected = expected_fn(x)
        for actual_fn, value in zip(actual_fns, values, strict=True):
            torch.testing.assert_close(value, expected.detach())
            assert graph_dies(actual_fn)
    assert_released()


def two_children_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        c = checkpointed(checkpoint)

        def f(x: torch.Tensor) -> torch.Tensor:
            return x.sin().exp().sin()

        def g(x: torch.Tensor) -> torch.Tensor:
            return x.cos().sin().exp()

        def hc(x: torch.Tensor) -> torch.Tensor:
            return c(g)(c(f)(x))

        a = torch.randn(3, 3, device=device, requires_grad=True)
        first = grad_of(sum_of(grad_of(sum_of(c(hc)))))(a)
        second = grad_of(sum_of(c(grad_of(sum_of(c(hc))))))(a)
        dies = [
            graph_dies(fn, device)
            for fn in (
                grad_of(c(hc)),
                grad_of(sum_of(grad_of(sum_of(c(hc))))),
                grad_of(sum_of(c(grad_of(sum_of(c(hc)))))),
            )
        ]
        return first.detach(), second.detach(), dies

    return step


@pytest.mark.usefixtures("early_stop")
def test_nested_checkpoint_two_children(offload_mode: str) -> None:
    """Mirrors torch's test_nested_checkpoint_two_children."""
    first, second, dies = parity(two_children_step("cpu"), mate(), reference(), mode=offload_mode)
    expected = grad_of(sum_of(grad_of(sum_of(lambda x: x.sin().exp().sin().cos().sin().exp()))))
    torch.manual_seed(SEED)  # the step's ``a``
    a = torch.randn(3, 3, requires_grad=True)
    torch.testing.assert_close(first, expected(a).detach())
    torch.testing.assert_close(second, expected(a).detach())
    assert dies == [True, True, True]


def non_tensor_io_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        def fn(k: int, a: torch.Tensor, b: torch.Tensor, f: Function) -> tuple[Any, ...]:
            return f(k * a * b.exp()), 1, "abcd"

        a = torch.tensor(2.0, device=device, requires_grad=True)
        b = torch.tensor(3.0, device=device, requires_grad=True)
        out, one, text = checkpoint(fn, 3, a * 1, b * 1, torch.sin)
        return one, text, out.detach(), torch.autograd.grad(out, (a, b))

    return step


@pytest.mark.usefixtures("early_stop")
def test_nested_checkpoint_non_tensor_inputs_and_outputs(offload_mode: str) -> None:
    """Mirrors torch's test_nested_checkpoint_non_tensor_inputs_and_outputs."""
    step = non_tensor_io_step("cpu")
    value = parity(step, mate(), reference(), mode=offload_mode)
    assert_same(value, run_seeded(step, eager).value)


def kwargs_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        def fn(a: torch.Tensor, blah: torch.Tensor | None = None) -> torch.Tensor:
            out = a.sin().exp()
            if blah is not None:
                out = out * blah
            return out.sin().exp()

        a = torch.tensor(2.0, device=device, requires_grad=True)
        b = torch.tensor(3.0, device=device, requires_grad=True)
        out = checkpoint(fn, a * 1, blah=b * 1)
        return out.detach(), torch.autograd.grad(out, (a, b))

    return step


@pytest.mark.usefixtures("early_stop")
def test_nested_checkpoint_kwargs(offload_mode: str) -> None:
    """Mirrors torch's test_nested_checkpoint_kwargs: a tensor keyword gets its gradient."""
    step = kwargs_step("cpu")
    value = parity(step, mate(), reference(), mode=offload_mode)
    assert_same(value, run_seeded(step, eager).value)


def hook_on_original_graph_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        counter = [0]

        def hook(*_: Any) -> None:
            counter[0] += 1

        a = torch.tensor(1.0, device=device, requires_grad=True)
        out = checkpoint(lambda t: t.sin().cos().sin(), a * 1)
        out.grad_fn.next_functions[0][0].register_hook(hook)
        out.backward()
        return counter[0], grads(a)

    return step


@pytest.mark.usefixtures("early_stop")
def test_nested_checkpoint_hook_on_original_graph(offload_mode: str) -> None:
    """Mirrors torch's test_nested_checkpoint_same_graph: a node hook runs exactly once."""
    count, _ = parity(hook_on_original_graph_step("cpu"), mate(), reference(), mode=offload_mode)
    assert count == 1


def backward_in_hook_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = a.sin().cos()
            return x, x.sin()

        a = torch.tensor(1.0, device=device, requires_grad=True)
        x, out = checkpoint(fn, a * 1)

        def hook(*_: Any) -> None:
            # Backward again from inside backward, skipping the part where the hook sits.
            x.backward(retain_graph=True)

        out.grad_fn.register_hook(hook)
        out.backward(retain_graph=True)
        return grads(a)

    return step


@pytest.mark.usefixtures("early_stop")
def test_nested_checkpoint_backward_inside_backward(offload_mode: str) -> None:
    """Mirrors torch's test_nested_checkpoint_reentrant_backwards."""
    parity(backward_in_hook_step("cpu"), mate(), reference(), mode=offload_mode)


# -- early stop ------------------------------------------------------------------------------------


def early_stop_counts_step(device: str, setting: str) -> Step:
    """Count recomputation of a clone after the last saving op under each early-stop setting."""

    def step(checkpoint: Checkpoint) -> Any:
        counter = [0]

        def clone(x: torch.Tensor) -> torch.Tensor:
            counter[0] += 1
            return x.clone()

        def fn(x: torch.Tensor) -> torch.Tensor:
            # clone saves nothing: it is recomputed only without early stop.
            return clone(x.sin().cos())

        context, options = {
            "default": (None, {}),
            "off": (None, {"early_stop": False}),
            "on": (None, {"early_stop": True}),
            "context_off": (False, {}),
            "context_on": (True, {}),
            "nested_contexts": ("nested", {"early_stop": False}),
            "context_off_beats_kwarg": (False, {"early_stop": True}),
            "context_on_beats_kwarg": (True, {"early_stop": False}),
        }[setting]
        a = torch.tensor(1.0, device=device, requires_grad=True)
        if context is None:
            out = checkpoint(fn, a * 1, **options)
        elif context == "nested":
            with (
                torch_checkpoint.set_checkpoint_early_stop(False),
                torch_checkpoint.set_checkpoint_early_stop(True),
            ):
                out = checkpoint(fn, a * 1, **options)
        else:
            with torch_checkpoint.set_checkpoint_early_stop(bool(context)):
                out = checkpoint(fn, a * 1, **options)
        out.backward()
        return counter[0], grads(a)

    return step


_EARLY_STOP_CALLS = {
    "default": 1,
    "off": 2,
    "on": 1,
    "context_off": 2,
    "context_on": 1,
    "nested_contexts": 1,
    "context_off_beats_kwarg": 2,
    "context_on_beats_kwarg": 1,
}


@pytest.mark.skipif(not compat.TORCH_2_9_PLUS, reason="early_stop= arrived in torch 2.9")
@pytest.mark.parametrize("setting", list(_EARLY_STOP_CALLS))
def test_early_stop_setting(offload_mode: str, setting: str) -> None:
    """Mirrors torch's test_nested_checkpoint_set_early_stop.

    The ``early_stop=`` keyword and the ``set_checkpoint_early_stop`` context (which wins, and is
    read when the checkpoint is called, not in backward) decide whether recomputation stops
    after the last saved tensor.
    """
    calls, _ = parity(
        early_stop_counts_step("cpu", setting), mate(), reference(), mode=offload_mode
    )
    assert calls == _EARLY_STOP_CALLS[setting]


class _CountSin(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.sin.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def early_stop_dispatch_step(device: str, early: bool, saves: bool) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        calls = [0]

        def fn(x: torch.Tensor) -> torch.Tensor:
            calls[0] += 1
            return x.sin() if saves else x.clone()

        a = torch.tensor(1.0, device=device, requires_grad=True)
        with _CountSin() as counter:
            with torch_checkpoint.set_checkpoint_early_stop(early):
                out = checkpoint(fn, a * 1)
            out.backward()
        return calls[0], counter.count, grads(a)

    return step


@pytest.mark.parametrize("early", [True, False], ids=["early_stop", "no_early_stop"])
@pytest.mark.parametrize("saves", [True, False], ids=["saves_input", "saves_nothing"])
def test_early_stop_skips_the_kernel(offload_mode: str, early: bool, saves: bool) -> None:
    """Mirrors torch's test_nested_checkpoint_set_early_stop_no_recompution_needed.

    When the only saved tensor is the input, early stop skips the recomputed kernel (it still
    enters the Python function); when nothing is saved, nothing is recomputed at all.
    """
    calls, kernels, _ = parity(
        early_stop_dispatch_step("cpu", early, saves), mate(), reference(), mode=offload_mode
    )
    if saves:
        assert (calls, kernels) == (2, 1 if early else 2)
    else:
        assert calls == 1


# -- selective activation checkpoint (TestSelectiveActivationCheckpoint) ---------------------------

needs_sac = pytest.mark.skipif(
    not compat.TORCH_2_5_PLUS, reason="create_selective_checkpoint_contexts arrived in torch 2.5"
)


def _must_save_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    if op == torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _is_mm(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> bool:
    return bool(op == torch.ops.aten.mm.default)


def sac_context(policy: Any, **kwargs: Any) -> Callable[[], Any]:
    return functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, policy, **kwargs
    )


def sac_step(device: str, policy: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        chosen = {
            "op_list": [torch.ops.aten.mm.default],
            "policy_fn": _must_save_mm,
            "bool_policy": _is_mm,
        }[policy]
        x = torch.randn(16, 16, device=device, requires_grad=True)
        y = torch.randn(16, 16, device=device, requires_grad=True)

        def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.mm(a.cos(), b).sin().sum()

        out = checkpoint(fn, x * 1, y * 1, context_fn=sac_context(chosen))
        out.backward()
        return out.detach(), grads(x, y)

    return step


@needs_sac
@pytest.mark.parametrize("policy", ["op_list", "policy_fn", "bool_policy"])
def test_selective_checkpoint_policies(offload_mode: str, policy: str) -> None:
    """Mirrors torch's SAC test_flops_and_mem (its numerics): every way of naming the saved op."""
    step = sac_step("cpu", policy)
    value = parity(step, mate(), reference(), mode=offload_mode)
    assert_same(value, run_seeded(step, eager).value)


def sac_int_view_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        x = torch.tensor([1, 2, 3], dtype=torch.int64, device=device)
        y = torch.randn(3, device=device, requires_grad=True)
        out = checkpoint(
            lambda a, b: (a.view(-1), b.sin().cos()),
            x,
            y * 1,
            context_fn=sac_context([torch.ops.aten.view.default]),
        )
        out[1].sum().backward()
        return out[0], out[1].detach(), grads(y)

    return step


@needs_sac
def test_selective_checkpoint_integer_view_output(offload_mode: str) -> None:
    """Mirrors torch's test_output_already_has_autograd_meta (a cached view of an int tensor)."""
    parity(sac_int_view_step("cpu"), mate(), reference(), mode=offload_mode)


def sac_stateful_policy_step(device: str) -> Step:
    from torch.utils.checkpoint import CheckpointPolicy

    def step(checkpoint: Checkpoint) -> Any:
        counters: list[int] = []

        class Policy:
            def __init__(self) -> None:
                self.counter = [0]
                self.recompute_counter = [0]

            def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
                counter = self.recompute_counter if ctx.is_recompute else self.counter
                counter[0] += 1
                counters.append(counter[0])
                return CheckpointPolicy.PREFER_RECOMPUTE

        x = torch.randn(3, device=device, requires_grad=True)
        context_fn = sac_context(Policy(), allow_cache_entry_mutation=True)
        out = checkpoint(lambda t: t.sin().sin().sin(), x * 1, context_fn=context_fn)
        out.sum().backward()
        return counters, grads(x)

    return step


@needs_sac
def test_selective_checkpoint_policy_with_state(offload_mode: str) -> None:
    """Mirrors torch's test_policy_with_state: a stateful policy sees what it sees with torch.

    (Whether the policy is consulted again during recomputation depends on the torch release;
    the forward's three calls are counted on every release.)
    """
    counters, _ = parity(sac_stateful_policy_step("cpu"), mate(), reference(), mode=offload_mode)
    assert counters[:3] == [1, 2, 3]


def sac_mutation_step(device: str, allow: bool) -> Step:
    def _save_sin(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        if op == torch.ops.aten.sin.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def step(checkpoint: Checkpoint) -> Any:
        x = torch.randn(3, device=device, requires_grad=True)
        context_fn = sac_context(_save_sin, allow_cache_entry_mutation=allow)
        out = checkpoint(lambda t: t.sin().mul_(2).cos().exp(), x * 1, context_fn=context_fn)
        out.sum().backward()
        return grads(x)

    return step


@needs_sac
@pytest.mark.parametrize("allow", [False, True], ids=["refused", "allowed"])
def test_selective_checkpoint_mutated_cache_entry(offload_mode: str, allow: bool) -> None:
    """Mirrors torch's SAC test_version_counter: a saved op output mutated in place."""
    parity(
        sac_mutation_step("cpu", allow),
        mate(),
        reference(),
        mode=offload_mode,
        raises=None if allow else "has been mutated",
    )


def sac_multi_output_step(device: str) -> Step:
    from torch.utils.checkpoint import CheckpointPolicy

    def step(checkpoint: Checkpoint) -> Any:
        counter = [0]

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
            if op == torch.ops.aten.var_mean.correction:
                counter[0] += 1
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        def fn(x: torch.Tensor) -> torch.Tensor:
            a, b = torch.var_mean(x)
            return a * b

        x = torch.randn(3, device=device, requires_grad=True)
        out = checkpoint(fn, x * 1, context_fn=sac_context(policy))
        (x_grad,) = torch.autograd.grad(out.sum(), (x,))
        (eager_grad,) = torch.autograd.grad(fn(x).sum(), (x,))
        return counter[0], x_grad, eager_grad

    return step


@needs_sac
def test_selective_checkpoint_op_with_two_outputs(offload_mode: str) -> None:
    """Mirrors torch's test_function_with_more_than_one_output (the policy sees the op as torch's
    checkpoint makes it see it; gradients equal the eager ones)."""
    count, x_grad, eager_grad = parity(
        sac_multi_output_step("cpu"), mate(), reference(), mode=offload_mode
    )
    assert count >= 1
    torch.testing.assert_close(x_grad, eager_grad)


_CUSTOM_OP_CALLS = [0]


@functools.cache
def _sin_with_extra() -> Any:
    """A custom op returning a tensor and an int (registered once per process)."""

    @torch.library.custom_op("matepoint_parity::sin_with_extra", mutates_args=())
    def sin_with_extra(x: torch.Tensor) -> tuple[torch.Tensor, int]:
        _CUSTOM_OP_CALLS[0] += 1
        return x.sin(), 2

    def setup_context(ctx: Any, inputs: Any, output: Any) -> None:
        (x,) = inputs
        ctx.save_for_backward(x)

    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * x.cos()

    torch.library.register_autograd(
        "matepoint_parity::sin_with_extra", backward, setup_context=setup_context
    )
    return torch.ops.matepoint_parity.sin_with_extra


def sac_custom_op_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        op = _sin_with_extra()

        def fn(x: torch.Tensor) -> torch.Tensor:
            return (op(x)[0] * x.sin().exp()).sin()

        x = torch.randn(3, device=device, requires_grad=True)
        _CUSTOM_OP_CALLS[0] = 0
        out = checkpoint(fn, x * 1, context_fn=sac_context([op.default]))
        (x_grad,) = torch.autograd.grad(out.sum(), (x,))
        calls = _CUSTOM_OP_CALLS[0]
        (eager_grad,) = torch.autograd.grad(fn(x).sum(), (x,))
        return calls, x_grad, eager_grad

    return step


@needs_sac
def test_selective_checkpoint_op_with_non_tensor_output(offload_mode: str) -> None:
    """Mirrors torch's test_function_with_non_tensor_output: the cached op runs only once."""
    calls, x_grad, eager_grad = parity(
        sac_custom_op_step("cpu"), mate(), reference(), mode=offload_mode
    )
    assert calls == 1
    torch.testing.assert_close(x_grad, eager_grad)


def sac_twice_step(device: str) -> Step:
    def _save_sin(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        from torch.utils.checkpoint import CheckpointPolicy

        if op == torch.ops.aten.sin.default:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def step(checkpoint: Checkpoint) -> Any:
        x = torch.randn(3, device=device, requires_grad=True)
        out = checkpoint(lambda t: t.sin().cos().exp(), x * 1, context_fn=sac_context(_save_sin))
        out.sum().backward(retain_graph=True)
        out.sum().backward(retain_graph=True)
        return grads(x)

    return step


@needs_sac
def test_selective_checkpoint_recomputes_only_once(offload_mode: str) -> None:
    """Mirrors torch's test_can_only_trigger_recompute_once: a second backward is refused."""
    parity(
        sac_twice_step("cpu"),
        mate(),
        reference(),
        mode=offload_mode,
        raises="Trying to backward an extra time",
    )


@needs_sac
def test_selective_checkpoint_graph_dropped_without_backward(offload_mode: str) -> None:
    """Mirrors torch's test_storage_lifetime: a dropped graph frees what SAC and matepoint hold."""
    from torch.utils.checkpoint import CheckpointPolicy

    def save_all(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE

    x = torch.randn(3, requires_grad=True)
    h = x * 1
    alive = weakref.ref(h)
    out = mate()(lambda t: t.cos().exp().sin(), h, context_fn=sac_context(save_all))
    del h
    assert alive() is not None
    del out
    gc.collect()
    assert alive() is None
    assert_released()
