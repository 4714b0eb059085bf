"""Tests for the compiled strategies (torch-compile, torch-compiled-offload, matepoint-compile).

On the CPU they compile with ``aot_eager``, which traces and partitions like inductor (so the
checkpoint regions, matepoint's compiled path and torch's offload pass all run) and executes the
graphs eagerly; torch's offload is then a synchronous host copy of a host tensor.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import matepoint_compat
from matepoint._compiled import forward_window
from matepoint_examples._workloads import Workload, build, get_workload
from matepoint_examples.bench import _compiled
from matepoint_examples.bench import _report as report
from matepoint_examples.bench import cli as bench
from matepoint_examples.bench._paired import StrategySwitch, run_paired
from matepoint_examples.strategies import get_strategy

CPU = torch.device("cpu")
COMPILED = ["torch-compile", "torch-compiled-offload", "matepoint-compile"]
TORCH_OFFLOAD = get_strategy("torch-compiled-offload").unavailable_reason(CPU) is None
MATEPOINT_PATH = "compiled" if matepoint_compat.COMPILED_OFFLOAD else "eager, graph breaks"
TINY_GPT = dataclasses.replace(
    get_workload("nanochat12").with_overrides(
        depth=3, width=64, batch=2, tokens=16, vocab_size=64, head_dim=32
    ),
    dtype="fp32",
)
TINY_ARGS = ["--depth", "3", "--width", "32", "--heads", "2", "--batch", "1", "--tokens", "16"]

needs_torch_offload = pytest.mark.skipif(
    not TORCH_OFFLOAD, reason="this torch has no compiled activation offloading to compare with"
)
# Where matepoint runs eagerly under compile (torch older than matepoint's compiled path, or
# made so), Dynamo warns where it breaks the graph, and torch's tensor warns when Dynamo,
# resuming after a break, reads .grad of a non-leaf activation.
pytestmark = [
    pytest.mark.slow,  # compiles with inductor
    pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning"),
    pytest.mark.filterwarnings("ignore:Graph break due to unsupported builtin:UserWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf"),
]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(workload: Workload, name: str) -> tuple[Tensor, list[Tensor], dict[str, Any]]:
    """Two steps of one strategy on a fresh model: the second's loss, gradients, compile report.

    Two, so that the second runs the cached graph (and would show a recompile).
    """
    strategy = get_strategy(name)
    with strategy.session(CPU):
        switch = StrategySwitch(strategy)
        built = build(workload, switch, CPU)
        forward = strategy.forward_fn(built.loss, CPU)
        for _ in range(2):
            built.model.zero_grad(set_to_none=True)
            loss = forward()
            loss.backward()
    grads = [p.grad.clone() for p in built.model.parameters() if p.grad is not None]
    report = forward.report() if isinstance(forward, _compiled.CompiledForward) else {}
    return loss.detach(), grads, report


def _close(a: list[Tensor], b: list[Tensor]) -> bool:
    """Whether two lists of gradients agree up to compiled-versus-eager rounding."""
    return len(a) == len(b) and all(
        torch.allclose(x, y, rtol=1e-4, atol=1e-6) for x, y in zip(a, b, strict=True)
    )


def test_compiled_strategies_are_registered_and_available() -> None:
    for name in COMPILED:
        strategy = get_strategy(name)
        assert strategy.compiled is not None
        reason = strategy.unavailable_reason(CPU)
        assert reason is None if name != "torch-compiled-offload" or TORCH_OFFLOAD else reason
    assert get_strategy("torch").forward_fn(len, CPU) is len  # eager: the forward itself


@pytest.mark.parametrize("workload", [TINY_GPT, get_workload("cpu-small")], ids=["gpt", "latent"])
def test_compiled_strategies_match_torch(workload: Workload) -> None:
    workload = workload.with_overrides(depth=3, width=32, heads=2, batch=1, tokens=16)
    ref_loss, ref_grads, _ = _step(workload, "torch")
    loss, grads, report = _step(workload, "torch-compile")
    assert (report["graphs"], report["graph_breaks"]) == (1, 0)
    assert report["graphs_after_first_forward"] == 0
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert _close(grads, ref_grads)
    # The offloading strategies compile to torch-compile's graph plus the copies: bitwise equal.
    if TORCH_OFFLOAD:
        offload_loss, offload_grads, offload = _step(workload, "torch-compiled-offload")
        assert (offload["graphs"], offload["graph_breaks"]) == (1, 0)
        assert torch.equal(offload_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(offload_grads, grads, strict=True))
    mate_loss, mate_grads, mate = _step(workload, "matepoint-compile")
    assert mate["matepoint_path"] == MATEPOINT_PATH
    assert mate["graphs_after_first_forward"] == 0
    if matepoint_compat.COMPILED_OFFLOAD:
        assert (mate["graphs"], mate["graph_breaks"]) == (1, 0)
        assert torch.equal(mate_loss, loss)
        assert all(torch.equal(a, b) for a, b in zip(mate_grads, grads, strict=True))
    else:  # matepoint's eager checkpoint between the graph breaks
        assert mate["graph_breaks"] > 0
        assert torch.allclose(mate_loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert _close(mate_grads, ref_grads)


@needs_torch_offload
def test_torch_compiled_offload_moves_the_checkpoint_inputs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's partitioner offloads every block input it saves, nanochat's x0 included."""
    from torch._functorch._activation_offloading import activation_offloading

    offloaded: list[str] = []
    original = activation_offloading.enable_activation_offloading

    def spy(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, *args: Any) -> None:
        original(fwd, bwd, *args)
        offloaded.extend(n.name for n in fwd.graph.nodes if n.name.startswith("cpu_offload_"))

    monkeypatch.setattr(activation_offloading, "enable_activation_offloading", spy)
    before = _compiled.MARKS.values
    _step(TINY_GPT, "torch-compiled-offload")
    assert _compiled.MARKS.values > before
    # Blocks 1 and 2 read the outputs of blocks 0 and 1; every block reads x0, which the
    # partitioner saves as the embedding (and the norm's scale, which the CPU also moves).
    assert "cpu_offload_embedding" in offloaded
    assert len([n for n in offloaded if n.startswith("cpu_offload_add")]) == TINY_GPT.depth - 1
    offloaded.clear()
    _step(TINY_GPT, "torch-compile")
    assert offloaded == []  # the baseline compiles without the offload


