"""A handle on a tensor's autograd version counter that holds none of its memory.

Note [Version witness]
    autograd gives a tensor, its base and every view of that base one shared version counter;
    every in-place write through any of them (``base.add_``, ``param.mul_`` under ``no_grad``,
    ``view.copy_``) bumps it, and ``detach()`` aliases share it too. torch's checkpoint keeps its
    saved inputs alive and so sees every such write. matepoint lets the device original go once
    its copy has reached the host, so it keeps a *witness* instead: a detached alias of the input
    whose storage has been swapped for an empty one. It shares the counter, owns no device
    memory, and keeps nothing else alive. Comparing the witness's ``_version`` with the version
    at pack time tells whether anything wrote the input's memory through any alias.
"""

from __future__ import annotations

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

__all__ = ["version_witness"]


def version_witness(tensor: torch.Tensor) -> torch.Tensor:
    """Return a storage-less tensor that shares ``tensor``'s version counter.

    See Note [Version witness]. ``set_()`` on the detached alias is itself an in-place call that
    bumps the shared counter; ``torch.autograd._unsafe_preserve_version_counter`` (present on
    every supported release, 2.4 on) puts the counter back, so neither the user's tensor nor any
    other saved tensor of theirs sees a version change.

    Args:
        tensor: A tensor with a version counter (not an inference tensor).

    Returns:
        A 0-element tensor on ``tensor``'s device whose ``_version`` follows ``tensor``'s.

    Example:
        >>> import torch
        >>> base = torch.zeros(4)
        >>> witness = version_witness(base[:2])
        >>> base.add_(1)._version == witness._version
        True
    """
    witness = tensor.detach()
    with torch.no_grad(), _unsafe_preserve_version_counter(tensor):
        witness.set_()  # type: ignore[call-overload]  # the no-argument form is real, untyped
    return witness
