"""Write the ``config.json`` files of Gemma 3 27B and Qwen2.5-VL-7B (the Hub's published fields,
no weights) for ``relax plan`` (benchmarks/RESULTS.md, "relax plan for vision-language GRPO").

    python benchmarks/plan_vision_configs.py /tmp/vlm   # writes /tmp/vlm/{gemma-3-27b,qwen2.5-vl-7b}
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GEMMA3_27B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "vocab_size": 262208,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 168,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "max_position_embeddings": 131072,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "patch_size": 14,
        "image_size": 896,
        "vision_use_head": False,
    },
}

QWEN2_5_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 128000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "image_token_id": 151655,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "torch_dtype": "bfloat16",
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "hidden_act": "silu",
    },
}


def write(root: str | Path) -> dict[str, Path]:
    """Each model's directory under ``root`` with its ``config.json``."""
    out = {}
    for name, config in (("gemma-3-27b", GEMMA3_27B), ("qwen2.5-vl-7b", QWEN2_5_VL_7B)):
        d = Path(root) / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config, indent=1))
        out[name] = d
    return out


if __name__ == "__main__":
    for name, d in write(sys.argv[1] if len(sys.argv) > 1 else "vlm_configs").items():
        print(name, d / "config.json")
