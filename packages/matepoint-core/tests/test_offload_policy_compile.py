"""Selective checkpointing's CPU-offload values under a whole-model compile (compiled path on).

What happens today (torch 2.11 to 2.14 checked): Dynamo traces ``matepoint.checkpoint`` as torch's
checkpoint with the call's own ``context_fn``; torch's compiled selective checkpointing tags each
op with the policy's value, and the partitioner treats ``MUST_CPU_OFFLOAD``/``PREFER_CPU_OFFLOAD``
as save: those outputs are saved on the device, not copied to the host (torch's compiled
activation offloading does not act on the tag). matepoint's compiled path still offloads the
checkpoint inputs. These tests pin that, so a torch release that starts offloading the tagged
values shows up here.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from _helpers import CapturingBackend
from torch import nn

import matepoint
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport, use_transport

pytestmark = [
    pytest.mark.skipif(
        not compat.SELECTIVE_OFFLOAD_POLICIES or not compat.COMPILED_OFFLOAD,
        reason="needs CheckpointPolicy's CPU-offload values and matepoint's compiled path",
    ),
    # Importing inductor touches torch.jit.script_method, deprecated in recent torch.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

WIDTH = 16
DEPTH = 3
_TORCH_CONFIG = (
    "joint_custom_pass",
    "enable_activation_offloading",
    "activation_offload_separate_stream",
    "activation_offload_sink_wait",
    "activation_reload_prefetch",
)


@pytest.fixture(autouse=True)
def compiled_path() -> Iterator[None]:
    """Compile from scratch with the compiled path on, CPU tensors offloadable (the test
    transport); leave torch's settings as they were."""
    import torch._functorch.config as functorch_config

    saved = {name: getattr(functorch_config, name, None) for name in _TORCH_CONFIG}
    torch._dynamo.reset()
    transport = CPUTestTransport()
    with use_transport(transport), matepoint.options(compiled_offload=True, min_offload_bytes=0):
        yield
    transport.drain()
    torch._dynamo.reset()
    for name, value in saved.items():
        if hasattr(functorch_config, name):
            setattr(functorch_config, name, value)


def sac(decision_name: str) -> Callable[[], Any]:
    decision = torch_checkpoint.CheckpointPolicy[decision_name]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if op is torch.ops.aten.addmm.default:
            return decision
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(torch_checkpoint.create_selective_checkpoint_contexts, policy)


class Model(nn.Module):
    def __init__(self, checkpoint: Callable[..., Any], context_fn: Callable[[], Any]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(DEPTH)
        )
        self.checkpoint = checkpoint
        self.context_fn = context_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.tanh()
        for block in self.blocks:
            h = h + self.checkpoint(block, h, use_reentrant=False, context_fn=self.context_fn)
        return h


def step(model: nn.Module, backend: Any) -> list[torch.Tensor]:
    torch._dynamo.reset()
    x = torch.randn(2, 8, WIDTH, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.compile(model, backend=backend)(x).square().mean().backward()
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [grad for grad in grads if grad is not None]


@pytest.mark.parametrize("decision", ["MUST_CPU_OFFLOAD", "PREFER_CPU_OFFLOAD"])
def test_compiled_offload_values_are_saved_on_the_device(decision: str) -> None:
    reference = Model(torch_checkpoint.checkpoint, sac("MUST_SAVE"))
    saving = copy.deepcopy(reference)
    saving.checkpoint = matepoint.checkpoint
    offloading = copy.deepcopy(saving)
    offloading.context_fn = sac(decision)
    expected = step(reference, "aot_eager")
    saving_backend, offloading_backend = CapturingBackend(), CapturingBackend()
    step(saving, saving_backend)
    got = step(offloading, offloading_backend)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    # The same graph as with MUST_SAVE: the matmul outputs are saved, on the device, and only
    # the checkpoint inputs go to the host.
    assert offloading_backend.saved() == saving_backend.saved()
    # The up projections (GELU needs them; the down projections feed only an add).
    assert sum(name.startswith("addmm") for name in offloading_backend.saved()) == DEPTH
    assert offloading_backend.offloaded() == saving_backend.offloaded()
    assert not any("addmm" in name for name in offloading_backend.offloaded())
    assert len(offloading_backend.offloaded()) == DEPTH
    assert matepoint.stats().policy_offloads == 0
