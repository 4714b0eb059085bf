"""The budget benchmark's pieces that need no GPU: its peers' policies and its refusal on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint

from matepoint_examples.bench import budget

pytestmark = pytest.mark.skipif(
    not hasattr(torch_checkpoint, "CheckpointPolicy"),
    reason="torch's selective checkpointing arrived in 2.5",
)


def test_the_selective_peers_save_exactly_their_kinds() -> None:
    policy = budget.selective_policy(frozenset({"attention", "matmul 64x128"}))
    a, b = torch.empty(8, 64), torch.empty(64, 128)
    save = torch_checkpoint.CheckpointPolicy.MUST_SAVE
    recompute = torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, torch.ops.aten.mm.default, a, b) == save
    assert policy(None, torch.ops.aten.mm.default, b, b.t()) == recompute
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert policy(None, flash, a, a, a) == save


def test_the_peers_of_a_workload_are_named_and_runnable_on_a_cpu() -> None:
    config = budget.WORKLOADS["llama-tiny"][0]
    functions = budget._checkpoint_fns(config)
    assert set(functions) == {
        "torch",
        "matepoint",
        "none",
        "sac-attention-down",
        "sac-every-matmul",
    }
    x = torch.randn(2, 3, requires_grad=True)
    for function in functions.values():
        assert torch.equal(function(torch.sin, x), torch.sin(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert budget.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().out
