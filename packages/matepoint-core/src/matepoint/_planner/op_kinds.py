"""What each checkpointed region computes, op by op, and what recomputing each kind of op costs.

A budget plan (``matepoint._planner.search``) decides per kind of op inside the checkpointed regions
whether its outputs are kept on the device, offloaded to host memory, or recomputed. This module
gives it the two things it ranks the kinds by: the bytes an op's outputs hold, and the FLOPs
recomputing them takes (torch's flop counter, no GPU needed), summed per kind over a step. It
also counts each region's ops between its module calls, from which the search charges a plan's
policy the ops its scoped modes will see (Note [The budget search], rule 2).

Note [Op kinds]
    Rule 1. Ops are grouped by what a selective-checkpoint policy can see of them before they
        run (the function and its inputs), so the same key names them when profiled and when
        the policy decides.
    Rule 2. The kinds are ``"attention"`` (every scaled-dot-product attention kernel),
        ``"matmul KxN"`` (matrix products by their inner and output width, so a block's
        projections are told apart: a transformer has a few such shapes, each repeated in every
        block) and ``"other"`` (elementwise work, norms, views: cheap to recompute per byte, so
        never ranked nor worth keeping).
    Rule 3. A kind that runs more than once in a region (a SwiGLU's gate and up projections
        share a shape) is split by its order there into classes ``"matmul KxN #1"``, ``"#2"``,
        ... which a plan decides one by one: a policy counts the ops of each kind it has seen in
        its region, in forward and in the recomputation apart.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import matepoint_compat as compat
from matepoint._planner.scoped_modes import ops_in_windows, window_runs
from matepoint._planner.trace import tensors_in

__all__ = ["KindProfile", "RegionProfiler", "named_kind", "occurrence_class", "op_kind"]

# The ops torch's selective-checkpoint modes run without asking the policy (none before torch
# named them).
_UNASKED: Any = getattr(torch_checkpoint, "SAC_IGNORED_OPS", frozenset())
_MATMULS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})
# The matrix operands' positions: addmm and baddbmm take the bias first.
_BIAS_FIRST = frozenset({"addmm", "baddbmm"})


@functools.cache
def _named_kind(packet: Any) -> str:
    """What an op's name alone says of its kind: attention, a matrix product, or other.

    Cached per op: a plan's policy asks for every op of every region, in training's hot path.
    """
    name: str = packet.__name__
    if "scaled_dot_product" in name or name.endswith("attention_forward"):
        return "attention"
    if name in _BIAS_FIRST:
        return "bias first"
    return "matmul" if name in _MATMULS else "other"


# Per op, by its id: the op and what its name says of its kind (_named_kind). Holding the op
# keeps its id from naming another; an op lives as long as torch anyway. A policy asks for every
# op of every region, and an op's attribute and its packet's hash each cost a Python call.
_NAMED_KINDS: dict[int, tuple[Any, str]] = {}


def named_kind(func: Any) -> str:
    """What an op's name alone says of its kind: ``"attention"``, ``"matmul"`` or ``"bias
    first"`` (matrix products), or ``"other"``."""
    cached = _NAMED_KINDS.get(id(func))
    if cached is None:
        cached = _NAMED_KINDS[id(func)] = (func, _named_kind(func.overloadpacket))
    return cached[1]


def op_kind(func: Any, args: tuple[Any, ...]) -> str:
    """Name the kind of an op call from what a policy sees of it (Note [Op kinds], rules 1, 2)."""
    named = named_kind(func)
    if named in ("matmul", "bias first"):
        left, right = (args[1], args[2]) if named == "bias first" else (args[0], args[1])
        if isinstance(left, torch.Tensor) and isinstance(right, torch.Tensor):
            return f"matmul {left.shape[-1]}x{right.shape[-1]}"
        return "other"
    return named


@dataclasses.dataclass(frozen=True)
class KindProfile:
    """One class of op across the checkpointed regions of a step.

    Attributes:
        kind: Its name: a kind, or one occurrence of a kind repeated in a region (Note [Op
            kinds]).
        calls: How many times it runs in one forward.
        output_bytes: Bytes its outputs hold over the whole step.
        flops: FLOPs of its forward calls (what recomputing them costs).
        recomputed: How many of its calls backward's recomputation runs again when nothing
            is kept: 0 for an op after everything backward reads from a region (torch's
            recomputation stops there), whose outputs are not worth keeping or offloading.
    """

    kind: str
    calls: int
    output_bytes: int
    flops: int
    recomputed: int = 0

    @property
    def flops_per_byte(self) -> float:
        """Recompute FLOPs saved per byte kept: the ranking of Note [The budget search], rule 1."""
        return self.flops / max(self.output_bytes, 1)


def occurrence_class(kind: str, occurrence: int) -> str:
    """The class of the ``occurrence``-th op of ``kind`` in a region (Note [Op kinds], rule 3)."""
    return f"{kind} #{occurrence}"


