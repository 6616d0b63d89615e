"""Model configuration: one frozen dataclass for the Llama / Mistral / Qwen2 / Qwen3 family."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

Family = Literal["llama", "mistral", "qwen2", "qwen3"]
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``kind="llama3"`` is Llama 3.1's piecewise rescaling of the inverse frequencies
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position``);
    ``kind="linear"`` divides every inverse frequency by ``factor`` (positions / factor).
    """

    kind: Literal["llama3", "linear"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer.

    The five supported checkpoints differ only in these fields:
    Llama 2/3 and Mistral (no biases, no q/k norm; Llama 3 adds ``rope_scaling``,
    Mistral a ``sliding_window``), Qwen2 (``qkv_bias``), Qwen3 (``qk_norm`` and an explicit
    ``head_dim``). ``family`` is the Hugging Face ``model_type`` written back on save.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: Family = "llama"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family={self.family!r}; valid: {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-layer parameter shapes (no ``[L]`` axis) of the ``LayerStack`` fields this config
        has, in one fixed order: the one definition init, the HF loader and ``num_params`` use."""
        D, F, hd = self.hidden_size, self.intermediate_size, self.head_dim
        qd, kd = self.num_heads * hd, self.num_kv_heads * hd
        s = dict(attn_norm=(D,), wq=(D, qd), wk=(D, kd), wv=(D, kd), wo=(qd, D), mlp_norm=(D,),
                 w_gate=(D, F), w_up=(D, F), w_down=(F, D))
        if self.qkv_bias:
            s.update(bq=(qd,), bk=(kd,), bv=(kd,))
        if self.o_bias:
            s.update(bo=(D,))
        if self.qk_norm:
            s.update(q_norm=(hd,), k_norm=(hd,))
        if self.mlp_bias:
            s.update(b_gate=(F,), b_up=(F,), b_down=(D,))
        return s

    def num_params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        per_layer = sum(math.prod(shape) for shape in self.layer_shapes().values())
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + self.num_layers * per_layer + d + head


def small_config(**overrides) -> ModelConfig:
    """The benchmark's "small" CPU config (Llama architecture, 4 layers, vocab 4096)."""
    base = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_layers=4,
                num_heads=8, num_kv_heads=4, head_dim=32, max_position_embeddings=2048)
    base.update(overrides)
    return ModelConfig(**base)