def test_torch_compiled_offload_reports_an_old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_compiled, "TORCH_COMPILED_OFFLOAD", False)
    reason = get_strategy("torch-compiled-offload").unavailable_reason(CPU)
    assert reason is not None
    assert "2.11" in reason
    rows = {
        r["strategy"]: r
        for r in run_paired(TINY_GPT, ["torch", "torch-compiled-offload"], CPU, 1, 0)
    }
    assert rows["torch-compiled-offload"]["status"] == "skipped"
    assert rows["torch-compiled-offload"]["note"] == reason
    assert rows["torch"]["status"] == "ok"


def test_matepoint_compile_says_when_it_ran_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where matepoint's compiled path is off (torch older than its gate), the row says so."""
    import matepoint_compat._compile as compat_compile

    monkeypatch.setattr(compat_compile, "COMPILED_OFFLOAD", False)
    monkeypatch.setattr(matepoint_compat, "COMPILED_OFFLOAD", False)
    ref_loss, ref_grads, _ = _step(TINY_GPT, "torch")
    loss, grads, report = _step(TINY_GPT, "matepoint-compile")
    assert report["matepoint_path"] == "eager, graph breaks"
    assert report["graph_breaks"] > 0
    assert report["graphs_after_first_forward"] == 0
    assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert _close(grads, ref_grads)


def _worker_json(capsys: pytest.CaptureFixture[str], args: list[str]) -> dict[str, Any]:
    assert bench.main(args) == 0
    result: dict[str, Any] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return result


