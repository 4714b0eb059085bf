"""The compiled strategies' machinery: the whole model under ``torch.compile``, per strategy.

Three strategies of :mod:`matepoint_examples.strategies` compile the whole model (loss included)
with every block checkpointed: torch's checkpoint (the same-mode baseline), torch's checkpoint
with torch's own compiled activation offloading, and matepoint's checkpoint with its opt-in
compiled path. In a paired run they share one model and alternate step by step, so:

- Each strategy compiles its own copy of :func:`_forward`, a copy with its own code object.
  Dynamo keeps its cache, and counts recompiles against its limit, per code object; one copy per
  strategy keeps the strategies' graphs apart, so alternating them recompiles nothing (the
  strategy's checkpoint function, read through the model's switch, is among the guards, and a
  copy only ever runs with its own strategy current).
- Each compiles under its own settings of AOTAutograd's activation offloading
  (``torch._functorch.config``): torch's defaults plus the strategy's changes, applied around
  each of its forwards. They are process-wide and read when a graph is compiled (the first
  forward, or a recompile); a forward that runs a cached graph does not read them.
- The first forward compiles (and the first backward compiles the backward graph), so compiled
  strategies need at least one untimed warm-up step; :class:`CompiledForward` counts the graphs
  compiled after the first call, which should stay 0.

torch's compiled offloading (``torch._functorch._activation_offloading``) moves a saved forward
value to the host when the joint graph marks it ``meta["should_offload"]``; nothing in torch 2.13
sets that mark for a checkpoint (``CheckpointPolicy.MUST_CPU_OFFLOAD`` and ``PREFER_CPU_OFFLOAD``
exist, but nothing turns them into that mark: in a compiled graph they only keep a node from
being forced to recompute, and eager mode recomputes them), so the way torch's own tests use
the offloading is a ``joint_custom_pass`` that sets the mark. :func:`mark_checkpoint_inputs`
marks what matepoint would move: the values a checkpoint region reads from outside it (the
block inputs, and what the partitioner may save in their place), of at least matepoint's
default ``min_offload_bytes``. The partitioner then offloads the ones it saves.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
import types
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import matepoint
import matepoint_compat
from matepoint._compiled import regions
from matepoint_examples.bench._compile_caches import CompileStepCaches

__all__ = [
    "TORCH_COMPILED_OFFLOAD",
    "CompileSpec",
    "CompiledForward",
    "cacheable_rng_settings",
    "default_backend",
    "mark_checkpoint_inputs",
    "torch_offload_session",
    "torch_offload_settings",
    "torch_offload_unavailable",
]

_OFFLOAD_SETTINGS = {
    "enable_activation_offloading": False,
    "activation_offload_separate_stream": False,
    "activation_offload_sink_wait": False,
    "activation_reload_prefetch": False,
    "joint_custom_pass": None,
}
"""torch's defaults of the AOTAutograd settings the compiled strategies change."""

# Gate for every private torch symbol of the torch-compiled-offload strategy: the settings above
# (``torch._functorch.config``), the module ``torch._functorch._activation_offloading`` and, where
# it exists (2.13), its ``offload_ops.pinned_memory_pool``, and the joint graph's node metadata
# (``meta["ac_graph_id"]`` on checkpointed nodes, ``meta["should_offload"]`` read by the
# partitioner). Checked on torch 2.13 (CPU, aot_eager: the pass marks, the partitioner offloads,
# gradients bitwise those of torch-compile); torch 2.11, the H200 machine's, has the same settings
# and module (its first GPU run confirms the rest). It becomes a plain version gate, and then
# always true, when the oldest supported torch is 2.11.
TORCH_COMPILED_OFFLOAD: bool = matepoint_compat.TORCH_2_11_PLUS
"""Whether this torch is a release the ``torch-compiled-offload`` strategy is written for."""


