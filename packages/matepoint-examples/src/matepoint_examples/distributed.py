"""Train an example model with every block checkpointed, alone, under DDP or under FSDP2.

Run it under ``torchrun`` for DDP and FSDP2, or as a plain program for the single-process
reference. Every mode builds the same model from the same seed and draws the same global batch
each step; a distributed run gives each rank an equal slice of it, so after N steps its
parameters match the single-process run up to the summation order of the gradient all-reduce.
Each block is wrapped with torch's ``checkpoint_wrapper`` (matepoint's through
:func:`matepoint.integrations.checkpoint_wrapper`, or torch's own), and FSDP2 shards the wrapped
blocks, so FSDP's all-gathers stay outside the checkpoints.

On a CPU (gloo) matepoint runs under :class:`matepoint.testing.CPUTestTransport` with no minimum
size, so the offload path really runs; on CUDA each rank uses ``cuda:LOCAL_RANK``.

Rank 0 writes a JSON report: the loss per step, the final parameters' checksums, gradient norms,
step times, and per rank the device bytes held after forward, host RSS and ``matepoint.stats()``.
``--save-params`` writes the final parameters, and ``--compare-to`` compares with such a file.

``--checkpoint paired`` compares the two checkpoints' speed in one run: the time of one step in
two separate processes varies by several percent between runs, more than the gap to measure.
Each block's wrapper then asks a :class:`CheckpointSwitch` which checkpoint to run at call time,
and after ``--warmup`` untimed steps the loop runs ``--rounds`` rounds of one step with torch's
checkpoint and one with matepoint's, on the same model and optimizer, the order swapped every
round. The report's ``paired`` entry has each checkpoint's median step time and matepoint's time
over torch's as the median of the per-round ratios, with their interquartile range. Both are
exact checkpoints (identical gradients on identical weights), so alternating them trains the
model as either would alone; still, this mode only measures time, and parity with a single
process is what the other modes check.

Example:
    torchrun --nproc-per-node 2 -m matepoint_examples.distributed --mode ddp --out ddp.json
    python -m matepoint_examples.distributed --mode single --save-params ref.pt --out ref.json
    torchrun --nproc-per-node 2 -m matepoint_examples.distributed --mode ddp \
        --checkpoint paired --warmup 6 --rounds 20 --out paired.json
"""

from __future__ import annotations

import os

# Before torch.distributed starts: NVLink multicast (NVLS) stays off. On shared multi-GPU hosts a
# program that uses it can put every GPU of the host out of service, so this is not optional.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

import matepoint
import matepoint_compat
from matepoint.integrations import apply_matepoint_checkpointing, matepoint_checkpoint_fn
from matepoint_examples._paired import quartiles, round_order
from matepoint_examples._runtime import rss_bytes, synchronize
from matepoint_examples.models import (
    DeepLatentConfig,
    DeepLatentStack,
    GPTBlock,
    GPTConfig,
    LatentBlock,
    NanoGPT,
)
from matepoint_examples.strategies import get_strategy

__all__ = [
    "PAIRED",
    "CheckpointSwitch",
    "compare_params",
    "fully_shard_fn",
    "main",
    "paired_line",
    "paired_summary",
    "parse_args",
    "run",
]

MODES = ("single", "ddp", "fsdp2")
CHECKPOINTS = ("matepoint", "torch", "none", "paired")
PAIRED = ("torch", "matepoint")
"""What ``--checkpoint paired`` alternates; the first is the reference of the ratio."""
_WRAPPED_PREFIX = "_checkpoint_wrapped_module."