@dataclasses.dataclass
class _Stretches:
    """One region's ops between its module events, stretch ``g`` before event ``g`` (Note
    [Scoped selective-checkpoint modes], rule 4, in ``matepoint._planner.scoped_modes``).

    Attributes:
        kinds: Per stretch of forward, the kinds of op it ran, ``"other"`` left out.
        ops: Per stretch of forward, its ops.
        asked: Per stretch of forward, its ops a policy is asked about: torch's modes pass a
            few (a detach) straight on, and a stretch of those alone parts no windows.
        recomputed: Per stretch of the recomputation, its ops, up to where torch stopped it.
    """

    kinds: list[set[str]] = dataclasses.field(default_factory=lambda: [set()])
    ops: list[int] = dataclasses.field(default_factory=lambda: [0])
    asked: list[int] = dataclasses.field(default_factory=lambda: [0])
    recomputed: list[int] = dataclasses.field(default_factory=lambda: [0])

    def policy_ops(self, scoped: frozenset[str] | None) -> int:
        """The ops torch's modes see in forward and in the recomputation where a policy keeps
        or offloads ops of the kinds ``scoped`` (all of them where None: the plan decides
        ``"other"``): those of the windows the modes would learn (Note [Scoped
        selective-checkpoint modes], rules 2 to 5)."""
        if scoped is None:
            return sum(self.ops) + sum(self.recomputed)
        holding = [stretch for stretch, kinds in enumerate(self.kinds) if kinds & scoped]
        empty = {stretch for stretch, asked in enumerate(self.asked) if not asked}
        runs = window_runs(holding, empty)
        return ops_in_windows(self.ops, runs) + ops_in_windows(self.recomputed, runs)


class RegionProfiler:
    """A ``context_fn`` for every checkpoint call of a step that profiles each region's forward.

    Each call gives its region a dispatch mode as the forward context, so it sees exactly the
    ops a selective-checkpoint policy would be asked about, and no others, and one as the
    recomputation's context, which counts the ops backward runs again. Both count them per
    stretch between the region's module events, so that a plan's policy is charged the ops its
    scoped modes will see (:meth:`policy_ops`).
    """

    def __init__(self) -> None:
        self.regions = 0
        self.ops = 0
        # Per kind and occurrence in its region: calls, output bytes, FLOPs and calls
        # recomputed, as first seen.
        self.totals: dict[tuple[str, int], list[int]] = {}
        self.repeated: set[str] = set()
        self.stretches: list[_Stretches] = []  # per region, in call order
        self.charged: dict[tuple[int, frozenset[str] | None], int] = {}

    def __call__(self) -> tuple[Any, Any]:
        self.regions += 1
        stretches = _Stretches()
        self.stretches.append(stretches)
        return (
            _RegionMode(self, stretches, recompute=False),
            _RegionMode(self, stretches, recompute=True),
        )

    def policy_ops(self, region: int, scoped: frozenset[str] | None) -> int:
        """The ops torch's modes see in region ``region``, forward and recomputation, where its
        policy keeps or offloads ops of the kinds ``scoped``, None for all (Note [The budget
        search], rule 2, in ``matepoint._planner.search``); 0 past the regions profiled."""
        if not 0 <= region < len(self.stretches):
            return 0
        key = (region, scoped)
        charged = self.charged.get(key)
        if charged is None:
            charged = self.charged[key] = self.stretches[region].policy_ops(scoped)
        return charged

    def kinds(self) -> list[KindProfile]:
        """The classes of op seen that hold bytes, best to keep first (Note [Op kinds], rule 3)."""
        kinds = [
            KindProfile(
                occurrence_class(kind, occurrence) if kind in self.repeated else kind, *totals
            )
            for (kind, occurrence), totals in self.totals.items()
        ]
        return sorted(kinds, key=lambda kind: kind.flops_per_byte, reverse=True)


class _RegionMode(compat.TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts every op of one region's forward, or of its recomputation, into its profiler.

    The recomputation runs a region's ops in forward's order up to where it stops, so the
    ``n``-th op of a kind there is the ``n``-th of forward.
    """

    def __init__(self, profiler: RegionProfiler, stretches: _Stretches, recompute: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.profiler = profiler
        self.recompute = recompute
        self.seen: collections.Counter[str] = collections.Counter()
        # Ops per stretch between module events: the recomputation's, or forward's.
        self.ops = stretches.recomputed if recompute else stretches.ops
        self.kinds = stretches.kinds
        self.asked = stretches.asked
        self.handles: list[Any] = []

    def __enter__(self) -> Any:
        """Count the module events of the region from here, on this thread, as the recording
        of Note [Scoped selective-checkpoint modes] does (rule 4)."""
        thread = threading.get_ident()

        def event(*arguments: Any) -> None:
            if threading.get_ident() == thread:
                self.ops.append(0)
                if not self.recompute:
                    self.kinds.append(set())
                    self.asked.append(0)

        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(event),
            torch.nn.modules.module.register_module_forward_hook(event),
        ]
        return super().__enter__()  # type: ignore[no-untyped-call]

    def __exit__(self, *exc_info: Any) -> Any:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        return super().__exit__(*exc_info)  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = op_kind(func, args)
        self.seen[kind] += 1
        self.ops[-1] += 1
        profiler = self.profiler
        if self.recompute:
            totals = profiler.totals.get((kind, self.seen[kind]))
            if totals is not None:
                totals[3] += 1
            return out
        if kind != "other":
            self.kinds[-1].add(kind)
        if func not in _UNASKED:
            self.asked[-1] += 1
        profiler.ops += 1
        if self.seen[kind] > 1:
            profiler.repeated.add(kind)
        output_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors_in(out))
        if kind != "other" and output_bytes:
            totals = profiler.totals.setdefault((kind, self.seen[kind]), [0, 0, 0, 0])
            totals[0] += 1
            totals[1] += output_bytes
            totals[2] += compat.op_flops(func, args, kwargs, out)
        return out
