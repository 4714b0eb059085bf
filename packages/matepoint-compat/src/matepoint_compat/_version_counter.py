"""A handle on a tensor's autograd version counter that holds none of its memory.

Note [Version witness]
    Rule 1. A tensor, its base, every view of that base and every ``detach()`` alias share one
            autograd version counter, bumped by an in-place write through any of them
            (``base.add_``, ``param.mul_`` under ``no_grad``, ``view.copy_``).
    Rule 2. torch's checkpoint keeps its saved inputs alive and so sees every such write.
            matepoint lets a device original go once its copy is on the host and keeps a
            *witness* instead: a detached alias whose storage is swapped for an empty one. It
            shares the counter, owns no device memory and keeps nothing else alive.
    Rule 3. A witness whose ``_version`` differs from the version at pack time means something
            wrote the input's memory, through some alias.
    Rule 4. Making a witness changes no version the user can see.
    Example: ``x = h[:, :64]`` is saved, offloaded and let go; ``h.add_(1)`` before backward
    bumps ``x``'s witness too, and backward raises as torch's checkpoint would.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["version_witness"]

_set_version_counter: Any = torch._C._autograd._unsafe_set_version_counter


# torch 2.4 takes (tensor, version); later releases take (tensors, versions).
try:
    _set_version_counter((torch.zeros(()),), (0,))
    _TAKES_TUPLES = True
except TypeError:
    _TAKES_TUPLES = False


def version_witness(tensor: torch.Tensor) -> torch.Tensor:
    """Return a storage-less tensor that shares ``tensor``'s version counter.

    See Note [Version witness], rule 4. ``set_()`` on the detached alias is itself an in-place
    call that bumps the shared counter; ``torch._C._autograd._unsafe_set_version_counter`` (what
    ``torch.autograd.graph``'s ``_unsafe_preserve_version_counter`` calls, checked on 2.4 to
    2.15; it took one tensor and one version on 2.4, tuples of them on 2.13) puts it back, so
    neither the user's tensor nor any other saved tensor of theirs sees a version change. This
    runs once per offload on the forward's host path, so it calls torch directly rather than
    through two context managers.

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
    version = tensor._version
    witness = tensor.detach()  # requires no grad, so set_() records nothing for autograd
    witness.set_()  # type: ignore[call-overload]  # the no-argument form is real, untyped
    if _TAKES_TUPLES:
        _set_version_counter((witness,), (version,))
    else:
        _set_version_counter(witness, version)
    return witness
