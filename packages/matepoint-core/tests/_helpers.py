"""Small models and checks shared by the engine tests (fixtures live in conftest.py).

The tests run matepoint's engine on the CPU through :class:`matepoint.testing.CPUTestTransport`,
which treats CPU tensors as device tensors and defers every copy to an explicit sync point.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint
from matepoint._compiled import regions
from matepoint._engine import channel_engine as _engine
from matepoint._engine import engines as _engines_table
from matepoint.testing import CPUTestTransport

WIDTH = 16


def engine_of(transport: CPUTestTransport) -> _engine.ChannelEngine:
    """Return the engine that offloads through ``transport`` (after at least one offload)."""
    engine = _engines_table._engines.get(("cpu-test", id(transport)))
    assert engine is not None, "nothing was offloaded through this transport"
    return engine


def settle() -> matepoint.OffloadStats:
    """Collect garbage and return fresh stats."""
    gc.collect()
    return matepoint.stats()


def assert_nothing_leaked() -> None:
    """No offloaded tensor is alive and no pinned block is in use, on any engine."""
    snapshot = settle()
    assert snapshot.live_records == 0
    assert snapshot.pool_in_use_bytes == 0
    assert snapshot.device_bytes_held == 0


class Stack(torch.nn.Module):
    """``depth`` small tanh-MLP blocks; ``forward`` checkpoints each with ``checkpoint_fn``."""

    def __init__(self, depth: int = 4, width: int = WIDTH, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.blocks = torch.nn.ModuleList()
        for _ in range(depth):
            layer = torch.nn.Linear(width, width)
            with torch.no_grad():
                layer.weight.copy_(torch.randn(width, width, generator=generator) / width**0.5)
                layer.bias.copy_(torch.randn(width, generator=generator) * 0.1)
            self.blocks.append(layer)

    def forward(
        self, x: torch.Tensor, checkpoint_fn: Callable[..., Any] | None = None
    ) -> torch.Tensor:
        # x * 1 gives the first checkpoint an input that dies with the graph, like an activation.
        h = x * 1
        for block in self.blocks:
            h = _block(block, h) if checkpoint_fn is None else checkpoint_fn(_block, block, h)
        return h


def _block(layer: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    return torch.tanh(layer(h)) + h


def torch_ckpt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """torch's own non-reentrant checkpoint, the reference."""
    return torch_checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


def mate_ckpt(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return matepoint.checkpoint(function, *args, **kwargs)


def grads_of(
    model: torch.nn.Module,
    x: torch.Tensor,
    checkpoint_fn: Callable[..., Any] | None,
) -> list[torch.Tensor]:
    """One forward and backward; return the gradients of the input and every parameter."""
    model.zero_grad(set_to_none=True)
    leaf = x.detach().clone().requires_grad_(True)
    out = model(leaf, checkpoint_fn)
    out.square().sum().backward()
    assert leaf.grad is not None
    return [leaf.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_grads_equal(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected, strict=True):
        assert not torch.isnan(got).any(), "NaN in a gradient: a copy was read before it completed"
        torch.testing.assert_close(got, want, rtol=0, atol=0)


T = TypeVar("T")


def run_in_threads(step: Callable[[int], T], threads: int, steps: int) -> list[list[T]]:
    """Run ``step(index)`` ``steps`` times in each of ``threads`` threads released together.

    Returns each thread's results in order. Re-raises the first error any thread hit, once all
    threads have ended.
    """
    results: list[list[T]] = [[] for _ in range(threads)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def work(index: int) -> None:
        try:
            barrier.wait()
            for _ in range(steps):
                results[index].append(step(index))
        except BaseException as error:
            errors.append(error)

    workers = [threading.Thread(target=work, args=(index,)) for index in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]
    return results


class CapturingBackend:
    """aot_eager (min-cut partitioner, no compiler) that keeps the partitioned forward graphs."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.forward_graphs: list[torch.fx.GraphModule] = []

        def forward_compiler(graph: torch.fx.GraphModule, inputs: Any) -> Any:
            self.forward_graphs.append(graph)
            return make_boxed_func(graph.forward)

        def backward_compiler(graph: torch.fx.GraphModule, inputs: Any) -> Any:
            return make_boxed_func(graph.forward)

        self.backend = aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=backward_compiler,
            partition_fn=min_cut_rematerialization_partition,
            keep_inference_input_mutations=True,
        )

    def __call__(self, graph: torch.fx.GraphModule, inputs: Any) -> Any:
        return self.backend(graph, inputs)

    def offloaded(self) -> list[str]:
        """The values the forward graphs send to the host."""
        return [name for graph in self.forward_graphs for name in regions.offloaded_nodes(graph)]

    def saved(self) -> list[str]:
        """Names of what the forward graphs return (outputs and saved values)."""
        names = []
        for graph in self.forward_graphs:
            (output,) = [node for node in graph.graph.nodes if node.op == "output"]
            names += [getattr(value, "name", "") for value in output.args[0]]
        return names
