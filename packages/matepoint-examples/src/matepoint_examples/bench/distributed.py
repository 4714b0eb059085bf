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
    torchrun --nproc-per-node 2 -m matepoint_examples.bench.distributed --mode ddp --out ddp.json
    python -m matepoint_examples.bench.distributed --mode single --save-params ref.pt --out ref.json
    torchrun --nproc-per-node 2 -m matepoint_examples.bench.distributed --mode ddp \
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
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import matepoint
import matepoint_compat
from matepoint.integrations import apply_matepoint_checkpointing
from matepoint_examples._runtime import rss_bytes, synchronize
from matepoint_examples.bench._distributed_paired import (
    PAIRED,
    CheckpointSwitch,
    paired_line,
    paired_summary,
    step_schedule,
)
from matepoint_examples.bench._distributed_params import (
    checksums,
    compare_params,
    full_params,
    grad_norm,
)
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
        prog="python -m matepoint_examples.bench.distributed",
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


def _barrier(device: torch.device) -> None:
    """A barrier over all ranks, on this rank's GPU under NCCL."""
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


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
    schedule = step_schedule(args)
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
            grad_norms.append(grad_norm(model, sharded=args.mode == "fsdp2"))
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
    params = full_params(model)
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
        "param_checksums": checksums(params),
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
