"""relax: pure-JAX reinforcement-learning post-training for language models."""

from relax.compose import Stage, compose, stage
from relax.models import ModelConfig, Transformer
from relax.models.hf import load_pretrained, save_pretrained
from relax.rollout.sampler import Rollout, generate
from relax.text import load_tokenizer
from relax.text.sentencepiece_model import Tokenizer

__version__ = "0.1.0"

__all__ = ["ModelConfig", "Rollout", "Stage", "Tokenizer", "Transformer", "compose", "generate",
           "load_pretrained", "load_tokenizer", "save_pretrained", "stage"]
