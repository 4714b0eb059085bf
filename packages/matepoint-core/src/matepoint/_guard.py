"""The guard on a budget plan's first real steps: the measured peak against the plan's.

A plan's peak is predicted on the meta device; the real step's peak is read from the device
after it ran. :class:`BudgetGuard` compares the two on the first steps under a plan and, where
the step went over the budget, warns with the figures and plans again with the measured gap
(Note [The budget guard]). An out-of-memory error in a guarded step, or in a block the
integrations run under the guard's plan, is re-raised as
:class:`matepoint.BudgetOutOfMemoryError`, naming the plan, with the model left usable.

The integrations' ``budget=`` path installs a guard on the model's root module
(:meth:`BudgetGuard.attach`); :func:`budget_guard` finds it.

Note [The budget guard]
    Rule 1. A step's measured peak is the device's peak allocated memory between two readings
        (``torch.cuda.max_memory_allocated``, its peak reset at each reading). The plan's
        figures count the optimizer's states apart (``BudgetPlan.budget_bytes`` is the budget
        less them), so the guard adds them back: the budget and the predicted peak it compares
        with are the whole step's.
    Rule 2. A step over the budget is the prediction's error, ``gap = measured - predicted``:
        the guard plans again at ``budget - gap``, so that the new plan's prediction plus the
        same error fits, and applies the new plan. A plan that did not fit to begin with and
        ran within its prediction has no gap to plan away: the guard only warns.
    Rule 3. The guard reads the first ``steps`` steps under each plan (a new plan starts the
        count again) and plans again at most ``max_replans`` times; after that it reads
        nothing. A step the guard does not read costs it nothing.
    Rule 4. An out-of-memory error inside :meth:`BudgetGuard.step` leaves no gradient behind:
        the model's and the optimizer's gradients are set to None (a half-run backward has
        accumulated into some only), and the frames of the error are cleared so the tensors
        they held are freed; the next step starts from a clean model.
    Rule 5. Under an integration's ``budget=``, the blocks it runs name the plan too, outside
        :meth:`BudgetGuard.step`: an out-of-memory error in a block's forward or in its
        recomputation is re-raised so, the frames cleared as in rule 4 (``naming_the_plan``).
        The gradients are set to None at once where the error came from forward, and before
        the model's next forward where it came from backward, whose engine may still be
        winding down other work. An error elsewhere in the step (the optimizer's, backward's
        own buffers) keeps torch's message: only ``step()`` sees the whole step. Under a
        compile the blocks run as they are traced, without the renaming.
    Rule 6. A plan bounds what its step allocates; the caching allocator holds more: free pieces
        of segments in use, which a larger request cannot use and the allocator cannot give
        back. Where the device gives the process little more than the budget (``budget="auto"``
        leaves ``AUTO_MARGIN`` for them, which a step that frees and allocates many sizes can
        outgrow), a step whose peak is within the budget can run out of memory. An out-of-memory
        error (rules 4 and 5) reads the pieces the allocator holds at the error (it gave back
        every free segment before it failed): the guard plans again at the budget less them
        before the next training step (its first training forward, or ``step()``), read or not.
        A read step is planned again the same way, before any step fails, where the allocator
        reached its limit (it freed its cache and retried a device allocation:
        ``AllocatorMemory.reached_limit``) and the step's peak plus the most it held in such
        pieces exceeds the most it held at all: the peak came within the pieces of failing. At a
        cap the allocator reaches its limit on most steps, freeing cached segments to serve a
        request; a step whose peak and pieces fit what it held is not planned again. Both count
        against ``max_replans``; an overshoot of the budget (rule 2) is read first. The new
        plan's peak plus the same pieces fits what the first one held.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from matepoint._device_memory import AllocatorMemory, CudaMemory, DeviceMemory
from matepoint._errors import BudgetOutOfMemoryError
from matepoint._planner.budget_plan import BudgetPlan

__all__ = [
    "BudgetGuard",
    "BudgetOvershootWarning",
    "CudaMemory",
    "DeviceMemory",
    "GuardReading",
    "budget_guard",
]

_GIB = float(1 << 30)
# The guard each model carries, by the model: not an attribute of the model, which the meta
# twin of a re-plan deep-copies (Note [The meta twin] in matepoint._planner.live_model). The
# model's hook holds the guard; a weak reference here lets both die together.
_GUARDS: weakref.WeakKeyDictionary[nn.Module, weakref.ref[BudgetGuard]] = (
    weakref.WeakKeyDictionary()
)


class BudgetOvershootWarning(UserWarning):
    """A guarded step's measured peak went over the budget (See Note [The budget guard])."""


