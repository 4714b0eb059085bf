"""Parity of ``matepoint.checkpoint`` with ``torch.utils.checkpoint.checkpoint`` on the CPU.

Every test runs one step twice on identically seeded twins (same seed for the weights, the data
and dropout), once through matepoint with the CPU test transport and once through torch's own
checkpoint, and compares outputs and gradients bitwise (``torch.equal``, fp32). Where torch
raises, matepoint must raise the same exception type. Each test also checks that matepoint's
offload path really ran (``stats().offloads`` and the transport's copies), so a parity pass
cannot come from matepoint quietly doing nothing.
"""

from __future__ import annotations

import functools
import gc
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn
from torch.nn import functional as F
from torch.utils import _pytree as pytree

import matepoint
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport
from matepoint_compat import ignore_torch_warnings

SEED = 1234
WIDTH = 16
BATCH = 4  # a (4, 16) fp32 activation is 256 bytes


# -- helpers -----------------------------------------------------------------------------------


class Block(nn.Module):
    """A small residual block with dropout, so RNG preservation matters."""

    def __init__(self, width: int = WIDTH, p: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.dropout(self.linear(x)))


def make_blocks(count: int = 6, p: float = 0.0) -> nn.ModuleList:
    return nn.ModuleList(Block(p=p) for _ in range(count))


def param_grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [parameter.grad for parameter in module.parameters()]


def data(*shape: int, requires_grad: bool = True) -> torch.Tensor:
    return torch.randn(*(shape or (BATCH, WIDTH))).requires_grad_(requires_grad)


Checkpoint = Callable[..., Any]


class Outcome(NamedTuple):
    kind: str  # "ok" or "raised"
    value: Any  # the step's result, or the exception
    warnings: list[tuple[type[Warning], str]]


def ours(pipeline: bool, use_reentrant: bool | None, **extra: Any) -> Checkpoint:
    return functools.partial(
        matepoint.checkpoint, use_reentrant=use_reentrant, pipeline=pipeline, **extra
    )


def _torch_checkpoint(function: Any, *args: Any, use_reentrant: bool | None, **kwargs: Any) -> Any:
    if "early_stop" in kwargs and not compat.TORCH_2_9_PLUS:
        # torch < 2.9 has no early_stop= keyword, only the global switch: what a user of that
        # torch writes (matepoint_compat.adapt_checkpoint_kwargs does the same).
        options = {"early_stop": kwargs.pop("early_stop")}
        reentrant = True if use_reentrant is None else use_reentrant
        with compat.adapt_checkpoint_kwargs(options, use_reentrant=reentrant):
            return torch_checkpoint.checkpoint(
                function, *args, use_reentrant=use_reentrant, **kwargs
            )
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=use_reentrant, **kwargs)


def theirs(use_reentrant: bool | None, **extra: Any) -> Checkpoint:
    return functools.partial(_torch_checkpoint, use_reentrant=use_reentrant, **extra)


