"""matepoint behind other libraries' checkpointing: transformers, checkpoint_wrapper, torch.compile.

Each test runs identically seeded twins, one through the library's own (torch) checkpointing and
one through matepoint under the CPU test transport with no minimum size, compares the gradients
bitwise (``torch.equal``, fp32), and checks that matepoint really offloaded something.
"""

from __future__ import annotations

import copy
import functools
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import matepoint
import matepoint.integrations as mi
import matepoint_compat as compat
from matepoint.testing import CPUTestTransport, use_transport

SEED = 0
WIDTH = 16


@pytest.fixture
def transport() -> Iterator[CPUTestTransport]:
    """A deferred-completion CPU test transport that offloads every tensor, however small.

    Counters start at zero, so each test can count exactly what it offloaded.
    """
    gc.collect()
    matepoint.reset_stats()
    test_transport = CPUTestTransport()
    with use_transport(test_transport), matepoint.options(min_offload_bytes=0):
        yield test_transport
    test_transport.drain()


def grads(module: nn.Module) -> list[torch.Tensor | None]:
    return [parameter.grad for parameter in module.parameters()]


def assert_grads_equal(got: list[torch.Tensor | None], want: list[torch.Tensor | None]) -> None:
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a is not None, f"gradient {index} missing"
        assert b is not None, f"reference gradient {index} missing"
        assert torch.equal(a, b), f"gradient {index} differs: {(a - b).abs().max().item()}"


# -- Hugging Face transformers -------------------------------------------------------------------


def _tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(SEED)
    model: nn.Module = transformers.LlamaForCausalLM(config)
    return model


def _tiny_gpt2_with_dropout() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=32,
        n_embd=32,
        n_layer=3,
        n_head=4,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    torch.manual_seed(SEED)
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


def _enable_torch(model: nn.Module) -> None:
    """transformers' own gradient checkpointing with torch's non-reentrant checkpoint."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _hf_step(model: nn.Module, ids: torch.Tensor) -> None:
    model.train()
    torch.manual_seed(SEED + 1)  # the same dropout masks for both twins
    model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize(
    ("make_model", "pipeline"),
    [(_tiny_llama, True), (_tiny_llama, False), (_tiny_gpt2_with_dropout, True)],
    ids=["llama-pipeline", "llama-nopipeline", "gpt2-dropout-pipeline"],
)
def test_hf_gradients_match_transformers_checkpointing(
    transport: CPUTestTransport, make_model: Callable[[], nn.Module], pipeline: bool
) -> None:
    reference = make_model()
    model = copy.deepcopy(reference)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(SEED))
    _enable_torch(reference)
    mi.enable_hf_gradient_checkpointing(model, pipeline=pipeline)
    _hf_step(reference, ids)
    _hf_step(model, ids)
    snapshot = matepoint.stats()
    assert snapshot.offloads == 3, snapshot  # one hidden-state input per decoder layer
    assert transport.copies_out >= 3
    assert_grads_equal(grads(model), grads(reference))


def test_hf_layers_use_matepoint_with_the_given_options() -> None:
    model = _tiny_llama()
    options = matepoint.OffloadOptions(min_offload_bytes=0)
    mi.enable_hf_gradient_checkpointing(model, pipeline=False, offload=options)
    functions = [
        module._gradient_checkpointing_func
        for module in model.modules()
        if hasattr(module, "_gradient_checkpointing_func")
    ]
    assert len(functions) >= 3  # the decoder layers, and the base model that holds them
    for function in functions:
        assert isinstance(function, functools.partial)
        assert function.func is matepoint.checkpoint
        assert function.keywords == {"use_reentrant": False, "pipeline": False, "offload": options}


def test_hf_disable_turns_checkpointing_off(transport: CPUTestTransport) -> None:
    model = _tiny_llama()
    mi.enable_hf_gradient_checkpointing(model)
    # transformers 5 renamed the method and warns on the old name.
    disable = getattr(model, "activation_checkpointing_disable", None)
    if callable(disable):
        disable()
    else:
        model.gradient_checkpointing_disable()
    _hf_step(model, torch.randint(0, 64, (2, 16)))
    assert matepoint.stats().offloads == 0


def test_hf_rejects_a_model_without_gradient_checkpointing() -> None:
    with pytest.raises(TypeError, match="PreTrainedModel"):
        mi.enable_hf_gradient_checkpointing(nn.Linear(2, 2))


def test_hf_rejects_the_pre_4_35_format() -> None:
    class OldFormat(nn.Module):
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Any = None) -> None:
            self.gradient_checkpointing = True

    with pytest.raises(TypeError, match=r"4\.35"):
        mi.enable_hf_gradient_checkpointing(OldFormat())


# -- torch's checkpoint_wrapper / apply_activation_checkpointing ----------------------------------


class Block(nn.Module):
    """A residual block with dropout (RNG replay) and an optional tensor keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = self.dropout(torch.tanh(self.linear(x)))
        return x + (h if scale is None else h * scale)