@dataclasses.dataclass(frozen=True)
class GuardReading:
    """One step's figures, the optimizer's states included in each (Note [The budget guard],
    rule 1).

    Attributes:
        measured_bytes: The step's measured peak.
        predicted_bytes: The plan's predicted peak.
        budget_bytes: The budget.
        reserved_bytes: The most the caching allocator held over the step, or None where the
            guard's memory does not tell (Note [The budget guard], rule 6). Default: None.
        pieces_bytes: The most it held in free pieces of segments in use, which it can
            neither give a larger request nor give back (rule 6). Default: 0.
        reached_limit: Whether the allocator reached what the device gives the process
            during the step (rule 6). Default: False.
    """

    measured_bytes: int
    predicted_bytes: int
    budget_bytes: int
    reserved_bytes: int | None = None
    pieces_bytes: int = 0
    reached_limit: bool = False

    @property
    def near_failure(self) -> bool:
        """Whether the allocator reached its limit with its peak and its free pieces together
        above the most it held: the step came within those pieces of running out of memory
        (Note [The budget guard], rule 6)."""
        held = self.reserved_bytes or 0
        return self.reached_limit and self.measured_bytes + self.pieces_bytes > held

    @property
    def gap_bytes(self) -> int:
        """How far the measured peak is above the prediction (negative below it)."""
        return self.measured_bytes - self.predicted_bytes

    @property
    def over_budget(self) -> bool:
        """Whether the measured peak is above the budget."""
        return self.measured_bytes > self.budget_bytes


def _gib(size: int) -> str:
    return f"{size / _GIB:.2f} GiB ({size} bytes)"


def describe(plan: BudgetPlan) -> str:
    """A plan in one line: its decisions and the settings it chose."""
    if not plan.checkpoint:
        return f"budget plan of {plan.regions} regions (no checkpoint: every block as it is)"
    decided = ", ".join(f"{kind} {decision}" for kind, decision in plan.decisions)
    unchecked = f"; the last {plan.unchecked_last} unchecked" if plan.unchecked_last else ""
    return (
        f"budget plan of {plan.regions} regions ({decided or 'every op recomputed'}{unchecked}; "
        f"prefetch {plan.prefetch}, min_offload_bytes {plan.min_offload_bytes})"
    )


