"""The vision-language model types relax reads, by ``config.json``'s ``model_type``, with their
transformers architecture. Their language models are text families (``families.py``); their
towers, checkpoints and records live in ``relax.models.vision.families``. The text loader reads
this list to refuse such a directory with a pointer there."""

from types import MappingProxyType

__all__ = ["VISION_LANGUAGE"]

VISION_LANGUAGE = MappingProxyType(
    {
        "gemma3": "Gemma3ForConditionalGeneration",
        "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    }
)