def outcome(step: Callable[[Checkpoint], Any], checkpoint: Checkpoint) -> Outcome:
    """Run ``step`` seeded; return ("ok", its result) or ("raised", the exception), and the
    warnings it emitted (as (category, message) pairs)."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ignore_torch_warnings()  # torch's own, on some releases (checkpointed or not)
        try:
            result: tuple[str, Any] = ("ok", step(checkpoint))
        except Exception as error:  # parity covers the failure cases too
            result = ("raised", error)
    return Outcome(*result, [(w.category, str(w.message)) for w in caught])


def assert_tree_equal(actual: Any, expected: Any) -> None:
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert actual_spec == expected_spec
    for index, (mine, reference) in enumerate(zip(actual_leaves, expected_leaves, strict=True)):
        if isinstance(reference, torch.Tensor):
            assert isinstance(mine, torch.Tensor), f"leaf {index}: {mine!r} is not a tensor"
            assert mine.dtype == reference.dtype, f"leaf {index}"
            assert mine.shape == reference.shape, f"leaf {index}"
            assert torch.equal(mine, reference), f"leaf {index} differs from torch's"
        else:
            assert mine == reference, f"leaf {index}: {mine!r} != {reference!r}"


def assert_same_outcome(mine: Outcome, reference: Outcome) -> None:
    assert mine.warnings == reference.warnings, "matepoint warned differently from torch"
    if reference[0] == "raised":
        assert mine[0] == "raised", f"torch raised {reference[1]!r}, matepoint returned"
        assert isinstance(mine[1], type(reference[1])), (
            f"torch raised {type(reference[1]).__name__}: {reference[1]}; "
            f"matepoint raised {type(mine[1]).__name__}: {mine[1]}"
        )
    else:
        if mine[0] == "raised":
            raise AssertionError("matepoint raised where torch did not") from mine[1]
        assert_tree_equal(mine[1], reference[1])


def assert_offloaded(stats: matepoint.OffloadStats, transport: CPUTestTransport) -> None:
    assert stats.offloads > 0, "matepoint offloaded nothing: the parity proves nothing"
    assert transport.copies_out >= stats.offloads


def compare(
    step: Callable[[Checkpoint], Any],
    transport: CPUTestTransport,
    *,
    pipeline: bool,
    use_reentrant: bool | None,
    offload_expected: bool = True,
    torch_raises: bool = False,
    **extra: Any,
) -> tuple[Outcome, matepoint.OffloadStats]:
    """Run ``step`` with matepoint then with torch (same seed); assert identical outcomes.

    ``torch_raises`` says whether torch's checkpoint is expected to refuse the step (so a test
    can never pass vacuously because both sides failed for some unrelated reason).
    """
    mine = outcome(step, ours(pipeline, use_reentrant, **extra))
    stats = matepoint.stats()
    reference = outcome(step, theirs(use_reentrant, **extra))
    if torch_raises:
        assert reference[0] == "raised", "torch was expected to refuse this step"
    elif reference[0] == "raised":
        raise AssertionError("torch's own checkpoint failed on this step") from reference[1]
    assert_same_outcome(mine, reference)
    if offload_expected and reference[0] == "ok":
        assert_offloaded(stats, transport)
    return reference, stats


def chain_step(count: int = 6, p: float = 0.0, loss_power: int = 2) -> Callable[[Checkpoint], Any]:
    """A stack of checkpointed blocks: intermediate activations die after forward."""

    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(count, p)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        h.pow(loss_power).sum().backward()
        return h.detach(), x.grad, param_grads(blocks)

    return step


# -- gradients ---------------------------------------------------------------------------------


def test_gradients_match_torch(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    _, stats = compare(chain_step(), cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    # Intermediate activations are referenced only by the graph: they really made the round trip.
    assert stats.fetches > 0
    assert cpu_transport.copies_in > 0
    if not pipeline:
        assert stats.prefetches == 0


def test_gradients_over_several_steps_reuse_pool(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4)
        results = []
        for _ in range(3):
            blocks.zero_grad(set_to_none=True)
            x = data()
            h = x
            for block in blocks:
                h = checkpoint(block, h)
            h.sum().backward()
            results.append((x.grad, param_grads(blocks)))
        return results

    _, stats = compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    assert stats.pool_blocks_reused > 0
    assert matepoint.stats().live_records == 0


@pytest.mark.parametrize("preserve_rng_state", [True, False])
def test_dropout_rng(
    cpu_transport: CPUTestTransport,
    pipeline: bool,
    use_reentrant: bool,
    preserve_rng_state: bool,
) -> None:
    compare(
        chain_step(count=4, p=0.5),
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        preserve_rng_state=preserve_rng_state,
    )


def test_dropout_rng_preserved_equals_eager(
    cpu_transport: CPUTestTransport, pipeline: bool
) -> None:
    """With preserve_rng_state, recompute draws the same masks: gradients equal no checkpoint."""
    mine = outcome(chain_step(count=4, p=0.5), ours(pipeline, False))
    assert_offloaded(matepoint.stats(), cpu_transport)
    eager = outcome(chain_step(count=4, p=0.5), lambda function, *args: function(*args))
    assert_same_outcome(mine, eager)


# -- nesting -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "nesting", ["matepoint_in_matepoint", "matepoint_in_torch", "torch_in_matepoint"]
)
def test_nested_checkpoints(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, nesting: str
) -> None:
    def run(inner: Checkpoint, outer: Checkpoint) -> Any:
        blocks = make_blocks(4, p=0.25)
        x = data()

        def pair(h: torch.Tensor, first: int) -> torch.Tensor:
            h = inner(blocks[first], h)
            return inner(blocks[first + 1], h)

        h = outer(pair, x, 0)
        h = outer(pair, h, 2)
        h.square().sum().backward()
        return h.detach(), x.grad, param_grads(blocks)

    mp = ours(pipeline, use_reentrant)
    tc = theirs(use_reentrant)
    inner, outer = {
        "matepoint_in_matepoint": (mp, mp),
        "matepoint_in_torch": (mp, tc),
        "torch_in_matepoint": (tc, mp),
    }[nesting]
    mine = outcome(lambda _: run(inner, outer), mp)
    stats = matepoint.stats()
    reference = outcome(lambda _: run(tc, tc), tc)
    assert_same_outcome(mine, reference)
    if nesting == "matepoint_in_torch":
        # torch's outer checkpoint owns the inner call's saved inputs (in forward and, without
        # reentrancy, in recomputation); the reentrant recomputation runs outside any hook, so
        # there the inner matepoint checkpoint offloads.
        if use_reentrant:
            assert_offloaded(stats, cpu_transport)
        else:
            assert stats.offloads == 0
    else:
        assert_offloaded(stats, cpu_transport)


# -- arguments ---------------------------------------------------------------------------------


def test_kwargs_tensor_and_non_tensor(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        block = Block()
        x = data()
        bias = data()
        gate = data(requires_grad=False)

        def function(
            h: torch.Tensor,
            *,
            bias: torch.Tensor,
            gate: torch.Tensor,
            scale: float,
            activation: str,
        ) -> torch.Tensor:
            return getattr(torch, activation)(block(h) * scale + bias * gate)

        out = checkpoint(function, x, bias=bias, gate=gate, scale=1.5, activation="sin")
        out.square().sum().backward()
        return out.detach(), x.grad, bias.grad, param_grads(block)

    reference, stats = compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=use_reentrant,
    )
    if use_reentrant:
        # torch's reentrant checkpoint takes no keyword arguments for the function.
        assert reference[0] == "raised"
        assert isinstance(reference[1], ValueError)
    else:
        # The keyword tensors were offloaded too (torch itself only holds them by reference).
        assert stats.offloads >= 3


def test_non_tensor_args(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        block = Block()
        x = data()

        def function(
            h: torch.Tensor, repeats: int, nothing: None, activation: str, scale: float, flag: bool
        ) -> torch.Tensor:
            assert nothing is None
            assert flag is True
            for _ in range(repeats):
                h = getattr(torch, activation)(block(h)) * scale
            return h

        out = checkpoint(function, x, 3, None, "tanh", 0.5, True)
        out.square().sum().backward()
        return out.detach(), x.grad, param_grads(block)

    compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


def test_tensors_nested_in_containers(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        block = Block()
        x = data()
        a, b, c, d = (data() for _ in range(4))
        frozen = data(requires_grad=False)

        def function(
            h: torch.Tensor,
            pair: tuple[torch.Tensor, torch.Tensor],
            items: list[Any],
            table: dict[str, Any],
        ) -> torch.Tensor:
            out = block(h) * pair[0] + pair[1]
            out = out * items[0] + items[1][0]
            return torch.sin(out * table["scale"] + table["d"] - table["frozen"] * table["k"])

        # Intermediates (only the call's containers reference them) as well as leaves.
        pair = (a * 1.0, b)
        items = [c.exp(), (d, "tag")]
        table = {"d": d, "scale": 0.5, "frozen": frozen * 2.0, "k": 2}
        out = checkpoint(function, x, pair, items, table)
        del pair, items, table
        out.square().sum().backward()
        grads = [t.grad for t in (a, b, c, d)]
        assert all(grad is not None for grad in grads)
        return out.detach(), x.grad, grads, param_grads(block)

    _, stats = compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    if not use_reentrant:
        # matepoint flattens the containers: x, a*1, b, c.exp(), d (twice: deduplicated) and
        # frozen*2 are all offloaded, and the intermediates come back from the host.
        assert stats.offloads == 6
        assert stats.dedupe_hits == 1
        assert stats.fetches > 0


# -- autograd entry points -----------------------------------------------------------------------


def test_autograd_grad(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        parameters = list(blocks.parameters())
        grads = torch.autograd.grad(h.square().sum(), [x, *parameters])
        assert x.grad is None
        return h.detach(), grads

    compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=use_reentrant,
    )


def test_retain_graph_two_backwards(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(5, p=0.3)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        loss = h.square().sum()
        loss.backward(retain_graph=True)
        first = [x.grad.clone(), *(grad.clone() for grad in param_grads(blocks))]
        loss.backward()
        return first, x.grad, param_grads(blocks)

    _, stats = compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    assert stats.fetches > 0


def test_backward_with_inputs(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        chosen = [x, blocks[1].linear.weight]
        h.square().sum().backward(inputs=chosen)
        return x.grad, param_grads(blocks)

    compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=use_reentrant,
    )


def test_double_backward(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(3)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        (grad_x,) = torch.autograd.grad(h.pow(3).sum(), x, create_graph=True)
        parameters = list(blocks.parameters())
        second = torch.autograd.grad(grad_x.square().sum(), [x, *parameters])
        return grad_x.detach(), second

    compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=use_reentrant,
    )


def test_no_grad_forward(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(3)
        x = data()
        with torch.no_grad():
            h = x
            for block in blocks:
                h = checkpoint(block, h)
        assert not h.requires_grad
        return h

    compare(
        step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant, offload_expected=False
    )
    assert matepoint.stats().offloads == 0  # nothing is saved without grad
    # The next step with grad offloads normally.
    compare(chain_step(3), cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


# -- torch's checkpoint options ------------------------------------------------------------------


def _sac_context() -> Any:
    return torch_checkpoint.create_selective_checkpoint_contexts(
        [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]
    )


@pytest.mark.skipif(
    not compat.TORCH_2_5_PLUS, reason="create_selective_checkpoint_contexts arrived in torch 2.5"
)
def test_context_fn_selective_checkpointing(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4, p=0.2)
        x = data()

        def pair(h: torch.Tensor, first: int) -> torch.Tensor:
            h = blocks[first](h)
            return blocks[first + 1](h) @ blocks[first].linear.weight

        h = checkpoint(pair, x, 0, context_fn=_sac_context)
        h = checkpoint(pair, h, 2, context_fn=_sac_context)
        h.square().sum().backward()
        return h.detach(), x.grad, param_grads(blocks)

    compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=use_reentrant,
    )


def test_determinism_check_none(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    compare(
        chain_step(4, p=0.3),
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        determinism_check="none",
    )


@pytest.fixture
def undo_logging_tensor_side_effect() -> Iterator[None]:
    """Undo what torch's ``debug=True`` leaves behind, so later tests can log normally.

    torch's debug mode logs each operator through its ``LoggingTensor`` logger with arguments but
    no ``%`` placeholders, and sets that logger's ``propagate = False`` for good. pytest attaches
    its capture handler to every non-propagating logger at the start of each test phase, and that
    handler raises on such records: every later ``debug=True`` checkpoint would fail inside
    torch. Restoring ``propagate`` keeps pytest's handler on the root logger only.
    """
    logger = logging.getLogger("LoggingTensor")
    propagate = logger.propagate
    yield
    logger.propagate = propagate


@pytest.mark.usefixtures("undo_logging_tensor_side_effect")
def test_debug(cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool) -> None:
    compare(
        chain_step(3),
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        debug=True,
        torch_raises=use_reentrant,
    )


@pytest.mark.parametrize("early_stop", [False, True])
def test_early_stop(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, early_stop: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4, p=0.2)
        x = data()

        def function(h: torch.Tensor) -> torch.Tensor:
            # Saves more after the point where early stop can end recomputation.
            h = blocks[0](h)
            h = blocks[1](h)
            return h * torch.sigmoid(h)

        h = checkpoint(function, x, early_stop=early_stop)
        h = checkpoint(function, h, early_stop=early_stop)
        h.square().sum().backward()
        return h.detach(), x.grad, param_grads(blocks)

    compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


def test_use_reentrant_none_warns_and_means_true(
    cpu_transport: CPUTestTransport, pipeline: bool
) -> None:
    def warned(checkpoint: Checkpoint) -> Checkpoint:
        def call(*args: Any, **kwargs: Any) -> Any:
            with pytest.warns(
                UserWarning, match="use_reentrant parameter should be passed explicitly"
            ):
                return checkpoint(*args, **kwargs)

        return call

    def step(checkpoint: Checkpoint) -> Any:
        return chain_step(3)(warned(checkpoint))

    mine = outcome(step, ours(pipeline, None))
    assert_offloaded(matepoint.stats(), cpu_transport)
    assert_same_outcome(mine, outcome(step, theirs(None)))
    # ... and behaves as use_reentrant=True: kwargs are refused as torch's reentrant refuses them.
    with (
        pytest.warns(UserWarning, match="use_reentrant"),
        pytest.raises(ValueError, match="Unexpected keyword"),
    ):
        matepoint.checkpoint(lambda h, *, k: h * k, data(), k=2.0, use_reentrant=None)
    # Reentrant checkpoints cannot serve torch.autograd.grad; non-reentrant ones can.
    x = data()
    with pytest.warns(UserWarning, match="use_reentrant"):
        out = matepoint.checkpoint(Block(), x, use_reentrant=None, pipeline=pipeline)
    with pytest.raises(RuntimeError, match=r"incompatible with \.grad"):
        torch.autograd.grad(out.sum(), x)


def test_decorator_form(cpu_transport: CPUTestTransport, pipeline: bool) -> None:
    def make(checkpoint_decorated: bool) -> Any:
        def step(checkpoint: Checkpoint) -> Any:
            block = Block(p=0.3)
            x = data()

            def function(h: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
                return block(h) * scale

            if checkpoint_decorated:
                function = matepoint.checkpoint(use_reentrant=False, pipeline=pipeline)(function)
                h = function(x, scale=2.0)
                h = function(h)
            else:
                h = checkpoint(function, x, scale=2.0)
                h = checkpoint(function, h)
            h.square().sum().backward()
            return h.detach(), x.grad, param_grads(block)

        return step

    mine = outcome(make(True), None)  # type: ignore[arg-type]
    assert_offloaded(matepoint.stats(), cpu_transport)
    assert_same_outcome(mine, outcome(make(False), theirs(False)))


# -- per-call offload options ------------------------------------------------------------------


def test_offload_false_is_plain_torch(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    mine = outcome(chain_step(4, p=0.2), ours(pipeline, use_reentrant, offload=False))
    stats = matepoint.stats()
    assert_same_outcome(mine, outcome(chain_step(4, p=0.2), theirs(use_reentrant)))
    assert stats.offloads == 0
    assert cpu_transport.copies_out == 0


def test_offload_options_per_call(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    per_call = matepoint.OffloadOptions(min_offload_bytes=0)
    with matepoint.options(prefetch=0, max_inflight_bytes=0):
        mine = outcome(chain_step(5, p=0.2), ours(pipeline, use_reentrant, offload=per_call))
    stats = matepoint.stats()
    assert_same_outcome(mine, outcome(chain_step(5, p=0.2), theirs(use_reentrant)))
    assert_offloaded(stats, cpu_transport)
    assert stats.prefetches == 0  # the settings' prefetch=0 in force when the call ran
    assert stats.fetches > 0

    # Per-call options also win the other way: nothing is big enough to move.
    matepoint.reset_stats()
    large = matepoint.OffloadOptions(min_offload_bytes=1 << 30)
    copies = cpu_transport.copies_out
    mine = outcome(chain_step(3), ours(pipeline, use_reentrant, offload=large))
    stats = matepoint.stats()
    assert_same_outcome(mine, outcome(chain_step(3), theirs(use_reentrant)))
    assert stats.offloads == 0
    assert stats.skipped_small > 0
    assert cpu_transport.copies_out == copies


def test_offload_options_wrong_type_raises() -> None:
    with pytest.raises(TypeError, match="offload="):
        matepoint.checkpoint(Block(), data(), offload="yes")


# -- in-place modification -------------------------------------------------------------------


@pytest.mark.parametrize("saved", ["offloaded", "kept_small", "parameter"])
def test_inplace_modification_after_forward_raises(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, saved: str
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        block = Block()
        weight = nn.Parameter(torch.randn(WIDTH, WIDTH))
        x = data()
        y = data()

        def function(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            return torch.tanh(block(h) @ w)

        out = checkpoint(function, x, weight)
        with torch.no_grad():
            (weight if saved == "parameter" else x).add_(1.0)
        # Another checkpoint after the modification: the engine settles the first copy here.
        out = out + checkpoint(function, y, weight)
        out.sum().backward()
        return x.grad, weight.grad

    extra = (
        {"offload": matepoint.OffloadOptions(min_offload_bytes=1 << 30)}
        if saved == "kept_small"
        else {}
    )
    mine = outcome(step, ours(pipeline, use_reentrant, **extra))
    stats = matepoint.stats()
    reference = outcome(step, theirs(use_reentrant))
    assert reference[0] == "raised"
    assert isinstance(reference[1], RuntimeError)
    assert "modified by an inplace operation" in str(reference[1])
    assert mine[0] == "raised", "matepoint recomputed from a modified input"
    assert isinstance(mine[1], RuntimeError)
    assert "modified by an inplace operation" in str(mine[1])
    if saved == "kept_small":
        assert stats.offloads == 0
        assert stats.skipped_small > 0
    else:
        assert_offloaded(stats, cpu_transport)
    if saved == "parameter":
        assert stats.skipped_parameters > 0


def test_inplace_on_offloaded_intermediate_raises(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    """The modified tensor is a graph intermediate whose device copy matepoint released."""

    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4)
        x = data()
        h = checkpoint(blocks[0], x)
        middle = h * 1.0
        h = checkpoint(blocks[1], middle)
        h = checkpoint(blocks[2], h)
        with torch.no_grad():
            middle.mul_(2.0)
        h = checkpoint(blocks[3], h)
        h.sum().backward()
        return x.grad

    mine = outcome(step, ours(pipeline, use_reentrant))
    assert_offloaded(matepoint.stats(), cpu_transport)
    reference = outcome(step, theirs(use_reentrant))
    assert reference[0] == "raised"
    assert "modified by an inplace operation" in str(reference[1])
    assert_same_outcome(mine, reference)
    assert "modified by an inplace operation" in str(mine[1])


def test_inplace_modification_after_backward_is_fine(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(3)
        x = data()
        h = x
        for block in blocks:
            h = checkpoint(block, h)
        h.sum().backward()
        with torch.no_grad():
            x.add_(1.0)
        return x.grad, param_grads(blocks)

    compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


# -- inputs of special kinds ---------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad_param", [True, False])
def test_inference_mode_tensor_input(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, requires_grad_param: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        block = Block().requires_grad_(requires_grad_param)
        with torch.inference_mode():
            x = torch.randn(BATCH, WIDTH)
        other = data()
        h = checkpoint(block, x)
        h = checkpoint(block, h + other)
        h.square().sum().backward()
        return h.detach(), other.grad, param_grads(block)

    # Non-reentrant: torch refuses to save an inference tensor (RuntimeError), so must matepoint.
    # Reentrant: nothing of that call requires grad, nothing is saved, both run.
    compare(
        step,
        cpu_transport,
        pipeline=pipeline,
        use_reentrant=use_reentrant,
        torch_raises=not use_reentrant,
    )


def test_parameter_input_is_never_offloaded(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        linear = nn.Linear(WIDTH, WIDTH)
        x = data()

        def function(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
            return torch.tanh(F.linear(h, weight, bias))

        h = checkpoint(function, x, linear.weight, linear.bias)
        h = checkpoint(function, h, linear.weight, linear.bias)
        h.square().sum().backward()
        return h.detach(), x.grad, param_grads(linear)

    _, stats = compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    assert stats.skipped_parameters == 4
    assert stats.offloads == 2  # x and the first output
    assert cpu_transport.copies_out == 2


# -- outputs -------------------------------------------------------------------------------------


def test_multiple_outputs(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4, p=0.2)
        x = data()

        def split(h: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
            a = blocks[first](h)
            return a, torch.sin(blocks[first + 1](a))

        a, b = checkpoint(split, x, 0)
        c, d = checkpoint(split, a * b, 2)
        (c.square().sum() + d.sum() + a.mean()).backward()
        return (a.detach(), b.detach(), c.detach(), d.detach()), x.grad, param_grads(blocks)

    compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


def test_non_tensor_outputs(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(2)
        x = data()

        def function(h: torch.Tensor, block: nn.Module) -> tuple[Any, ...]:
            out = block(h)
            return out, 3, "label", None, 0.5

        out, count, label, nothing, scale = checkpoint(function, x, blocks[0])
        out2, *rest = checkpoint(function, out * scale, blocks[1])
        (out2 * count).square().sum().backward()
        return out2.detach(), (count, label, nothing, scale), rest, x.grad, param_grads(blocks)

    compare(step, cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)


# -- failures ------------------------------------------------------------------------------------


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "recompute"])
def test_exception_in_function_propagates_and_next_step_works(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool, where: str
) -> None:
    def step(checkpoint: Checkpoint) -> Any:
        blocks = make_blocks(4)
        calls = {"count": 0}

        def fragile(h: torch.Tensor) -> torch.Tensor:
            calls["count"] += 1
            if (where == "forward" and calls["count"] == 1) or (
                where == "recompute" and calls["count"] == 2
            ):
                raise Boom(where)
            return blocks[2](h)

        x = data()
        h = checkpoint(blocks[0], x)
        h = checkpoint(blocks[1], h)
        h = checkpoint(fragile, h)
        h = checkpoint(blocks[3], h)
        h.sum().backward()
        return x.grad

    mine = outcome(step, ours(pipeline, use_reentrant))
    assert mine[0] == "raised"
    assert isinstance(mine[1], Boom)
    stats = matepoint.stats()
    assert_offloaded(stats, cpu_transport)
    reference = outcome(step, theirs(use_reentrant))
    assert_same_outcome(mine, reference)
    del mine, reference
    gc.collect()
    assert matepoint.stats().live_records == 0
    # The next step is clean and equal to torch's.
    matepoint.reset_stats()
    _, stats = compare(chain_step(4), cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
    gc.collect()
    assert matepoint.stats().live_records == 0


def test_graph_dropped_without_backward_frees_records(
    cpu_transport: CPUTestTransport, pipeline: bool, use_reentrant: bool
) -> None:
    blocks = make_blocks(4)
    h = data()
    for block in blocks:
        h = matepoint.checkpoint(block, h, use_reentrant=use_reentrant, pipeline=pipeline)
    assert matepoint.stats().live_records > 0
    del h
    gc.collect()
    assert matepoint.stats().live_records == 0
    compare(chain_step(4), cpu_transport, pipeline=pipeline, use_reentrant=use_reentrant)
