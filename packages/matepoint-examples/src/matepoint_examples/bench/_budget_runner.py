"""The budget benchmark's runner: one model and optimizer, a step under any strategy, paired.

:class:`Runner` holds the model, its inputs and AdamW and times one training step with its
peak; :func:`alternate` runs strategies in rotating order, round after round (see
``matepoint_examples.bench._paired`` for why); :func:`measure_finalists` is the ``measure=``
the budget search is given, so its finalists are timed the same way.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor

import matepoint
from matepoint._planner.optimizer_states import optimizer_state_bytes
from matepoint.integrations._functions import next_region
from matepoint_examples._runtime import peak_bytes, reset_peak, synchronize
from matepoint_examples.bench._budget_workloads import BudgetWorkload, CheckpointFn
from matepoint_examples.bench._errors import error_note
from matepoint_examples.bench._paired import per_round_ratios, round_order

__all__ = [
    "Alternated",
    "Runner",
    "Step",
    "alternate",
    "measure_finalists",
    "no_checkpoint",
    "plan_checkpoint_fn",
    "plan_one_call",
]


class Step(NamedTuple):
    """One timed training step (all NaN, peak -1, where it ran out of memory or failed).

    Attributes:
        seconds: Wall time from the step's start to the synchronize that ends it.
        peak_bytes: The allocator's peak over the step (0 on a CPU, which has none).
        host_seconds: Wall time until the host returned from the last call that enqueues the
            step's work (the optimizer step), before that synchronize: what issuing the step
            costs the host. Well below ``seconds``, the host waited for the device at the end;
            near it, the device waited for the host (host-bound), or the host waited for the
            device inside the step (a call that synchronizes).
    """

    seconds: float
    peak_bytes: int
    host_seconds: float


class Alternated(NamedTuple):
    """What :func:`alternate` measured, from the rounds after the warm-up.

    Attributes:
        times: Per strategy, its step's seconds in each round (None where it did not run).
        peaks: Per strategy, its largest peak (-1 where it ran out of memory in every round).
        host_times: Per strategy, its step's host seconds in each round, round for round
            with ``times`` (:attr:`Step.host_seconds`).
    """

    times: dict[str, list[float | None]]
    peaks: dict[str, int]
    host_times: dict[str, list[float | None]]


def no_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a block as it is (one function, so a compiled model's guard on it holds)."""
    return function(*args, **kwargs)


def _compiled_backend(memory_budget: float) -> Callable[..., Any]:
    """Inductor with torch's ``activation_memory_budget`` in force while it partitions."""
    import torch._functorch.config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    def backend(graph: Any, example_inputs: Any) -> Any:
        with functorch_config.patch(activation_memory_budget=memory_budget):
            return compile_fx(graph, example_inputs)

    return backend


