"""Budget plans on a GPU: measured peak and step against the plan, and against the peers.

Run ``matepoint-bench budget --workload llama8`` (or ``python -m
matepoint_examples.bench.budget``). One process builds one model (a Llama-style stack,
nanochat12, or a Hugging Face Llama) and one AdamW optimizer, measures torch's checkpoint and no
checkpoint once, plans a budget step on the meta device for each budget (``--budgets``: torch
checkpoint's measured peak, halfway to no checkpoint's, or a fixed size such as ``24GiB``;
``--device-memory 24GiB`` caps the process there with
``torch.cuda.set_per_process_memory_fraction``) with the search's two finalists measured on the
GPU (Note [Measured finalists] in ``matepoint._budget``; where the time model alone would have
chosen otherwise, its plan runs too, as ``budget@... model``), then runs every strategy
alternately, step by step (see ``matepoint_examples.bench._paired`` for why), and reports per
strategy the median per-round step ratio to torch's checkpoint [interquartile range], the
measured peak, and for the budget plans the predicted peak. A strategy that runs out of memory
is reported without a ratio. ``--compiled`` adds torch's compiled ``activation_memory_budget``
at each budget, for reference, and each budget plan run under matepoint's compiled path
(``compiled_offload``, the whole model compiled). ``--twin sac-every-matmul`` runs that peer a
second time each round, as a control: where it is a plan's fastest peer, the verdict gives the
twin's ratio to it beside the plan's (on a host-bound step the same strategy's two medians can
differ by a few percent). ``--plot frontier.png report.json ...`` draws step ratio against peak
memory from saved reports, without a GPU.

Note [Calibrating the planned peak]
    The planner plans forward and backward of the stack. A training step also holds the
    optimizer's states through forward and backward, and the optimizer step has a peak of its
    own (AdamW's foreach temporaries), which for a checkpointed step is the step's peak. Both
    are measured here, independent of the strategy: the states' bytes, and the peak of an
    optimizer step alone. A plan's budget for forward and backward is the measured budget less
    the states; its predicted peak is the larger of its planned peak plus the states and the
    optimizer step's peak. (Calibrating by torch checkpoint's measured minus planned peak
    instead over-predicted every step whose peak is in backward by the optimizer step's
    temporaries: 2 GiB on llama8.)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import time
import unittest.mock
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn

import matepoint
import matepoint.integrations
from matepoint._budget_profile import op_kind
from matepoint_examples.bench._budget_report import (
    TWIN_SUFFIX,
    plot_frontier,
    print_report,
    verdicts,
)
from matepoint_examples.bench._paired import per_round_ratios, quartiles, round_order
from matepoint_examples.models import GPTConfig, LlamaConfig, LlamaStack, NanoGPT

__all__ = [
    "WORKLOADS",
    "BudgetWorkload",
    "main",
    "parse_bytes",
    "plot_frontier",
    "selective_policy",
]

CheckpointFn = Callable[..., Any]


def _set_checkpoint_fn(model: nn.Module, fn: CheckpointFn) -> None:
    setattr(model, "checkpoint_fn", fn)  # noqa: B010 (an attribute of the example models only)


@dataclasses.dataclass(frozen=True)
class BudgetWorkload:
    """A model of the budget benchmark: how to build it, feed it and point it at a checkpoint.

    Attributes:
        build: Makes the model (in bf16, on the device in force) and its inputs.
        loss: The training loss of the model on its inputs.
        set_checkpoint: Runs every block of the model through a ``checkpoint_fn``. Default:
            the example models' ``checkpoint_fn`` attribute.
        projections: The matrix products of one block, as op kinds, for torch's selective
            peers: (every projection, the MLP's down projection).
        hf: Whether it is a Hugging Face model (checkpointed through its own layers).
        planning: The context the model is planned in on the meta device.
    """

    build: Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]
    loss: Callable[[Callable[..., Any], tuple[Tensor, ...]], Tensor]
    projections: tuple[frozenset[str], str]
    set_checkpoint: Callable[[nn.Module, CheckpointFn], None] = _set_checkpoint_fn
    hf: bool = False
    planning: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def _llama(config: LlamaConfig, batch: int) -> BudgetWorkload:
    d, f = config.width, config.ffn_width

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        stack = LlamaStack(config).to(torch.bfloat16)
        return stack, (torch.randn(batch, config.seq_len, d, dtype=torch.bfloat16),)

    every = frozenset(
        {f"matmul {d}x{3 * d}", f"matmul {d}x{d}", f"matmul {d}x{f}", f"matmul {f}x{d}"}
    )
    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: model(*inputs).float().square().mean(),
        projections=(every, f"matmul {f}x{d}"),
    )


def _nanochat(depth: int, batch: int, seq_len: int) -> BudgetWorkload:
    config = GPTConfig.from_depth(depth, seq_len=seq_len, x0_mixing=True)
    d, hidden = config.width, config.mlp_ratio * config.width

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        model = NanoGPT(config).to(torch.bfloat16)
        idx = torch.randint(0, config.vocab_size, (batch, seq_len))
        return model, (idx, idx)

    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: model(*inputs),
        projections=(
            frozenset({f"matmul {d}x{d}", f"matmul {d}x{hidden}", f"matmul {hidden}x{d}"}),
            f"matmul {hidden}x{d}",
        ),
    )


def _hf_llama(
    layers: int, width: int, ffn_width: int, heads: int, batch: int, seq_len: int
) -> BudgetWorkload:
    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        import transformers

        config = transformers.LlamaConfig(
            hidden_size=width,
            intermediate_size=ffn_width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            vocab_size=32000,
            max_position_embeddings=seq_len,
            attn_implementation="sdpa",
        )
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        model.train()
        # Layers call _gradient_checkpointing_func; torch's own until a strategy replaces it.
        matepoint.integrations.enable_hf_gradient_checkpointing(model)
        return model, (torch.randint(0, 32000, (batch, seq_len)),)

    def set_checkpoint(model: nn.Module, fn: CheckpointFn) -> None:
        for module in model.modules():
            if hasattr(module, "_gradient_checkpointing_func"):
                setattr(module, "_gradient_checkpointing_func", fn)  # noqa: B010

    every = frozenset(
        {f"matmul {width}x{width}", f"matmul {width}x{ffn_width}", f"matmul {ffn_width}x{width}"}
    )
    return BudgetWorkload(
        build=build,
        loss=lambda model, inputs: model(input_ids=inputs[0], labels=inputs[0]).loss,
        set_checkpoint=set_checkpoint,
        projections=(every, f"matmul {ffn_width}x{width}"),
        hf=True,
        planning=_one_sequence_per_row,
    )


def _one_sequence_per_row() -> contextlib.AbstractContextManager[Any]:
    """transformers' search for packed sequences, answered as the real step answers it: none.

    Without an attention mask, transformers reads the position ids' values to find sequences
    packed into one row, which the meta device cannot; the real step's ids are one range per
    row, so it finds none and runs SDPA causal, with no mask. Planning with a 4D mask instead
    traced an attention the real step does not run (the mask a checkpoint input of every
    layer): torch checkpoint's planned peak was 13 MiB above its measured one on an H200.
    """
    import transformers.masking_utils

    if not hasattr(transformers.masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    return unittest.mock.patch.object(
        transformers.masking_utils, "find_packed_sequence_indices", return_value=None
    )


WORKLOADS: dict[str, BudgetWorkload] = {
    "llama8": _llama(LlamaConfig(depth=8, width=4096, ffn_width=14336, heads=32, seq_len=8192), 1),
    "llama16": _llama(LlamaConfig(depth=16, width=2048, ffn_width=7168, heads=16, seq_len=4096), 2),
    # Beyond 24 GiB under torch's checkpoint (its saved block inputs: 16 GiB), within it once
    # matepoint offloads them: the fixed-budget workload.
    "llama64-long": _llama(
        LlamaConfig(depth=64, width=1024, ffn_width=3584, heads=8, seq_len=8192), 16
    ),
    "nanochat12": _nanochat(12, 8, 2048),
    "hf-llama16": _hf_llama(16, 2048, 5632, 16, 2, 4096),
    "llama-tiny": _llama(LlamaConfig(depth=2, width=64, ffn_width=128, heads=4, seq_len=64), 1),
}
"""Name -> workload."""


def parse_bytes(text: str) -> int:
    """``"24GiB"``, ``"1.5GB"``, ``"512MiB"`` or a plain number of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 1000, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for unit, scale in sorted(units.items(), key=lambda item: -len(item[0])):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * scale)
    return int(float(lowered))