def cacheable_rng_settings(device: torch.device) -> dict[str, Any]:
    """Return the AOTAutograd setting that lets every compiled strategy's graphs be cached.

    Under compile, a checkpointed region's random ops are replayed in backward with the state
    the forward saved (functionalized RNG). On CUDA, scaled dot-product attention's fused
    kernels count as random ops (tagged ``nondeterministic_seeded``, dropout or not), so every
    transformer block has one. By default torch wraps each in ``graphsafe_run_with_rng_state``,
    the form CUDA graphs can capture; before torch 2.13 that operator is not cacheable, so
    inductor bypasses its FX graph cache and AOTAutograd saves nothing: each process compiles
    from scratch (minutes on the deep workloads). The bench runs no CUDA graphs, so on those
    releases its compiled strategies all use torch's plain form (``run_and_save_rng_state``,
    replayed bitwise the same way, and cacheable). Every compiled strategy gets the same
    setting, so paired ratios among them compare like with like.

    Args:
        device: Where the model runs.

    Returns:
        The change to ``torch._functorch.config``, or none (a CPU, torch 2.13+, or a torch
        without the CUDA-graph-safe form).
    """
    if (
        device.type == "cuda"
        and not matepoint_compat.TORCH_2_13_PLUS
        and hasattr(_functorch_config(), "graphsafe_rng_functionalization")
    ):
        return {"graphsafe_rng_functionalization": False}
    return {}


def _functorch_config() -> Any:
    """Return ``torch._functorch.config`` (private: AOTAutograd's settings)."""
    import torch._functorch.config as config

    return config


def torch_offload_unavailable(device: torch.device) -> str | None:
    """Say why torch's compiled activation offloading cannot run here, or ``None``.

    Args:
        device: The device the run would use (any: on a CPU the copies are synchronous).

    Returns:
        A short reason, or ``None``.
    """
    del device
    if not TORCH_COMPILED_OFFLOAD:
        return f"torch {torch.__version__}: compiled activation offloading needs torch 2.11+"
    config = _functorch_config()
    missing = [name for name in _OFFLOAD_SETTINGS if not hasattr(config, name)]
    if importlib.util.find_spec("torch._functorch._activation_offloading") is None:
        missing.append("torch._functorch._activation_offloading")
    if missing:
        return f"torch {torch.__version__} lacks {', '.join(missing)}"
    return None


def default_backend(device: torch.device) -> str:
    """Return the compile backend used unless one is named: inductor on CUDA, else aot_eager.

    ``aot_eager`` traces and partitions like inductor (so checkpointing and the offload pass run)
    but executes the graphs eagerly: no C++ toolchain needed, and quick to compile on a CPU.
    """
    return "inductor" if device.type == "cuda" else "aot_eager"


@dataclass
class _Marks:
    """What :func:`mark_checkpoint_inputs` marked in the graphs compiled so far."""

    values: int = 0
    bytes: int = 0


MARKS = _Marks()
"""Running totals of :func:`mark_checkpoint_inputs` (reported in the strategy's row)."""


def _offloadable(node: torch.fx.Node) -> int:
    """Bytes of a forward value worth marking, or 0 (a view, or below the minimum size)."""
    value = node.meta.get("val")
    if not isinstance(value, Tensor) or value._is_view():  # the partitioner never moves a view
        return 0
    if node.target is torch.ops.aten.alias.default:  # nor an alias (not always a view here)
        return 0
    nbytes = value.numel() * value.element_size()
    minimum = 0 if value.device.type == "cpu" else matepoint.OffloadSettings().min_offload_bytes
    return nbytes if nbytes >= max(minimum, 1) else 0


def mark_checkpoint_inputs(gm: torch.fx.GraphModule, joint_inputs: Any) -> torch.fx.GraphModule:
    """Mark checkpoint inputs for torch's activation offloading (a ``joint_custom_pass``).

    Nodes of a checkpoint region carry ``meta["ac_graph_id"]`` in the joint graph. A value is a
    checkpoint input when it is computed in the forward graph (not a graph input: parameters and
    the batch belong to the caller) and a forward node of a region other than the value's own
    reads it. The partitioner may save an earlier value of the computation outside the regions
    that produces an input, and recompute the rest in backward (nanochat's ``x0``, the normed
    embedding, is saved as the embedding and the norm's scale), so the values that computation
    reads are marked too, back to the regions' outputs and the graph inputs. On a CUDA device
    only values of at least matepoint's default ``min_offload_bytes`` are marked; on a CPU every
    one (as matepoint's CPU session does). The partitioner offloads a marked value only if it
    saves it, and never a view or a model output.

    Args:
        gm: The joint forward and backward graph.
        joint_inputs: Its inputs (unused).

    Returns:
        ``gm``, marked.
    """
    del joint_inputs
    forward = regions.forward_nodes(gm.graph)
    starts = [
        node
        for node in gm.graph.nodes
        if node.op == "call_function"
        and node in forward
        and any(
            user in forward
            and user.meta.get("ac_graph_id", node.meta.get("ac_graph_id"))
            != node.meta.get("ac_graph_id")
            for user in node.users
        )
    ]
    seen: set[torch.fx.Node] = set()
    for start in starts:
        producers = [node for node, _ in regions.producers_outside_regions(start)]
        for node in [start, *producers]:
            if node in seen:
                continue
            seen.add(node)
            nbytes = _offloadable(node)
            if nbytes:
                regions.mark_for_offload(node)
                MARKS.values += 1
                MARKS.bytes += nbytes
    return gm


