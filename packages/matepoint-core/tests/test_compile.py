"""matepoint.checkpoint under a whole-model torch.compile (see Note [The compiled path]).

Twins from one seed, one checkpointed with torch's checkpoint and one with matepoint's, compiled
the same way: the compiled matepoint model has no graph break at its checkpoints, its gradients
are bitwise those of torch's checkpoint under the same compile (dropout included), and its
forward graph sends the checkpoint inputs to the host. On the CPU the "device" is the CPU test
transport's, so the offload pass really runs (torch's synchronous copies); the ``gpu`` tests do
the same with inductor on CUDA and check the device memory held after forward.

On torch releases without ``matepoint_compat.COMPILED_OFFLOAD`` matepoint runs eagerly under
compile, as before (see test_integrations.py); only the gate's own test runs there.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from _helpers import CapturingBackend
from torch import nn

import matepoint
import matepoint_compat as compat
from matepoint._compiled import forward_window, inductor_order, regions, scope, traffic
from matepoint.testing import CPUTestTransport, use_transport

WIDTH = 16
DEPTH = 3

needs_compiled_offload = pytest.mark.skipif(
    not compat.COMPILED_OFFLOAD,
    reason="this torch cannot trace matepoint's checkpoint (it runs eagerly under compile)",
)
# Importing inductor touches torch.jit.script_method, deprecated in recent torch.
_INDUCTOR_IMPORT = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)

# The torch settings matepoint's compiled path writes (see matepoint._compiled.scope).
_TORCH_CONFIG = (
    "joint_custom_pass",
    "enable_activation_offloading",
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)


@pytest.fixture(autouse=True)
def fresh_compile() -> Iterator[None]:
    """Each test compiles from scratch, with the (opt-in) compiled path switched on, and leaves
    torch's compile settings as it found them."""
    import torch._functorch.config as functorch_config

    saved = {name: getattr(functorch_config, name, None) for name in _TORCH_CONFIG}
    torch._dynamo.reset()
    with matepoint.options(compiled_offload=True):
        yield
    torch._dynamo.reset()
    for name, value in saved.items():
        if hasattr(functorch_config, name):
            setattr(functorch_config, name, value)


@pytest.fixture
def transport() -> Iterator[CPUTestTransport]:
    """The CPU test transport with no minimum size: every CPU checkpoint input is offloadable."""
    test_transport = CPUTestTransport()
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        yield test_transport
    gc.collect()
    test_transport.drain()


