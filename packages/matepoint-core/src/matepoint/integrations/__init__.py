"""One-call ways to put ``matepoint.checkpoint`` behind the checkpointing of other libraries.

- :func:`enable_hf_gradient_checkpointing`: a Hugging Face ``transformers`` model's gradient
  checkpointing runs through matepoint.
- :func:`checkpoint_wrapper` and :func:`apply_matepoint_checkpointing`: torch's
  ``checkpoint_wrapper`` / ``apply_activation_checkpointing`` (what FSDP, FSDP2, DDP and
  torchtitan-style training loops use) with matepoint as the checkpoint function.

Each takes ``budget=`` (with ``example_batch=`` and ``optimizer=``): it wraps the blocks, plans
the fastest step within the budget from the live model (:func:`matepoint.plan_budget`) and
applies the plan, each block with its own region (Note [A plan's regions] in
``matepoint._planner.policy``); or ``budget_plan=``, a plan made before. With ``budget=``,
:func:`apply_matepoint_checkpointing` and :func:`enable_hf_gradient_checkpointing` also attach
a :class:`matepoint.BudgetGuard` to the model (``guard=False`` leaves it out): it reads the
first steps' measured peaks and plans again where they go over the budget (Note [The budget
guard] in ``matepoint._guard``).

One module each: ``_huggingface`` (transformers), ``_wrappers`` (torch's wrapper and
``apply_activation_checkpointing``), and ``_functions``, what they share (the checkpoint
function a block runs with under a plan, planning from the live model, the guard).

None of these imports ``transformers``: the Hugging Face helper only calls the model's own
methods, so matepoint's runtime dependencies stay torch and matepoint-compat.

Example:
    >>> import torch
    >>> import matepoint.integrations as mi
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    >>> mi.apply_matepoint_checkpointing(model, check_fn=lambda m: isinstance(m, torch.nn.Linear))
    >>> model(torch.randn(2, 8, requires_grad=True)).sum().backward()
"""

from __future__ import annotations

from matepoint.integrations._functions import matepoint_checkpoint_fn
from matepoint.integrations._huggingface import enable_hf_gradient_checkpointing
from matepoint.integrations._wrappers import apply_matepoint_checkpointing, checkpoint_wrapper

__all__ = [
    "apply_matepoint_checkpointing",
    "checkpoint_wrapper",
    "enable_hf_gradient_checkpointing",
    "matepoint_checkpoint_fn",
]
