"""Transformer family (Llama 2/3, Mistral, Qwen2, Qwen3), HF interop and token log-probs."""

from relax.models.config import ModelConfig, RopeScaling, small_config
from relax.models.transformer import Transformer, cast, hidden_states, init, project

__all__ = ["ModelConfig", "RopeScaling", "Transformer", "cast", "hidden_states", "init",
           "project", "small_config"]