def selective_policy(saved_kinds: frozenset[str]) -> Callable[..., Any]:
    """torch's selective checkpoint saving the ops of ``saved_kinds`` (``matepoint`` op kinds)."""

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        del ctx, kwargs
        if op_kind(func, args) in saved_kinds:
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


# The eager strategies every run measures (``_checkpoint_fns``).
_EAGER_STRATEGIES = ("torch", "matepoint", "none", "sac-attention-down", "sac-every-matmul")


def _checkpoint_fns(workload: BudgetWorkload) -> dict[str, CheckpointFn]:
    every_matmul, down = workload.projections
    sac = functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

    def selective(kinds: frozenset[str]) -> CheckpointFn:
        context_fn = functools.partial(
            torch_checkpoint.create_selective_checkpoint_contexts, selective_policy(kinds)
        )
        return functools.partial(sac, context_fn=context_fn)

    return {
        "torch": sac,
        "matepoint": functools.partial(matepoint.checkpoint, use_reentrant=False),
        "none": _no_checkpoint,
        "sac-attention-down": selective(frozenset({"attention", down})),
        "sac-every-matmul": selective(frozenset({"attention", *every_matmul})),
    }


def _no_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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


class _Runner:
    """One model and optimizer; a step under any strategy, timed, with its peak memory."""

    def __init__(self, workload: BudgetWorkload) -> None:
        self.workload = workload
        torch.manual_seed(0)
        with torch.device("cuda"):
            self.model, self.inputs = workload.build()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)
        self.settings: dict[str, dict[str, Any]] = {}
        self.compiled: dict[str, Callable[[], Tensor]] = {}
        self.errors: dict[str, str] = {}

    def state_bytes(self) -> int:
        """Bytes of the optimizer's states (they stay on the device through every step)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, Tensor) and value.is_cuda
        )

    def optimizer_step_peak(self) -> int:
        """The peak of an optimizer step alone, gradients in place (zero gradients)."""
        for parameter in self.model.parameters():
            parameter.grad = torch.zeros_like(parameter)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self.optimizer.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
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

    def step(self, name: str, checkpoint_fn: CheckpointFn | None) -> tuple[float, int]:
        """One training step; (seconds, peak bytes), or (nan, -1) when it ran out of memory."""
        self.workload.set_checkpoint(self.model, checkpoint_fn or _no_checkpoint)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        try:
            with matepoint.options(**self.settings.get(name, {})):
                loss: Tensor = (
                    self.compiled[name]()
                    if name in self.compiled
                    else self.workload.loss(self.model, self.inputs)
                )
                loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
            del loss
            self.optimizer.step()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            self.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            return math.nan, -1
        except Exception as error:  # a compiled strategy that fails to compile: reported, skipped
            if name not in self.compiled:
                raise
            self.errors.setdefault(name, f"{type(error).__name__}: {error}"[:500])
            self.optimizer.zero_grad(set_to_none=True)
            return math.nan, -1
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, torch.cuda.max_memory_allocated()


def _alternate(
    runner: _Runner, strategies: Mapping[str, CheckpointFn | None], rounds: int, warmup: int
) -> tuple[dict[str, list[float | None]], dict[str, int]]:
    """Run each strategy once per round, the order rotating (``round_order``).

    Returns, from the rounds after ``warmup``, each strategy's step times (None where it ran
    out of memory) and its peak.
    """
    times: dict[str, list[float | None]] = {name: [] for name in strategies}
    peaks: dict[str, int] = {}
    for round_index in range(warmup + rounds):
        for name in round_order(list(strategies), round_index):
            seconds, peak = runner.step(name, strategies[name])
            if round_index >= warmup:
                times[name].append(None if math.isnan(seconds) else seconds)
                peaks[name] = max(peaks.get(name, -1), peak)
    return times, peaks


def _checkpoint_fn(plan: matepoint.BudgetPlan) -> CheckpointFn:
    """``matepoint.checkpoint`` with ``plan``'s policy (its settings go to ``_Runner.settings``)."""
    context_fn = plan.context_fn()
    extra: dict[str, Any] = {} if context_fn is None else {"context_fn": context_fn}
    return functools.partial(matepoint.checkpoint, use_reentrant=False, **extra)


