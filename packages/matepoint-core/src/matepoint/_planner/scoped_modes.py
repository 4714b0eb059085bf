"""torch's selective-checkpoint modes entered only around the parts of a region a plan decides.

A policy answers "recompute" for most ops of a region, yet torch's two modes send each through
Python, in forward and in the recomputation; scoped, every other op stays in C++.

Note [Scoped selective-checkpoint modes]
    Rule 1. torch's caching mode (forward) and cached mode (recomputation) match a region's
        ops by their order, per op: its ``n``-th call in one is its ``n``-th call in the other.
        They must see the same ops in both, not every op of the region: an op neither sees is
        recomputed, what a policy answering "recompute" asks for.
    Rule 2. A policy's scoped kinds are the kinds it keeps or offloads some op of (Note [Op
        kinds]); the others answer "recompute" whatever their count, so only the ops of scoped
        kinds need the modes. A plan that decides "other" (ops everywhere) keeps the modes over
        the whole region.
    Rule 3. Both contexts enter their mode at the region's start and leave it on until the
        region's first module call, whose module (the block, for a stack of blocks) names the
        region with the scoped kinds: what was learnt is kept per such pair, for as long as
        the module lives, whichever ``context_fn`` (a fresh one per call, one per block, or one
        counting its calls) made the contexts.
    Rule 4. Where nothing is learnt for the pair, the call runs the modes over the whole
        region and records the region's module calls in order (a forward pre-hook and a
        forward hook for every module, on the calling thread, from the first call on) and
        which stretches between two of them hold ops of scoped kinds. Those stretches, merged
        where no op parts them, are the region's windows: each opens at one module event and
        closes at a later one (or the region's end), an event named by its module, pre or
        post, and its number among that module's events.
    Rule 5. Where windows are learnt, each context registers hooks on their modules at the
        first module call, for its own life and thread, and enters its mode at each window's
        opening event and leaves it at its closing one; the recomputation by its forward's
        windows, whatever is learnt meanwhile. It runs the region's module calls in forward's
        order (a checkpoint's own requirement), so both modes see the same ops (rule 1), and
        the policy numbers each op of a scoped kind as over the whole region (Note [Op
        kinds], rule 3), every such op having run in a window.
    Rule 6. torch's cached mode resets its counts per op on entering (so that a second backward
        finds its entries consumed): the recomputation's context lets it on its first entry
        only, and keeps the counts across the windows after it.
    Rule 7. Every scoped forward checks that its policy saw as many ops of each scoped kind as
        the recording did. A pair that fails the check, whose windows' modules are gone, or
        whose recording met another dispatch mode above torch's at a module event, keeps the
        whole-region modes from then on. An op of a scoped kind that a later call runs outside
        every window (in a module call the recording did not see) is recomputed, as without a
        plan: the gradients stay torch's, only the memory kept differs.
    Rule 8. An exception (a forward that raises, the recomputation's early stop) may leave a
        window open: the context's exit leaves it, and removes its hooks either way.
    Rule 9. Under a tracer the modes cover the whole region (Note [A plan's regions], rule 5).
    Example: a Llama block whose plan keeps its QKV projection, attention and the SwiGLU's two
        up projections runs the modes from the QKV projection's pre-hook to the output
        projection's, and around each up projection: its norms, output and down projections
        and residual adds run in C++.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

__all__ = ["ScopedModes", "ops_in_windows", "scoped_contexts", "window_runs"]

# A module event's phase: its forward pre-hook or its forward hook.
_PRE, _POST = 0, 1
# What a pair keeps when it runs the modes over the whole region (Note [Scoped
# selective-checkpoint modes], rule 7).
_WHOLE = "whole"


@dataclasses.dataclass(frozen=True)
class _ModuleEvents:
    """One module's events that open or close a window: per phase, their numbers."""

    module: weakref.ref[nn.Module]
    opens: tuple[frozenset[int], frozenset[int]]
    closes: tuple[frozenset[int], frozenset[int]]


@dataclasses.dataclass(frozen=True)
class _Windows:
    """Where a region's modes are on (Note [Scoped selective-checkpoint modes], rule 4).

    Attributes:
        counts: Ops of each scoped kind the policy saw in the recorded forward.
        on_after_first: Whether the mode stays on after the region's first module event.
        modules: The modules whose events open or close a window.
    """

    counts: dict[str, int]
    on_after_first: bool
    modules: tuple[_ModuleEvents, ...]


