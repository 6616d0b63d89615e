"""Images for vision-language models: decoding a data row's image field (``decode``), and the
Gemma 3 (``gemma3``) and Qwen2-VL / Qwen2.5-VL (``qwen2_vl``) image processors with their prompt
text expansion, equal to transformers' PIL processors (``pixels``, ``prompt``: shared steps)."""

from relax.data.images.decode import (
    ImageError,
    ImageLimits,
    decode_image,
    record_images,
)
from relax.data.images.gemma3 import (
    Gemma3ImageConfig,
    Gemma3ImageProcessor,
    Gemma3Images,
    PanAndScan,
)
from relax.data.images.pixels import PixelSteps
from relax.data.images.prompt import expand_placeholders
from relax.data.images.qwen2_vl import (
    Qwen2VLImageConfig,
    Qwen2VLImageProcessor,
    QwenImages,
    smart_resize,
)

__all__ = [
    "Gemma3ImageConfig",
    "Gemma3ImageProcessor",
    "Gemma3Images",
    "ImageError",
    "ImageLimits",
    "PanAndScan",
    "PixelSteps",
    "Qwen2VLImageConfig",
    "Qwen2VLImageProcessor",
    "QwenImages",
    "decode_image",
    "expand_placeholders",
    "record_images",
    "smart_resize",
]