def _choice(plan: matepoint.BudgetPlan) -> tuple[Any, ...]:
    """What a plan does: its decisions, where it keeps, and its settings."""
    return plan.decisions, plan.kept_in_last, plan.settings_changes()


def _measure_finalists(
    runner: _Runner, rounds: int = 20
) -> Callable[[Sequence[matepoint.BudgetPlan]], list[float]]:
    """A ``measure=`` for the budget search: the finalists' steps alternated, paired.

    One warm-up round, then ``rounds``: a plan with a selective policy is host-bound in
    stretches on a fast device (its step runs at either of two speeds, the slower one for
    several steps in a row; docs/budget.md), and 8 rounds fell in one such stretch and chose
    the slower finalist. A finalist's time is a reference finalist's median step
    times the median of its per-round ratios to that reference (the pairing the other
    strategies are compared with; a median of each one's own times mixes the host's drift into
    the comparison); one that ran out of memory in any round measures ``math.inf`` (Note
    [Measured finalists] in ``matepoint._budget``).
    """

    def measure(plans: Sequence[matepoint.BudgetPlan]) -> list[float]:
        finalists: dict[str, CheckpointFn] = {}
        for index, plan in enumerate(plans):
            finalists[f"finalist {index}"] = _checkpoint_fn(plan)
            runner.settings[f"finalist {index}"] = plan.settings_changes()
        times = _alternate(runner, finalists, rounds, warmup=1)[0]
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


