"""Tests for what the compile caches did in a compiled strategy's compile step
(``matepoint_examples.bench._compile_caches``, read through ``CompiledForward.report``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import matepoint_compat
from matepoint_examples.bench import _compiled
from matepoint_examples.strategies import get_strategy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("forward", "backward", "expected"),
    [
        ([], [], "not used"),
        (["hit"], [], "hit"),
        (["miss"], ["saved"], "miss+saved"),
        (["miss"], [], "miss"),
        (["bypass"], [], "bypass"),
    ],
)
def test_compiled_forward_reports_what_the_autograd_cache_did_in_the_compile_step(
    forward: list[str], backward: list[str], expected: str
) -> None:
    from torch._dynamo.utils import counters

    calls = [forward, backward, ["hit"]]  # lookups and saves each call brings about

    def compiled(loss: Any) -> Tensor:
        for outcome in calls.pop(0):
            counters["aot_autograd"][f"autograd_cache_{outcome}"] += 1
        return loss()

    def lazy_backward() -> None:  # what the first backward does: compile, maybe save
        for outcome in calls.pop(0):
            counters["aot_autograd"][f"autograd_cache_{outcome}"] += 1

    step = _compiled.CompiledForward(
        lambda: torch.zeros(()), "probe", _compiled.CompileSpec(), CPU, backend="eager"
    )
    step.compiled = compiled
    step()
    lazy_backward()
    assert step.report()["autograd_cache"] == expected
    calls.insert(0, ["hit"])  # a later step's lookups do not change what the compile step did
    step()
    assert step.report()["autograd_cache"] == expected


class _Records(logging.Handler):
    """Keep the messages a logger passes to its handlers."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_compiled_forward_reports_what_the_fx_graph_cache_did_and_why_it_bypassed() -> None:
    """Outcomes and reasons of the compile step only, without changing what logging prints."""
    from torch._dynamo.utils import counters

    codecache = logging.getLogger("torch._inductor.codecache")
    shown = _Records()  # what the user's handlers above inductor's cache logger get
    logging.getLogger("torch._inductor").addHandler(shown)
    level, filters = codecache.level, list(codecache.filters)
    long_reason = "x" * 1000

    def bypass(reason: str) -> None:
        counters["inductor"]["fxgraph_cache_bypass"] += 1
        codecache.info("Bypassing FX Graph Cache because '%s'", reason)

    def compiled(loss: Any) -> Tensor:
        counters["inductor"]["fxgraph_cache_miss"] += 1
        for reason in ["Unsupported post grad custom pass", long_reason, long_reason]:
            bypass(reason)
        codecache.warning("a warning the user sees")
        return loss()

    try:
        step = _compiled.CompiledForward(
            lambda: torch.zeros(()), "probe", _compiled.CompileSpec(), CPU, backend="eager"
        )
        step.compiled = compiled
        step()
        bypass("Unsupported joint custom pass")  # the lazy backward's compile
        compiled_report = step.report()
        assert compiled_report["fx_graph_cache"] == "miss+bypass"
        reasons = ["Unsupported post grad custom pass", "x" * 200, "Unsupported joint custom pass"]
        assert compiled_report["fx_graph_cache_bypass"] == reasons  # each once, shortened
        step.compiled = compiled
        step()  # a later step's lookups and bypasses are not the compile step's
        assert {**step.report(), "calls": 1} == compiled_report
    finally:
        logging.getLogger("torch._inductor").removeHandler(shown)
    # Both warnings printed, each once; the INFO records stayed unprinted.
    assert shown.messages == ["a warning the user sees"] * 2
    assert (codecache.level, codecache.filters) == (level, filters)


def test_each_compile_step_reports_only_its_own_cache_outcomes() -> None:
    """A paired run compiles strategy after strategy: each row's outcomes are its own."""
    from torch._dynamo.utils import counters

    def compiling(outcome: str) -> Any:
        def compiled(loss: Any) -> Tensor:
            counters["aot_autograd"][f"autograd_cache_{outcome}"] += 1
            return loss()

        return compiled

    steps = []
    for outcome in ("hit", "miss"):
        step = _compiled.CompiledForward(
            lambda: torch.zeros(()), outcome, _compiled.CompileSpec(), CPU, backend="eager"
        )
        step.compiled = compiling(outcome)
        step()
        step.end_compile_step()  # as the paired worker does after each strategy's compile step
        steps.append(step)
    for step in steps:
        step.compiled = compiling("bypass")  # later steps do not count
        step()
    assert [step.report()["autograd_cache"] for step in steps] == ["hit", "miss"]


def _compile_step(backend: str) -> dict[str, Any]:
    """Compile a one-matmul loss with ``backend`` (forward and backward); return the report.

    One matmul: inductor calls the library's kernel for it and its gradient, so the compile
    builds no C++ kernel and takes a few seconds.
    """
    weight = torch.randn(4, 4, requires_grad=True)
    batch = torch.randn(4, 4)
    step = _compiled.CompiledForward(
        lambda: batch @ weight, "probe", _compiled.CompileSpec(), CPU, backend=backend
    )
    out = step()
    torch.autograd.backward(out, torch.ones_like(out))
    return step.report()


