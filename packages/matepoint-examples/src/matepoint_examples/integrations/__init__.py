"""Runnable examples of matepoint behind other libraries' checkpointing, one module each.

- ``python -m matepoint_examples.integrations.huggingface``: a ``transformers`` model's gradient
  checkpointing through :func:`matepoint.integrations.enable_hf_gradient_checkpointing`.
- ``python -m matepoint_examples.integrations.checkpoint_wrapper``: torch's
  ``apply_activation_checkpointing`` through
  :func:`matepoint.integrations.apply_matepoint_checkpointing`.
- ``python -m matepoint_examples.integrations.torch_compile``: ``torch.compile``-d blocks inside
  ``matepoint.checkpoint``.
- ``torchrun ... -m matepoint_examples.bench.distributed``: DDP and FSDP2 (see that module).

Each example trains twins (torch's checkpoint and matepoint's) for a few steps, prints whether
their losses and parameters agree bitwise and what matepoint moved, and returns 0 when they do.
"""

from matepoint_examples.integrations._twins import TwinResult, compare_twins

__all__ = ["TwinResult", "compare_twins"]