class Block(nn.Module):
    """A pre-norm MLP block with dropout; ``pair`` (a tuple of tensors) is added when given."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(
        self,
        x: torch.Tensor,
        scale: float = 1.0,
        pair: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        h = self.down(F.gelu(self.up(self.norm(x))))
        out = x + F.dropout(h, 0.25, self.training) * scale
        if pair is not None:
            out = out + pair[0] * pair[1]
        return out


class Model(nn.Module):
    """An input projection, then ``DEPTH`` blocks, each through ``checkpoint``.

    ``extras``: the blocks also get a float keyword and a tuple of two tensors computed once and
    shared by every block (as keyword ``pair=``), so nested and keyword tensors are inputs too.
    """

    def __init__(
        self,
        checkpoint: Callable[..., Any],
        extras: bool = False,
        depth: int = DEPTH,
        **checkpoint_kwargs: Any,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.checkpoint = checkpoint
        self.extras = extras
        self.checkpoint_kwargs = {"use_reentrant": False, **checkpoint_kwargs}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Not the projection's output itself: a 3-d Linear returns a view of its matmul, and
        # views stay on the device under compile (see docs/differences.md).
        h = self.proj(x).tanh()
        kwargs: dict[str, Any] = dict(self.checkpoint_kwargs)
        if self.extras:
            kwargs.update(scale=0.5, pair=(h.tanh(), h.sigmoid()))
        for block in self.blocks:
            h = self.checkpoint(block, h, **kwargs)
        return h


def twins(extras: bool = False, **checkpoint_kwargs: Any) -> tuple[Model, Model]:
    """(torch's checkpoint, matepoint's): the same weights, the same checkpoint arguments."""
    reference = Model(torch_checkpoint.checkpoint, extras, **checkpoint_kwargs)
    model = copy.deepcopy(reference)
    model.checkpoint = matepoint.checkpoint
    return reference, model


def step(model: nn.Module, backend: Any, **compile_kwargs: Any) -> list[torch.Tensor]:
    """One seeded compiled forward and backward; the input's and every parameter's gradient.

    Dynamo is reset first: its guards do not tell twins apart by their ``checkpoint`` attribute,
    and would run the graph compiled for the other twin.
    """
    torch._dynamo.reset()
    x = torch.randn(2, 8, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.manual_seed(2)
    compiled = torch.compile(model, backend=backend, **compile_kwargs)
    compiled(x).square().mean().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    assert all(grad is not None for grad in grads)
    return [grad for grad in grads if grad is not None]


def assert_bitwise(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(actual, expected, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def graph_breaks(model: nn.Module) -> tuple[int, int]:
    """(graph breaks, graphs) of the whole model under Dynamo."""
    x = torch.randn(2, 8, WIDTH, requires_grad=True)
    explanation = torch._dynamo.explain(model)(x)
    return explanation.graph_break_count, explanation.graph_count


# -- the gate ---------------------------------------------------------------------------------


def test_compile_tracing_is_true_only_while_dynamo_traces_a_supported_torch() -> None:
    def probe(x: torch.Tensor) -> torch.Tensor:
        return x + int(compat.compile_tracing())

    x = torch.zeros(2)
    assert compat.compile_tracing() is False
    assert probe(x).sum().item() == 0
    compiled = torch.compile(probe, backend="eager", fullgraph=True)
    assert compiled(x).sum().item() == (2 if compat.COMPILED_OFFLOAD else 0)


# -- no graph break ---------------------------------------------------------------------------


@needs_compiled_offload
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "kwargs_and_tuples"])
def test_no_graph_break_at_matepoint_checkpoints(transport: CPUTestTransport, extras: bool) -> None:
    reference, model = twins(extras)
    assert graph_breaks(model) == (0, 1)
    assert graph_breaks(reference) == (0, 1)
    # fullgraph=True raises at any graph break.
    step(model, "aot_eager", fullgraph=True)


@needs_compiled_offload
@pytest.mark.parametrize(
    "form",
    ["reentrant", "decorator", "offload_false", "options", "legacy_keyword", "sequential"],
)
def test_no_graph_break_with_other_call_forms(transport: CPUTestTransport, form: str) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(DEPTH))
    decorated = matepoint.checkpoint(offload=matepoint.OffloadOptions(min_offload_bytes=0))
    calls: dict[str, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {
        "reentrant": lambda block, h: matepoint.checkpoint(block, h, use_reentrant=True),
        "decorator": lambda block, h: decorated(block)(h),
        "offload_false": lambda block, h: matepoint.checkpoint(block, h, offload=False),
        "options": lambda block, h: matepoint.checkpoint(
            block, h, pipeline=False, offload=matepoint.OffloadOptions(min_offload_bytes=0)
        ),
        # A 0.1.x keyword the function does not take: dropped with its warning, still traced.
        "legacy_keyword": lambda block, h: matepoint.checkpoint(block, h, matepoint_ctx=[]),
    }

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if form == "sequential":
                return matepoint.checkpoint_sequential(
                    nn.Sequential(*self.blocks), DEPTH, x, use_reentrant=False
                )
            for block in self.blocks:
                x = calls[form](block, x)
            return x

    if form == "legacy_keyword":
        with pytest.warns(compat.MatepointDeprecationWarning, match="matepoint_ctx"):
            assert graph_breaks(Loop()) == (0, 1)
    else:
        assert graph_breaks(Loop()) == (0, 1)


# -- gradients and offloads -------------------------------------------------------------------


@needs_compiled_offload
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "kwargs_and_tuples"])
def test_gradients_equal_torch_checkpoint_under_aot_eager(
    transport: CPUTestTransport, extras: bool
) -> None:
    reference, model = twins(extras)
    torch_backend, matepoint_backend = CapturingBackend(), CapturingBackend()
    expected = step(reference, torch_backend)
    got = step(model, matepoint_backend)
    assert_bitwise(got, expected)
    assert torch_backend.offloaded() == []
    # The first block's input (computed in the graph), the first DEPTH - 1 blocks' outputs
    # and, with extras, the two tensors of the shared tuple: each once.
    assert len(matepoint_backend.offloaded()) == DEPTH + (2 if extras else 0)
    # Nothing went through matepoint's eager engine: what stats() counts is the compiled
    # graph's copies, once each way (Note [Counting compiled copies]).
    assert matepoint.stats().offloads == matepoint.stats().fetches == DEPTH + (2 if extras else 0)
    assert traffic.COMPILED_TRAFFIC.offloads == DEPTH + (2 if extras else 0)


@pytest.fixture
def marked(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the values matepoint's joint-graph pass marks for offload, as it marks them."""
    names: list[str] = []
    mark = regions.mark_for_offload

    def spy(node: torch.fx.Node) -> None:
        names.append(node.name)
        mark(node)

    monkeypatch.setattr(regions, "mark_for_offload", spy)
    return names


@pytest.mark.slow
@needs_compiled_offload
@_INDUCTOR_IMPORT
def test_gradients_equal_torch_checkpoint_under_inductor_on_cpu(
    transport: CPUTestTransport, marked: list[str]
) -> None:
    from torch._inductor.utils import fresh_inductor_cache

    reference, model = twins(extras=True)
    with fresh_inductor_cache():
        expected = step(reference, "inductor")
        assert marked == []
        got = step(model, "inductor")
    # Bitwise on the CPU (same generated kernels; the host copies change no value).
    assert_bitwise(got, expected)
    # The DEPTH + 2 region inputs, and the values outside the regions they are made from.
    assert len(marked) >= DEPTH + 2


@pytest.mark.slow
@needs_compiled_offload
@_INDUCTOR_IMPORT
def test_compile_cache_keeps_graphs_apart_by_matepoint_choices(
    transport: CPUTestTransport, marked: list[str]
) -> None:
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    def compile_with(min_offload_bytes: int) -> tuple[bool, int]:
        """Compile the model afresh; (whether the pass marked values, AOTAutograd cache hits)."""
        counters.clear()
        del marked[:]
        # Synchronous copies: cacheable on every torch (see the test below for the stream).
        offload = matepoint.OffloadOptions(min_offload_bytes=min_offload_bytes, pipeline=False)
        _, model = twins(offload=offload)
        step(model, "inductor")
        return bool(marked), counters["aot_autograd"]["autograd_cache_hit"]

    with fresh_inductor_cache():
        assert compile_with(1 << 40) == (False, 0)
        # The same graph, other choices: compiled anew, not the cached graph without copies.
        assert compile_with(0) == (True, 0)
        # The same choices: served from the cache (nothing to mark, the copies are in it).
        assert compile_with(0) == (False, 1)


