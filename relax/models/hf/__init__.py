"""Hugging Face interop: config.json, safetensors checkpoints, MoE fields."""
