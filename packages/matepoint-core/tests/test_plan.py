"""matepoint.plan: memory, host RAM and link bytes of toy models, by hand and against the engine.

The toy blocks are chains of ``sin``: ``sin`` saves its input and nothing else, so what each
strategy keeps is countable. With ``B`` the bytes of one activation and ``L`` checkpointed blocks
of ``x.sin().sin()``, forward leaves for backward (plus the 512-byte loss scalar):

- no checkpoint: both ``sin`` inputs of every block, ``2L - 1`` activations (the step's input
  is allocated before the step, and the last output is saved by nobody);
- torch's checkpoint: each block's input but the first, ``L - 1``;
- matepoint: the newest block input only (its copy is done but the engine holds the newest).

Every block input crosses to the host once (``L`` activations, as much pinned RAM); in backward
the caller's input and the newest input are served on the device, so ``L - 2`` come back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import matepoint
from matepoint.testing import CPUTestTransport, use_transport

N = 1 << 18  # float32 elements: 1 MiB per activation, the default min_offload_bytes
B = 4 * N
SCALAR = 512  # the loss, as the caching allocator rounds it


def sin2(x: torch.Tensor) -> torch.Tensor:
    return x.sin().sin()


def chain(depth: int, **checkpoint_kwargs: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(depth):
            x = matepoint.checkpoint(sin2, x, **checkpoint_kwargs)
        return x

    return model


def meta_input(numel: int = N) -> torch.Tensor:
    return torch.empty(numel, device="meta", requires_grad=True)


def test_chain_by_hand() -> None:
    depth = 6
    plan = matepoint.plan(chain(depth), meta_input())
    none, torch_ckpt, mate = plan["none"], plan["torch"], plan["matepoint"]
    for strategy in (none, torch_ckpt, mate):
        assert strategy.baseline_bytes == B
        assert strategy.parameter_bytes == 0
    assert none.held_after_forward_bytes == (2 * depth - 1) * B + SCALAR
    assert torch_ckpt.held_after_forward_bytes == (depth - 1) * B + SCALAR
    assert mate.held_after_forward_bytes == B + SCALAR
    assert none.link_bytes == torch_ckpt.link_bytes == 0
    assert mate.bytes_to_host == mate.pinned_bytes == depth * B
    assert mate.bytes_to_device == (depth - 2) * B
    assert mate.counters["stash_hits"] == 2
    assert [save.fate for save in plan.saves] == ["offloaded"] * depth
    assert none.peak_bytes > torch_ckpt.peak_bytes > mate.peak_bytes


def test_peak_grows_with_depth_except_under_matepoint() -> None:
    shallow = matepoint.plan(chain(6), meta_input())
    deep = matepoint.plan(chain(12), meta_input())
    assert deep["none"].peak_bytes - shallow["none"].peak_bytes == 2 * 6 * B
    assert deep["torch"].peak_bytes - shallow["torch"].peak_bytes == 6 * B
    assert deep["matepoint"].peak_bytes == shallow["matepoint"].peak_bytes
    # torch's peak: the input, the L - 1 saved inputs and three activations of one recompute.
    assert deep["torch"].peak_bytes - (1 + 11 + 3) * B < 4096


def test_matrix_products_count_one_cublas_workspace_per_thread() -> None:
    """Forward's thread and autograd's device thread each keep a cuBLAS workspace."""
    from matepoint._planner.trace import CUBLAS_WORKSPACE_BYTES

    with torch.device("meta"):
        layers = torch.nn.ModuleList(torch.nn.Linear(512, 512, bias=False) for _ in range(3))
        x = torch.empty(1024, 512, requires_grad=True)

    def model(h: torch.Tensor) -> torch.Tensor:
        for layer in layers:
            h = matepoint.checkpoint(layer, h)
        return h

    plan = matepoint.plan(model, x)
    weights = 3 * 512 * 512 * 4
    for strategy in ("none", "torch", "matepoint"):
        assert plan[strategy].parameter_bytes == weights
        assert plan[strategy].baseline_bytes == weights + x.numel() * 4 + 2 * CUBLAS_WORKSPACE_BYTES
    without = matepoint.plan(chain(2), meta_input())
    assert without["none"].baseline_bytes == B  # no product, no workspace


def test_stash_keeps_the_newest_inputs_on_the_device() -> None:
    depth, stashed = 8, 3
    options = matepoint.OffloadSettings(stash_bytes=stashed * B, min_offload_bytes=0)
    mate = matepoint.plan(chain(depth), meta_input(), options=options)["matepoint"]
    assert mate.held_after_forward_bytes == (1 + stashed) * B + SCALAR
    assert mate.bytes_to_host == depth * B  # stashed inputs are still copied out
    assert mate.bytes_to_device == (depth - 2 - stashed) * B


def test_min_offload_bytes_keeps_small_inputs() -> None:
    options = matepoint.OffloadSettings(min_offload_bytes=B + 1)
    plan = matepoint.plan(chain(5), meta_input(), options=options)
    assert plan["matepoint"].link_bytes == 0
    assert plan["matepoint"].held_after_forward_bytes == plan["torch"].held_after_forward_bytes
    assert {save.fate for save in plan.saves} == {"small"}


def test_per_call_options_are_used_without_override() -> None:
    call_options = matepoint.OffloadOptions(min_offload_bytes=0)
    with matepoint.options(stash_bytes=10 * B):
        plan = matepoint.plan(chain(4, offload=call_options), meta_input())
    assert plan["matepoint"].bytes_to_device == 0  # everything stashed
    assert plan["matepoint"].held_after_forward_bytes == 3 * B + SCALAR


def test_shared_input_crosses_the_link_once_each_way() -> None:
    depth = 5

    def model(x: torch.Tensor) -> torch.Tensor:
        x0 = x * 2  # freed when forward returns: backward must fetch it
        for _ in range(depth):
            x = matepoint.checkpoint(lambda h, r: (h * r).sin(), x, x0)
        return x

    plan = matepoint.plan(model, meta_input())
    mate = plan["matepoint"]
    fates = [save.fate for save in plan.saves]
    assert fates.count("shared") == depth - 1
    assert mate.counters["dedupe_hits"] == depth - 1
    assert mate.bytes_to_host == mate.pinned_bytes == (depth + 1) * B
    # x0 comes back once and serves the other checkpoints; the newest input x4 and the caller's
    # input x stay on the device; x1..x3 come back.
    assert mate.bytes_to_device == (1 + 3) * B
    assert mate.counters["shared_fetch_hits"] == depth - 1


def test_kwargs_and_nested_tensors_are_offloaded() -> None:
    def block(x: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor], *, s: torch.Tensor) -> Any:
        return (x * pair[0] * s).sin() + pair[1]

    def model(x: torch.Tensor) -> torch.Tensor:
        a, b, scale = x.cos(), x.exp(), x.tanh()
        return matepoint.checkpoint(block, x, (a, b), s=scale)

    plan = matepoint.plan(model, meta_input())
    assert [save.fate for save in plan.saves] == ["offloaded"] * 4
    assert plan["matepoint"].bytes_to_host == 4 * B


def test_nested_checkpoints_save_only_the_outer_inputs() -> None:
    def outer(x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = matepoint.checkpoint(sin2, x)
        return x

    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(4):
            x = matepoint.checkpoint(outer, x)
        return x

    plan = matepoint.plan(model, meta_input())
    assert len(plan.saves) == 4
    assert plan["matepoint"].bytes_to_host == 4 * B
    # Without checkpoints the inner blocks keep everything: 12 blocks of two saves.
    assert plan["none"].held_after_forward_bytes == (2 * 12 - 1) * B + SCALAR


def test_checkpoint_sequential_leaves_the_last_segment_unsaved() -> None:
    layers = torch.nn.Sequential(*[torch.nn.Tanh() for _ in range(8)])

    def model(x: torch.Tensor) -> torch.Tensor:
        return matepoint.checkpoint_sequential(layers, 4, x, use_reentrant=False)

    plan = matepoint.plan(model, meta_input())
    assert len(plan.saves) == 3
    assert plan["matepoint"].bytes_to_host == 3 * B


def test_parameters_and_cpu_tensors_stay() -> None:
    with torch.device("meta"):
        linear = torch.nn.Linear(256, 256, bias=False)
    scale = torch.tensor(2.0)  # on the CPU: matepoint offloads only device tensors

    def model(x: torch.Tensor) -> torch.Tensor:
        return matepoint.checkpoint(
            lambda h, w, c: F.linear(h, w).sin() * c, x, linear.weight, scale
        )

    x = torch.empty(64, 256, device="meta", requires_grad=True)
    plan = matepoint.plan(model, x, options=matepoint.OffloadSettings(min_offload_bytes=0))
    assert [save.fate for save in plan.saves] == ["offloaded", "parameter", "other"]
    mate = plan["matepoint"]
    assert mate.parameter_bytes == 256 * 256 * 4
    assert (mate.counters["skipped_parameters"], mate.counters["skipped_other"]) == (1, 1)
    assert mate.bytes_to_host == 64 * 256 * 4
    assert linear.weight.grad is None  # each planned step starts from the same state


def test_module_with_real_parameters_is_refused_clearly() -> None:
    cpu_model = torch.nn.Linear(8, 8)
    with pytest.raises(ValueError, match="meta device"):
        matepoint.plan(cpu_model, meta_input(8))


def test_pool_cap_spills_to_pageable() -> None:
    options = matepoint.OffloadSettings(min_offload_bytes=0, pool_cap_bytes=2 * B)
    mate = matepoint.plan(chain(5), meta_input(), options=options)["matepoint"]
    assert mate.pinned_bytes == 2 * B
    assert mate.pageable_bytes == 3 * B
    assert not mate.pool_would_raise
    raising = dataclasses_replace(options, on_pool_exhausted="raise")
    assert matepoint.plan(chain(5), meta_input(), options=raising)["matepoint"].pool_would_raise


def test_options_may_be_a_calls_offload_options() -> None:
    """``OffloadOptions`` resolve over the settings in force, as a checkpoint's ``offload=``."""
    everything = matepoint.plan(chain(5), meta_input(), options=matepoint.OffloadOptions())
    assert everything["matepoint"].bytes_to_host == 5 * B
    call = matepoint.OffloadOptions(min_offload_bytes=B + 1)
    with matepoint.options(stash_bytes=3 * B, prefetch=1):
        plan = matepoint.plan(chain(5), meta_input(), options=call)
    assert plan.options is not None
    assert (plan.options.min_offload_bytes, plan.options.stash_bytes) == (B + 1, 3 * B)
    assert plan.options.prefetch == 1
    assert {save.fate for save in plan.saves} == {"small"}
    assert plan["matepoint"].link_bytes == 0
    with pytest.raises(ValueError, match="enabled=False"):
        matepoint.plan(chain(2), meta_input(), options=matepoint.OffloadOptions(enabled=False))


