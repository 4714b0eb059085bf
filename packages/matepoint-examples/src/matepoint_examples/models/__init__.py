"""Example models for matepoint: a deep latent stack, a nanochat-style GPT and a Llama stack.

Both run every block through a ``checkpoint_fn`` argument, so one model definition serves the
no-checkpoint baseline, ``torch.utils.checkpoint``, matepoint and the offloading peers.
"""

from matepoint_examples.models._common import CheckpointFn, no_checkpoint
from matepoint_examples.models._gpt import GPTBlock, GPTConfig, NanoGPT
from matepoint_examples.models._latent import DeepLatentConfig, DeepLatentStack, LatentBlock
from matepoint_examples.models._llama import LlamaBlock, LlamaConfig, LlamaStack

__all__ = [
    "CheckpointFn",
    "DeepLatentConfig",
    "DeepLatentStack",
    "GPTBlock",
    "GPTConfig",
    "LatentBlock",
    "LlamaBlock",
    "LlamaConfig",
    "LlamaStack",
    "NanoGPT",
    "no_checkpoint",
]
