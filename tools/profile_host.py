"""Profile the host side of a benchmark workload's forward pass, per strategy.

``python tools/profile_host.py [--workload gpt12] [--strategies torch,matepoint] [--steps 5]``

On a launch-bound workload the host's time to enqueue the forward is the step time, so every
microsecond matepoint spends per offload shows up in it. For each strategy this builds the
workload (as ``matepoint-bench`` does), runs warm-up steps, then times the forward's enqueue
(``perf_counter`` around the forward, no synchronize inside it) and the whole step over
``--steps`` steps, and prints the median of each. With ``--profile`` it also runs the forward of
the last strategy under cProfile and prints the functions with the most own time: where the
host's extra time goes. With ``--trace`` it runs one whole step of every strategy under
``torch.profiler`` (CPU and CUDA activity) and prints the operators and CUDA runtime calls with
the most own host time, then those with the most device time: a blocking runtime call or a
kernel that only one strategy runs shows up there. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import gzip
import io
import pstats
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from matepoint_examples._workloads import build, get_workload
from matepoint_examples.bench._worker import _one_step
from matepoint_examples.strategies import get_strategy


class _GcPauses:
    """A ``gc.callbacks`` entry that adds up the time spent in garbage collection."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.collections += 1


def _trace_step(built: Any, strategy: Any, chrome_trace: Path | None) -> str:
    """One step under torch.profiler: the top host-time and device-time rows.

    With ``chrome_trace`` the step's timeline is also written there, gzipped (chrome://tracing
    or Perfetto open it): which stream ran what when, and where the host waited.
    """
    from torch.profiler import ProfilerActivity, profile

    built.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        with strategy.forward_context():
            loss = built.loss()
        torch.autograd.backward(loss)
        torch.cuda.synchronize()
    if chrome_trace is not None:
        raw = chrome_trace.with_suffix("")
        trace.export_chrome_trace(str(raw))
        with raw.open("rb") as source, gzip.open(chrome_trace, "wb") as target:
            shutil.copyfileobj(source, target)
        raw.unlink()
    averages = trace.key_averages()
    host = averages.table(sort_by="self_cpu_time_total", row_limit=25)
    device = averages.table(sort_by="self_cuda_time_total", row_limit=20)
    return f"{host}\n{device}\n"


def _measure(
    workload_name: str,
    strategy_name: str,
    steps: int,
    profile: bool,
    trace: bool,
    trace_dir: Path | None = None,
) -> str:
    device = torch.device("cuda")
    strategy = get_strategy(strategy_name)
    with strategy.session(device):
        built = build(get_workload(workload_name), strategy.checkpoint_fn, device)
        for _ in range(3):
            _one_step(built, strategy)
        torch.cuda.synchronize()
        enqueue: list[float] = []
        whole: list[float] = []
        pauses = _GcPauses()
        gc.callbacks.append(pauses)
        for _ in range(steps):
            built.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            start = time.perf_counter()
            with strategy.forward_context():
                loss = built.loss()
            enqueued = time.perf_counter()
            torch.autograd.backward(loss)
            torch.cuda.synchronize()
            enqueue.append(enqueued - start)
            whole.append(time.perf_counter() - start)
            del loss
        gc.callbacks.remove(pauses)
        text = (
            f"{workload_name} / {strategy_name}: forward enqueue "
            f"{1e3 * statistics.median(enqueue):.2f} ms, step {1e3 * statistics.median(whole):.2f}"
            f" ms (medians); garbage collection {1e3 * pauses.seconds / steps:.2f} ms and "
            f"{pauses.collections / steps:.1f} collections per step\n"
        )
        if profile:
            profiler = cProfile.Profile()
            built.model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            with strategy.forward_context():
                profiler.enable()
                loss = built.loss()
                profiler.disable()
            torch.autograd.backward(loss)
            torch.cuda.synchronize()
            stream = io.StringIO()
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
            text += stream.getvalue()
        if trace:
            path = None
            if trace_dir is not None:
                path = trace_dir / f"{workload_name}-{strategy_name}.json.gz"
            text += _trace_step(built, strategy, path)
    return text


def _micro(calls: int) -> str:
    """cProfile ``calls`` checkpoint calls of a cheap block on a 2 MiB input (no backward).

    Every output is kept until the loop ends, as a forward pass keeps its activations, so
    ``calls`` x 2 MiB of pinned memory is in use at the end.

    The block is one multiply, so almost all host time is the checkpoint machinery: torch's and,
    for ``matepoint.checkpoint``, the pack hook, the engine's bookkeeping and the copy's launch.
    """
    import torch.utils.checkpoint as torch_checkpoint

    import matepoint

    x = torch.randn(512, 1024, device="cuda", requires_grad=True)

    def block(h: torch.Tensor) -> torch.Tensor:
        return h * 2.0

    # x * 1: each call saves a new activation (the same tensor twice would be deduplicated).
    def run_torch() -> Any:
        return torch_checkpoint.checkpoint(block, x * 1, use_reentrant=False)

    def run_matepoint() -> Any:
        return matepoint.checkpoint(block, x * 1)

    text = ""
    for name, call in (("torch", run_torch), ("matepoint", run_matepoint)):
        for _ in range(50):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = [call() for _ in range(calls)]
        elapsed = time.perf_counter() - start
        del outputs
        torch.cuda.synchronize()
        text += f"{name}: {1e6 * elapsed / calls:.1f} us per checkpoint call (host)\n"
    profiler = cProfile.Profile()
    outputs = []
    profiler.enable()
    for _ in range(calls):
        outputs.append(run_matepoint())
    profiler.disable()
    del outputs
    torch.cuda.synchronize()
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    return text + stream.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--workload", default="gpt12")
    parser.add_argument("--strategies", default="torch,matepoint")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the last strategy")
    parser.add_argument(
        "--micro", type=int, metavar="CALLS", help="only cProfile CALLS cheap checkpoint calls"
    )
    parser.add_argument("--trace", action="store_true", help="torch.profiler, every strategy")
    parser.add_argument(
        "--trace-dir", type=Path, help="with --trace: write each step's Chrome trace here"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_host.py needs a CUDA device", file=sys.stderr)
        return 2
    if args.micro:
        print(_micro(args.micro), flush=True)
        return 0
    names = args.strategies.split(",")
    for index, name in enumerate(names):
        profile = args.profile and index == len(names) - 1
        text = _measure(args.workload, name, args.steps, profile, args.trace, args.trace_dir)
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