def dataclasses_replace(options: matepoint.OffloadSettings, **fields: Any) -> Any:
    import dataclasses

    return dataclasses.replace(options, **fields)


def test_timeline_and_json() -> None:
    plan = matepoint.plan(chain(4), meta_input())
    mate = plan["matepoint"]
    assert max(point.device_bytes for point in mate.timeline) == mate.peak_bytes
    assert mate.timeline[0].phase == "forward"
    assert {p.phase for p in mate.timeline} == {"forward", "backward", "after"}
    assert max(p.host_bytes for p in mate.timeline) == mate.pinned_bytes
    data = plan.to_dict(max_points=10)
    assert len(data["strategies"]["matepoint"]["timeline"]) <= 20
    peaks = [row[1] for row in data["strategies"]["matepoint"]["timeline"]]
    assert max(peaks) == mate.peak_bytes
    assert "estimate" in data["estimate_note"]
    assert "matepoint" in str(plan)


def test_times_follow_bandwidth_and_flops() -> None:
    with torch.device("meta"):
        blocks = torch.nn.ModuleList(torch.nn.Linear(1024, 1024, bias=False) for _ in range(4))
        x = torch.empty(2048, 1024, requires_grad=True)

    def model(x: torch.Tensor) -> torch.Tensor:
        for block in blocks:
            x = matepoint.checkpoint(lambda h, b=block: b(h).tanh(), x)
        return x

    plan = matepoint.plan(model, x, link_bandwidth=1e9, peak_flops=1e12)
    mate = plan["matepoint"]
    matmul = 2 * 2048 * 1024 * 1024
    assert mate.forward_flops == 4 * matmul
    assert plan["none"].backward_flops == 8 * matmul  # a weight and an input gradient each
    assert mate.backward_flops == plan["torch"].backward_flops == 12 * matmul  # and recompute
    assert mate.to_host_seconds == pytest.approx(mate.bytes_to_host / 1e9)
    assert mate.forward_seconds == pytest.approx(4 * matmul / 1e12)