@pytest.mark.slow
@needs_compiled_offload
@_INDUCTOR_IMPORT
def test_pipelined_graphs_stay_out_of_the_cache_where_torch_cannot_load_their_streams(
    transport: CPUTestTransport, marked: list[str]
) -> None:
    """torch 2.11 registers the transfer stream's stream and events in the partitioner, which a
    graph loaded from AOTAutograd's cache skips (on a GPU its first stream op then fails); so
    there a pipelined region's graph is compiled each time, and from 2.12 it is cached."""
    from torch._dynamo.utils import counters
    from torch._inductor.utils import fresh_inductor_cache

    def compile_pipelined() -> tuple[bool, int, int]:
        counters.clear()
        del marked[:]
        _, model = twins(offload=matepoint.OffloadOptions(min_offload_bytes=0, pipeline=True))
        step(model, "inductor")
        aot = counters["aot_autograd"]
        return bool(marked), aot["autograd_cache_hit"], aot["autograd_cache_bypass"]

    with fresh_inductor_cache():
        first = compile_pipelined()
        second = compile_pipelined()
    if compat.STREAM_COPIES_CACHEABLE:
        assert (first[:2], second[:2]) == ((True, 0), (False, 1))
    else:
        assert first[:2] == second[:2] == (True, 0)  # marked and compiled anew both times
        assert first[2] >= 1
        assert second[2] >= 1


