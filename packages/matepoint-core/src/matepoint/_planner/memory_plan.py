"""``matepoint.plan``: a step's device memory, host RAM and link traffic, before renting a GPU.

The planner runs one training step of the user's own model on the meta device, once with no
checkpoint, once with torch's checkpoint and once with matepoint, whose own offload engine runs
on tensors that hold no memory (see ``matepoint._planner.step``). It reports, per strategy,
the peak device memory and its timeline, the bytes forward leaves for backward, the pinned host
RAM, the bytes each way over the link, and the time those bytes need against an estimate of the
compute time, and it finds the fastest step within a device-memory budget (``fastest_under``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import textwrap
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

from matepoint._options import OffloadOptions, OffloadSettings, get_options, resolve
from matepoint._planner.budget_plan import BudgetPlan
from matepoint._planner.recommend import Recommendation, recommend
from matepoint._planner.search import fastest_under
from matepoint._planner.step import Planned, SavedInput, StrategyPlan, TimelinePoint, run_step
from matepoint._planner.time_model import DEFAULT_LINK_BANDWIDTH, DEFAULT_PEAK_FLOPS, DeviceModel

__all__ = ["MemoryPlan", "Recommendation", "StrategyPlan", "TimelinePoint", "plan"]

STRATEGIES = ("none", "torch", "matepoint")
_GB = 1e9
_GIB = float(1 << 30)


def _gib(value: int) -> str:
    return f"{value / _GIB:.2f} GiB"


# Note [Settings a search plans under]
#     Rule 1. A plan made with each call's own options (``plan()`` without ``options=``) is
#         re-planned by ``fastest_under`` and ``recommend`` with their candidate settings as the
#         settings in force, as ``configure(**budget.settings_changes())`` makes them when the
#         plan is applied: a call's own ``offload=`` still wins for the fields it sets, in the
#         planned step as in the real one.
#     Rule 2. A plan made with ``options=`` re-plans with the candidate settings for every call
#         instead of its own, as that plan did.
#     Rule 3. The candidate settings are the planned step's own (``run_step``'s ``in_force``):
#         the process's settings never change, so no other thread, planning or offloading for
#         real, sees them.
#     Example: every call passes ``offload=OffloadOptions(min_offload_bytes=1 << 40)``: whatever
#     ``min_offload_bytes`` the search tries, its planned steps move no checkpoint input, as the
#     real steps will not.


def _planned_in_force(
    replan: Callable[..., Planned],
    settings: OffloadSettings,
    context_fn: Callable[[], Any] | None = None,
    checkpointed_calls: int | None = None,
) -> Planned:
    """Plan the step with ``settings`` in force and each call's own options over them (Note
    [Settings a search plans under], rules 1 and 3)."""
    return replan(
        None, context_fn=context_fn, in_force=settings, checkpointed_calls=checkpointed_calls
    )


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The planned step under each strategy, and how to re-plan it with other options.

    Attributes:
        strategies: ``"none"``, ``"torch"`` and ``"matepoint"``, each a :class:`StrategyPlan`.
        options: Options of the matepoint strategy (``None``: each checkpoint call's own, the
            process defaults unless a call passes ``offload=``).
        link_bandwidth: Bytes per second each way used for the link times.
        peak_flops: FLOP/s used for the compute-time estimates.
        saves: Every checkpoint input of the matepoint step, with what matepoint did with it.
    """

    strategies: dict[str, StrategyPlan]
    options: OffloadSettings | None
    link_bandwidth: float
    peak_flops: float
    saves: tuple[SavedInput, ...]
    replan: Callable[..., Planned] = dataclasses.field(repr=False, compare=False)

    def __getitem__(self, strategy: str) -> StrategyPlan:
        return self.strategies[strategy]

    @property
    def effective_options(self) -> OffloadSettings:
        """The options of the matepoint strategy, or the process defaults it used."""
        return self.options if self.options is not None else get_options()

    @property
    def _search_replan(self) -> Callable[..., Planned]:
        """Plans the step with candidate settings as applying them will run it (Note [Settings a
        search plans under])."""
        if self.options is not None:
            return self.replan
        return partial(_planned_in_force, self.replan)

    def recommend(self, budget_bytes: int) -> Recommendation:
        """Propose offload options that fit ``budget_bytes`` of device memory with least traffic.

        The options-only search, kept for its API: it changes ``min_offload_bytes``,
        ``stash_bytes`` and ``prefetch`` alone, for the least link traffic, not the fastest
        step. :meth:`fastest_under` is the one answer to a budget (what ``matepoint-plan``
        prints): it chooses the look-ahead, the inputs held and the stash (with this search's
        rule: Note [The stash] in ``matepoint._planner.conclusion``) with keep, offload or
        recompute per kind of op, and where nothing fits says how much of the batch would. It
        also runs before torch 2.5, which budget plans need.

        Re-plans the step with candidate options (a few to a few dozen meta steps); see
        :class:`Recommendation` for the search.

        Args:
            budget_bytes: Device memory the step may use, parameters and gradients included.

        Returns:
            The proposal, or what would fit if nothing does.
        """
        return recommend(self.effective_options, self._search_replan, budget_bytes)

    def fastest_under(
        self,
        budget_bytes: int,
        *,
        host_budget_bytes: int | None = None,
        ranks_per_node: int = 1,
        device: DeviceModel | None = None,
        measure: Callable[[Sequence[BudgetPlan]], Sequence[float]] | None = None,
    ) -> BudgetPlan:
        """Find the fastest step within ``budget_bytes``: keep, offload or recompute per op kind.

        Re-plans the step with selective-checkpoint policies on every ``matepoint.checkpoint``
        call (one profile, then a few steps per kind of op); see Note [The budget search] in
        ``matepoint._planner.search``. Last, over the plan chosen, it takes the largest stash
        that fits where the link limits the step (Note [The stash]). Peaks and bytes are the
        planner's; times come from ``device``.

        Args:
            budget_bytes: Device memory the step may use, parameters and gradients included:
                a positive, finite number of bytes.
            host_budget_bytes: Pinned host RAM a node may use (bytes, 0 or more), or None for
                no limit. Default: ``None``.
            ranks_per_node: Processes per node, each with its own pool: a whole number, 1 or
                more. Default: ``1``.
            device: The time model's rates, a :class:`~matepoint.DeviceModel`
                (:func:`matepoint.calibrate` measures one on a GPU). The plan is made on the
                meta device whatever device trains; this only says how fast that device is.
                Default: this plan's ``peak_flops`` and ``link_bandwidth``, with
                :class:`~matepoint.DeviceModel`'s policy cost.
            measure: Times plans on the real device: called with the search's finalists (the
                fastest plan with a selective-checkpoint policy and the fastest without), it
                returns each one's step time in seconds, and the faster is chosen (Note
                [Measured finalists] in ``matepoint._planner.search``). Default: ``None``, the time
                model decides.

        Returns:
            The chosen plan (``fits`` False, the smallest budget that would fit and the share of
            the batch that would, if none does).

        Raises:
            TypeError: For an argument of the wrong type (a budget that is not a number, a
                ``device`` that is not a :class:`~matepoint.DeviceModel`, such as ``"cuda"``).
            ValueError: For a budget that is zero, negative, NaN or infinite, a negative host
                budget, or ``ranks_per_node`` below 1.
        """
        budget, host_budget, ranks = _search_arguments(
            budget_bytes, host_budget_bytes, ranks_per_node, device, measure
        )
        link = self.link_bandwidth
        default = DeviceModel(self.peak_flops, to_host_bandwidth=link, to_device_bandwidth=link)
        return fastest_under(
            self._search_replan,
            self.effective_options,
            budget,
            host_budget,
            ranks,
            device or default,
            measure,
            self.strategies.get("none"),
        )

    def to_dict(self, max_points: int = 2000) -> dict[str, Any]:
        """Return the whole plan as a JSON-ready dict."""
        return {
            "estimate_note": ESTIMATE_NOTE,
            "link_bandwidth_bytes_per_s": self.link_bandwidth,
            "peak_flops": self.peak_flops,
            "options": dataclasses.asdict(self.effective_options),
            "strategies": {name: self[name].to_dict(max_points) for name in self.strategies},
            "saves": [dataclasses.asdict(save) for save in self.saves],
        }

    def __str__(self) -> str:
        """Render the plan as an aligned text table, one column per strategy."""
        plans = list(self.strategies.values())

        def ms(value: float) -> str:
            return f"{value * 1e3:.1f} ms"

        lines = [
            "matepoint plan (one training step, no GPU used)",
            _row("", [plan.strategy for plan in plans]),
            _row("peak device memory", [_gib(plan.peak_bytes) for plan in plans]),
            _row("held after forward", [_gib(plan.held_after_forward_bytes) for plan in plans]),
            _row("pinned host RAM", [_gib(plan.pinned_bytes) for plan in plans]),
            _row("to host / to device", [
                f"{plan.bytes_to_host / _GB:.2f}/{plan.bytes_to_device / _GB:.2f} GB"
                for plan in plans
            ]),
            _row("link time (each way)", [
                f"{ms(plan.to_host_seconds)}/{ms(plan.to_device_seconds)}" for plan in plans
            ]),
            _row("compute est. fwd/bwd", [
                f"{ms(plan.forward_seconds)}/{ms(plan.backward_seconds)}" for plan in plans
            ]),
        ]  # fmt: skip
        note = (
            f"link {self.link_bandwidth / _GB:.0f} GB/s each way; compute at "
            f"{self.peak_flops / 1e12:.0f} TFLOP/s. {ESTIMATE_NOTE}"
        )
        lines += textwrap.wrap(note, width=96, initial_indent="  ", subsequent_indent="  ")
        return "\n".join(lines)