# What is learnt per scoped kinds and first module (Note [Scoped selective-checkpoint modes],
# rule 3): windows or _WHOLE. The windows hold their modules weakly, so an entry dies with its
# module.
_LEARNT: dict[frozenset[str], weakref.WeakKeyDictionary[nn.Module, _Windows | str]] = {}
_LEARNT_LOCK = threading.Lock()


def _learn(kinds: frozenset[str], module: nn.Module, learnt: _Windows | str) -> None:
    """Keep what a forward learnt; threads may learn at once, under one lock."""
    with _LEARNT_LOCK:
        _LEARNT.setdefault(kinds, weakref.WeakKeyDictionary())[module] = learnt


def scoped_contexts(
    policy: Callable[..., Any], scoped_kinds: frozenset[str] | None, seen: dict[str, int]
) -> Any:
    """torch's selective-checkpoint contexts around ``policy``, scoped where the region allows.

    See Note [Scoped selective-checkpoint modes]. ``scoped_kinds`` None: the plan decides
    "other", and the modes cover the whole region (rule 2). ``seen`` is the policy's count of
    the ops of each kind it has seen in forward (rules 4 and 7).
    """
    modes = torch_checkpoint.create_selective_checkpoint_contexts(  # type: ignore[no-untyped-call]
        policy
    )
    if scoped_kinds is None:
        return modes
    return ScopedModes(modes, _Call(scoped_kinds, seen))


class ScopedModes:
    """The pair of contexts a checkpoint runs a region's forward and recomputation under.

    Iterates as the pair torch unpacks. ``modes`` is torch's pair inside it and
    ``with_modes`` puts another in its place (the offload wrapper of Note [Offloading what a
    selective policy saves] in ``matepoint._selective`` replaces torch's caching mode).
    """

    def __init__(self, modes: tuple[Any, Any], call: _Call) -> None:
        self.modes = modes
        self.call = call

    def with_modes(self, modes: tuple[Any, Any]) -> ScopedModes:
        """The same scoping around ``modes``; ``self`` where they are the pair it holds."""
        return self if modes is self.modes else ScopedModes(modes, self.call)

    def __iter__(self) -> Iterator[Any]:
        forward, recomputation = self.modes
        return iter((_Scoped(forward, self.call, False), _Scoped(recomputation, self.call, True)))


class _Call:
    """One checkpoint call's scoping, chosen by its forward and followed by its recomputation."""

    def __init__(self, kinds: frozenset[str], seen: dict[str, int]) -> None:
        self.kinds = kinds
        self.seen = seen
        self.first: nn.Module | None = None  # the region's first module
        # What the forward chose at its first module event: windows, _WHOLE, or a recording.
        self.plan: _Windows | str | _Recording = _WHOLE

    def choose(self, module: nn.Module, foreign: bool) -> _Windows | str | _Recording:
        """The forward's choice at the region's first module event (Note, rules 3 and 4);
        ``foreign``: another dispatch mode is above torch's there."""
        if foreign:
            self.plan = _WHOLE
            return self.plan
        self.first = module
        by_module = _LEARNT.get(self.kinds)
        learnt = None if by_module is None else by_module.get(module)
        if learnt is None:
            self.plan = _Recording(self.seen, self.kinds)
        elif isinstance(learnt, _Windows) and any(e.module() is None for e in learnt.modules):
            _learn(self.kinds, module, _WHOLE)  # See the Note's rule 7.
            self.plan = _WHOLE
        else:
            self.plan = learnt
        return self.plan

    def conclude(self) -> None:
        """After a forward without an exception: learn what it recorded, or check it (rule 7)."""
        first, plan = self.first, self.plan
        if first is None:
            return
        if isinstance(plan, _Recording):
            _learn(self.kinds, first, plan.windows())
            self.plan = _WHOLE  # what its recomputation runs; the record's modules let go
        elif isinstance(plan, _Windows):
            seen = self.seen
            if any(seen.get(kind, 0) != count for kind, count in plan.counts.items()):
                _learn(self.kinds, first, _WHOLE)