def torch_offload_settings(device: torch.device) -> dict[str, Any]:
    """Return torch's compiled offloading of checkpoint inputs, as strong as it is fair.

    On CUDA the copies run on torch's transfer stream and backward's reloads are moved earlier
    by their estimated transfer time (``activation_offload_separate_stream``,
    ``activation_reload_prefetch``). ``activation_offload_sink_wait`` stays off: it moves every
    forward wait to the end of the graph, which keeps every offloaded value on the device until
    the whole forward ends (torch's own docstring says so for a whole-model compile), so device
    memory would grow with depth as under plain checkpointing. On a CPU the copies are
    synchronous (no streams), and so they are on torch 2.11: its transfer-stream offload does not
    compile there (``streams::record_stream``'s fake implementation takes the wrong arguments).
    matepoint's compiled path mends that op before it uses the stream on 2.11; this strategy is
    torch's offload as torch ships it, so it does not ask for the stream there (in a process
    where matepoint has mended the op, it would compile, which would make the row depend on the
    order the strategies compiled in).

    Args:
        device: Where the model runs.

    Returns:
        The changes to ``torch._functorch.config``.
    """
    cuda = device.type == "cuda" and matepoint_compat.TORCH_2_12_PLUS
    return {
        "enable_activation_offloading": True,
        "activation_offload_separate_stream": cuda,
        "activation_reload_prefetch": cuda,
        "joint_custom_pass": mark_checkpoint_inputs,
    }


def torch_offload_session(device: torch.device) -> AbstractContextManager[object]:
    """Reuse pinned host buffers across steps where torch offers it.

    torch 2.13's asynchronous offload allocates a fresh pinned buffer per copy unless its
    ``offload_ops.pinned_memory_pool`` is entered; releases without the pool run as they are.

    Args:
        device: Where the model runs (the pool is for CUDA's asynchronous copies only).

    Returns:
        The pool's context, or one that does nothing.
    """
    if device.type != "cuda":
        return contextlib.nullcontext()
    try:
        from torch._functorch._activation_offloading import offload_ops
    except ImportError:
        return contextlib.nullcontext()
    pool: Callable[[], AbstractContextManager[object]] | None
    pool = getattr(offload_ops, "pinned_memory_pool", None)
    return contextlib.nullcontext() if pool is None else pool()


def _no_changes(device: torch.device) -> dict[str, Any]:
    return {}


def _available(device: torch.device) -> str | None:
    return None


@dataclass(frozen=True)
class CompileSpec:
    """How a strategy compiles the model (see the module docstring).

    Args:
        settings: Given the device, the changes to ``torch._functorch.config`` the strategy
            compiles under, on top of torch's defaults of the offloading settings.
        unavailable: Given the device, why this torch cannot run the strategy, or ``None``.
        report: Extra facts for the strategy's row, read after its run (JSON-ready).
    """

    settings: Callable[[torch.device], dict[str, Any]] = _no_changes
    unavailable: Callable[[torch.device], str | None] = _available
    report: Callable[[], dict[str, Any]] | None = field(default=None)


def _forward(loss: Callable[[], Tensor]) -> Tensor:
    """Run one forward; what a compiled strategy compiles (each a copy, see the module doc)."""
    return loss()


