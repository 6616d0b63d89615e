"""Decoder-only transformers (Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3), HF interop and token log-probs."""

from relax.models.config.model import ModelConfig, RopeScaling, family_config, small_config
from relax.models.decoder.logprobs import token_entropy, token_logprobs
from relax.models.decoder.transformer import Transformer, cast, hidden_states, init, project
from relax.models.hf.checkpoint import HFFormatError, load_pretrained, save_pretrained

__all__ = [
    "HFFormatError",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "cast",
    "family_config",
    "hidden_states",
    "init",
    "load_pretrained",
    "project",
    "save_pretrained",
    "small_config",
    "token_entropy",
    "token_logprobs",
]
