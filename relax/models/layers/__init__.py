"""Building blocks of a decoder layer: rotary embeddings, the matmul, LoRA parameters."""

from relax.models.layers.lora import (
    DTYPES,
    INITS,
    TARGETS,
    Adapters,
    LoRAConfig,
    LoRAWeights,
    adapted,
    delta,
    init_adapters,
    merged_weight,
)
from relax.models.layers.matmul import matmul, weight_grad
from relax.models.layers.rope import (
    CosSin,
    Rotary,
    apply_rope,
    attention_factor,
    has_local_rope,
    inverse_frequencies,
    layer_rotary,
    rope_angles,
    rotary,
)

__all__ = [
    "Adapters",
    "CosSin",
    "DTYPES",
    "INITS",
    "LoRAConfig",
    "LoRAWeights",
    "Rotary",
    "TARGETS",
    "adapted",
    "apply_rope",
    "attention_factor",
    "delta",
    "has_local_rope",
    "init_adapters",
    "inverse_frequencies",
    "layer_rotary",
    "matmul",
    "merged_weight",
    "rope_angles",
    "rotary",
    "weight_grad",
]
