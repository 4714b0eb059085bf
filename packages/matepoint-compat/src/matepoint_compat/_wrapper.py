"""torch's activation-checkpoint wrapper, which lives in a private module.

``torch.distributed.algorithms._checkpoint.checkpoint_wrapper`` is public in all but name: FSDP's
documentation and torchtitan import ``checkpoint_wrapper`` and ``apply_activation_checkpointing``
from there. Both take the parameters used here on every supported release, 2.4 through 2.15 (the
per-release test sessions run matepoint's integration tests and the compat shim test on each), so
no gate is needed today. The module is imported on use, so that importing matepoint never
imports ``torch.distributed`` itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["torch_apply_activation_checkpointing", "torch_checkpoint_wrapper"]


def torch_checkpoint_wrapper(module: nn.Module, checkpoint_fn: Callable[..., Any]) -> nn.Module:
    """Return torch's ``CheckpointWrapper`` around ``module``, checkpointing with ``checkpoint_fn``.

    Args:
        module: The module to checkpoint on every call.
        checkpoint_fn: The checkpoint function the wrapper calls, with torch's signature.

    Returns:
        ``checkpoint_wrapper(module, checkpoint_fn=checkpoint_fn)``.
    """
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_module

    return torch_module.checkpoint_wrapper(module, checkpoint_fn=checkpoint_fn)


def torch_apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module],
    check_fn: Callable[[nn.Module], bool],
    auto_wrap_policy: Callable[[nn.Module, bool, int], bool] | None,
) -> None:
    """Run torch's ``apply_activation_checkpointing`` with these arguments.

    Args:
        model: The model whose selected submodules are replaced in place.
        checkpoint_wrapper_fn: Wraps one selected submodule.
        check_fn: Which submodules to wrap.
        auto_wrap_policy: torch's wrap policy, or None; takes precedence over ``check_fn``.
    """
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_module

    torch_module.apply_activation_checkpointing(
        model, checkpoint_wrapper_fn, check_fn, auto_wrap_policy
    )
