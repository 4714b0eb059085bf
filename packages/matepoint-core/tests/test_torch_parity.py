"""torch's own checkpoint tests, ported: ``matepoint.checkpoint`` must pass what torch's passes.

PyTorch checks its checkpoint with a suite of behaviours (``TestCheckpoint``, the checkpoint
tests of ``TestAutograd``, ``TestNestedCheckpoint``, ``TestSelectiveActivationCheckpoint``). These
tests pin the same behaviours on matepoint, written for matepoint's parity suite:

- every step runs twice from the same seed, once with ``matepoint.checkpoint`` and once with
  ``torch.utils.checkpoint.checkpoint``; outputs and gradients must be bitwise equal (fp32, CPU),
  warnings identical, and where torch raises matepoint must raise an exception of the same class
  (a subclass is fine) with a message that says the same thing;
- every test runs in two offload modes (the ``offload_mode`` fixture): matepoint's defaults, and
  every saved input forced through the offload path and back (the deferred CPU test transport);
  in the forced mode a test also checks that something really was offloaded, so a pass cannot
  come from matepoint doing nothing, and that every record and pinned block is released after.

This module holds the shared helpers and the ports of ``TestCheckpoint``;
``test_torch_parity_autograd.py`` ports the checkpoint tests of ``TestAutograd``,
``test_torch_parity_nested.py`` nesting, early stop and selective checkpointing, and
``test_torch_parity_inputs.py`` arguments, outputs, in-place writes and unusual inputs. The step
builders take a device so the CUDA suite runs the same steps.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.utils import _pytree as pytree

import matepoint
from matepoint_compat import ignore_torch_warnings

SEED = 20240
Checkpoint = Callable[..., Any]
Step = Callable[[Checkpoint], Any]

# -- helpers shared by the torch-parity modules ----------------------------------------------------


class Outcome(NamedTuple):
    """What one seeded run of a step gave: its value or its exception, and its warnings."""

    value: Any
    error: BaseException | None
    warned: list[tuple[type[Warning], str]]


def run_seeded(step: Step, checkpoint: Checkpoint) -> Outcome:
    """Run ``step(checkpoint)`` from ``SEED``, catching its exception and recording its warnings."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_torch_warnings()
        try:
            value, error = step(checkpoint), None
        except Exception as exception:  # parity covers failures too
            value, error = None, exception
    return Outcome(value, error, [(w.category, str(w.message)) for w in caught])


def mate(use_reentrant: bool | None = False, **options: Any) -> Checkpoint:
    """``matepoint.checkpoint`` with the given flags."""
    return functools.partial(matepoint.checkpoint, use_reentrant=use_reentrant, **options)


def reference(use_reentrant: bool | None = False, **options: Any) -> Checkpoint:
    """``torch.utils.checkpoint.checkpoint`` with the given flags: the reference."""
    return functools.partial(torch_checkpoint.checkpoint, use_reentrant=use_reentrant, **options)


_CHECKPOINT_OPTIONS = frozenset(
    {"preserve_rng_state", "context_fn", "determinism_check", "debug", "early_stop"}
)


def eager(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """No checkpoint at all (checkpoint options ignored): the gradients a checkpoint must give."""
    return function(*args, **{k: v for k, v in kwargs.items() if k not in _CHECKPOINT_OPTIONS})


def assert_same(actual: Any, expected: Any) -> None:
    """Equal structure; tensors equal bit for bit (dtype, shape and device too; a NaN only where
    the reference has one), other leaves ``==``."""
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert actual_spec == expected_spec, f"{actual_spec} != {expected_spec}"
    for index, (got, want) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), f"leaf {index}: {got!r} is not a tensor"
            torch.testing.assert_close(
                got, want, rtol=0, atol=0, equal_nan=True, msg=f"leaf {index} differs"
            )
        else:
            assert got == want, f"leaf {index}: {got!r} != {want!r}"


def assert_released() -> None:
    """No offloaded input is alive, no pinned block in use, no device original held."""
    gc.collect()
    snapshot = matepoint.stats()
    assert snapshot.live_records == 0, "an offloaded input outlived its graph"
    assert snapshot.pool_in_use_bytes == 0
    assert snapshot.device_bytes_held == 0


