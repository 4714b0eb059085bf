"""Flattening nested arguments into leaves, through torch's (private) pytree module.

matepoint.checkpoint flattens a checkpoint's args and kwargs so that tensors nested in tuples,
lists and dicts are offloaded too. ``torch.utils._pytree`` is private; ``tree_flatten(tree)`` and
``tree_unflatten(leaves, spec)`` have had the same signature and the same registered containers
(tuple, list, dict, namedtuple, OrderedDict, defaultdict, deque) on every release from 2.4 to 2.15,
so no gate is needed today; a future change is adapted here, not in core.
"""

from __future__ import annotations

from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["tree_flatten", "tree_unflatten"]