def _private_copy(function: Callable[..., Tensor], tag: str) -> Callable[..., Tensor]:
    """Return ``function`` with a code object of its own (so Dynamo caches it on its own)."""
    if not isinstance(function, types.FunctionType):
        raise TypeError(f"expected a plain function, got {type(function).__name__}")
    code = function.__code__
    name = f"{code.co_name}__{''.join(c if c.isalnum() else '_' for c in tag)}"
    return types.FunctionType(
        code.replace(co_name=name), function.__globals__, name, function.__defaults__
    )


def _dynamo_counts() -> tuple[int, int]:
    """Graphs Dynamo has compiled and graph breaks it has met in this process, so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


class CompiledForward:
    """One strategy's compiled forward of one model: ``loss`` under ``torch.compile``.

    Args:
        loss: The workload's forward (returns the loss); compiled, not changed.
        tag: The strategy's name (names the code object Dynamo sees).
        spec: How the strategy compiles.
        device: Where the model runs.
        backend: The ``torch.compile`` backend. Default: :func:`default_backend`.
    """

    def __init__(
        self,
        loss: Callable[[], Tensor],
        tag: str,
        spec: CompileSpec,
        device: torch.device,
        backend: str | None = None,
    ) -> None:
        self.loss = loss
        self.spec = spec
        self.backend = backend or default_backend(device)
        self.settings = {
            name: value
            for name, value in {
                **_OFFLOAD_SETTINGS,
                **cacheable_rng_settings(device),
                **spec.settings(device),
            }.items()
            if hasattr(_functorch_config(), name)
        }
        self.compiled = torch.compile(
            _private_copy(_forward, tag), backend=self.backend, dynamic=False
        )
        self.calls = 0
        self.first_call_s: float | None = None
        self.graphs = 0
        self.graphs_after_first_call = 0
        self.graph_breaks = 0
        self.caches = CompileStepCaches()

    def end_compile_step(self) -> None:
        """Say what the compile caches did from the first call until now (once).

        Call it when the compile step (the first forward and its backward) is over, before
        another strategy compiles: the counts and logged reasons are the process's, so a step
        settled later would take in the other strategy's. The next call settles a step not
        ended this way.
        """
        self.caches.end()

    def __call__(self) -> Tensor:
        """Run one forward through the compiled copy (compiling it on the first call)."""
        graphs, breaks = _dynamo_counts()
        if self.calls == 0:
            self.caches.start()
        else:  # the compile step (first forward and its backward) is over
            self.end_compile_step()
        t0 = time.perf_counter()
        with _functorch_config().patch(self.settings):
            out: Tensor = self.compiled(self.loss)
        graphs_now, breaks_now = _dynamo_counts()
        if self.calls == 0:
            self.first_call_s = time.perf_counter() - t0
        else:
            self.graphs_after_first_call += graphs_now - graphs
        self.calls += 1
        self.graphs += graphs_now - graphs
        self.graph_breaks += breaks_now - breaks
        return out

    def report(self) -> dict[str, Any]:
        """Return what the compiler did for this strategy (JSON-ready).

        Besides the graph counts: what the compile caches did in the compile step (the first
        forward and its backward, which compiles lazily; ended by :meth:`end_compile_step`), as
        :class:`~matepoint_examples.bench._compile_caches.CompileStepCaches` says. An AOTAutograd
        ``hit`` means the joint pass and the partitioner did not run in this process, so a
        strategy's marks count 0 (the row says so, as ``partitioner``); ``rng_replay`` says
        when :func:`cacheable_rng_settings` changed how random ops are replayed.
        """
        self.end_compile_step()
        info: dict[str, Any] = {
            "backend": self.backend,
            "calls": self.calls,
            "first_forward_s": self.first_call_s,
            "graphs": self.graphs,
            "graph_breaks": self.graph_breaks,
            "graphs_after_first_forward": self.graphs_after_first_call,
            **self.caches.report(),
        }
        if self.settings.get("graphsafe_rng_functionalization") is False:
            info["rng_replay"] = "plain, cacheable (see cacheable_rng_settings)"
        if self.caches.autograd_cache == "hit":
            info["partitioner"] = "not run in this process (cache hit), so its counts are 0"
        if self.spec.report is not None:
            info.update(self.spec.report())
        return info