class _Switch:
    """Enters and leaves one of torch's modes at window boundaries, on one thread."""

    def __init__(self, mode: Any, recomputation: bool) -> None:
        self.mode = mode
        self.recomputation = recomputation
        self.entered = False
        self.depth = -1  # the dispatch-mode stack's length while the mode is on

    def open(self) -> None:
        """Enter the mode, its counts per op kept after its first entry (Note, rule 6)."""
        if self.depth >= 0:
            return
        counts = getattr(self.mode, "func_counter", None)
        kept = dict(counts) if self.entered and self.recomputation and counts else None
        self.mode.__enter__()
        if kept is not None:
            counts.update(kept)  # type: ignore[union-attr]
        self.entered = True
        self.depth = torch._C._len_torch_dispatch_stack()

    def close(self, *exc_info: Any) -> None:
        """Leave the mode where it is on; it must be the innermost mode."""
        if self.depth < 0:
            return
        if torch._C._len_torch_dispatch_stack() != self.depth:
            raise RuntimeError(
                "a dispatch mode entered inside a checkpointed region under a budget plan is "
                "still active where the plan's selective-checkpoint mode is left"
            )
        self.depth = -1
        self.mode.__exit__(*(exc_info or (None, None, None)))


def _event_hook(
    switch: _Switch, thread: int, opens: frozenset[int], closes: frozenset[int], number: int
) -> Callable[..., None]:
    """A module hook opening and closing windows at its numbered events on ``thread``;
    ``number`` events of its module and phase have happened already."""

    def hook(module: nn.Module, *arguments: Any) -> None:
        nonlocal number
        if threading.get_ident() != thread:
            return
        number += 1
        if number in opens:
            switch.open()
        elif number in closes:
            switch.close()

    return hook


class _Scoped:
    """One of torch's modes over a region, scoped by what its call chose (Note, rules 3-5)."""

    def __init__(self, mode: Any, call: _Call, recomputation: bool) -> None:
        self.switch = _Switch(mode, recomputation)
        self.call = call
        self.thread = -1
        self.base = 0  # the dispatch-mode stack's length outside the region
        self.handles: list[Any] = []

    def __enter__(self) -> _Scoped:
        self.thread = threading.get_ident()
        self.switch.entered = False
        self.base = torch._C._len_torch_dispatch_stack()
        self.switch.open()
        self.handles = [nn.modules.module.register_module_forward_pre_hook(self.first_event)]
        return self

    def first_event(self, module: nn.Module, arguments: Any) -> None:
        """At the region's first module call: scope the mode by the call's plan."""
        if threading.get_ident() != self.thread:
            return
        for handle in self.handles:
            handle.remove()
        self.handles = []
        call, switch = self.call, self.switch
        if switch.recomputation:
            plan = call.plan
        else:
            plan = call.choose(module, torch._C._len_torch_dispatch_stack() != switch.depth)
        if isinstance(plan, _Recording):
            if not switch.recomputation:
                self.handles = plan.start(module, self.thread, self.base, switch.mode)
        elif isinstance(plan, _Windows):
            self.handles = self.hooks(plan, module)
            if not plan.on_after_first:
                switch.close()

    def hooks(self, windows: _Windows, first: nn.Module) -> list[Any]:
        """Register the windows' module hooks; the first module's pre-hook counts its event."""
        switch, thread, handles = self.switch, self.thread, []
        for events in windows.modules:
            module = events.module()
            if module is None:
                continue  # gone since the call began: its windows never open
            if events.opens[_PRE] or events.closes[_PRE]:
                done = 1 if module is first else 0
                hook = _event_hook(switch, thread, events.opens[_PRE], events.closes[_PRE], done)
                handles.append(module.register_forward_pre_hook(hook, prepend=True))
            if events.opens[_POST] or events.closes[_POST]:
                hook = _event_hook(switch, thread, events.opens[_POST], events.closes[_POST], 0)
                handles.append(module.register_forward_hook(hook, prepend=True))
        return handles

    def __exit__(self, *exc_info: Any) -> None:
        handles, self.handles = self.handles, []
        for handle in handles:
            handle.remove()
        self.switch.close(*exc_info)
        if exc_info[0] is None and not self.switch.recomputation:
            self.call.conclude()


