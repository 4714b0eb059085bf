"""torch's checkpoint contract for arguments, outputs, in-place writes and unusual inputs.

Same method as ``test_torch_parity.py`` (whose helpers this module uses): seeded twins through
matepoint and through torch, bitwise equal results, the same errors, in both offload modes. Where
torch detects an in-place write to a saved input (also through another alias of its memory: the
base of a view, the parameter a slice was taken from), matepoint must detect it too, whether the
input stayed on the device or made the round trip through host memory.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
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
from torch.nn import functional as F

WIDTH = 8
INPLACE = "modified by an inplace operation"


def block(device: str) -> nn.Module:
    return nn.Linear(WIDTH, WIDTH).to(device)


def data(device: str, *shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*(shape or (4, WIDTH)), device=device, requires_grad=requires_grad)


# -- keyword arguments -----------------------------------------------------------------------------


def keyword_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x, bias = data(device), data(device)
        gate = data(device, requires_grad=False)

        def function(
            h: torch.Tensor, *, bias: torch.Tensor, gate: torch.Tensor, scale: float, act: str
        ) -> torch.Tensor:
            return getattr(torch, act)(layer(h) * scale + bias * gate)

        out = checkpoint(function, x * 1, bias=bias * 1, gate=gate, scale=1.5, act="tanh")
        out.square().sum().backward()
        return out.detach(), grads(x, bias), param_grads(layer)

    return step


def test_keyword_arguments(offload_mode: str, use_reentrant: bool) -> None:
    """Tensor and non-tensor keyword arguments reach the function (mirrors torch's
    test_checkpointing_without_reentrant's keyword input); the reentrant checkpoint refuses
    them with torch's ValueError."""
    step = keyword_step("cpu")
    value = parity(
        step,
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="Unexpected keyword arguments" if use_reentrant else None,
        offloads=not use_reentrant,
    )
    if not use_reentrant:
        assert_same(value, run_seeded(step, eager).value)


def keyword_dropout_step(device: str, layout: str, preserve_rng_state: bool) -> Step:
    """Dropout on tensors passed by keyword only (``layout="keywords"``) or next to a positional.

    torch saves the device RNG states of the positional tensor arguments only: with every tensor
    passed by keyword, its recomputation on an accelerator draws fresh masks. A drop-in must do
    exactly the same.
    """

    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x, h = data(device), data(device)

        def function(*args: torch.Tensor, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            out = F.dropout(layer(x), 0.5) + F.dropout(h, 0.5)
            for extra in args:
                out = out * F.dropout(extra, 0.25)
            return out

        positional = (data(device) * 1,) if layout == "mixed" else ()
        out = checkpoint(
            function, *positional, x=x * 1, h=h * 1, preserve_rng_state=preserve_rng_state
        )
        out.square().sum().backward()
        return out.detach(), grads(x, h), param_grads(layer)

    return step


@pytest.mark.parametrize("layout", ["keywords", "mixed"])
@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_keyword_only_tensors_with_dropout(
    offload_mode: str, layout: str, preserve_rng_state: bool
) -> None:
    """Keyword-only tensors under dropout: the recomputation's masks are torch's."""
    parity(
        keyword_dropout_step("cpu", layout, preserve_rng_state),
        mate(False),
        reference(False),
        mode=offload_mode,
        # torch holds keyword tensors by reference; moving them is optional.
        offloads=layout == "mixed",
    )


def legacy_named_keyword_step(device: str, name: str) -> Step:
    """The function itself declares a keyword named like one of matepoint 0.1.x's options."""

    def step(checkpoint: Checkpoint) -> Any:
        x = data(device)

        def function(h: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            return h.sin() * (2.0 if kwargs.get(name) == "given" else 3.0)

        out = checkpoint(function, x * 1, **{name: "given"})
        out.sum().backward()
        return out.detach(), grads(x)

    return step


@pytest.mark.parametrize("name", ["stream", "matepoint_ctx", "check_inplace_modifications"])
def test_function_keyword_named_like_a_legacy_option(offload_mode: str, name: str) -> None:
    """torch passes every unknown keyword to the function; so must matepoint, whatever its name."""
    parity(legacy_named_keyword_step("cpu", name), mate(False), reference(False), mode=offload_mode)


# -- containers and outputs ------------------------------------------------------------------------


def containers_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x = data(device)
        a, b, c = data(device), data(device), data(device)
        frozen = data(device, requires_grad=False)

        def function(
            h: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], table: dict[str, Any]
        ) -> torch.Tensor:
            out = layer(h) * pair[0] + pair[1]
            return torch.tanh(out * table["scale"] + table["c"] - table["frozen"])

        # Intermediates (only the containers reference them) as well as leaves.
        out = checkpoint(
            function, x * 1, (a * 1, b), {"c": c.exp(), "scale": 0.5, "frozen": frozen * 2}
        )
        out.square().sum().backward()
        return out.detach(), grads(x, a, b, c), param_grads(layer)

    return step


def test_tensors_in_tuples_and_dicts(offload_mode: str, use_reentrant: bool) -> None:
    """Tensors nested in tuple and dict arguments get the gradients they get with torch."""
    parity(containers_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode)


def structured_output_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x = data(device)

        def function(h: torch.Tensor) -> Any:
            y = torch.tanh(layer(h))
            return y, (y.sin(), 3), {"cos": y.cos(), "tag": "out"}, None

        y, (sin, three), table, nothing = checkpoint(function, x * 1)
        (y.sum() + sin.square().sum() + table["cos"].mean() * three).backward()
        plain = (three, table["tag"], nothing)
        return (
            plain,
            (y.detach(), sin.detach(), table["cos"].detach()),
            grads(x),
            param_grads(layer),
        )

    return step


def test_structured_outputs(offload_mode: str) -> None:
    """Tuples, nested tuples, dicts and non-tensors come out of the function as they went in."""
    step = structured_output_step("cpu")
    value = parity(step, mate(False), reference(False), mode=offload_mode)
    assert_same(value, run_seeded(step, eager).value)


def no_grad_inputs_step(device: str) -> Step:
    """Inputs that need no gradient; the parameters inside and a scale outside do."""

    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x = data(device, requires_grad=False)
        scale = torch.ones(1, device=device, requires_grad=True)
        out = checkpoint(lambda h: torch.tanh(layer(h)), x * 1)
        (out * scale).square().sum().backward()
        return out.detach(), grads(scale), param_grads(layer), out.requires_grad

    return step


def test_inputs_without_grad(offload_mode: str, use_reentrant: bool) -> None:
    """Without reentrancy the parameters still get gradients; with it torch warns and they get
    none (the reentrant checkpoint only tracks its tensor inputs)."""
    parity(
        no_grad_inputs_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        offloads=not use_reentrant,  # the reentrant call builds no graph: nothing is saved
    )


def detached_output_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x = data(device)

        def function(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.tanh(layer(h))
            return y, y.detach() * 2

        y, frozen = checkpoint(function, x * 1)
        (y * frozen).sum().backward()
        return y.detach(), frozen, frozen.requires_grad, grads(x), param_grads(layer)

    return step


def test_detached_outputs(offload_mode: str, use_reentrant: bool) -> None:
    """A detached output carries no gradient back, in matepoint as in torch."""
    parity(
        detached_output_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )


# -- autograd entry points -------------------------------------------------------------------------


def chain(checkpoint: Checkpoint, device: str, depth: int = 4) -> tuple[Any, ...]:
    """``depth`` checkpointed tanh blocks; returns (output, input leaf, the blocks)."""
    layers = nn.ModuleList(block(device) for _ in range(depth))
    x = data(device)
    h = x * 1
    for layer in layers:
        h = checkpoint(lambda t, layer=layer: torch.tanh(layer(t)) + t, h)
    return h, x, layers


def retain_graph_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        out, x, layers = chain(checkpoint, device)
        loss = out.square().sum()
        loss.backward(retain_graph=True)
        first = (grads(x), param_grads(layers))
        loss.backward()
        return first, grads(x), param_grads(layers)

    return step


def test_retain_graph_backward_twice(offload_mode: str, use_reentrant: bool) -> None:
    """Two backward passes through one retained graph: each unpack serves the saved inputs."""
    parity(
        retain_graph_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )


def double_backward_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        out, x, layers = chain(checkpoint, device, depth=3)
        (grad_x,) = torch.autograd.grad(out.pow(3).sum(), x, create_graph=True)
        second = torch.autograd.grad(grad_x.square().sum(), [x, *layers.parameters()])
        return grad_x.detach(), second

    return step


def test_double_backward(offload_mode: str, use_reentrant: bool) -> None:
    """Gradients of gradients through checkpoints; reentrant refuses autograd.grad as in torch."""
    parity(
        double_backward_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises="is incompatible" if use_reentrant else None,
    )


def debug_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        out, x, layers = chain(checkpoint, device, depth=2)
        out.sum().backward()
        return out.detach(), grads(x), param_grads(layers)

    return step


@pytest.mark.usefixtures("undo_debug_logging")
def test_debug_mode(offload_mode: str, use_reentrant: bool) -> None:
    """``debug=True`` changes nothing in a deterministic function; reentrant refuses it."""
    parity(
        debug_step("cpu"),
        mate(use_reentrant, debug=True),
        reference(use_reentrant, debug=True),
        mode=offload_mode,
        raises="only supported when use_reentrant=False" if use_reentrant else None,
        offloads=not use_reentrant,
    )


# -- in-place writes -----------------------------------------------------------------------------


def _saving(t: torch.Tensor) -> torch.Tensor:
    return t.sin() * t


def inplace_input_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        a = data(device)
        x = a * 1
        out = checkpoint(_saving, x)
        out = checkpoint(_saving, out * 1)
        with torch.no_grad():
            x.add_(1.0)
        out = checkpoint(_saving, out * 1)
        out.sum().backward()
        return grads(a)

    return step


def test_input_modified_in_place_raises(offload_mode: str, use_reentrant: bool) -> None:
    """An input written in place between forward and backward: backward raises, as in torch."""
    parity(
        inplace_input_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises=INPLACE,
    )


def view_base_write_step(device: str, keep_view: bool) -> Step:
    """The input is a dense view (leading rows) of an activation whose base is written later."""

    def step(checkpoint: Checkpoint) -> Any:
        a = data(device, 8, WIDTH)
        base = a * 1
        view = base[:4]
        out = checkpoint(_saving, view)
        if not keep_view:
            del view  # only the checkpoint still knows the view
        # The next checkpoint lets an engine settle (and release) the first one's input...
        out = checkpoint(_saving, out * 1)
        with torch.no_grad():
            base.add_(1.0)  # ... before the write, as an optimizer step would come after forward
        out = checkpoint(_saving, out * 1)
        out.sum().backward()
        return grads(a)

    return step


@pytest.mark.parametrize("keep_view", [True, False], ids=["view_kept", "view_dropped"])
def test_write_through_the_base_of_a_view_input_raises(
    offload_mode: str, use_reentrant: bool, keep_view: bool
) -> None:
    """Writing the base of a view input after forward is writing the input: backward raises."""
    parity(
        view_base_write_step("cpu", keep_view),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises=INPLACE,
    )


def parameter_slice_write_step(device: str, view: str) -> Step:
    """The input is a slice (or the transpose) of a parameter updated under no_grad later."""

    def step(checkpoint: Checkpoint) -> Any:
        weight = nn.Parameter(torch.randn(8, WIDTH, device=device))
        sliced = weight[:4] if view == "rows" else weight.t()
        out = checkpoint(_saving, sliced)
        del sliced
        out = checkpoint(_saving, out * 1)
        with torch.no_grad():
            weight.mul_(2.0)  # an optimizer step, say, after the forward
        out = checkpoint(_saving, out * 1)
        out.sum().backward()
        return grads(weight)

    return step


@pytest.mark.parametrize("view", ["rows", "transpose"])
def test_write_to_the_parameter_an_input_was_sliced_from_raises(
    offload_mode: str, use_reentrant: bool, view: str
) -> None:
    """Updating a parameter after a slice of it was checkpointed: backward raises, as in torch."""
    parity(
        parameter_slice_write_step("cpu", view),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
        raises=INPLACE,
    )


def inplace_after_backward_step(device: str) -> Step:
    def step(checkpoint: Checkpoint) -> Any:
        out, x, layers = chain(checkpoint, device, depth=3)
        out.sum().backward()
        with torch.no_grad():
            x.add_(1.0)
            for parameter in layers.parameters():
                parameter.mul_(0.5)
        return grads(x), param_grads(layers)

    return step


def test_inplace_writes_after_backward_are_fine(offload_mode: str, use_reentrant: bool) -> None:
    """Once backward has run, inputs and parameters may be updated in place freely."""
    parity(
        inplace_after_backward_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )


# -- unusual inputs ------------------------------------------------------------------------------


def scalar_chain_step(device: str) -> Step:
    """Checkpoints whose inputs are 0-dim activations."""

    def step(checkpoint: Checkpoint) -> Any:
        x = torch.randn((), device=device, requires_grad=True)
        w = torch.randn((), device=device, requires_grad=True)
        h = x * 1
        for _ in range(4):
            h = checkpoint(lambda t: torch.tanh(t * w) + t.sin(), h)
        h.backward()
        return h.detach(), grads(x, w)

    return step


def test_zero_dim_inputs(offload_mode: str, use_reentrant: bool) -> None:
    """0-dim inputs are saved, restored and differentiated as with torch."""
    parity(
        scalar_chain_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )


def empty_chain_step(device: str) -> Step:
    """Checkpoints whose inputs have no elements, next to ordinary ones."""

    def step(checkpoint: Checkpoint) -> Any:
        layer = block(device)
        x = data(device)
        empty = torch.randn(0, WIDTH, device=device, requires_grad=True)
        h, e = x * 1, empty * 1
        for _ in range(3):
            h, e = checkpoint(lambda t, z: (torch.tanh(layer(t)), torch.tanh(layer(z))), h, e)
        (h.square().sum() + e.sum()).backward()
        return h.detach(), e.detach(), grads(x, empty), param_grads(layer)

    return step


def test_zero_size_inputs(offload_mode: str, use_reentrant: bool) -> None:
    """Inputs with no elements pass through (nothing to offload) with torch's gradients."""
    parity(
        empty_chain_step("cpu"), mate(use_reentrant), reference(use_reentrant), mode=offload_mode
    )


def complex_step(device: str) -> Step:
    """Complex activations as inputs."""

    def step(checkpoint: Checkpoint) -> Any:
        z = torch.randn(4, WIDTH, dtype=torch.complex64, device=device, requires_grad=True)
        w = torch.randn(WIDTH, WIDTH, dtype=torch.complex64, device=device, requires_grad=True)
        h = z * 1
        for _ in range(3):
            h = checkpoint(lambda t: torch.tanh(t @ w) + t, h)
        h.abs().sum().backward()
        return h.detach(), grads(z, w)

    return step


def conj_view_step(device: str, kind: str, rows: int = 4) -> Step:
    """One input carrying a lazy bit: ``h.conj()`` (conj bit) or ``h.conj().imag`` (neg bit)."""

    def step(checkpoint: Checkpoint) -> Any:
        z = torch.randn(rows, WIDTH, dtype=torch.complex64, device=device, requires_grad=True)
        h = z * 0.5  # small values: exp and sin of complex numbers stay finite
        lazy = h.conj() if kind == "conj" else h.conj().imag
        assert lazy.is_conj() if kind == "conj" else lazy.is_neg()
        out = checkpoint(lambda t: (t * 2).exp() * t, lazy)
        del lazy
        out = checkpoint(lambda t: t.sin() * t, out * 1)
        out.abs().sum().backward()
        return out.detach(), grads(z)

    return step


def test_complex_inputs(offload_mode: str, use_reentrant: bool) -> None:
    """Complex activations are saved and restored exactly."""
    parity(
        complex_step("cpu"),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )


@pytest.mark.parametrize("kind", ["conj", "neg"])
def test_conj_and_neg_view_inputs(offload_mode: str, use_reentrant: bool, kind: str) -> None:
    """Inputs with a conj or neg bit come back with the values they had (the bit resolved or
    kept, never lost)."""
    parity(
        conj_view_step("cpu", kind),
        mate(use_reentrant),
        reference(use_reentrant),
        mode=offload_mode,
    )
