"""Hugging Face interop: config.json, safetensors checkpoints, MoE fields."""

from relax.models.hf.checkpoint import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    save_pretrained,
)
from relax.models.hf.config import (
    dtype_name,
    generation_config_to_hf,
    with_generation_config,
)
from relax.models.hf.moe import moe_fields, moe_problems, moe_to_hf
from relax.models.hf.reader import ConfigReader
from relax.models.hf.weights_io import (
    FLOAT_DTYPES,
    INDEX,
    WEIGHTS,
    SafetensorsFile,
    open_weights,
    read_json,
    write_json,
    write_safetensors,
)

__all__ = [
    "ConfigReader",
    "FLOAT_DTYPES",
    "HFFormatError",
    "INDEX",
    "SafetensorsFile",
    "WEIGHTS",
    "config_from_hf",
    "config_to_hf",
    "dtype_name",
    "generation_config_to_hf",
    "load_pretrained",
    "moe_fields",
    "moe_problems",
    "moe_to_hf",
    "open_weights",
    "read_json",
    "save_pretrained",
    "with_generation_config",
    "write_json",
    "write_safetensors",
]