class Stack(nn.Module):
    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(depth))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale=scale)
        out: torch.Tensor = self.head(x).sum()
        return out


def _stack_twins() -> tuple[Stack, Stack]:
    torch.manual_seed(SEED)
    reference = Stack()
    return reference, copy.deepcopy(reference)


def _stack_step(model: nn.Module, scale: torch.Tensor | None = None) -> torch.Tensor:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(SEED)).requires_grad_()
    torch.manual_seed(SEED + 1)
    model(x, scale).backward()
    assert x.grad is not None
    return x.grad


def _torch_apply(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))


@pytest.mark.parametrize("with_kwarg", [False, True], ids=["args", "tensor-kwarg"])
def test_apply_matepoint_checkpointing_matches_torch_wrapper(
    transport: CPUTestTransport, with_kwarg: bool
) -> None:
    reference, model = _stack_twins()
    _torch_apply(reference)
    mi.apply_matepoint_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    scale = torch.full((WIDTH,), 0.5, requires_grad=True) if with_kwarg else None
    want_x = _stack_step(reference, scale)
    want_scale = None if scale is None else scale.grad
    if scale is not None:
        scale.grad = None
    got_x = _stack_step(model, scale)
    snapshot = matepoint.stats()
    # One block input per block; the shared keyword tensor is offloaded once (dedupe).
    assert snapshot.offloads == (5 if with_kwarg else 4), snapshot
    assert torch.equal(got_x, want_x)
    assert_grads_equal(grads(model), grads(reference))
    if scale is not None:
        assert_grads_equal([scale.grad], [want_scale])


def test_apply_matepoint_checkpointing_keeps_names_and_wraps_blocks() -> None:
    reference, model = _stack_twins()
    mi.apply_matepoint_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    assert all(isinstance(block, CheckpointWrapper) for block in model.blocks)
    assert not isinstance(model.head, CheckpointWrapper)
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict())


def test_checkpoint_wrapper_passes_options(transport: CPUTestTransport) -> None:
    torch.manual_seed(SEED)
    block = Block()
    wrapped = mi.checkpoint_wrapper(copy.deepcopy(block), pipeline=False, preserve_rng_state=True)
    x = torch.randn(4, WIDTH, requires_grad=True)
    torch.manual_seed(SEED + 1)
    want = torch_checkpoint.checkpoint(block, x, use_reentrant=False)
    want.sum().backward()
    want_x = x.grad
    x.grad = None
    torch.manual_seed(SEED + 1)
    got = wrapped(x)
    assert torch.equal(got, want)
    got.sum().backward()
    assert matepoint.stats().offloads == 1
    assert x.grad is not None
    assert want_x is not None
    assert torch.equal(x.grad, want_x)
    assert_grads_equal(grads(wrapped), grads(block))


# -- torch.compile ----------------------------------------------------------------------------


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 4 * WIDTH)
        self.fc2 = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh"))


def _compile_twins(device: str = "cpu") -> nn.ModuleList:
    torch.manual_seed(SEED)
    return nn.ModuleList(Mlp() for _ in range(3)).to(device)


