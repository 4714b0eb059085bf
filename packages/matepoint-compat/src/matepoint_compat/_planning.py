"""What matepoint's memory planner needs from torch internals, spelled per release.

The planner runs one training step on the meta device, watching every operator through a
dispatch mode, counting FLOPs with the formulas of torch's flop counter, and imitating the memory
behaviour of CUDA kernels that differ from their meta/CPU fallbacks. Every private torch symbol
it touches is read here.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from matepoint_compat._version import TORCH_2_6_PLUS, TORCH_2_9_PLUS

__all__ = [
    "CUDA_FUSED_RMS_NORM",
    "TorchDispatchMode",
    "UnguardedDispatchMode",
    "meta_checkpointing",
    "no_torch_function_modes",
    "op_flops",
    "run_backward",
]

# ``torch.utils._python_dispatch.TorchDispatchMode`` is private but has kept the same
# ``__torch_dispatch__(func, types, args, kwargs)`` protocol from 2.4 to 2.15; it is the only way
# to see every operator (and so every allocation) of a step.

no_torch_function_modes: Callable[[], contextlib.AbstractContextManager[Any]] = (
    torch._C.DisableTorchFunction
)
"""A context with every torch function mode off (private; the same from 2.4 to 2.15)."""


class UnguardedDispatchMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """A dispatch mode whose handler torch does not wrap in its guard against Dynamo.

    Recent releases wrap every mode's ``__torch_dispatch__`` so that Dynamo never compiles it,
    at a few microseconds an op; a mode that nothing compiles declines the guard through the
    private hook torch gives mode authors for that. Before the hook, an unused classmethod.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


CUDA_FUSED_RMS_NORM: bool = TORCH_2_9_PLUS and hasattr(torch.ops.aten, "_fused_rms_norm")
"""Whether ``F.rms_norm`` on CUDA runs one fused kernel that saves only its input and ``rstd``.

The fused CUDA kernel arrived with ``aten._fused_rms_norm`` (2.9); before it, and on the meta
device in every release, ``rms_norm`` is a composite that saves a float32 copy of its input.
"""


def op_flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> int:
    """Return the FLOPs torch's flop counter assigns to one operator call (0 if it has none).

    ``torch.utils.flop_counter.flop_registry`` maps an overload packet to a formula called as
    ``formula(*args, **kwargs, out_val=out)``; registry and calling convention are what
    ``FlopCounterMode`` itself uses on every release from 2.4 to 2.15.

    Args:
        func: The ``OpOverload`` that ran.
        args: Its positional arguments.
        kwargs: Its keyword arguments.
        out: What it returned.

    Returns:
        The FLOPs (matrix products and attention; elementwise work counts as 0).
    """
    formula = flop_registry.get(func.overloadpacket)
    return 0 if formula is None else int(formula(*args, **kwargs, out_val=out))


def run_backward(loss: torch.Tensor) -> None:
    """Run backward from a scalar ``loss`` without passing through ``__torch_function__``.

    ``torch.autograd.backward`` is itself a torch function: a ``TorchFunctionMode`` intercepts
    the call and runs it with the mode switched off, so the recomputation inside backward would
    escape the mode. Calling autograd's engine (``Variable._execution_engine.run_backward``,
    private, same signature from 2.4 to 2.15) keeps the mode in force during backward.

    Args:
        loss: A scalar that requires grad.
    """
    engine: Any = torch.autograd.Variable._execution_engine
    grad = torch.ones_like(loss, memory_format=torch.preserve_format)
    engine.run_backward((loss,), (grad,), False, False, (), True, True)


@contextlib.contextmanager
def meta_checkpointing() -> Iterator[None]:
    """Let ``torch.utils.checkpoint`` run on meta tensors inside the block.

    Before 2.5 checkpoint looks the device's module up as ``getattr(torch, "meta")``, which does
    not exist (pytorch#132684 fixed it in 2.5), and before 2.6 ``torch.random.fork_rng`` does the
    same in the reentrant variant's backward (pytorch#137715). On those releases a stand-in
    module, never initialized, is installed for the duration of the block. Shim can go when torch
    2.6 is the oldest supported release.

    Yields:
        Nothing; checkpoint works on meta tensors inside.
    """
    if TORCH_2_6_PLUS or hasattr(torch, "meta"):
        yield
        return
    # A stand-in ``torch.meta``, uninitialized: checkpoint then saves no device RNG state, and
    # fork_rng gets an empty device list, so neither asks the module for anything else.
    module = types.ModuleType("torch.meta")
    module._initialized = False  # type: ignore[attr-defined]
    torch.meta = module  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del torch.meta  # type: ignore[attr-defined]
