"""LoRA adapters on a model, and PEFT's file format."""

from relax.models.adapters.operations import (
    adapter_fields,
    adapters_zero,
    add_lora,
    base_weights,
    has_lora,
    lora_off,
    merge_lora,
    split_trainable,
    trainable,
    uses_dropout,
    with_adapters,
    with_dropout_key,
    without_base,
)
from relax.models.adapters.peft import (
    CONFIG,
    WEIGHTS,
    fused_adapter_error,
    load_adapter,
    read_adapter_config,
    save_adapter,
)

__all__ = [
    "CONFIG",
    "WEIGHTS",
    "adapter_fields",
    "adapters_zero",
    "add_lora",
    "base_weights",
    "fused_adapter_error",
    "has_lora",
    "load_adapter",
    "lora_off",
    "merge_lora",
    "read_adapter_config",
    "save_adapter",
    "split_trainable",
    "trainable",
    "uses_dropout",
    "with_adapters",
    "with_dropout_key",
    "without_base",
]
