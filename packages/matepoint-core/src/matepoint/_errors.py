"""The exceptions matepoint raises, so callers can catch matepoint's failures by class.

Also :func:`inplace_error`, the one wording of the in-place error, for offloaded and kept inputs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "BudgetOutOfMemoryError",
    "InplaceModificationError",
    "MatepointError",
    "PinnedMemoryExhausted",
    "inplace_error",
]


class MatepointError(Exception):
    """Base class of every error matepoint raises itself."""


class PinnedMemoryExhausted(MatepointError, MemoryError):
    """Raised in forward when pinned host memory runs out and ``on_pool_exhausted="raise"``.

    Pinned memory runs out when the pool cap is reached, or when the pinned allocation fails even
    after idle blocks were released.

    The checkpoint call that hit the limit leaves nothing behind: the step can be retried after
    freeing memory, raising ``pool_cap_bytes`` or choosing ``on_pool_exhausted="pageable"``.
    """


# torch.cuda.OutOfMemoryError is torch.OutOfMemoryError from torch 2.5 on, and in torch 2.4 too.
class BudgetOutOfMemoryError(MatepointError, torch.cuda.OutOfMemoryError):
    """Raised when a step under a budget plan runs out of device memory.

    A subclass of torch's out-of-memory error, so existing handlers still catch it; its message
    names the plan, its budget and its predicted peak, and the same are its attributes. The
    guard that raised it (:class:`matepoint.BudgetGuard`) set the gradients to None first: the
    next step can run.

    Attributes:
        plan: The :class:`matepoint.BudgetPlan` in force.
        budget_bytes: The step's budget, the optimizer's states included.
        predicted_bytes: The plan's predicted peak, the optimizer's states included.
    """

    def __init__(
        self, message: str, *, plan: Any = None, budget_bytes: int = 0, predicted_bytes: int = 0
    ) -> None:
        super().__init__(message)
        self.plan = plan
        self.budget_bytes = budget_bytes
        self.predicted_bytes = predicted_bytes


class InplaceModificationError(MatepointError, RuntimeError):
    """Raised in backward when a checkpoint input was modified in place after the forward.

    torch raises the same condition as a ``RuntimeError`` ("modified by an inplace operation");
    this subclass keeps that contract and wording while naming matepoint as the place that found
    it, for example:

        InplaceModificationError: one of the variables needed for gradient computation has been
        modified by an inplace operation: [torch.cuda.FloatTensor [1024, 512]] (an input of a
        matepoint.checkpoint) is at version 1; expected version 0 instead. Hint: clone the input
        before modifying it in place, or modify it only after backward.
    """


def inplace_error(
    tensor_type: str, shape: tuple[int, ...], version: int, expected: int
) -> InplaceModificationError:
    """Build the error for a saved checkpoint input modified in place, worded as torch words it."""
    sizes = ", ".join(str(size) for size in shape)
    return InplaceModificationError(
        "one of the variables needed for gradient computation has been modified by an inplace "
        f"operation: [{tensor_type} [{sizes}]] (an input of a matepoint.checkpoint) is at "
        f"version {version}; expected version {expected} instead. Hint: clone the input before "
        "modifying it in place, or modify it only after backward."
    )