def _forget(*outcomes: Outcome) -> None:
    # A kept exception's traceback keeps the failed step's frames, and its graph, alive.
    for outcome in outcomes:
        if outcome.error is not None:
            outcome.error.__traceback__ = None


def assert_same_outcome(
    mine: Outcome,
    theirs: Outcome,
    stats: matepoint.OffloadStats,
    *,
    mode: str,
    raises: str | None,
    offloads: bool,
) -> None:
    """Assert matepoint's run ended as torch's did: the same error, or the same values.

    ``stats`` are matepoint's counters over its run; the other arguments are :func:`parity`'s.
    """
    if raises is not None:
        assert theirs.error is not None, f"torch was expected to raise {raises!r}"
        assert re.search(raises, str(theirs.error)), theirs.error
        if mine.error is None:
            raise AssertionError(f"torch raised {theirs.error!r}; matepoint did not")
        assert isinstance(mine.error, type(theirs.error)), (
            f"torch raised {type(theirs.error).__name__}: {theirs.error}; "
            f"matepoint raised {type(mine.error).__name__}: {mine.error}"
        )
        assert re.search(raises, str(mine.error)), mine.error
    else:
        if theirs.error is not None:
            raise AssertionError("torch's own checkpoint failed") from theirs.error
        if mine.error is not None:
            raise AssertionError("matepoint raised where torch did not") from mine.error
        assert_same(mine.value, theirs.value)
    assert mine.warned == theirs.warned, "matepoint warned differently from torch"
    if mode == "forced" and offloads:
        assert stats.offloads > 0, "nothing was offloaded: the parity proves nothing"


def parity(
    step: Step,
    ours: Checkpoint,
    theirs: Checkpoint,
    *,
    mode: str,
    raises: str | None = None,
    offloads: bool = True,
) -> Any:
    """Run ``step`` with matepoint, then with torch; assert the same outcome. Return torch's value.

    Args:
        step: Builds its model and data, runs forward and backward through the checkpoint it is
            given, returns what to compare (detached tensors and plain values).
        ours: matepoint's checkpoint (or checkpoint_sequential) with the test's flags.
        theirs: torch's, with the same flags.
        mode: The ``offload_mode``; ``"forced"`` also requires an offload and a full release.
        raises: A pattern torch's error must match (torch must raise; matepoint must raise the
            same class with a message matching it). ``None``: neither may raise.
        offloads: Whether the step saves inputs at all (``False`` where nothing is saved).
    """
    mine = run_seeded(step, ours)
    stats = matepoint.stats()
    theirs_outcome = run_seeded(step, theirs)
    assert_same_outcome(mine, theirs_outcome, stats, mode=mode, raises=raises, offloads=offloads)
    value = theirs_outcome.value
    _forget(mine, theirs_outcome)
    del mine, theirs_outcome
    assert_released()
    return value


def grads(*tensors: torch.Tensor) -> list[torch.Tensor | None]:
    """The ``.grad`` of each tensor (cloned, so later accumulation cannot change it)."""
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def param_grads(module: nn.Module) -> list[torch.Tensor | None]:
    return grads(*module.parameters())


def mlp(device: str, *widths: int) -> nn.Sequential:
    """Linear layers of the given widths with ReLUs between (and after), on ``device``."""
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers).to(device)


# -- checkpoint_sequential (TestCheckpoint) --------------------------------------------------------


def mate_sequential(use_reentrant: bool | None = False, **options: Any) -> Checkpoint:
    return functools.partial(
        matepoint.checkpoint_sequential, use_reentrant=use_reentrant, **options
    )


def reference_sequential(use_reentrant: bool | None = False, **options: Any) -> Checkpoint:
    return functools.partial(
        torch_checkpoint.checkpoint_sequential, use_reentrant=use_reentrant, **options
    )


def eager_sequential(functions: Any, segments: int, input: torch.Tensor, **_: Any) -> Any:
    for function in functions.children() if isinstance(functions, nn.Sequential) else functions:
        input = function(input)
    return input