@pytest.mark.skipif(
    not _compiled.TORCH_COMPILED_OFFLOAD,
    reason="the compiled strategies' releases (2.11+) log why inductor bypassed its cache",
)
def test_compiled_forward_says_why_inductor_bypassed_its_fx_graph_cache() -> None:
    """A custom post-grad pass that is no ``CustomGraphPass`` cannot be part of a cache key."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_inductor_cache

    def post_grad_pass(graph: torch.fx.Graph) -> None:
        del graph

    with (
        fresh_inductor_cache(),
        inductor_config.patch(fx_graph_cache=True, post_grad_custom_post_pass=post_grad_pass),
    ):
        compiled = _compile_step("inductor")
    assert "bypass" in compiled["fx_graph_cache"].split("+")
    assert "Unsupported post grad custom pass" in compiled["fx_graph_cache_bypass"]
    assert "saved" not in compiled["autograd_cache"].split("+")


def test_fx_graph_cache_is_not_used_without_inductor() -> None:
    compiled = _compile_step("aot_eager")
    assert compiled["fx_graph_cache"] == "not used"
    assert "fx_graph_cache_bypass" not in compiled


CUDA = torch.device("cuda")
PLAIN_RNG = (
    {"graphsafe_rng_functionalization": False}
    if not matepoint_compat.TORCH_2_13_PLUS
    and hasattr(torch._functorch.config, "graphsafe_rng_functionalization")
    else {}
)
"""What every compiled strategy changes on CUDA so that its graphs can be cached (nothing on
torch 2.13+, which caches the CUDA-graph-safe form, nor on a torch without that form)."""


@pytest.mark.parametrize(
    "strategy", ["torch-compile", "torch-compiled-offload", "matepoint-compile"]
)
def test_every_compiled_strategy_replays_random_ops_in_a_cacheable_form_on_cuda(
    strategy: str,
) -> None:
    """Before torch 2.13 the CUDA-graph-safe replay is not cacheable, so it is off on CUDA."""
    spec = get_strategy(strategy).compiled
    assert spec is not None
    on_cuda = _compiled.CompiledForward(lambda: torch.zeros(()), "probe", spec, CUDA)
    on_cpu = _compiled.CompiledForward(lambda: torch.zeros(()), "probe", spec, CPU)
    for name, value in PLAIN_RNG.items():
        assert on_cuda.settings[name] is value
    assert "graphsafe_rng_functionalization" not in on_cpu.settings
    assert _compiled.cacheable_rng_settings(CPU) == {}


def test_a_row_says_how_random_ops_replay_and_when_the_partitioner_did_not_run() -> None:
    from torch._dynamo.utils import counters

    def compiled(loss: Any) -> Tensor:
        counters["aot_autograd"]["autograd_cache_hit"] += 1
        return loss()

    step = _compiled.CompiledForward(
        lambda: torch.zeros(()), "probe", _compiled.CompileSpec(), CUDA, backend="eager"
    )
    step.compiled = compiled
    step()
    report = step.report()
    assert report["autograd_cache"] == "hit"
    assert "cache hit" in report["partitioner"]
    assert ("rng_replay" in report) is bool(PLAIN_RNG)
    missed = _compiled.CompiledForward(
        lambda: torch.zeros(()), "probe", _compiled.CompileSpec(), CPU, backend="eager"
    )
    missed()
    assert "partitioner" not in missed.report()
    assert "rng_replay" not in missed.report()


def _attention_step(settings: dict[str, Any] | None, seed: int) -> tuple[dict[str, Any], Tensor]:
    """One step of a checkpointed attention with dropout on CUDA: the compile report (empty
    when ``settings`` is ``None``: run eagerly) and the input's gradient."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    query = torch.randn(2, 4, 256, 64, device=CUDA, dtype=torch.bfloat16, requires_grad=True)

    def block(x: Tensor) -> Tensor:
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, dropout_p=0.25)

    def loss() -> Tensor:
        return checkpoint(block, query, use_reentrant=False).float().square().sum()

    torch.manual_seed(seed)
    if settings is None:
        loss().backward()
        report: dict[str, Any] = {}
    else:
        step = _compiled.CompiledForward(loss, "attention", _compiled.CompileSpec(), CUDA)
        step.settings.update(settings)
        step().backward()
        report = step.report()
    assert query.grad is not None
    return report, query.grad


@pytest.mark.gpu
def test_plain_rng_replay_is_saved_by_the_caches_and_replays_dropout_on_cuda() -> None:
    """The cacheable replay is saved (the CUDA-graph-safe one is not, before 2.13), and it
    replays in backward the dropout mask the forward drew: the gradient is eager's, seed for
    seed. (The CUDA-graph-safe form draws from a generator of its own, so its mask is not.)"""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import fresh_inductor_cache

    plain_rng = {"graphsafe_rng_functionalization": False}
    with fresh_inductor_cache(), inductor_config.patch(fx_graph_cache=True):
        plain, plain_grad = _attention_step(plain_rng, seed=1)
        torch._dynamo.reset()
        graphsafe, _ = _attention_step({"graphsafe_rng_functionalization": True}, seed=1)
        torch._dynamo.reset()
    _, eager_grad = _attention_step(None, seed=1)
    _, other_seed_grad = _attention_step(None, seed=2)
    assert plain["autograd_cache"] == "miss+saved", plain
    if not matepoint_compat.TORCH_2_13_PLUS:
        assert "saved" not in graphsafe["autograd_cache"].split("+"), graphsafe
        assert any("graphsafe_run_with_rng_state" in r for r in graphsafe["fx_graph_cache_bypass"])
    # One bf16 rounding step apart where inductor fuses the loss's gradient differently (0.3%
    # of elements on an H200); another mask moves most elements by far more.
    tolerance = {"rtol": 1.6e-2, "atol": 4e-3}
    torch.testing.assert_close(plain_grad, eager_grad, **tolerance)
    assert not torch.allclose(plain_grad, other_seed_grad, **tolerance)  # the test can fail