def fully_shard_fn() -> Callable[..., Any] | None:
    """Return FSDP2's ``fully_shard``, or ``None`` where this torch lacks it.

    Returns:
        The function, from ``torch.distributed.fsdp`` (torch 2.6+) or its earlier home.
    """
    if not dist.is_available():
        return None
    try:
        if matepoint_compat.TORCH_2_6_PLUS:
            from torch.distributed.fsdp import fully_shard
        else:  # torch < 2.6; delete with support for torch 2.5
            from torch.distributed._composable.fsdp import (  # type: ignore[attr-defined,unused-ignore]
                fully_shard,
            )
    except ImportError:
        return None
    return fully_shard


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line.

    Args:
        argv: Arguments without the program name. Default: ``sys.argv[1:]``.

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(
        prog="python -m matepoint_examples.distributed",
        description="Train an example model with checkpointed blocks: single, DDP or FSDP2.",
    )
    parser.add_argument("--model", choices=("latent", "gpt"), default="latent")
    parser.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="default: ddp under torchrun with several processes, else single",
    )
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl on CUDA, gloo on CPU",
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--checkpoint",
        choices=CHECKPOINTS,
        default="matepoint",
        help="what checkpoints each block (default: matepoint); paired: torch's and "
        "matepoint's alternately, step by step, timing both",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps to train (not paired)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="paired only: untimed steps first, alternating the checkpoints (default: 2)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="paired only: timed rounds of one step per checkpoint (default: 10)",
    )
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sample (GPT: seq len)")
    parser.add_argument(
        "--batch", type=int, default=4, help="global batch, split evenly across ranks"
    )
    parser.add_argument("--vocab-size", type=int, default=256, help="GPT only")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="bfloat16: autocast around forward, float32 parameters",
    )
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON report (rank 0)")
    parser.add_argument(
        "--save-params",
        type=Path,
        default=None,
        help="save the final full parameters here (rank 0, torch.save)",
    )
    parser.add_argument(
        "--compare-to",
        type=Path,
        default=None,
        help="compare the final parameters with a --save-params file",
    )
    parser.add_argument("--rtol", type=float, default=1e-5)
    parser.add_argument("--atol", type=float, default=1e-6)
    args = parser.parse_args(argv)
    if args.mode is None:
        args.mode = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"
    for name in ("steps", "rounds", "depth", "width", "heads", "tokens", "batch", "vocab_size"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0:
        parser.error("--warmup must not be negative")
    return args


# -- the model and the data ---------------------------------------------------------------------


def _build_model(args: argparse.Namespace) -> tuple[nn.Module, type[nn.Module]]:
    """Build the model on the CPU from the seed (the same on every rank) and say its block type."""
    torch.manual_seed(args.seed)
    if args.model == "latent":
        latent = DeepLatentConfig(
            depth=args.depth,
            width=args.width,
            heads=args.heads,
            batch=args.batch,
            tokens=args.tokens,
        )
        return DeepLatentStack(latent), LatentBlock
    gpt = GPTConfig(
        depth=args.depth,
        width=args.width,
        head_dim=args.width // args.heads,
        seq_len=args.tokens,
        vocab_size=args.vocab_size,
    )
    return NanoGPT(gpt), GPTBlock


class CheckpointSwitch:
    """A checkpoint function that runs torch's or matepoint's, whichever is current at call time.

    ``--checkpoint paired`` wraps every block in torch's ``CheckpointWrapper`` with this as its
    ``checkpoint_fn``; setting :attr:`current` changes how the blocks are checkpointed from the
    next call on. The two functions are exactly what ``--checkpoint torch`` and ``--checkpoint
    matepoint`` install: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` and
    :func:`matepoint.integrations.matepoint_checkpoint_fn` (``matepoint.checkpoint``,
    non-reentrant).

    Args:
        current: The checkpoint to start with, one of :data:`PAIRED`.
    """

    def __init__(self, current: str = PAIRED[0]) -> None:
        self.functions: dict[str, Callable[..., Any]] = {
            "torch": functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False),
            "matepoint": matepoint_checkpoint_fn(),
        }
        self.current = current
        self.calls = dict.fromkeys(self.functions, 0)

    @property
    def current(self) -> str:
        """The checkpoint the next call runs: ``"torch"`` or ``"matepoint"``."""
        return self._current

    @current.setter
    def current(self, name: str) -> None:
        if name not in self.functions:
            raise ValueError(
                f"unknown checkpoint {name!r}; expected one of {sorted(self.functions)}"
            )
        self._current = name

    def __call__(self, function: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run ``function(*args, **kwargs)`` under the current checkpoint."""
        self.calls[self._current] += 1
        return self.functions[self._current](function, *args, **kwargs)


def _checkpoint_blocks(
    model: nn.Module, block_type: type[nn.Module], how: str
) -> CheckpointSwitch | None:
    """Wrap every block in a ``CheckpointWrapper`` running matepoint's or torch's checkpoint.

    ``how="paired"`` wraps them through the same machinery as
    :func:`matepoint.integrations.apply_matepoint_checkpointing` (torch's
    ``apply_activation_checkpointing`` and ``checkpoint_wrapper``), with a
    :class:`CheckpointSwitch` as the checkpoint function, and returns the switch.
    """

    def is_block(module: nn.Module) -> bool:
        return isinstance(module, block_type)

    if how == "matepoint":
        apply_matepoint_checkpointing(model, check_fn=is_block)
    elif how == "torch":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=is_block)
    elif how == "paired":
        switch = CheckpointSwitch()
        matepoint_compat.torch_apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(
                matepoint_compat.torch_checkpoint_wrapper, checkpoint_fn=switch
            ),
            check_fn=is_block,
            auto_wrap_policy=None,
        )
        return switch
    return None


def _global_batch(args: argparse.Namespace, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Draw one step's global batch on the CPU: ``(input, target)``."""
    if args.model == "latent":
        shape = (args.batch, args.tokens, args.width)
        return (torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    tokens = torch.randint(0, args.vocab_size, (args.batch, args.tokens + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(model: nn.Module, args: argparse.Namespace, inputs: Tensor, target: Tensor) -> Tensor:
    """The mean loss over this rank's slice (equal slices: the mean of means is the global mean)."""
    if args.model == "latent":
        return F.mse_loss(model(inputs).float(), target.float())
    loss: Tensor = model(inputs, target)
    return loss


# -- helpers over ranks -------------------------------------------------------------------------


def _clean_name(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (DDP's ``module.``, the checkpoint's)."""
    name = name.replace(_WRAPPED_PREFIX, "")
    return name.removeprefix("module.")


def _full(tensor: Tensor) -> Tensor:
    """The full tensor of an FSDP2 shard (a collective: every rank must call it), else itself."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


def _local(tensor: Tensor) -> Tensor:
    """This rank's piece of an FSDP2 shard, else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _grad_norm(model: nn.Module, sharded: bool) -> float:
    """The global gradient norm (sharded: the squares of each rank's shard summed over ranks)."""
    total = torch.zeros((), dtype=torch.float64)
    for parameter in model.parameters():
        if parameter.grad is not None:
            total += _local(parameter.grad).detach().double().square().sum().cpu()
    if sharded:
        device = next(model.parameters()).device
        total = total.to(device)
        dist.all_reduce(total)
    return math.sqrt(float(total))


def _full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter, whole, in float32 on the CPU, by its unwrapped name (all ranks call it)."""
    return {
        _clean_name(name): _full(parameter.detach()).float().cpu()
        for name, parameter in model.named_parameters()
    }


def _checksums(params: dict[str, Tensor]) -> dict[str, Any]:
    total = sum(float(t.double().sum()) for t in params.values())
    total_abs = sum(float(t.double().abs().sum()) for t in params.values())
    return {
        "sum": total,
        "abs_sum": total_abs,
        "per_parameter_sum": {name: float(t.double().sum()) for name, t in params.items()},
    }


def compare_params(
    got: dict[str, Tensor], want: dict[str, Tensor], rtol: float, atol: float
) -> dict[str, Any]:
    """Compare two parameter dictionaries with ``torch.allclose`` and report the largest gaps.

    Args:
        got: Parameters by name.
        want: Reference parameters by name (the same names and shapes).
        rtol: Relative tolerance.
        atol: Absolute tolerance.

    Returns:
        ``{"allclose", "bitwise_equal", "max_abs_diff", "max_rel_diff", "worst_parameter"}``.

    Raises:
        ValueError: If the names or shapes differ.
    """
    if set(got) != set(want):
        raise ValueError(f"parameter names differ: {sorted(set(got) ^ set(want))}")
    allclose = bitwise = True
    max_abs = max_rel = 0.0
    worst = ""
    for name, reference in want.items():
        value = got[name]
        if value.shape != reference.shape:
            raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(reference.shape)}")
        diff = (value.double() - reference.double()).abs()
        abs_diff = float(diff.max()) if diff.numel() else 0.0
        relative = diff / reference.double().abs().clamp_min(1e-30)
        rel_diff = float(relative.max()) if diff.numel() else 0.0
        allclose &= torch.allclose(value, reference, rtol=rtol, atol=atol)
        bitwise &= torch.equal(value, reference)
        if abs_diff > max_abs:
            max_abs, worst = abs_diff, name
        max_rel = max(max_rel, rel_diff)
    return {
        "allclose": allclose,
        "bitwise_equal": bitwise,
        "rtol": rtol,
        "atol": atol,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "worst_parameter": worst,
    }


# -- the run ------------------------------------------------------------------------------------


def _setup(args: argparse.Namespace) -> tuple[torch.device, int, int]:
    """Start the process group (distributed modes) and pick this rank's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode == "single":
        if world > 1:
            raise SystemExit("--mode single runs in one process; launch it without torchrun")
        rank = 0
    else:
        if "RANK" not in os.environ:
            raise SystemExit(f"--mode {args.mode} needs torchrun (RANK and WORLD_SIZE unset)")
        rank = int(os.environ["RANK"])
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: CUDA is not available")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if args.mode != "single":
        backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl" and device.type != "cuda":
            raise SystemExit("--backend nccl needs CUDA devices")
        dist.init_process_group(backend=backend)
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split evenly over {world} ranks")
    return device, rank, world


def _distribute(
    model: nn.Module, args: argparse.Namespace, device: torch.device, world: int
) -> nn.Module:
    """Wrap ``model`` for its mode: as is, in DDP, or each block and the root fully sharded."""
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=device_ids)
    if args.mode == "fsdp2":
        fully_shard = fully_shard_fn()
        if fully_shard is None:
            raise SystemExit(f"--mode fsdp2 needs FSDP2 (fully_shard); torch {torch.__version__}")
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world,))
        blocks = model.get_submodule("blocks")
        for block in blocks.children():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _allocated(device: torch.device) -> int | None:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    """Train for ``args.steps`` steps and return the report on rank 0 (``None`` elsewhere).

    Args:
        args: Options from :func:`parse_args`.

    Returns:
        The report (also written to ``args.out`` when given) on rank 0.
    """
    device, rank, world = _setup(args)
    finished = False
    try:
        report = _train(args, device, rank, world)
        finished = True
        return report
    finally:
        if dist.is_available() and dist.is_initialized():
            if finished:
                # Every rank's collectives are done before the group's threads are torn down.
                dist.barrier()
            dist.destroy_process_group()


def _schedule(args: argparse.Namespace) -> list[str]:
    """The checkpoint each step runs: ``--steps`` times the one asked, or paired warm-up + rounds.

    Paired: the warm-up alternates the two checkpoints; round ``r`` runs each once, in
    :func:`matepoint_examples._paired.round_order` (rotated by one every round), so neither
    always runs first or always follows the other.
    """
    if args.checkpoint != "paired":
        return [args.checkpoint] * args.steps
    warmup = [PAIRED[i % len(PAIRED)] for i in range(args.warmup)]
    return warmup + [name for r in range(args.rounds) for name in round_order(PAIRED, r)]


def _barrier(device: torch.device) -> None:
    """A barrier over all ranks, on this rank's GPU under NCCL."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def paired_summary(
    strategies: Sequence[str], seconds_per_rank: Sequence[Sequence[float]], warmup: int
) -> dict[str, Any]:
    """Summarize a paired run: per checkpoint the median step, and matepoint's ratio to torch.

    A step's time is the largest over ranks (see ``_train``). The steps after the warm-up form
    rounds of one step per checkpoint in :data:`PAIRED`; the ratio is the median of the rounds'
    ``matepoint / torch``, with the first and third quartiles (``statistics.quantiles``,
    inclusive, as ``matepoint-bench`` reports them) and their difference ``iqr``.

    Args:
        strategies: The checkpoint of every step, warm-up included.
        seconds_per_rank: Per rank, every step's time in seconds, in the same order.
        warmup: How many steps at the start are warm-up (not timed into the summary).

    Returns:
        A JSON-ready dict: ``median_step_seconds``, ``ratio`` (``median``, ``q1``, ``q3``,
        ``iqr``, ``rounds``), ``per_round_ratios``, ``round_seconds`` and the schedule.

    Raises:
        ValueError: If a round is incomplete or runs a checkpoint twice, or no round was timed.
    """
    reference, measured = PAIRED
    seconds = [max(rank[i] for rank in seconds_per_rank) for i in range(len(strategies))]
    timed = list(zip(strategies[warmup:], seconds[warmup:], strict=True))
    if not timed or len(timed) % len(PAIRED):
        raise ValueError(f"{len(timed)} timed steps do not make whole rounds of {len(PAIRED)}")
    rounds: list[dict[str, Any]] = []
    for start in range(0, len(timed), len(PAIRED)):
        steps = timed[start : start + len(PAIRED)]
        if sorted(name for name, _ in steps) != sorted(PAIRED):
            raise ValueError(f"round {start // len(PAIRED)} ran {[n for n, _ in steps]}")
        rounds.append({"first": steps[0][0], **dict(steps)})
    ratios = [row[measured] / row[reference] for row in rounds]
    q1, median, q3 = quartiles(ratios)
    return {
        "strategies": list(PAIRED),
        "reference": reference,
        "warmup_steps": warmup,
        "rounds": len(rounds),
        "timing": (
            "forward + backward + optimizer step, between device synchronizes; under "
            "torchrun every rank starts the step after a barrier and the step's time is the "
            "largest over ranks"
        ),
        "step_strategy": list(strategies),
        "median_step_seconds": {
            name: statistics.median(row[name] for row in rounds) for name in PAIRED
        },
        "ratio": {
            "of": f"{measured}/{reference}",
            "median": median,
            "q1": q1,
            "q3": q3,
            "iqr": q3 - q1,
            "rounds": len(ratios),
        },
        "per_round_ratios": ratios,
        "round_seconds": rounds,
    }


def _train(
    args: argparse.Namespace, device: torch.device, rank: int, world: int
) -> dict[str, Any] | None:
    model, block_type = _build_model(args)
    switch = _checkpoint_blocks(model, block_type, args.checkpoint)
    model.to(device)
    model = _distribute(model, args, device, world)
    optimizer: torch.optim.Optimizer
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    generator = torch.Generator().manual_seed(args.seed + 1)
    share = args.batch // world
    rows = slice(rank * share, (rank + 1) * share)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    # matepoint's session only sets up its transport (on a CPU); torch's checkpoint ignores it,
    # so a paired run keeps it open around the steps of both.
    session = (
        get_strategy("matepoint").session(device)
        if args.checkpoint in ("matepoint", "paired")
        else contextlib.nullcontext()
    )
    schedule = _schedule(args)
    losses: list[float] = []
    grad_norms: list[float] = []
    step_seconds: list[float] = []
    held_after_forward: list[int | None] = []
    activation_bytes: list[int | None] = []
    with session:
        matepoint.reset_stats()
        for strategy in schedule:
            if switch is not None:
                switch.current = strategy
            inputs, target = (t[rows].to(device) for t in _global_batch(args, generator))
            if switch is not None and world > 1:
                # Paired timing over ranks: every rank starts the step together, after a
                # barrier, and times it on its own between device synchronizes; the report takes
                # the largest time over ranks. A data-parallel step is over only when the last
                # rank's is, and the optimizer step after the last all-reduce runs on each rank
                # unsynchronized, so rank 0's time alone could miss a slower rank's tail. The
                # barrier (untimed) keeps one step's skew between ranks, which the next step's
                # first collective would absorb as waiting, out of the next step, which in a
                # paired run belongs to the other checkpoint half of the time.
                synchronize(device)
                _barrier(device)
            synchronize(device)
            start = time.perf_counter()
            before = _allocated(device)
            with autocast:
                loss = _loss(model, args, inputs, target)
            after = _allocated(device)
            held_after_forward.append(after)
            activation_bytes.append(None if after is None or before is None else after - before)
            loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
            optimizer.step()
            synchronize(device)
            step_seconds.append(time.perf_counter() - start)
            # Outside the timed span (it copies to the host once per parameter). SGD and AdamW
            # read ``.grad`` and never write it, so this is the norm the step just used.
            grad_norms.append(_grad_norm(model, sharded=args.mode == "fsdp2"))
            optimizer.zero_grad(set_to_none=True)
            mean_loss = loss.detach().float()
            if world > 1:
                dist.all_reduce(mean_loss)
                mean_loss /= world
            losses.append(float(mean_loss))
            del loss, inputs, target
        offload_stats = dataclasses.asdict(matepoint.stats(synchronize=True))
    per_rank = {
        "rank": rank,
        "device": str(device),
        "device_bytes_after_forward": held_after_forward,
        "activation_bytes_after_forward": activation_bytes,
        "peak_device_bytes": (
            torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        ),
        "host_rss_bytes": rss_bytes(),
        "step_seconds": step_seconds,
        "matepoint_stats": offload_stats,
    }
    ranks: list[Any] = [per_rank]
    if world > 1:
        ranks = [None] * world
        dist.all_gather_object(ranks, per_rank)
    params = _full_params(model)
    if rank != 0:
        return None
    paired = (
        paired_summary(schedule, [r["step_seconds"] for r in ranks], args.warmup)
        if switch is not None
        else None
    )
    report: dict[str, Any] = {
        "model": args.model,
        "mode": args.mode,
        "checkpoint": args.checkpoint,
        "world_size": world,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "torch": torch.__version__,
        "matepoint": matepoint.__version__,
        "config": {
            key: (str(value) if isinstance(value, Path) else value)
            for key, value in vars(args).items()
        },
        "losses": losses,
        "grad_norms": grad_norms,
        "final_grad_norm": grad_norms[-1],
        # Paired: over the timed steps of both checkpoints (see "paired" for each one's).
        "step_seconds_median": (
            statistics.median(step_seconds[1:] or step_seconds)
            if paired is None
            else statistics.median(
                t for row in paired["round_seconds"] for t in (row[n] for n in PAIRED)
            )
        ),
        "param_checksums": _checksums(params),
        "ranks": ranks,
    }
    if paired is not None:
        report["paired"] = paired
    if args.save_params is not None:
        torch.save(params, args.save_params)
    if args.compare_to is not None:
        reference = torch.load(args.compare_to, weights_only=True)
        report["comparison"] = {
            "reference": str(args.compare_to),
            **compare_params(params, reference, args.rtol, args.atol),
        }
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def paired_line(paired: dict[str, Any]) -> str:
    """One line for a paired run: the ratio with its interquartile range, and the medians."""
    ratio = paired["ratio"]
    medians = ", ".join(
        f"{name} {seconds * 1e3:.2f} ms" for name, seconds in paired["median_step_seconds"].items()
    )
    return (
        f"paired {ratio['of']}: {ratio['median']:.4f} (IQR {ratio['q1']:.4f}-{ratio['q3']:.4f}, "
        f"{ratio['rounds']} rounds); median step: {medians}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: train, print a summary on rank 0.

    Args:
        argv: Arguments without the program name. Default: ``sys.argv[1:]``.

    Returns:
        0, or 1 if ``--compare-to`` found parameters outside the tolerance.
    """
    args = parse_args(argv)
    report = run(args)
    if report is None:
        return 0
    summary = {
        "mode": report["mode"],
        "checkpoint": report["checkpoint"],
        "world_size": report["world_size"],
        "losses": report["losses"],
        "final_grad_norm": report["final_grad_norm"],
        "param_sum": report["param_checksums"]["sum"],
        "step_seconds_median": report["step_seconds_median"],
        "offloads_per_rank": [r["matepoint_stats"]["offloads"] for r in report["ranks"]],
        "activation_bytes_after_forward": [
            r["activation_bytes_after_forward"][-1] for r in report["ranks"]
        ],
    }
    if "comparison" in report:
        summary["comparison"] = report["comparison"]
    if "paired" in report:
        summary["paired_ratio"] = report["paired"]["ratio"]
        summary["paired_median_step_seconds"] = report["paired"]["median_step_seconds"]
    print(json.dumps(summary, indent=2))
    if "paired" in report:
        print(paired_line(report["paired"]))
    if "comparison" in report and not report["comparison"]["allclose"]:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