class _ModuleListNet(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.module_list = nn.ModuleList(mlp(device, 24, 12, 6, 3).children())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.module_list:
            x = layer(x)
        return x


def sequential_step(device: str, container: str, segments: int = 2) -> Step:
    """Checkpoint an MLP in segments: as the Sequential, its children list, or a ModuleList."""

    def step(checkpoint_sequential: Checkpoint) -> Any:
        if container == "module_list":
            owner: nn.Module = _ModuleListNet(device)
            functions: Any = owner.module_list
        else:
            owner = mlp(device, 24, 12, 6, 3)
            functions = owner if container == "sequential" else list(owner.children())
        x = torch.randn(2, 24, device=device, requires_grad=True)
        out = checkpoint_sequential(functions, segments, x)
        out.sum().backward()
        return out.detach(), grads(x), param_grads(owner)

    return step


@pytest.mark.parametrize("container", ["sequential", "children", "module_list"])
def test_checkpoint_sequential_matches_torch_and_no_checkpoint(
    offload_mode: str, use_reentrant: bool, container: str
) -> None:
    """Mirrors torch's test_checkpoint / test_checkpoint_module_list: same outputs and grads."""
    step = sequential_step("cpu", container)
    value = parity(
        step,
        mate_sequential(use_reentrant),
        reference_sequential(use_reentrant),
        mode=offload_mode,
    )
    assert_same(value, run_seeded(step, eager_sequential).value)


class _Counting(nn.Module):
    """Counts its forward calls; saves its input (a product with a constant) for backward."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.counter = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counter += 1
        return x * torch.tensor(2.0, device=self.device)


def sequential_trigger_step(device: str) -> Step:
    def step(checkpoint_sequential: Checkpoint) -> Any:
        modules = [_Counting(device) for _ in range(10)]
        x = torch.randn(3, 4, device=device, requires_grad=True)
        out = checkpoint_sequential(modules, 2, x)
        after_forward = [module.counter for module in modules]
        out.sum().backward()
        return after_forward, [module.counter for module in modules], grads(x)

    return step


def test_checkpoint_sequential_recomputes_only_checkpointed_segments(
    offload_mode: str, use_reentrant: bool
) -> None:
    """Mirrors torch's test_checkpoint_trigger: the first half runs twice, the last half once."""
    after_forward, after_backward, _ = parity(
        sequential_trigger_step("cpu"),
        mate_sequential(use_reentrant),
        reference_sequential(use_reentrant),
        mode=offload_mode,
    )
    assert after_forward == [1] * 10
    assert after_backward == [2] * 5 + [1] * 5


class _Two(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, b


class _Nothing(nn.Module):
    def forward(self) -> None:
        return None


@pytest.mark.parametrize("call", ["two_inputs", "no_input"])
def test_checkpoint_sequential_takes_exactly_one_input(use_reentrant: bool, call: str) -> None:
    """Mirrors torch's test_checkpoint_sequential_deprecated_*_args: TypeError, as in torch."""

    def step(checkpoint_sequential: Checkpoint) -> Any:
        a = torch.randn(1, 8, requires_grad=True)
        b = torch.randn(1, 8, requires_grad=True)
        if call == "two_inputs":
            return checkpoint_sequential(nn.Sequential(_Two()), 1, a, b)
        return checkpoint_sequential(nn.Sequential(_Nothing()), 1)

    parity(
        step,
        mate_sequential(use_reentrant),
        reference_sequential(use_reentrant),
        mode="default",
        raises=r"argument|positional",
    )


def sequential_autograd_grad_step(device: str) -> Step:
    def step(checkpoint_sequential: Checkpoint) -> Any:
        model = mlp(device, 24, 12, 6, 3)
        x = torch.randn(1, 24, device=device, requires_grad=True)
        out = checkpoint_sequential(list(model.children()), 2, x)
        (grad_x,) = torch.autograd.grad(
            [out], [x], grad_outputs=[torch.ones(1, 3, device=device)], create_graph=True
        )
        (second,) = torch.autograd.grad(grad_x.square().sum(), [x])
        return out.detach(), grad_x.detach(), second

    return step


def test_checkpoint_sequential_autograd_grad(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpoint_valid: reentrant refuses autograd.grad, the other matches."""
    step = sequential_autograd_grad_step("cpu")
    value = parity(
        step,
        mate_sequential(use_reentrant),
        reference_sequential(use_reentrant),
        mode=offload_mode,
        raises=r"torch\.utils\.checkpoint is incompatible" if use_reentrant else None,
    )
    if not use_reentrant:
        assert_same(value, run_seeded(step, eager_sequential).value)


def test_use_reentrant_none_warns_and_explicit_does_not() -> None:
    """Mirrors torch's test_checkpoint*_warns_if_use_reentrant_not_passed_explcitly.

    matepoint defaults to ``use_reentrant=False`` (so leaving it out never warns); an explicit
    ``None`` means ``True`` with a warning, as torch's default does.
    """
    modules = [nn.Linear(3, 3) for _ in range(3)]
    a = torch.randn(3, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matepoint.checkpoint(lambda x: x, a, use_reentrant=False)
        matepoint.checkpoint(lambda x: x * 2, a)
        matepoint.checkpoint_sequential(modules, 3, a, use_reentrant=False)
        matepoint.checkpoint_sequential(modules, 3, a)
    with pytest.warns(UserWarning, match="use_reentrant"):
        matepoint.checkpoint(lambda x: x * 2, a, use_reentrant=None)
    with pytest.warns(UserWarning, match="use_reentrant"):
        matepoint.checkpoint_sequential(modules, 3, a, use_reentrant=None)


# -- RNG (TestCheckpoint) --------------------------------------------------------------------------


def dropout_step(device: str, preserve_rng_state: bool = True) -> Step:
    """Dropout before the checkpoint and inside it, twice (the RNG state moves on in between)."""

    def step(checkpoint: Checkpoint) -> Any:
        results = []
        for _ in range(2):
            x = torch.randn(2000, device=device).requires_grad_()
            outside, inside = nn.Dropout(), nn.Dropout()
            out = checkpoint(inside, outside(x), preserve_rng_state=preserve_rng_state)
            out.sum().backward()
            results.append((out.detach(), grads(x)))
        return results

    return step


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_dropout_rng(offload_mode: str, use_reentrant: bool, preserve_rng_state: bool) -> None:
    """Mirrors torch's test_checkpoint_rng_cpu and test_checkpoint_not_preserve_rng_state_*.

    With the RNG state preserved, recomputation draws the same mask: gradients equal to running
    without a checkpoint. Without it, gradients equal torch's (whatever mask it draws).
    """
    step = dropout_step("cpu", preserve_rng_state)
    value = parity(step, mate(use_reentrant), reference(use_reentrant), mode=offload_mode)
    if preserve_rng_state:
        assert_same(value, run_seeded(step, eager).value)


# -- non-tensor arguments and outputs (TestCheckpoint) ---------------------------------------------


def none_argument_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        def run(first: torch.Tensor, second: torch.Tensor | None) -> torch.Tensor:
            return first.sin() if second is None else first + second

        x = torch.randn(1, 100, device=device, requires_grad=True)
        out = checkpoint(run, x * 1, None)
        out.sum().backward()
        return out.detach(), grads(x)

    return step


def test_none_argument(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpoint_non_tensor: ``None`` passes through as an argument."""
    parity(
        none_argument_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )


def _mixed(t1: torch.Tensor, t2: torch.Tensor, scale: int, t3: torch.Tensor) -> tuple[Any, ...]:
    t4 = t1 + t2 * t3
    t5 = t1 * t2 + t3
    t4 *= scale
    t5 *= scale
    return scale, t4, None, True, t5, "bar", t1


def mixed_inputs_outputs_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        t1 = torch.rand(10, device=device, requires_grad=True)
        t2 = torch.rand(10, device=device, requires_grad=True)
        t3 = torch.rand(10, device=device)
        res = checkpoint(_mixed, t1, t2, 7, t3)
        plain = [value for index, value in enumerate(res) if index not in (1, 4, 6)]
        tensors = [res[1].detach(), res[4].detach(), res[6].detach()]
        res[1].sum().backward(retain_graph=True)
        res[4].sum().backward(retain_graph=True)
        res[6].sum().backward()
        first_grads = grads(t1, t2)
        second: bool | str
        try:
            res[6].sum().backward()
            second = "ok"
        except RuntimeError as error:
            second = "backward through the graph a second time" in str(error)
        return plain, tensors, first_grads, second

    return step


def test_non_tensor_inputs_and_outputs(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpoint_non_tensor_inputs_outputs.

    Non-tensor arguments pass through, non-tensor outputs come back as they are, a returned input
    is returned, gradients equal the uncheckpointed function's, and a second backward through the
    freed graph fails (or not) as it does in torch.
    """
    step = mixed_inputs_outputs_step("cpu")
    plain, tensors, (grad_t1, grad_t2), _ = parity(
        step, mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )
    assert plain == [7, None, True, "bar"]
    torch.manual_seed(SEED)
    t1 = torch.rand(10, requires_grad=True)
    t2 = torch.rand(10, requires_grad=True)
    t3 = torch.rand(10)
    res = _mixed(t1, t2, 7, t3)
    assert_same(tensors, [res[1].detach(), res[4].detach(), res[6].detach()])
    torch.autograd.backward([res[1].sum(), res[4].sum(), res[6].sum()])
    assert_same([grad_t1, grad_t2], grads(t1, t2))


def test_no_tensor_arguments(offload_mode: str, use_reentrant: bool) -> None:
    """Mirrors torch's test_checkpoint_no_tensors: only Python numbers in, the same numbers out."""

    def step(checkpoint: Checkpoint) -> Any:
        return checkpoint(_mixed, 0.25, 0.5, 3, 0.75)

    assert parity(
        step, mate(use_reentrant), reference(use_reentrant), mode=offload_mode, offloads=False
    ) == (3, (0.25 + 0.5 * 0.75) * 3, None, True, (0.25 * 0.5 + 0.75) * 3, "bar", 0.25)


def partial_grad_step(device: str, output_requires_grad: bool) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        if output_requires_grad:
            a = torch.randn(1, 4, device=device, requires_grad=True)
            b = torch.randn(1, 4, device=device)
            out = checkpoint(lambda first, second: (first.sin(), second), a, b)
            out[0].sum().backward()
            return out[0].detach(), out[1], grads(a)
        a = torch.randn(1, 4, device=device)
        b = torch.randn(1, 4, device=device, requires_grad=True)
        out = checkpoint(lambda first, second: first.sin(), a, b)
        out.sum().backward()
        return grads(b)

    return step


@pytest.mark.parametrize("output_requires_grad", [True, False])
def test_partial_grad(offload_mode: str, use_reentrant: bool, output_requires_grad: bool) -> None:
    """Mirrors torch's test_checkpoint_partial_grad.

    An output that does not need grad next to one that does is fine; an output that needs none
    at all fails in backward exactly as it does with torch.
    """
    parity(
        partial_grad_step("cpu", output_requires_grad),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises=None if output_requires_grad else r"does not require grad|none of output",
    )


# -- default device (TestCheckpoint) ---------------------------------------------------------------


@contextlib.contextmanager
def default_device(device: str, how: str) -> Iterator[None]:
    """Make ``device`` the default: by a ``torch.device`` context or by ``set_default_device``."""
    if how == "context":
        with torch.device(device):
            yield
        return
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def default_device_step(device: str, how: str) -> Step:
    """The function makes a tensor without naming a device, under a default-device setting."""

    def step(checkpoint: Checkpoint) -> Any:
        seen: list[str] = []

        def function(x: torch.Tensor) -> torch.Tensor:
            made = torch.ones(4)
            seen.append(made.device.type)
            return x.sin() * made.sum()

        x = torch.randn(4, device=device, requires_grad=True)
        with default_device(device, how):
            h = checkpoint(function, x * 1)
            h = checkpoint(function, h * 1)
            h.sum().backward()
        return seen, h.detach(), grads(x)

    return step


@pytest.mark.parametrize("how", ["context", "set_default_device"])
def test_default_device_is_kept_for_recompute(
    offload_mode: str, use_reentrant: bool, how: str
) -> None:
    """Mirrors torch's test_checkpoint_preserves_device_context.

    Forward and recomputation both create their tensors on the default device, and matepoint's
    own host allocations must not be misdirected by it.
    """
    seen, _, _ = parity(
        default_device_step("cpu", how),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )
    assert seen == ["cpu"] * 4
