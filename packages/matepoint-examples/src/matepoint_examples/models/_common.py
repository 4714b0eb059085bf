"""Pieces shared by the example models: the checkpoint-function protocol and helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor

__all__ = ["CheckpointFn", "no_checkpoint"]


class CheckpointFn(Protocol):
    """A callable that runs ``function(*args)``, possibly checkpointed.

    The example models never pick a checkpoint implementation themselves: every block goes through
    one of these, so the same model runs with no checkpoint, ``torch.utils.checkpoint``, matepoint
    or a peer, and the comparison differs only in that one call.
    """

    def __call__(self, function: Callable[..., Tensor], /, *args: Tensor) -> Any:
        """Run ``function(*args)`` and return its output.

        Args:
            function: The block to run.
            *args: The tensors the block takes; these are what a checkpoint saves.

        Returns:
            The block's output.
        """
        ...


def no_checkpoint(function: Callable[..., Tensor], /, *args: Tensor) -> Tensor:
    """Run ``function(*args)`` directly, keeping every activation on the device.

    Used as the default ``checkpoint_fn`` so a model built without arguments is a plain model.

    Args:
        function: The block to run.
        *args: The block's inputs.

    Returns:
        The block's output.
    """
    return function(*args)