def test_worker_paired_json_alternates_compiled_strategies(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One model, the three compiled strategies and torch's, alternating: no recompiles."""
    # The window counts are the process's: start them at 0 for this run.
    for field in dataclasses.fields(forward_window.FORWARD_WINDOW_COUNTS):
        monkeypatch.setattr(forward_window.FORWARD_WINDOW_COUNTS, field.name, 0)
    args = ["--worker", "paired", "--workload", "cpu-small", "--device", "cpu", "--rounds", "2"]
    args += ["--warmup", "0", "--compile-backend", "aot_eager", *TINY_ARGS]
    args += ["--strategies", ",".join(["torch", *COMPILED])]
    rows = {r["strategy"]: r for r in _worker_json(capsys, args)["rows"]}
    assert list(rows) == ["torch", *COMPILED]
    ran = [name for name in COMPILED if name != "torch-compiled-offload" or TORCH_OFFLOAD]
    for name in ran:
        row = rows[name]
        assert row["status"] == "ok", row
        assert len(row["times"]) == 2  # the compile step is not timed
        assert row["ratio"] is not None
        assert row["ratio_to_torch_compile"]["rounds"] == 2  # the same-mode baseline
        compiled = row["compile"]
        assert compiled["backend"] == "aot_eager"
        assert compiled["graphs_after_first_forward"] == 0
        assert 0 < compiled["first_forward_s"] < row["compile_step_s"]
    assert rows["torch-compile"]["ratio_to_torch_compile"]["median"] == 1.0
    assert rows["matepoint-compile"]["compile"]["matepoint_path"] == MATEPOINT_PATH
    if TORCH_OFFLOAD:
        assert rows["torch-compiled-offload"]["compile"]["marked_for_offload"] > 0
    else:
        assert rows["torch-compiled-offload"]["status"] == "skipped"
    assert "compile" not in rows["torch"]
    assert "ratio_to_torch_compile" not in rows["torch"]
    notes = report.compile_notes(list(rows.values()))
    assert len(notes) == len(ran)
    assert notes[-1].startswith("cpu-small / matepoint-compile (paired): aot_eager, ")
    assert f"matepoint_path {MATEPOINT_PATH}, " in notes[-1]
    if matepoint_compat.COMPILED_OFFLOAD:  # on the CPU the copies are synchronous: no window
        # The inductor_order counts are the process's (earlier tests may compile with inductor).
        assert re.search(
            r", forward_window 0 of 0 waits moved in 0 graphs, inductor_order kept in \d+ of "
            r"\d+ graphs \(peak-memory reorder off\), step / ",
            notes[-1],
        )
    assert ", fx_graph_cache not used, " in notes[-1]  # aot_eager: no inductor cache


@pytest.mark.parametrize("strategy", COMPILED)
def test_worker_train_json_compiled(capsys: pytest.CaptureFixture[str], strategy: str) -> None:
    if get_strategy(strategy).unavailable_reason(CPU) is not None:
        pytest.skip(f"{strategy} cannot run on this torch")
    args = ["--worker", "train", "--workload", "cpu-small", "--device", "cpu", "--steps", "1"]
    result = _worker_json(capsys, [*args, "--warmup", "0", "--strategy", strategy, *TINY_ARGS])
    assert result["status"] == "ok", result
    assert result["compile"]["graphs_after_first_forward"] == 0
    assert result["compile"]["calls"] == 3  # the compile step, the timed step, the counted one
    assert result["compile_step_s"] > result["compile"]["first_forward_s"] > 0
    assert "held_after_forward_bytes" in result  # None on the CPU, measured on CUDA
    assert "timeline" not in result


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["torch-compiled-offload", "matepoint-compile"])
def test_compiled_offload_holds_less_than_torch_compile_on_cuda(
    capsys: pytest.CaptureFixture[str], strategy: str
) -> None:
    held = {}
    for name in ("torch-compile", strategy):
        args = ["--worker", "train", "--workload", "deep48", "--device", "cuda", "--steps", "1"]
        args += ["--warmup", "1", "--depth", "6", "--batch", "1", "--strategy", name]
        result = _worker_json(capsys, args)
        assert result["status"] == "ok", f"{result.get('note')}\n{result.get('traceback')}"
        held[name] = result["held_after_forward_bytes"]
    assert held[strategy] < held["torch-compile"]