def _run_blocks(
    blocks: nn.ModuleList,
    checkpoint: Callable[..., Any],
    compile_backend: str | None,
    device: str = "cpu",
) -> list[torch.Tensor | None]:
    blocks = copy.deepcopy(blocks)
    runners: list[Callable[..., Any]] = [
        torch.compile(block, backend=compile_backend) if compile_backend else block
        for block in blocks
    ]
    x = torch.randn(2, 8, WIDTH, generator=torch.Generator().manual_seed(SEED)).to(device)
    x.requires_grad_()
    h = x
    for run in runners:
        h = checkpoint(run, h, use_reentrant=False)
    h.square().mean().backward()
    return [x.grad, *grads(blocks)]


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# torch 2.4's own non-reentrant checkpoint fails around torch.compile'd code ("A different number
# of tensors was saved during the original forward and recomputation"); fixed in 2.5.
_COMPILE_IN_CHECKPOINT = pytest.mark.skipif(
    not compat.TORCH_2_5_PLUS, reason="torch 2.4's checkpoint breaks around compiled code"
)


@_COMPILE_IN_CHECKPOINT
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_blocks_inside_matepoint_checkpoint(
    transport: CPUTestTransport, fresh_dynamo: None, backend: str
) -> None:
    blocks = _compile_twins()
    uncompiled = _run_blocks(blocks, torch_checkpoint.checkpoint, None)
    compiled_torch = _run_blocks(blocks, torch_checkpoint.checkpoint, backend)
    got = _run_blocks(blocks, matepoint.checkpoint, backend)
    assert matepoint.stats().offloads == 3
    # Same compiled graphs, same numbers: matepoint only moved the block inputs.
    assert_grads_equal(got, compiled_torch)
    if backend == "eager":
        assert_grads_equal(got, uncompiled)
    else:
        # aot_eager may decompose ops differently from eager (bitwise equal on torch 2.13).
        for a, b in zip(got, uncompiled, strict=True):
            assert a is not None
            assert b is not None
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


# Dynamo cannot trace saved_tensors_hooks and says so once per reason, as a UserWarning.
@_COMPILE_IN_CHECKPOINT
# The compiled path (test_compile.py) is opt-in: by default whole-model compile breaks the graph.
@pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning")
# The graph break is the point; torch 2.5 and 2.6's dynamo also warns about it (the builtin
# _saved_tensors_hooks_is_enabled it cannot trace), which pytest.ini would turn into an error.
@pytest.mark.filterwarnings("ignore:Graph break due to unsupported builtin:UserWarning")
def test_compiling_the_whole_model_graph_breaks_at_matepoint(
    transport: CPUTestTransport, fresh_dynamo: None
) -> None:
    blocks = _compile_twins()

    class Model(nn.Module):
        def __init__(self, checkpoint: Callable[..., Any]) -> None:
            super().__init__()
            self.blocks = copy.deepcopy(blocks)
            self.checkpoint = checkpoint

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = self.checkpoint(block, x, use_reentrant=False)
            return x

    x0 = torch.randn(2, 8, WIDTH, generator=torch.Generator().manual_seed(SEED))
    reference = Model(torch_checkpoint.checkpoint)
    x = x0.clone().requires_grad_()
    reference(x).square().mean().backward()
    want = [x.grad, *grads(reference)]
    model = Model(matepoint.checkpoint)
    x = x0.clone().requires_grad_()
    torch.compile(model, backend="eager")(x).square().mean().backward()
    assert matepoint.stats().offloads == 3
    assert_grads_equal([x.grad, *grads(model)], want)


@pytest.mark.gpu
# Importing inductor touches torch.jit.script_method, deprecated in recent torch.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
# Inductor suggests TF32 when it compiles an fp32 matmul on a GPU that has it; the test keeps fp32.
@pytest.mark.filterwarnings("ignore:TensorFloat32 tensor cores:UserWarning")
def test_inductor_compiled_blocks_inside_matepoint_checkpoint(fresh_dynamo: None) -> None:
    blocks = _compile_twins("cuda")
    with matepoint.options(min_offload_bytes=0):
        compiled_torch = _run_blocks(blocks, torch_checkpoint.checkpoint, "inductor", "cuda")
        uncompiled = _run_blocks(blocks, torch_checkpoint.checkpoint, None, "cuda")
        matepoint.reset_stats()
        got = _run_blocks(blocks, matepoint.checkpoint, "inductor", "cuda")
        assert matepoint.stats(synchronize=True).offloads == 3
    assert_grads_equal(got, compiled_torch)
    for a, b in zip(got, uncompiled, strict=True):
        assert a is not None
        assert b is not None
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
