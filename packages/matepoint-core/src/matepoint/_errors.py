"""The exceptions matepoint raises, so callers can catch matepoint's failures by class."""

from __future__ import annotations

__all__ = ["InplaceModificationError", "MatepointError", "PinnedMemoryExhausted"]


class MatepointError(Exception):
    """Base class of every error matepoint raises itself."""


class PinnedMemoryExhausted(MatepointError, MemoryError):
    """Raised when pinned host memory runs out and the policy is ``on_pool_exhausted="raise"``.

    The checkpoint call that hit the limit leaves nothing behind: the step can be retried after
    freeing memory, raising ``pool_cap_bytes`` or choosing ``on_pool_exhausted="pageable"``.
    """


class InplaceModificationError(MatepointError, RuntimeError):
    """Raised in backward when a checkpoint input was modified in place after the forward.

    torch raises the same condition as a ``RuntimeError`` ("modified by an inplace operation");
    this subclass keeps that contract while naming matepoint as the place that found it.
    """