ESTIMATE_NOTE = (
    "Memory, host RAM and link bytes are computed from the step itself; times are estimates: "
    "bytes at the given link bandwidth, and FLOPs (torch's flop counter) at the given peak "
    "FLOP/s, which real steps never reach, so real compute takes longer than shown."
)


def _search_arguments(
    budget_bytes: object,
    host_budget_bytes: object,
    ranks_per_node: object,
    device: object,
    measure: object,
) -> tuple[int, int | None, int]:
    """``fastest_under``'s sizes as whole numbers, after refusing what the search cannot use.

    A wrong type is a TypeError and a wrong value a ValueError, each naming the argument, before
    any step is planned (deep in the search, a NaN budget fits nothing and a string device
    fails as an AttributeError).
    """
    budget = _bytes("budget_bytes", budget_bytes, least=1)
    host_budget = None
    if host_budget_bytes is not None:
        host_budget = _bytes("host_budget_bytes", host_budget_bytes, least=0)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, numbers.Integral):
        raise TypeError(
            "fastest_under: ranks_per_node must be a whole number of processes, got "
            f"{ranks_per_node!r} ({type(ranks_per_node).__name__})"
        )
    if ranks_per_node < 1:
        raise ValueError(f"fastest_under: ranks_per_node must be 1 or more, got {ranks_per_node}")
    if device is not None and not isinstance(device, DeviceModel):
        raise TypeError(
            "fastest_under: device= takes a DeviceModel, the rates the time model uses "
            "(matepoint.calibrate() measures one on a GPU; matepoint.DeviceModel(...) states "
            f"one), not where to run: got {device!r} ({type(device).__name__}). The plan is "
            "made on the meta device whatever device trains"
        )
    if measure is not None and not callable(measure):
        raise TypeError(
            "fastest_under: measure= takes a function of the finalist plans that returns "
            f"their step times, got {type(measure).__name__}"
        )
    return budget, host_budget, int(ranks_per_node)