class Runner:
    """One model and optimizer; a step under any strategy, timed, with its peak memory.

    Args:
        workload: The model, its inputs and how its blocks are checkpointed.
        device: Where to build and run it (a CPU for tests: no peaks, both times wall times).
            Default: ``"cuda"``.
    """

    def __init__(self, workload: BudgetWorkload, device: torch.device | str = "cuda") -> None:
        self.workload = workload
        self.device = torch.device(device)
        torch.manual_seed(0)
        with self.device:
            self.model, self.inputs = workload.build()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)
        self.settings: dict[str, dict[str, Any]] = {}
        self.compiled: dict[str, Callable[[], Tensor]] = {}
        # Strategies whose failure (a compile that fails) is reported, not raised.
        self.may_fail: set[str] = set()
        self.errors: dict[str, str] = {}
        # Strategies run under a budget guard, as the one call runs a user's steps.
        self.guards: dict[str, matepoint.BudgetGuard] = {}

    def state_bytes(self) -> int:
        """Bytes of the optimizer's states (they stay on the device through every step)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, Tensor) and value.device.type == self.device.type
        )

    def optimizer_step_peak(self) -> int:
        """The peak of an optimizer step alone, gradients in place (zero gradients)."""
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        synchronize(self.device)
        reset_peak(self.device)
        self.optimizer.step()
        synchronize(self.device)
        peak = peak_bytes(self.device) or 0
        self.optimizer.zero_grad(set_to_none=True)
        return peak

    def add_compiled(self, name: str, memory_budget: float | None = None) -> None:
        """A strategy: the whole model compiled.

        With ``memory_budget``, torch's ``activation_memory_budget`` chooses what to recompute
        (run it without a checkpoint); without, inductor as it comes (run it with a budget
        plan's checkpoint and ``compiled_offload``).
        """
        backend = "inductor" if memory_budget is None else _compiled_backend(memory_budget)
        compiled = torch.compile(self.model, backend=backend)
        self.compiled[name] = lambda: self.workload.loss(compiled, self.inputs)

    def step(self, name: str, checkpoint_fn: CheckpointFn | None) -> Step:
        """One training step: its seconds, peak and host seconds (:class:`Step`).

        The step is forward, backward and the optimizer step, from a synchronized start to the
        synchronize after them; its host time stops where the host returns from the optimizer
        step, before that synchronize. A step that runs out of memory (or a compiled strategy
        that fails) gives NaN seconds and peak -1.
        """
        failed = Step(math.nan, -1, math.nan)
        guard = self.guards.get(name)
        synchronize(self.device)
        reset_peak(self.device)
        start = time.perf_counter()
        try:
            # A guard may plan again as its step starts (Note [The budget guard], rule 6), so
            # the blocks get their function and settings inside it.
            with guard.step() if guard is not None else contextlib.nullcontext():
                self.workload.set_checkpoint(self.model, checkpoint_fn or no_checkpoint)
                with matepoint.options(**self.settings.get(name, {})):
                    loss: Tensor = (
                        self.compiled[name]()
                        if name in self.compiled
                        else self.workload.loss(self.model, self.inputs)
                    )
                    loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
                del loss
                self.optimizer.step()
                issued = time.perf_counter()
                synchronize(self.device)
                seconds = time.perf_counter() - start
                peak = peak_bytes(self.device) or 0
                # Read before the guard reads the step and resets the peak, and the gradients
                # gone before it: a plan it makes again there is of a step that starts without.
                self.optimizer.zero_grad(set_to_none=True)
        except torch.cuda.OutOfMemoryError:
            pass  # handled below, once the except clause has let go of the failed step
        except Exception as error:  # a compiled strategy that fails to compile: reported, skipped
            if name not in self.compiled and name not in self.may_fail:
                raise
            self.errors.setdefault(name, error_note(error))
            self.optimizer.zero_grad(set_to_none=True)
            return failed
        else:
            return Step(seconds, peak, issued - start)
        self.optimizer.zero_grad(set_to_none=True)
        # Out of memory. Out of the except clause, whose traceback held the failed step's
        # tensors: only now can the cache give their memory back, and the next strategy start
        # from a clean one.
        torch.cuda.empty_cache()
        return failed


def alternate(
    runner: Runner, strategies: Mapping[str, CheckpointFn | None], rounds: int, warmup: int
) -> Alternated:
    """Run each strategy once per round, the order rotating (``round_order``).

    Returns, from the rounds after ``warmup``, each strategy's step times and host times (None
    where it ran out of memory) and its peak (:class:`Alternated`).
    """
    measured = Alternated({name: [] for name in strategies}, {}, {name: [] for name in strategies})
    for round_index in range(warmup + rounds):
        for name in round_order(list(strategies), round_index):
            step = runner.step(name, strategies[name])
            if round_index >= warmup:
                ran = not math.isnan(step.seconds)
                measured.times[name].append(step.seconds if ran else None)
                measured.host_times[name].append(step.host_seconds if ran else None)
                measured.peaks[name] = max(measured.peaks.get(name, -1), step.peak_bytes)
    return measured


def plan_checkpoint_fn(plan: matepoint.BudgetPlan) -> CheckpointFn:
    """``matepoint.checkpoint`` with ``plan``'s policy (its settings go to ``Runner.settings``);
    the blocks run as they are where the plan checkpoints nothing (``plan.checkpoint``) or
    not their region (``plan.unchecked_last``: the calls are counted, block ``i`` of a step
    being region ``i``)."""
    if not plan.checkpoint:
        return no_checkpoint
    if not plan.unchecked_last:
        context_fn = plan.context_fn()
        if context_fn is torch_checkpoint.noop_context_fn:  # Dynamo refuses torch's noop
            return functools.partial(matepoint.checkpoint, use_reentrant=False)
        return functools.partial(matepoint.checkpoint, use_reentrant=False, context_fn=context_fn)
    # Made before any step, so that a compiled model sees each region's own functions; a
    # region without a policy gets no context_fn, which Dynamo would refuse torch's noop as.
    functions: list[CheckpointFn] = [no_checkpoint] * plan.regions
    for region in range(plan.regions):
        if plan.checkpoints_region(region):
            context_fn = plan.context_fn(region)
            noop = context_fn is torch_checkpoint.noop_context_fn
            context: dict[str, Any] = {} if noop else {"context_fn": context_fn}
            functions[region] = functools.partial(
                matepoint.checkpoint, use_reentrant=False, **context
            )
    return functools.partial(next_region, itertools.count(), functions)


def plan_one_call(
    runner: Runner, budget: int | str, device: matepoint.DeviceModel | None
) -> matepoint.BudgetPlan:
    """The plan a user gets in one call: :func:`matepoint.plan_budget` on the live model.

    The runner's model, with every block run by ``matepoint.checkpoint``, its inputs and its
    AdamW: the optimizer's states are counted by ``plan_budget`` itself (from the states the
    runner's first step made), the budget is the whole step's (``"auto"`` included), and no
    step is measured (no ``measure=``).
    """
    workload = runner.workload
    workload.set_checkpoint(
        runner.model, functools.partial(matepoint.checkpoint, use_reentrant=False)
    )
    batch, loss_fn = workload.one_call(runner.inputs)
    with workload.planning():
        return matepoint.plan_budget(
            runner.model,
            batch,
            optimizer=runner.optimizer,
            budget=budget,
            loss_fn=loss_fn,
            device=device,
        )


def guarded_one_call(
    runner: Runner,
    name: str,
    plan: matepoint.BudgetPlan,
    device: matepoint.DeviceModel | None,
) -> CheckpointFn:
    """The one call's plan under the guard the integrations attach (Note [The budget guard]):
    the strategy ``name`` runs each step in the guard's ``step()``, which reads its first steps
    and plans again (:func:`plan_one_call` at the smaller budget) where one went over the
    budget or drove the allocator to its limit. Returns the strategy's checkpoint function,
    which runs the block by the plan in force."""
    current: list[CheckpointFn] = []

    def apply(new_plan: matepoint.BudgetPlan) -> None:
        current[:] = [plan_checkpoint_fn(new_plan)]
        runner.settings[name] = new_plan.settings_changes()

    apply(plan)
    runner.guards[name] = matepoint.BudgetGuard(
        plan,
        replan=lambda budget: plan_one_call(runner, budget, device),
        apply=apply,
        states_bytes=optimizer_state_bytes(runner.optimizer),
        model=runner.model,
        optimizer=runner.optimizer,
    )

    def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return current[0](function, *args, **kwargs)

    return checkpoint


def measure_finalists(
    runner: Runner, rounds: int = 20
) -> Callable[[Sequence[matepoint.BudgetPlan]], list[float]]:
    """A ``measure=`` for the budget search: the finalists' steps alternated, paired.

    One warm-up round, then ``rounds``: a plan with a selective policy is host-bound in
    stretches on a fast device (its step runs at either of two speeds, the slower one for
    several steps in a row; docs/benchmarks.md), and 8 rounds fell in one such stretch and chose
    the slower finalist. A finalist's time is a reference finalist's median step
    times the median of its per-round ratios to that reference (the pairing the other
    strategies are compared with; a median of each one's own times mixes the host's drift into
    the comparison); one that ran out of memory in any round measures ``math.inf`` (Note
    [Measured finalists] in ``matepoint._planner.search``).
    """

    def measure(plans: Sequence[matepoint.BudgetPlan]) -> list[float]:
        finalists: dict[str, CheckpointFn] = {}
        for index, plan in enumerate(plans):
            finalists[f"finalist {index}"] = plan_checkpoint_fn(plan)
            runner.settings[f"finalist {index}"] = plan.settings_changes()
        times = alternate(runner, finalists, rounds, warmup=1).times
        ran = [name for name in finalists if None not in times[name]]
        if not ran:
            return [math.inf] * len(plans)
        reference = ran[0]
        base = statistics.median(value for value in times[reference] if value is not None)
        ratios = per_round_ratios(times, reference)
        return [
            base * statistics.median(ratios[name]) if name in ran else math.inf
            for name in finalists
        ]

    return measure
