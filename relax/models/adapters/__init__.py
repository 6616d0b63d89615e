"""LoRA adapters on a model, and PEFT's file format."""
