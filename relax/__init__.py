"""relax: pure-JAX reinforcement-learning post-training for language models."""

from relax.compose import Stage, compose, stage
from relax.models import ModelConfig, Transformer
from relax.models.adapters.operations import add_lora, merge_lora
from relax.models.adapters.peft import load_adapter, save_adapter
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.models.layers.lora import LoRAConfig
from relax.rollout.sampler import Rollout, generate
from relax.text import load_tokenizer
from relax.text.sentencepiece_model import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "LoRAConfig",
    "ModelConfig",
    "Rollout",
    "Stage",
    "Tokenizer",
    "Transformer",
    "add_lora",
    "compose",
    "generate",
    "load_adapter",
    "load_pretrained",
    "load_tokenizer",
    "merge_lora",
    "save_adapter",
    "save_pretrained",
    "stage",
]