def _plan(workload: BudgetWorkload) -> matepoint.MemoryPlan:
    torch.manual_seed(0)
    with torch.device("meta"):
        model, inputs = workload.build()
    if not workload.hf:
        workload.set_checkpoint(model, functools.partial(matepoint.checkpoint, use_reentrant=False))

    def step(*args: Tensor) -> Tensor:
        # The plan runs the step again for each search: the context goes with it.
        with workload.planning():
            return workload.loss(model, args)

    return matepoint.plan(step, *inputs)


def _budgets(names: Sequence[str], peaks: dict[str, int]) -> dict[str, int]:
    """``torch`` / ``mid`` / a size -> the budget in bytes (skipping what ran out of memory)."""
    budgets: dict[str, int] = {}
    for name in names:
        if name == "torch" and peaks["torch"] > 0:
            budgets["budget@torch"] = peaks["torch"]
        elif name == "mid" and min(peaks.values()) > 0:
            budgets["budget@mid"] = (peaks["torch"] + peaks["none"]) // 2
        elif name not in ("torch", "mid"):
            budgets[f"budget@{name}"] = parse_bytes(name)
    return budgets


def run(
    workload_name: str,
    rounds: int,
    warmup: int,
    budget_names: Sequence[str] = ("torch", "mid"),
    compiled: bool = False,
    twin: str | None = None,
) -> dict[str, Any]:
    """Measure every strategy and the budget plans of ``workload_name``; return the report.

    ``twin`` names an eager strategy to run a second time each round (``TWIN_SUFFIX``).
    """
    workload = WORKLOADS[workload_name]
    runner = _Runner(workload)
    strategies: dict[str, CheckpointFn | None] = dict(_checkpoint_fns(workload))
    if twin is not None:
        strategies[twin + TWIN_SUFFIX] = strategies[twin]
    measured_peaks: dict[str, int] = {}
    # The optimizer's states exist after its first step: a step of matepoint's, which fits
    # wherever anything does (torch's checkpoint may not, under a device-memory cap).
    runner.step("matepoint", strategies["matepoint"])
    for name in ("torch", "none"):
        for _ in range(2):
            measured_peaks[name] = runner.step(name, strategies[name])[1]
    memory_plan = _plan(workload)
    # See Note [Calibrating the planned peak].
    states = runner.state_bytes()
    optimizer_peak = runner.optimizer_step_peak()

    def predicted(planned_peak: int) -> int:
        return max(planned_peak + states, optimizer_peak)

    # The time model's rates, measured on this device (cached per device and torch).
    device_model = matepoint.calibrate(refresh=True)
    print(device_model, flush=True)
    budgets = _budgets(budget_names, measured_peaks)
    plans: dict[str, dict[str, Any]] = {}
    for name, budget in budgets.items():
        # The time model's own choice, then the search again with its finalists measured here.
        started = time.perf_counter()
        model_plan = memory_plan.fastest_under(budget - states, device=device_model)
        search_seconds = time.perf_counter() - started
        budget_plan = memory_plan.fastest_under(
            budget - states, device=device_model, measure=_measure_finalists(runner)
        )
        plans[name] = {
            "budget_bytes": budget,
            "fits": budget_plan.fits,
            "model_decisions": dict(model_plan.decisions),
            "model_kept_in_last": dict(model_plan.kept_in_last),
            "measured_finalist_seconds": list(budget_plan.measured_seconds),
            "decisions": dict(budget_plan.decisions),
            "kept_in_last": dict(budget_plan.kept_in_last),
            "settings": budget_plan.settings_changes(),
            "predicted_peak_bytes": predicted(budget_plan.peak_bytes),
            "smallest_budget_bytes": predicted(budget_plan.smallest_budget_bytes),
            "estimated_step_ratio": budget_plan.step_seconds / budget_plan.every_block_seconds,
            "search_seconds": search_seconds,
        }
        print(budget_plan, flush=True)
        strategies[name] = _checkpoint_fn(budget_plan)
        runner.settings[name] = budget_plan.settings_changes()
        if _choice(model_plan) != _choice(budget_plan):
            strategies[f"{name} model"] = _checkpoint_fn(model_plan)
            runner.settings[f"{name} model"] = model_plan.settings_changes()
        if compiled and min(measured_peaks.values()) > 0:
            # torch's knob is a fraction of what recomputing nothing would hold.
            span = measured_peaks["none"] - measured_peaks["torch"]
            fraction = min(1.0, max(0.0, (budget - measured_peaks["torch"]) / span))
            label = f"compiled-amb@{name.removeprefix('budget@')}"
            runner.add_compiled(label, fraction)
            strategies[label] = None
            plans[name]["compiled_activation_memory_budget"] = fraction
        elif compiled:
            print(
                f"{name}: no compiled activation_memory_budget: torch's checkpoint or no "
                "checkpoint ran out of memory, and its knob is a fraction of the way between "
                "their peaks",
                flush=True,
            )
        if compiled:
            # The plan under matepoint's compiled path: torch's compiled selective checkpointing
            # takes its policy (offload values as save: docs/selective.md), matepoint moves the
            # checkpoint inputs.
            label = f"compiled-plan@{name.removeprefix('budget@')}"
            runner.add_compiled(label)
            strategies[label] = _checkpoint_fn(budget_plan)
            runner.settings[label] = {**budget_plan.settings_changes(), "compiled_offload": True}
    names = list(strategies)
    times, peaks = _alternate(runner, strategies, rounds, warmup)
    # Beside the ratio to torch's checkpoint, the ratio to matepoint on every block: the one
    # reference that fits wherever anything does (under a device-memory cap torch's may not).
    references = {
        "ratio": per_round_ratios(times),
        "to_matepoint": per_round_ratios(times, "matepoint"),
    }
    rows = {}
    for name in names:
        row: dict[str, Any] = {"peak_bytes": peaks.get(name)}
        for label, ratios in references.items():
            if ratios.get(name):
                q1, median, q3 = quartiles(ratios[name])
                row.update({label: median, f"{label}_q1": q1, f"{label}_q3": q3})
        if name in runner.errors:
            row["error"] = runner.errors[name]
        planned = name in ("torch", "none", "matepoint")
        row["planned_peak_bytes"] = predicted(memory_plan[name].peak_bytes) if planned else None
        row["seconds"] = times[name]
        rows[name] = row
    for name, verdict in verdicts(plans, times, peaks, runner.errors).items():
        plans[name]["verdict"] = verdict
    return {
        "workload": workload_name,
        "rounds": rounds,
        "device": torch.cuda.get_device_name(),
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "torch": torch.__version__,
        "device_model": dataclasses.asdict(device_model),
        "optimizer_state_bytes": states,
        "optimizer_step_peak_bytes": optimizer_peak,
        "plans": plans,
        "rows": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run the budget benchmark, or plot saved reports; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="matepoint-bench budget",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="llama8")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--budgets",
        default="torch,mid",
        help="comma-separated: torch (torch checkpoint's measured peak), mid (halfway to no "
        "checkpoint's) or a size such as 24GiB",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_bytes,
        default=None,
        help="cap this process's device memory (e.g. 24GiB) with "
        "torch.cuda.set_per_process_memory_fraction",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="add torch's compiled activation_memory_budget at each budget, for reference, and "
        "each budget plan under matepoint's compiled path",
    )
    parser.add_argument(
        "--twin",
        choices=sorted(_EAGER_STRATEGIES),
        default=None,
        help="run this eager strategy twice each round: the verdict's control of the run's noise",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--plot", type=Path, default=None, help="draw the frontier of REPORTS into this file"
    )
    parser.add_argument("reports", nargs="*", type=Path, help="saved reports, for --plot")
    args = parser.parse_args(argv)
    if args.plot is not None:
        plot_frontier([json.loads(path.read_text()) for path in args.reports], args.plot)
        return 0
    if not torch.cuda.is_available():
        print("the budget benchmark measures GPU memory and needs a CUDA device")
        return 2
    if args.device_memory is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.device_memory / total))
    budget_names = [name.strip() for name in args.budgets.split(",") if name.strip()]
    report = run(args.workload, args.rounds, args.warmup, budget_names, args.compiled, args.twin)
    report["device_memory_cap_bytes"] = args.device_memory
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