# -- the planner beside the real engine (the counters: see test_plan_conformance.py) ------------


def test_plan_leaves_the_real_engine_alone() -> None:
    transport = CPUTestTransport(completion="immediate")
    with use_transport(transport), matepoint.options(min_offload_bytes=0):
        matepoint.plan(chain(3), meta_input())
        assert matepoint.stats().offloads == 0
        x = torch.randn(N, requires_grad=True)
        chain(3)(x).sum().backward()
        assert matepoint.stats().offloads == 3


def test_a_plan_attaches_to_its_own_thread_only() -> None:
    """Another thread checkpoints for real while a plan is in its forward, and both are right."""
    from matepoint import _checkpoint
    from matepoint._engine import saving as _saving

    inside, resume = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def paused(x: torch.Tensor) -> torch.Tensor:
        x = matepoint.checkpoint(sin2, x)
        inside.set()
        assert resume.wait(30)
        return chain(2)(x)

    def planner() -> None:
        try:
            results.append(matepoint.plan(paused, meta_input(), strategies=("matepoint",)))
        except BaseException as error:
            errors.append(error)
            inside.set()

    results: list[matepoint.MemoryPlan] = []
    thread = threading.Thread(target=planner)
    with use_transport(CPUTestTransport(completion="immediate")), matepoint.options(prefetch=2):
        thread.start()
        assert inside.wait(30)
        assert _checkpoint.pack is _saving.pack  # nothing process-wide is swapped
        x = torch.randn(N, requires_grad=True)
        chain(3)(x * 1).sum().backward()
        resume.set()
        thread.join()
        real = matepoint.stats()
    assert not errors, errors
    assert (real.offloads, real.bytes_fetched) == (3, 2 * B)
    torch.testing.assert_close(x.grad, sin2_grad(x.detach(), 3))
    planned = results[0]["matepoint"]
    assert planned.bytes_to_host == 3 * B
    alone = matepoint.plan(paused, meta_input(), strategies=("matepoint",))["matepoint"]
    assert planned.counters == alone.counters