class BudgetGuard:
    """Checks a budget plan's first real steps and plans again where they go over the budget,
    or come within the caching allocator's free pieces of running out of memory.

    The integrations' ``budget=`` install one on the model (find it with
    :func:`matepoint.budget_guard`): it reads the previous step's peak at each training forward
    of the root module. For a model applying a plan itself, make one and either call
    :meth:`check` after each step or run each step in ``with guard.step():``, which also
    names the plan in an out-of-memory error (Note [The budget guard]).

    Args:
        plan: The plan in force.
        replan: Plans again at a whole-step budget in bytes, the optimizer's states included
            (as ``matepoint.plan_budget(..., budget=bytes)`` does).
        apply: Applies a new plan (``configure`` its settings, each block's ``context_fn``).
        states_bytes: The optimizer's states the plan's budget left out. Default: 0.
        model: The model whose gradients an out-of-memory error clears. Default: None.
        optimizer: The optimizer whose gradients it clears too. Default: None.
        memory: Where the peak is read, and, where it tells them, what the caching allocator
            held (Note [The budget guard], rule 6). Default: the current CUDA device's where
            CUDA is available, else None (the guard reads nothing).
        steps: Steps read under each plan. Default: 3.
        max_replans: Re-plans at most. Default: 2.

    Example:
        >>> guard = matepoint.BudgetGuard(  # doctest: +SKIP
        ...     plan, replan=lambda b: matepoint.plan_budget(model, batch, optimizer=opt,
        ...     budget=b), apply=apply_plan, model=model, optimizer=opt)
        >>> with guard.step():  # doctest: +SKIP
        ...     model(batch).sum().backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        plan: BudgetPlan,
        *,
        replan: Callable[[int], BudgetPlan],
        apply: Callable[[BudgetPlan], None],
        states_bytes: int = 0,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        memory: DeviceMemory | None = None,
        steps: int = 3,
        max_replans: int = 2,
    ) -> None:
        if memory is None and torch.cuda.is_available():
            memory = CudaMemory()
        self.plan, self.memory, self.enabled = plan, memory, True
        self.budget_bytes = plan.budget_bytes + states_bytes
        self.states_bytes, self.steps, self.max_replans = states_bytes, steps, max_replans
        self.readings: list[GuardReading] = []
        self.replans = 0
        self._replan, self._apply = replan, apply
        self._model, self._optimizer = model, optimizer
        self._read = 0  # steps read under the plan in force
        self._started = False  # a step's peak is being counted
        self._in_step = False
        self._clear_before_forward = False  # rule 5: a backward ran out of memory
        self._pieces_at_error = 0  # rule 6: the allocator's free pieces at such an error
        self._handle: Any = None

    def _predicted(self, plan: BudgetPlan) -> int:
        """A plan's predicted step peak: forward and backward's or the optimizer step's
        (``BudgetPlan.optimizer_step_bytes``), the optimizer's states beside either."""
        return max(plan.peak_bytes, plan.optimizer_step_bytes) + self.states_bytes

    @property
    def watching(self) -> bool:
        """Whether the next step is read (See Note [The budget guard], rule 3)."""
        return self.enabled and self.memory is not None and self._read < self.steps

    def start(self) -> None:
        """Start counting a step's peak (the next :meth:`check` reads from here)."""
        if self.watching:
            assert self.memory is not None
            self.memory.reset_peak()
            self._started = True

    def check(self) -> GuardReading | None:
        """Read the step since the last reading; warn and plan again where it went over the
        budget, or drove the allocator to its limit (Note [The budget guard], rules 2 and 6).

        Returns:
            The step's figures, or None where the guard reads nothing.
        """
        if not (self.watching and self._started):
            self.start()
            return None
        assert self.memory is not None
        reading = self._read_memory(self.memory)
        self.readings.append(reading)
        self._read += 1
        if reading.over_budget:
            self._overshoot(reading)
        elif reading.near_failure:
            self._plan_again(
                f"matepoint: a step under the {describe(self.plan)} drove the caching "
                f"allocator to its limit: it held {_gib(reading.reserved_bytes or 0)} for a "
                f"peak of {_gib(reading.measured_bytes)}, up to {_gib(reading.pieces_bytes)} "
                "of it in free pieces of its segments, and a later step may run out of memory",
                reading.budget_bytes - reading.pieces_bytes,
            )
        self.start()
        return reading

    def _read_memory(self, memory: DeviceMemory) -> GuardReading:
        """The step's figures from ``memory``, the allocator's where it tells them (rule 6)."""
        figures = (memory.peak_bytes(), self._predicted(self.plan), self.budget_bytes)
        if not isinstance(memory, AllocatorMemory):
            return GuardReading(*figures)
        return GuardReading(
            *figures,
            reserved_bytes=memory.reserved_peak_bytes(),
            pieces_bytes=memory.pieces_peak_bytes(),
            reached_limit=memory.reached_limit(),
        )

    def _overshoot(self, reading: GuardReading) -> None:
        """Warn with the figures; plan again at the budget less the gap (rule 2)."""
        message = (
            f"matepoint: a step under the {describe(self.plan)} peaked at "
            f"{_gib(reading.measured_bytes)}, over the budget of {_gib(reading.budget_bytes)}; "
            f"predicted {_gib(reading.predicted_bytes)}, a gap of {_gib(reading.gap_bytes)}"
        )
        if reading.gap_bytes <= 0:
            warnings.warn(f"{message}; not planned again", BudgetOvershootWarning, stacklevel=3)
            return
        self._plan_again(message, reading.budget_bytes - reading.gap_bytes)

    def _plan_again(self, message: str, target: int) -> None:
        """Warn with ``message``; plan again at ``target`` whole-step bytes and apply the new
        plan, unless the guard has planned again ``max_replans`` times (rule 3)."""
        if self.replans >= self.max_replans:
            warnings.warn(f"{message}; not planned again", BudgetOvershootWarning, stacklevel=4)
            return
        started = time.perf_counter()
        try:
            plan = self._replan(target)
        except ValueError as error:
            warnings.warn(
                f"{message}; planning again at {_gib(target)} failed: {error}",
                BudgetOvershootWarning,
                stacklevel=4,
            )
            return
        warnings.warn(
            f"{message}; planned again at {_gib(target)} in {time.perf_counter() - started:.1f} s: "
            f"the {describe(plan)}, predicted {_gib(self._predicted(plan))}"
            + ("" if plan.fits else ", which does NOT fit"),
            BudgetOvershootWarning,
            stacklevel=4,
        )
        self._apply(plan)
        self.plan, self.replans, self._read = plan, self.replans + 1, 0

    def _before_step(self, training: bool = True) -> None:
        """Before a forward: clear what a failed backward left (rule 5) and, before a training
        step, plan again where an out-of-memory error found the allocator's segments in pieces
        (rule 6); an evaluation forward leaves that to the next training step."""
        if self._clear_before_forward:
            self._clear_gradients()
        if not training:
            return
        pieces, self._pieces_at_error = self._pieces_at_error, 0
        if pieces > 0:
            self._plan_again(
                f"matepoint: a step under the {describe(self.plan)} ran out of memory with "
                f"{_gib(pieces)} held by the caching allocator in free pieces of its segments",
                self.budget_bytes - pieces,
            )

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Run one planned step: read it at the end, and name the plan if it runs out of memory.

        Raises:
            BudgetOutOfMemoryError: For an out-of-memory error inside the step, after the
                model's and optimizer's gradients are set to None (See Note [The budget
                guard], rule 4).
        """
        self._before_step()
        self._in_step = True
        self.start()
        try:
            yield
        except torch.cuda.OutOfMemoryError as error:
            if isinstance(error, BudgetOutOfMemoryError):
                raise
            raise self._out_of_memory(error) from error
        finally:
            self._in_step = False
        self.check()

    def _out_of_memory(
        self, error: BaseException, *, clear_now: bool = True
    ) -> BudgetOutOfMemoryError:
        """Clear what the failed step left, now or before the next forward (rules 4 and 5),
        and name the plan."""
        # Read while the failed step's tensors are held still: the pieces between them.
        if isinstance(self.memory, AllocatorMemory):
            self._pieces_at_error = self.memory.unallocated_bytes()
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        if clear_now:
            self._clear_gradients()
        else:
            self._clear_before_forward = True
        self._started = False
        first = str(error).strip().splitlines()[0] if str(error).strip() else "out of memory"
        return BudgetOutOfMemoryError(
            f"out of memory in a step under the {describe(self.plan)}: its budget is "
            f"{_gib(self.budget_bytes)} and its predicted peak "
            f"{_gib(self._predicted(self.plan))} ({first}). The gradients were "
            "set to None and the next step can run; plan at a smaller budget, or give the "
            "device more room (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
            plan=self.plan,
            budget_bytes=self.budget_bytes,
            predicted_bytes=self._predicted(self.plan),
        )

    def _clear_gradients(self) -> None:
        """Set the model's and the optimizer's gradients to None (rule 4)."""
        self._clear_before_forward = False
        for owner in (self._model, self._optimizer):
            if owner is not None:
                owner.zero_grad(set_to_none=True)

    def attach(self, model: nn.Module) -> BudgetGuard:
        """Read each step at the root module's next training forward; :func:`budget_guard`
        finds the guard by ``model``. Returns the guard."""
        self.remove()
        self._handle = model.register_forward_pre_hook(_GuardHook(self, model))
        _GUARDS[model] = weakref.ref(self)
        return self

    def remove(self) -> None:
        """Take the guard off the model it is attached to; it reads nothing by itself after."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        for model, guard in list(_GUARDS.items()):
            if guard() is self:
                del _GUARDS[model]


class _GuardHook:
    """The root module's forward pre-hook: read the previous step. A copy of it (in the meta
    twin of a re-plan, or in a pickled model) is inert: it guards no model."""

    def __init__(self, guard: BudgetGuard | None = None, model: nn.Module | None = None) -> None:
        self.guard = guard
        self.root = None if model is None else weakref.ref(model)

    def __call__(self, module: nn.Module, _args: Any) -> None:
        guard = self.guard
        if guard is None or self.root is None or module is not self.root() or guard._in_step:
            return
        training = module.training and torch.is_grad_enabled()
        guard._before_step(training)  # rules 5 and 6
        if training and guard.watching:
            guard.check()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_GuardHook, ())


def budget_guard(model: nn.Module) -> BudgetGuard | None:
    """The guard the integrations' ``budget=`` attached to ``model``, or None."""
    guard = _GUARDS.get(model)
    return None if guard is None else guard()