class _Recording:
    """A forward run with the whole-region modes, recording where its ops run (Note, rule 4)."""

    def __init__(self, seen: dict[str, int], kinds: frozenset[str]) -> None:
        self.seen = seen
        self.kinds = kinds
        self.thread = -1
        self.base = 0  # the dispatch-mode stack's length outside the region
        self.events: list[tuple[nn.Module, int]] = []
        # Per stretch between two events (stretch g lies before event g): those holding ops of
        # scoped kinds, and those where the policy saw no op at all.
        self.scoped: set[int] = set()
        self.empty: set[int] = set()
        self.scoped_ops = self.ops = 0
        self.counter: dict[Any, int] | None = None  # torch's counts per op, where it keeps them
        self.foreign = False

    def start(self, first: nn.Module, thread: int, base: int, mode: Any) -> list[Any]:
        """Record from the region's first module event on; return the hooks' handles."""
        self.thread, self.base = thread, base
        self.counter = getattr(mode, "func_counter", None)
        self.event(first, _PRE)

        def pre(module: nn.Module, arguments: Any) -> None:
            self.event(module, _PRE)

        def post(module: nn.Module, arguments: Any, output: Any) -> None:
            self.event(module, _POST)

        return [
            nn.modules.module.register_module_forward_pre_hook(pre),
            nn.modules.module.register_module_forward_hook(post),
        ]

    def end_stretch(self) -> None:
        """Note what the stretch ending now held."""
        stretch = len(self.events)
        scoped = sum(self.seen.get(kind, 0) for kind in self.kinds)
        if scoped != self.scoped_ops:
            self.scoped.add(stretch)
            self.scoped_ops = scoped
        if self.counter is not None:
            ops = sum(self.counter.values())
            if ops == self.ops:
                self.empty.add(stretch)
            self.ops = ops

    def event(self, module: nn.Module, phase: int) -> None:
        """Record one module event of the region (on the region's thread)."""
        if threading.get_ident() != self.thread:
            return
        self.end_stretch()
        if torch._C._len_torch_dispatch_stack() != self.base + 1:
            self.foreign = True  # See the Note's rule 7.
        self.events.append((module, phase))

    def windows(self) -> _Windows | str:
        """The region's windows, or _WHOLE (Note [Scoped selective-checkpoint modes], rule 4)."""
        self.end_stretch()
        events = self.events
        if self.foreign:
            return _WHOLE
        counts = {kind: self.seen.get(kind, 0) for kind in self.kinds}
        runs = window_runs(self.scoped, self.empty)
        if any(first <= 1 and last == len(events) for first, last in runs):
            return _WHOLE  # on from the first module event to the region's end
        on_after_first = any(first <= 1 <= last for first, last in runs)
        return _Windows(counts, on_after_first, _module_events(events, runs))


def window_runs(scoped: Iterable[int], empty: Container[int]) -> list[list[int]]:
    """A region's windows, runs ``[first, last]`` of stretches (stretch ``g`` lies before module
    event ``g``): those holding ops of scoped kinds, merged where only stretches without an op
    part them (Note [Scoped selective-checkpoint modes], rule 4); the budget search's too."""
    runs: list[list[int]] = []
    for stretch in sorted(scoped):
        if runs and all(s in empty for s in range(runs[-1][1] + 1, stretch)):
            runs[-1][1] = stretch
        else:
            runs.append([stretch, stretch])
    return runs


def ops_in_windows(ops: Sequence[int], runs: list[list[int]]) -> int:
    """The ops the mode sees of a region run with ``ops`` per stretch and windows ``runs``: those
    before its first module event (the mode is on from its start, rule 3) and in a window. A
    pass that stops early (the recomputation) has fewer stretches than the windows name."""
    inside = set(range(min(len(ops), 1)))
    for first, last in runs:
        inside.update(range(first, min(last + 1, len(ops))))
    return sum(ops[stretch] for stretch in inside)


def _module_events(events: list[tuple[nn.Module, int]], runs: list[list[int]]) -> Any:
    """Per module, the numbered events that open and close the windows ``runs``; a run that
    begins before the first event is on already there (``_Windows.on_after_first``)."""
    numbers: dict[tuple[int, int], int] = {}
    named: list[tuple[nn.Module, int, int]] = []
    for module, phase in events:
        number = numbers[id(module), phase] = numbers.get((id(module), phase), 0) + 1
        named.append((module, phase, number))
    marks: dict[int, tuple[nn.Module, list[set[int]], list[set[int]]]] = {}
    for first, last in runs:
        for index, opening in ((first - 1, True), (last, False)):
            if index < 1 or index >= len(events):
                continue  # the first event (on_after_first) or the region's end
            module, phase, number = named[index]
            _, opens, closes = marks.setdefault(
                id(module), (module, [set(), set()], [set(), set()])
            )
            (opens if opening else closes)[phase].add(number)
    return tuple(
        _ModuleEvents(
            weakref.ref(module),
            (frozenset(opens[_PRE]), frozenset(opens[_POST])),
            (frozenset(closes[_PRE]), frozenset(closes[_POST])),
        )
        for module, opens, closes in marks.values()
    )