def sin2_grad(x: torch.Tensor, depth: int) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    out = leaf
    for _ in range(depth):
        out = sin2(out)
    out.sum().backward()
    assert leaf.grad is not None
    return leaf.grad


def test_seven_billion_parameter_config_two_blocks_plans_quickly() -> None:
    width, heads, hidden, vocab, batch, seq = 4096, 32, 11008, 32000, 1, 4096

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
            self.out = torch.nn.Linear(width, width, bias=False)
            self.up = torch.nn.Linear(width, 2 * hidden, bias=False)
            self.down = torch.nn.Linear(hidden, width, bias=False)
            self.norm1 = (
                torch.nn.RMSNorm(width)
                if hasattr(torch.nn, "RMSNorm")
                else torch.nn.LayerNorm(width)
            )
            self.norm2 = (
                torch.nn.RMSNorm(width)
                if hasattr(torch.nn, "RMSNorm")
                else torch.nn.LayerNorm(width)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, heads, -1).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.out(a.transpose(1, 2).reshape(batch, seq, width))
            gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
            return x + self.down(F.silu(gate) * up)

    with torch.device("meta"):
        embed = torch.nn.Embedding(vocab, width, dtype=torch.bfloat16)
        blocks = torch.nn.ModuleList(Block() for _ in range(2)).to(torch.bfloat16)
        head = torch.nn.Linear(width, vocab, bias=False, dtype=torch.bfloat16)
        tokens = torch.randint(0, vocab, (batch, seq))

    def model(idx: torch.Tensor) -> torch.Tensor:
        x = embed(idx)
        for block in blocks:
            x = matepoint.checkpoint(block, x)
        return F.cross_entropy(head(x).float().flatten(0, 1), idx.flatten())

    start = time.perf_counter()
    plan = matepoint.plan(model, tokens)
    elapsed = time.perf_counter() - start
    assert elapsed < 20
    block_input = batch * seq * width * 2
    assert plan["matepoint"].bytes_to_host == 2 * block_input
    attention_matrix = batch * heads * seq * seq * 2
    # Planned as CUDA's fused attention: no seq x seq matrix is ever held.
    assert plan["none"].held_after_forward_bytes < 2 * attention_matrix