def _bytes(name: str, value: object, *, least: int) -> int:
    """``value`` as whole bytes, or a TypeError / ValueError that names the argument."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"fastest_under: {name} must be a number of bytes, got {value!r} "
            f"({type(value).__name__})"
        )
    if not math.isfinite(value) or value < least:
        wanted = "a positive, finite number" if least > 0 else "a finite number, 0 or more,"
        raise ValueError(f"fastest_under: {name} must be {wanted} of bytes, got {value!r}")
    return operator.index(value) if isinstance(value, numbers.Integral) else int(float(value))


def _row(label: str, values: list[str]) -> str:
    return f"  {label:<26}" + "".join(f"{value:>16}" for value in values)


def plan(
    fn: Callable[..., Any],
    *example_args: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    options: OffloadSettings | OffloadOptions | None = None,
    link_bandwidth: float = DEFAULT_LINK_BANDWIDTH,
    peak_flops: float = DEFAULT_PEAK_FLOPS,
    strategies: tuple[str, ...] = STRATEGIES,
    **example_kwargs: Any,
) -> MemoryPlan:
    """Plan one training step's device memory, host RAM and link traffic without a GPU.

    Runs forward and backward of ``fn(*example_args, **example_kwargs)`` on the meta device,
    where tensors have shapes but no memory, so a 7B-parameter model plans in seconds on a laptop.
    The step runs three times: every ``matepoint.checkpoint`` call as a plain call (no
    checkpoint), as ``torch.utils.checkpoint``, and as matepoint with its options, running
    matepoint's own offload engine (what is kept, dedupe, stash, fetches and look-ahead, the
    exact-size pinned pool) over a channel that moves nothing. Attention and RMS norm are planned
    as CUDA's fused kernels allocate, and every allocation is rounded as the CUDA caching
    allocator rounds it. Times are estimates; bytes are not.

    Build the model and its inputs on the meta device (``with torch.device("meta"):``) so that
    nothing is allocated. Only ``matepoint.checkpoint`` and ``checkpoint_sequential`` calls
    change between strategies; ``torch.utils.checkpoint`` called directly stays as it is.
    The keyword names below are the planner's; other keyword arguments go to ``fn``.

    Args:
        fn: The model or function whose training step to plan.
        *example_args: Its arguments, on the meta device.
        loss_fn: Turns ``fn``'s output into the loss. Default: the output if it is a scalar,
            else the sum of its elements.
        options: Settings for every offloading checkpoint call instead of its own, or an
            :class:`OffloadOptions`, resolved over the settings in force as a call's ``offload=``
            is. Default: each call's own (the process defaults).
        link_bandwidth: Host-device bandwidth each way, in bytes per second.
            Default: :data:`DEFAULT_LINK_BANDWIDTH` (55 GB/s, measured on an H200 host).
        peak_flops: FLOP/s for the compute-time estimate. Default: :data:`DEFAULT_PEAK_FLOPS`
            (989 TFLOP/s, dense bf16 on an H100/H200).
        strategies: Which strategies to plan. Default: all three.
        **example_kwargs: Keyword arguments of ``fn``.

    Returns:
        The plan; ``str(plan)`` is a table, ``plan.fastest_under(budget)`` finds the fastest
        step within a budget.

    Raises:
        ValueError: For an unknown strategy; for ``OffloadOptions(enabled=False)``; if ``fn``
            is a module (or a module's method) with parameters or buffers not on the meta
            device; if the output has no tensor that requires grad and no ``loss_fn`` is given.

    Example:
        >>> import torch, matepoint
        >>> with torch.device("meta"):
        ...     blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(8))
        ...     x = torch.randn(4096, 1024, requires_grad=True)
        >>> def model(x):
        ...     for block in blocks:
        ...         x = matepoint.checkpoint(block, x)
        ...     return x
        >>> p = matepoint.plan(model, x)
        >>> p["matepoint"].bytes_to_host // 2**20
        128
    """

    if isinstance(options, OffloadOptions):
        # As a checkpoint call resolves its offload=: unset fields take the settings in force.
        if (resolved := resolve(options)) is None:
            raise ValueError(
                "matepoint.plan: options=OffloadOptions(enabled=False) offloads nothing; the "
                '"torch" strategy is that step'
            )
        fields = dataclasses.fields(OffloadSettings)
        options = OffloadSettings(**{field.name: getattr(resolved, field.name) for field in fields})
    if unknown := set(strategies) - set(STRATEGIES):
        raise ValueError(f"unknown strategies {sorted(unknown)}; known: {', '.join(STRATEGIES)}")
    run = partial(run_step, fn, example_args, example_kwargs, loss_fn, link_bandwidth, peak_flops)
    results = {strategy: run(strategy, options) for strategy in strategies}
    saves = results["matepoint"][1] if "matepoint" in results else ()
    plans = {strategy: result[0] for strategy, result in results.items()}
    return MemoryPlan(plans, options, link_bandwidth, peak_flops, saves, partial(run, "matepoint"))