@pytest.mark.slow
@needs_compiled_offload
@_INDUCTOR_IMPORT
def test_inductor_keeps_the_order_of_matepoints_graphs_and_reorders_others(
    transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor's peak-memory reorder moved every forward copy to the host after the forward's
    last kernel on a GPU (Note [Inductor's peak-memory reorder]); matepoint's forward and
    backward compile without it, torch's checkpoint under the same compile still gets it, and
    the gradients stay bitwise torch's."""
    from torch._inductor import memory
    from torch._inductor.utils import fresh_inductor_cache

    reorders: list[int] = []
    reorder = memory.reorder_for_peak_memory

    def spy(nodes: Any, *args: Any, **kwargs: Any) -> Any:
        reorders.append(len(nodes))
        return reorder(nodes, *args, **kwargs)

    monkeypatch.setattr(memory, "reorder_for_peak_memory", spy)
    monkeypatch.setattr(
        inductor_order, "INDUCTOR_ORDER_COUNTS", inductor_order.InductorOrderCounts()
    )
    reference, model = twins()
    with fresh_inductor_cache():
        expected = step(reference, "inductor")
        assert len(reorders) == 2  # torch's forward and backward
        assert inductor_order.INDUCTOR_ORDER_COUNTS.compiled == 0
        got = step(model, "inductor")
    assert len(reorders) == 2  # none for matepoint's
    assert inductor_order.INDUCTOR_ORDER_COUNTS.marked == 2
    assert inductor_order.INDUCTOR_ORDER_COUNTS.compiled == 2
    assert_bitwise(got, expected)


@needs_compiled_offload
def test_reentrant_under_compile_does_what_torchs_does(transport: CPUTestTransport) -> None:
    reference, model = twins(use_reentrant=True)
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert len(backend.offloaded()) == DEPTH


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    policy = torch_checkpoint.CheckpointPolicy
    return policy.MUST_SAVE if op is torch.ops.aten.addmm.default else policy.PREFER_RECOMPUTE


@needs_compiled_offload
def test_a_calls_own_context_fn_is_kept(transport: CPUTestTransport) -> None:
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, _save_matmuls
    )
    reference, model = twins(context_fn=context_fn)
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert len(backend.offloaded()) == DEPTH


@needs_compiled_offload
@pytest.mark.parametrize(
    "offload",
    [
        False,
        matepoint.OffloadOptions(enabled=False),
        matepoint.OffloadOptions(min_offload_bytes=1 << 40),
    ],
    ids=["false", "disabled", "too_small"],
)
def test_calls_that_offload_nothing_compile_to_torchs_graph(
    transport: CPUTestTransport, offload: Any
) -> None:
    reference, model = twins(offload=offload)
    reference.checkpoint_kwargs.pop("offload")
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert backend.offloaded() == []


@needs_compiled_offload
def test_cpu_tensors_stay_without_a_test_transport() -> None:
    # matepoint's defaults on a CPU-only machine: the CPU is not an offload device.
    with matepoint.options(min_offload_bytes=0):
        reference, model = twins()
        backend = CapturingBackend()
        assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert backend.offloaded() == []


@needs_compiled_offload
def test_the_settings_minimum_size_applies_when_the_graph_compiles(
    transport: CPUTestTransport,
) -> None:
    block_input_bytes = 2 * 8 * WIDTH * 4
    reference, model = twins(extras=True)
    backend = CapturingBackend()
    with matepoint.options(min_offload_bytes=block_input_bytes + 1):
        assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert backend.offloaded() == []


@needs_compiled_offload
def test_the_settings_copy_window_reaches_the_partitioner(
    transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bound of Note [The forward copy window] is the device's max_inflight_bytes, as in eager
    # mode. The CPU test transport has no streams, so the copies stay synchronous (no window).
    asked: list[dict[str, Any]] = []
    configure = scope.compiled_offload_config

    def spy(**kwargs: Any) -> None:
        asked.append(kwargs)
        configure(**kwargs)

    monkeypatch.setattr(scope, "compiled_offload_config", spy)
    reference, model = twins()
    with matepoint.options(max_inflight_bytes=12345):
        assert_bitwise(step(model, "aot_eager"), step(reference, "aot_eager"))
    assert asked == [{"pipelined": False, "max_inflight_bytes": 12345}]


@needs_compiled_offload
def test_the_copy_window_is_part_of_the_compile_cache_key() -> None:
    from matepoint._compiled import _resolve

    try:
        with matepoint.options(max_inflight_bytes=1):
            first = _resolve(None, True)
        with matepoint.options(max_inflight_bytes=2):
            second = _resolve(None, True)
    finally:
        scope.close_compile_scope()  # _resolve opened it, as in a trace
    assert first is not None
    assert second is not None
    assert (first[3], second[3]) == (1, 2)
    assert first[0] != second[0]


@functools.cache
def _host_copy_op() -> Any:
    """An extern op standing in for a forward copy to the host (registered once)."""

    @torch.library.custom_op("matepoint_test::copy_out", mutates_args=())
    def copy_out(value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @copy_out.register_fake
    def _(value: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(value)

    return torch.ops.matepoint_test.copy_out.default


def _generated_code_with_stream_copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Force torch 2.11's transfer-stream copies on the CPU test transport, with stream and event
    ids as plain numbers and each copy an extern op; returns the list inductor's generated code
    is appended to, graph by graph."""
    import itertools

    from torch._functorch._activation_offloading import activation_offloading
    from torch._inductor import graph as inductor_graph

    from matepoint._compiled import forward_window as window

    ids = itertools.count(1000)
    for name in ("get_current_stream", "new_stream", "new_event"):
        monkeypatch.setattr(activation_offloading, name, lambda *args, **kwargs: next(ids))
    # Backward's prefetch times nodes on a GPU; the forward is what is checked here.
    monkeypatch.setattr(activation_offloading, "activation_reload_prefetch", lambda graph: None)
    configure = scope.compiled_offload_config

    def with_the_stream(*, pipelined: bool, max_inflight_bytes: int = 0) -> None:
        configure(pipelined=True, max_inflight_bytes=max_inflight_bytes)

    monkeypatch.setattr(scope, "compiled_offload_config", with_the_stream)
    codes: list[str] = []
    codegen = inductor_graph.GraphLowering.codegen

    def keep_code(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = codegen(self, *args, **kwargs)
        code = result[0] if isinstance(result, tuple) else result
        codes.append(str(getattr(code, "value", code)))
        return result

    monkeypatch.setattr(inductor_graph.GraphLowering, "codegen", keep_code)
    # A copy to the host is an extern kernel on CUDA; on the CPU it folds away (CPU to CPU), so
    # each copy becomes an extern op of the same shape, which inductor schedules as it would
    # schedule the CUDA copy.
    copy_out = _host_copy_op()
    bound = window.bound_forward_waits

    def with_extern_copies(graph: torch.fx.Graph, *args: Any, **kwargs: Any) -> int:
        moved = bound(graph, *args, **kwargs)
        for node in graph.find_nodes(op="call_function", target=torch.ops.prims.device_put.default):
            node.target, node.args, node.kwargs = copy_out, node.args[:1], {}
        return moved

    monkeypatch.setattr(window, "bound_forward_waits", with_extern_copies)
    return codes


class Residual(nn.Module):
    """A block whose output add inductor emits lazily (seen inside a fork..join)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


@needs_compiled_offload
@_INDUCTOR_IMPORT
@pytest.mark.skipif(
    compat.TORCH_2_12_PLUS, reason="torch 2.12+ copies inside one op (ao::offload), no stream ops"
)
def test_inductor_runs_each_forward_copy_alone_on_the_transfer_stream_and_waits_a_block_later(
    transport: CPUTestTransport, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's stream ops have no data dependencies; a kernel emitted between a copy's
    ``fork`` and ``join`` runs after the event the transfer stream waited on (Note [The forward
    copy window], rule 4). So in inductor's generated forward each copy runs alone between
    its fork and join, and each moved wait comes after the next block's kernels. The CPU test
    transport has no streams, so the stream path is forced and stream and event ids are plain
    numbers: the generated code is read, not run. (With torch's placement, max_inflight_bytes
    0, the wait check fails: each wait follows its join.)"""
    from torch._inductor.utils import fresh_inductor_cache

    codes = _generated_code_with_stream_copies(monkeypatch)
    blocks = nn.ModuleList(Residual() for _ in range(DEPTH + 1))

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x.tanh()
        for block in blocks:
            h = matepoint.checkpoint(block, h, use_reentrant=False)
        return h.square().mean()

    x = torch.randn(32, WIDTH, requires_grad=True)
    with fresh_inductor_cache(), pytest.raises(Exception):  # noqa: B017, PT011
        # The stream ids are not real: running fails, after the code is generated.
        torch.compile(forward, backend="inductor")(x).backward()
    forward = codes[0][codes[0].index("def call(") :]
    lines = [line.strip() for line in forward.splitlines()]
    forks = [i for i, line in enumerate(lines) if "torch.ops.streams.fork" in line]
    assert len(forks) == DEPTH + 1  # one copy per block input
    joins = []
    for fork in forks:
        join = next(i for i in range(fork, len(lines)) if "torch.ops.streams.join" in lines[i])
        joins.append(join)
        region = [line for line in lines[fork + 1 : join] if line and not line.startswith("#")]
        copies = [line for line in region if "copy_out" in line and "=" in line.split("(")[0]]
        assert len(copies) == 1, region  # the copy itself runs on the transfer stream
        others = [line for line in region if "(" in line and "copy_out" not in line]
        assert all(line.startswith("torch.ops.streams.") for line in others), region
    # Each moved wait comes after the next block's compute, before the next copy's event (the
    # last one goes to the end of the graph, where inductor may still emit the loss after it).
    waits = [i for i, line in enumerate(lines) if line.startswith("torch.ops.streams.wait_event")]
    assert any(i > joins[-1] for i in waits)
    for join, next_fork in zip(joins[:-1], forks[1:], strict=True):
        between = lines[join + 1 : next_fork]
        compute = [line for line in between if "extern_kernels." in line or "cpp_fused" in line]
        assert compute, between  # the next block ran between the copies
        moved = [i for i in waits if join < i < next_fork]
        assert moved, between
        assert lines.index(compute[-1], join) < moved[0], between


class SharedInputModel(nn.Module):
    """A GPT's x0 pattern: a normed embedding every block reads, mixed in by a learnt scale."""

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.mix = nn.Parameter(torch.ones(DEPTH))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = F.rms_norm(self.embed(x).tanh(), (WIDTH,))
        h = x0
        for index in range(len(self.blocks)):

            def mixed(h: torch.Tensor, x0: torch.Tensor, index: int = index) -> torch.Tensor:
                return self.blocks[index](h + self.mix[index] * x0)

            h = self.checkpoint(mixed, h, x0, use_reentrant=False)
        return h


@needs_compiled_offload
def test_what_the_partitioner_saves_for_a_shared_input_moves(transport: CPUTestTransport) -> None:
    # The partitioner saves x0 as its pre-norm value (and recomputes the norm in backward):
    # whatever form it saves, no activation of the model's width stays on the device.
    reference = SharedInputModel(torch_checkpoint.checkpoint)
    model = copy.deepcopy(reference)
    model.checkpoint = matepoint.checkpoint
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    (forward,) = backend.forward_graphs
    (output,) = (node for node in forward.graph.nodes if node.op == "output")
    saved = [node for node in output.args[0][1:] if isinstance(node, torch.fx.Node)]
    kept = [
        node.name
        for node in saved
        if node.op == "call_function"
        and not node.name.startswith("cpu_offload_")
        and tuple(node.meta["val"].shape) == (2, 8, WIDTH)
    ]
    assert kept == []
    assert len(backend.offloaded()) > DEPTH - 1


@needs_compiled_offload
def test_a_users_joint_pass_still_runs(transport: CPUTestTransport) -> None:
    import torch._functorch.config as functorch_config

    seen: list[int] = []

    def users_pass(graph: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
        seen.append(len(graph.graph.nodes))
        return graph

    functorch_config.joint_custom_pass = users_pass
    reference, model = twins()
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert len(seen) == 2  # both compiles
    assert len(backend.offloaded()) == DEPTH


@needs_compiled_offload
def test_eager_calls_after_a_compile_still_use_the_engine(transport: CPUTestTransport) -> None:
    reference, model = twins()
    step(model, "aot_eager")
    assert traffic.COMPILED_TRAFFIC.offloads == DEPTH  # the compiled graph's own copies
    matepoint.reset_stats()
    model.zero_grad(set_to_none=True)
    x = torch.randn(2, 8, WIDTH, requires_grad=True)
    torch.manual_seed(3)
    model(x).square().mean().backward()
    got = [x.grad] + [p.grad for p in model.parameters()]
    x.grad = None
    reference.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    reference(x).square().mean().backward()
    expected = [x.grad] + [p.grad for p in reference.parameters()]
    assert matepoint.stats().offloads == DEPTH
    assert_bitwise([g for g in got if g is not None], [g for g in expected if g is not None])


# -- one engine: choices, settings, keep rules, counts, 0.1.x keywords ------------------------

_MIXED_CHOICES = """
import json
import sys

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint.testing import CPUTestTransport, use_transport

form = sys.argv[1]
torch.manual_seed(0)
blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))


def call(checkpoint, index, block, h):
    if checkpoint is torch_checkpoint.checkpoint:
        return checkpoint(block, h, use_reentrant=False)
    if form == "pipeline":
        return checkpoint(block, h, use_reentrant=False, pipeline=(index != 1))
    options = matepoint.OffloadOptions(min_offload_bytes=index)
    return checkpoint(block, h, use_reentrant=False, offload=options)


def run(checkpoint):
    torch._dynamo.reset()
    blocks.zero_grad(set_to_none=True)

    def forward(x):
        h = x.tanh()
        for index, block in enumerate(blocks):
            h = call(checkpoint, index, block, h).tanh()
        return h.square().mean()

    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    torch.compile(forward, backend="aot_eager", fullgraph=True)(x).backward()
    return [x.grad.tolist()] + [p.grad.tolist() for p in blocks.parameters()]


everything = matepoint.options(compiled_offload=True, min_offload_bytes=0)
with use_transport(CPUTestTransport()), everything:
    got = run(matepoint.checkpoint)  # first: the fresh process is what failed
    offloads = matepoint.stats().offloads
    expected = run(torch_checkpoint.checkpoint)
print(json.dumps({"offloads": offloads, "equal": got == expected}))
"""


@pytest.mark.slow
@needs_compiled_offload
@pytest.mark.parametrize("form", ["pipeline", "min_offload_bytes"])
def test_calls_with_different_choices_compile_fullgraph_in_a_fresh_process(
    tmp_path: Any, form: str
) -> None:
    """Each set of choices gets its own context_fn while Dynamo traces; they were kept in a dict
    that Dynamo read once per trace, so the second set of choices in a fresh process raised
    KeyError (fullgraph failed; without it Dynamo skipped the frame and nothing moved)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "mixed.py"
    script.write_text(_MIXED_CHOICES)
    done = subprocess.run(
        [sys.executable, str(script), form], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # The inputs of blocks 1 to 3 (block 0's is the graph's own input's tanh, also moved).
    assert result == {"offloads": 4, "equal": True}


@needs_compiled_offload
def test_a_legacy_keyword_compiles_fullgraph_and_warns_at_the_call(
    transport: CPUTestTransport,
) -> None:
    """Dynamo cannot trace the deprecation warning's construction: the warning is given at trace
    time, attributed to the line of the call (see Note [Deprecation warnings under
    torch.compile])."""
    reference, model = twins(stream=None)
    reference.checkpoint_kwargs.pop("stream")
    backend = CapturingBackend()
    with pytest.warns(compat.MatepointDeprecationWarning, match="`stream=`") as caught:
        got = step(model, backend, fullgraph=True)
    ours = [w for w in caught if issubclass(w.category, compat.MatepointDeprecationWarning)]
    assert {warning.filename for warning in ours} == {__file__}
    assert_bitwise(got, step(reference, "aot_eager"))
    assert len(backend.offloaded()) == DEPTH


@needs_compiled_offload
def test_torchs_compile_settings_are_as_before_after_a_compiled_step(
    transport: CPUTestTransport, marked: list[str]
) -> None:
    """The AOTAutograd settings the compiled path needs are set for its compile only (Note
    [Compile settings are scoped])."""
    import torch._functorch.config as functorch_config

    before = {name: getattr(functorch_config, name) for name in _TORCH_CONFIG}
    _, model = twins()
    step(model, "aot_eager")
    assert marked  # the joint pass ran during the compile
    assert {name: getattr(functorch_config, name) for name in _TORCH_CONFIG} == before
    # A compile without matepoint regions compiles under torch's own settings.
    assert functorch_config.enable_activation_offloading is before["enable_activation_offloading"]


class StridedInputs(nn.Module):
    """Each block reads every other feature of a wider value: a saved input that is not dense."""

    def __init__(self, checkpoint: Callable[..., Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.tanh()
        for block in self.blocks:
            wide = torch.cat([h, h.sin()], dim=-1)
            h = self.checkpoint(block, wide[..., ::2], use_reentrant=False)
        return h


@needs_compiled_offload
def test_a_non_dense_saved_input_stays_on_the_device_as_in_eager(
    transport: CPUTestTransport,
) -> None:
    """The compiled pass asks the pack hook's rules (matepoint._engine.saving.stay_reason), dense
    layout included."""
    reference = StridedInputs(torch_checkpoint.checkpoint)
    model = copy.deepcopy(reference)
    model.checkpoint = matepoint.checkpoint
    x = torch.randn(2, 8, WIDTH, requires_grad=True)
    model(x).sum().backward()  # eager: every saved input is kept, as not dense
    eager = matepoint.stats()
    assert (eager.offloads, eager.skipped_other) == (0, DEPTH)
    matepoint.reset_stats()
    model.zero_grad(set_to_none=True)
    backend = CapturingBackend()
    assert_bitwise(step(model, backend), step(reference, "aot_eager"))
    assert backend.offloaded() == []
    assert matepoint.stats().offloads == 0


@needs_compiled_offload
def test_stats_count_the_compiled_graphs_copies_each_run(transport: CPUTestTransport) -> None:
    """What a compiled graph moves is counted per run (Note [Counting compiled copies])."""
    _, model = twins()
    block_input_bytes = 2 * 8 * WIDTH * 4
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for run in range(1, 3):
        x = torch.randn(2, 8, WIDTH, requires_grad=True)
        compiled(x).square().mean().backward()
        stats = matepoint.stats()
        moved = (run * DEPTH, run * DEPTH * block_input_bytes)
        assert (stats.offloads, stats.bytes_offloaded) == moved
        assert (stats.fetches, stats.bytes_fetched) == moved
    assert "offloaded         6 tensors, 6.00 KiB" in matepoint.report()
    matepoint.reset_stats()
    assert matepoint.stats().offloads == 0


# -- on CUDA ----------------------------------------------------------------------------------


def _cuda_step(
    blocks: nn.ModuleList, checkpoint: Callable[..., Any], pipeline: bool
) -> tuple[list[torch.Tensor], int, int]:
    """Compiled (inductor) forward and backward on CUDA, after one warm-up step.

    Returns the gradients of the measured step, the device bytes held between its forward and
    its backward (what the autograd graph keeps) over those held before it, and Dynamo's graph
    breaks.
    """
    from _cuda_helpers import TOKENS
    from _cuda_helpers import WIDTH as CUDA_WIDTH

    kwargs: dict[str, Any] = {"use_reentrant": False}
    if checkpoint is matepoint.checkpoint:
        kwargs["pipeline"] = pipeline

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = blocks

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = checkpoint(block, x, **kwargs)
            return x

    torch._dynamo.reset()
    probe = torch.randn(TOKENS, CUDA_WIDTH, device="cuda", requires_grad=True)
    breaks = torch._dynamo.explain(Stack())(probe).graph_break_count
    del probe
    torch._dynamo.reset()
    compiled = torch.compile(Stack(), backend="inductor")
    for _ in range(2):  # the first step compiles
        blocks.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        x = torch.randn(TOKENS, CUDA_WIDTH, device="cuda", requires_grad=True)
        torch.cuda.manual_seed(2)
        gc.collect()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = compiled(x)
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        out.square().mean().backward()
        torch.cuda.synchronize()
        del out
    grads = [x.grad] + [p.grad for p in blocks.parameters()]
    return [grad.clone() for grad in grads if grad is not None], held, breaks


@functools.cache
def _transfer_delay() -> Any:
    """A test op that holds up the stream it runs on (``torch.cuda._sleep``) for ``cycles``.

    Put before each forward copy on torch 2.11's transfer stream, it makes the copies finish long
    after the compute that follows them has run: a value freed (or its buffer reused) before the
    compute stream waited for its copy would then reach the host overwritten.
    """
    from torch.fx.node import has_side_effect

    @torch.library.custom_op("matepoint_tests::transfer_delay", mutates_args=())
    def transfer_delay(value: torch.Tensor, cycles: int) -> None:
        del value
        torch.cuda._sleep(cycles)

    @transfer_delay.register_fake
    def _(value: torch.Tensor, cycles: int) -> None:
        del value, cycles

    has_side_effect(torch.ops.matepoint_tests.transfer_delay.default)
    return torch.ops.matepoint_tests.transfer_delay.default


@pytest.fixture
def window_moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many forward waits the copy window moved, per graph; and slow copies where it can.

    Wraps ``matepoint._compiled.forward_window.bound_forward_waits``. On torch 2.11's
    layout (a ``device_put`` on the transfer stream) it also puts ``_transfer_delay`` before each
    copy (Streams standard: delay injection). torch 2.12+ copies inside one op, out of reach.
    """
    moves: list[int] = []
    original = forward_window.bound_forward_waits

    def spy(graph: torch.fx.Graph, max_inflight_bytes: int) -> int:
        moved = original(graph, max_inflight_bytes)
        moves.append(moved)
        for node in list(graph.nodes):
            if compat.op_name(node) == "prims::device_put" and node.name.startswith("cpu_offload_"):
                with graph.inserting_before(node):
                    graph.call_function(_transfer_delay(), (node.args[0], 2_000_000))
        return moved

    monkeypatch.setattr(forward_window, "bound_forward_waits", spy)
    return moves


_MIB = 1 << 20


@pytest.mark.gpu
@needs_compiled_offload
@_INDUCTOR_IMPORT
# Inductor suggests TF32 when it compiles an fp32 matmul on a GPU that has it; the test keeps fp32.
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
@pytest.mark.usefixtures("clean_start")
@pytest.mark.parametrize(
    ("pipeline", "max_inflight_bytes"),
    [(True, 2048 * _MIB), (True, 8 * _MIB), (True, 0), (False, 2048 * _MIB)],
    ids=["pipeline-window", "pipeline-window-too-small", "pipeline-nowindow", "nopipeline"],
)
def test_inductor_on_cuda_offloads_and_matches_torch(
    pipeline: bool, max_inflight_bytes: int, marked: list[str], window_moves: list[int]
) -> None:
    from _cuda_helpers import TOKENS, make_stack
    from _cuda_helpers import WIDTH as CUDA_WIDTH
    from torch._inductor.utils import fresh_inductor_cache

    depth = 8
    block_input_bytes = TOKENS * CUDA_WIDTH * 4  # 16 MiB in fp32
    torch_blocks = make_stack(depth)
    matepoint_blocks = copy.deepcopy(torch_blocks)
    # A fresh cache: the pass must really run (a cached graph skips it).
    with fresh_inductor_cache():
        expected, torch_held, torch_breaks = _cuda_step(
            torch_blocks, torch_checkpoint.checkpoint, pipeline
        )
        assert window_moves == []
        with matepoint.options(max_inflight_bytes=max_inflight_bytes):
            got, matepoint_held, matepoint_breaks = _cuda_step(
                matepoint_blocks, matepoint.checkpoint, pipeline
            )
    bitwise = all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    print(
        f"\n[gpu] compiled (inductor), {depth} blocks of {block_input_bytes} bytes, held after "
        f"forward: torch checkpoint {torch_held}, matepoint (pipeline={pipeline}, "
        f"max_inflight_bytes={max_inflight_bytes}) {matepoint_held}; waits moved {window_moves}; "
        f"gradients bitwise equal: {bitwise}; marked: {marked}"
    )
    assert (torch_breaks, matepoint_breaks) == (0, 0)
    # The first block's input is the compiled graph's own input (the caller holds it): the
    # other block inputs (the outputs of blocks 0 .. depth - 2) are marked.
    assert len(marked) == depth - 1
    # The window moves every forward wait (each to the next copy's start, the last to the end of
    # forward); none where each copy is larger than the bound, or with a bound of 0 (torch's
    # placement); it is not asked for without the transfer stream.
    if not pipeline:
        assert window_moves == []
    else:
        assert window_moves == [depth - 1 if max_inflight_bytes >= block_input_bytes else 0]
    # The same graph plus the copies: the kernels should be the same and the gradients bitwise
    # equal. The tolerance only allows for fusion changed around the copies; a different dropout
    # mask in the recomputation, or a block input overwritten before its copy ended, would be
    # off by far more.
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # torch keeps the block inputs it saves (depth - 1 of them, plus the output: depth x 16 MiB);
    # matepoint moves the saved ones to the host. Allow two block inputs beyond the output for
    # what a schedule may still hold when forward returns.
    assert torch_held >= (depth - 1) * block_input_bytes
    assert matepoint_held <= torch_held - (depth - 3) * block_input_bytes


_CACHED_STEP = """
import json

import torch
from torch._dynamo.utils import counters

import matepoint

torch.manual_seed(0)
blocks = torch.nn.ModuleList(
    torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024))
    for _ in range(4)
).cuda()


def forward(x):
    for block in blocks:
        x = matepoint.checkpoint(block, x, use_reentrant=False)
    return x.square().mean()


x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
with matepoint.options(compiled_offload=True):
    torch.compile(forward)(x).backward()
torch.cuda.synchronize()
aot = counters["aot_autograd"]
print(json.dumps({
    "hit": aot["autograd_cache_hit"],
    "bypass": aot["autograd_cache_bypass"],
    "grads": [p.grad.double().sum().item() for p in blocks.parameters()],
}))
"""


@pytest.mark.gpu
@needs_compiled_offload
def test_a_second_process_runs_the_pipelined_graph_with_a_warm_compile_cache(
    tmp_path: Any,
) -> None:
    """Two processes, one compile cache: the second must run (on torch 2.11 a graph with
    transfer-stream copies loaded from AOTAutograd's cache failed at its first stream op) and
    get the first one's gradients."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "step.py"
    script.write_text(_CACHED_STEP)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    print(
        f"\n[gpu] two processes, one compile cache: {first['hit']}, {second['hit']} hits, "
        f"{first['bypass']}, {second['bypass']} bypasses"
    )
    assert first["grads"] == second["grads"]
    if compat.STREAM_COPIES_CACHEABLE:
        assert second["hit"] >= 1
    else:
        assert second["hit"] == 0
        assert second["bypass"] >= 1


@pytest.mark.gpu
@needs_compiled_offload
@_INDUCTOR_IMPORT
@pytest.mark.usefixtures("clean_start")
# torch 2.11 warns on every profiler start that a new cycle drops the last one's events.
@pytest.mark.filterwarnings("ignore:.*Profiler clears events:UserWarning")
def test_the_forward_copies_run_among_the_forward_kernels_on_cuda(tmp_path: Any) -> None:
    """On blocks of the benchmark's deep48 width and tokens, inductor's peak-memory reorder put
    every forward copy after the forward's last kernel, on the compute stream (Note [Inductor's
    peak-memory reorder]); matepoint's forward keeps them where the partitioner put them, on the
    transfer stream (torch 2.11) among the forward's kernels."""
    import json

    from torch._inductor.utils import fresh_inductor_cache
    from torch.profiler import ProfilerActivity, profile, record_function

    width, rows, depth = 1536, 32768, 4
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        for _ in range(depth)
    ).to("cuda", torch.bfloat16)

    def forward(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = x + matepoint.checkpoint(block, x, use_reentrant=False)
        return x.float().square().mean()

    x = torch.randn(rows, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    with fresh_inductor_cache(), matepoint.options(compiled_offload=True):
        compiled = torch.compile(forward, backend="inductor")
        compiled(x).backward()  # compiles
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("matepoint-test forward"):
                loss = compiled(x)
                torch.cuda.synchronize()
            loss.backward()
            torch.cuda.synchronize()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    mark = next(e for e in events if e.get("name") == "matepoint-test forward")
    end = mark["ts"] + mark["dur"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e["ts"] < end]
    copies = [
        e
        for e in events
        if e.get("cat") == "gpu_memcpy" and "DtoH" in e.get("name", "") and e["ts"] < end
    ]
    busy: dict[Any, float] = {}
    for kernel in kernels:
        busy[kernel["args"].get("stream")] = (
            busy.get(kernel["args"].get("stream"), 0) + kernel["dur"]
        )
    compute = max(busy, key=lambda stream: busy[stream])
    last_kernel = max(kernel["ts"] for kernel in kernels)
    print(
        f"\n[gpu] forward: {len(kernels)} kernels, {len(copies)} copies to the host, "
        f"{sum(c['ts'] < last_kernel for c in copies)} started before the last kernel, "
        f"{sum(c['args'].get('stream') != compute for c in copies)} off the compute stream"
    )
    # Blocks 1 .. depth - 1 read a copied value; the partitioner may keep the last in place.
    assert len(copies) >= depth - 2
    # The last copy may start after the forward's last kernel; the others run among them.
    assert sum(copy_["ts"] < last_kernel for copy_ in copies) >= len(copies) - 1
    if not compat.TORCH_2_12_PLUS:
        assert all(copy_["args"].get("stream") != compute for copy_ in copies)