# -- recommendations ---------------------------------------------------------------------------


def test_recommend_offloads_nothing_when_torch_checkpoint_fits() -> None:
    plan = matepoint.plan(chain(12), meta_input())
    advice = plan.recommend(plan["torch"].peak_bytes)
    assert advice.fits
    assert advice.options is not None
    assert advice.plan.link_bytes == 0
    assert advice.options.min_offload_bytes > B  # keeps every block input on the device
    assert "no offloading needed" in str(advice)
    # A round threshold (the next power of two), not the largest input's size plus one.
    assert advice.options.min_offload_bytes == 2 * B
    assert f"min_offload_bytes={2 * B}:" in str(advice)


def test_threshold_candidates_are_round() -> None:
    from matepoint._planner.recommend import _threshold_classes
    from matepoint._planner.step import SavedInput

    def saves(*sizes: int) -> tuple[SavedInput, ...]:
        return tuple(
            SavedInput(i, size, (size,), "torch.uint8", "offloaded") for i, size in enumerate(sizes)
        )

    mib = 1 << 20
    # Between two sizes: the power of two above the kept one, if the moved one reaches it.
    assert _threshold_classes(saves(3 * mib, 5 * mib), 1) == [1, 4 * mib, 8 * mib]
    # Else the size of the smallest input moved.
    assert _threshold_classes(saves(32 * mib, 48 * mib), 1) == [1, 48 * mib, 64 * mib]
    # A current value inside a class stands for it.
    assert _threshold_classes(saves(32 * mib, 48 * mib), 40 * mib) == [1, 40 * mib, 64 * mib]


def test_recommend_stashes_as_much_as_fits() -> None:
    plan = matepoint.plan(chain(12), meta_input())
    budget = plan["matepoint"].peak_bytes + 3 * B + B // 2
    advice = plan.recommend(budget)
    assert advice.fits
    assert advice.options is not None
    assert advice.plan.peak_bytes <= budget
    assert advice.options.stash_bytes > 0
    assert advice.plan.link_bytes < plan["matepoint"].link_bytes
    one_more = dataclasses_replace(advice.options, stash_bytes=advice.options.stash_bytes + B)
    assert (
        matepoint.plan(chain(12), meta_input(), options=one_more)["matepoint"].peak_bytes > budget
    )


def test_recommend_trades_look_ahead_for_memory() -> None:
    base = matepoint.plan(chain(12), meta_input())
    frugal = matepoint.OffloadSettings(min_offload_bytes=1, prefetch=0)
    without = matepoint.plan(chain(12), meta_input(), options=frugal)["matepoint"].peak_bytes
    assert without < base["matepoint"].peak_bytes  # two prefetched inputs cost memory
    advice = base.recommend(without)
    assert advice.fits
    assert advice.options is not None
    assert advice.options.prefetch == 0


def test_recommend_says_what_would_fit_when_nothing_does() -> None:
    with torch.device("meta"):
        weights = torch.nn.Parameter(torch.empty(N))

    def model(x: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = matepoint.checkpoint(lambda h: (h * weights).sin().sin(), x)
        return x

    plan = matepoint.plan(model, meta_input())
    advice = plan.recommend(3 * B)
    assert not advice.fits
    assert advice.options is None
    assert advice.minimum_peak_bytes > 3 * B
    assert advice.fixed_bytes == 2 * B  # the parameter and its gradient
    assert advice.batch_fraction is not None
    assert 0 < advice.batch_fraction < 1
    assert "nothing fits" in str(advice)


def test_meta_results_are_reused_only_where_arguments_decide_them() -> None:
    """Note [Meta results reused]: a reused result is a fresh tensor of the layout the op gave."""
    from matepoint._planner import trace as _plan_trace

    aten = torch.ops.aten
    assert _plan_trace._reusable(aten.mul.Tensor)
    assert not _plan_trace._reusable(aten.mul_.Tensor)  # writes its argument
    assert not _plan_trace._reusable(aten.view.default)  # its result aliases the argument
    assert not _plan_trace._reusable(aten.split.Tensor)  # a list of views

    x = torch.empty(3, 4, device="meta").t()  # not contiguous: the layout must come along
    first, flops = _plan_trace._run_meta(aten.mul.Tensor, (x, x), {})
    again, _ = _plan_trace._run_meta(aten.mul.Tensor, (x, x), {})
    assert again.stride() == first.stride() == x.stride()
    assert again.shape == first.shape
    # A storage of its own (the same StorageImpl would make the tracker count it once).
    assert again.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert flops == 0
    # The type of a plain argument is part of the key: a bool fill makes a bool tensor.
    ints, _ = _plan_trace._run_meta(aten.full.default, ((2,), 1), {"device": "meta"})
    bools, _ = _plan_trace._run_meta(aten.full.default, ((2,), True), {"device": "meta"})
    assert (ints.dtype, bools.dtype) == (torch.int64, torch.bool)
    # So is the default dtype, which a factory without a dtype makes.
    fill = (aten.full.default, ((2,), 0.5), {"device": "meta"})
    floats = _plan_trace._run_meta(*fill)[0].dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        doubles = _plan_trace._run_meta(*fill)[0].dtype
    finally:
        torch.set_default_dtype(previous)
    assert (floats, doubles) == (torch.float32, torch.float64)
    # A matrix product's FLOPs come back with its reused result.
    a, b = torch.empty(8, 16, device="meta"), torch.empty(16, 4, device="meta")
    counted = [_plan_trace._run_meta(aten.mm.default, (a, b), {})[1] for _ in range(2)]
    assert counted == [2 * 8 * 16 * 4] * 2


def test_a_plan_is_the_same_with_meta_results_reused_or_not() -> None:
    from matepoint._planner import trace as _plan_trace

    def planned() -> list[Any]:
        memory_plan = matepoint.plan(chain(4), meta_input())
        return [
            (plan.peak_bytes, plan.pinned_bytes, plan.bytes_to_host, plan.forward_flops)
            for plan in memory_plan.strategies.values()
        ]

    _plan_trace._meta_results.clear()
    cold = planned()
    assert _plan_trace._meta_results  # the ops of the step were recorded
    assert planned() == cold


def test_a_step_that_reads_a_value_names_the_cause() -> None:
    with torch.device("meta"):
        linear = torch.nn.Linear(4, 4)
        x = torch.randn(2, 4)

    def step(inputs: torch.Tensor) -> torch.Tensor:
        y = matepoint.checkpoint(linear, inputs)
        return y.sum() if y.sum() > 0 else y.mean()  # a branch on a value

    with pytest.raises(RuntimeError, match="reads a tensor's value") as error:
        matepoint.plan(step, x)
    assert "meta tensors" in str(error.value.__cause__)
