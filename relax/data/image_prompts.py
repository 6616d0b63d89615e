"""Rows with images become image prompts: the images decoded, the prompt rendered with image
parts by the model's own chat template, each image's placeholder expanded to its image tokens as
the family's processor does, and a batch's pixel values for the vision tower.

A row's prompt is a string (then it becomes one user message whose content is the row's images,
then the text) or a list of chat messages whose image parts (``{"type": "image"}``) are as many
as the row's images. ``--image-field``'s value is one image or a list (paths relative to the
data file, bytes, base64; ``relax.data.images.decode``). A bad image is an error naming the
file, row and field (``bad_images="reject"``) or the row is dropped and counted (``"drop"``), as
prompts over the budget are. A row keeps its image field's value, not its pixels: a batch decodes
and processes its images again when it is collated (memory stays the rows').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from relax.data.files import PathLike, Record
from relax.data.images.decode import ImageLimits, record_images
from relax.data.images.gemma3 import (
    Gemma3ImageConfig,
    Gemma3ImageProcessor,
    check_tokens_per_image,
)
from relax.data.images.qwen2_vl import Qwen2VLImageConfig, Qwen2VLImageProcessor

__all__ = ["BAD_IMAGES", "ImageBatch", "ImagePrompts", "image_messages", "processor_for"]

BAD_IMAGES = ("reject", "drop")


class ImageBatch(NamedTuple):
    """A batch's images for the vision tower, in prompt order: ``pixel_values`` (Gemma 3:
    ``[n, 3, H, W]``; Qwen2-VL: every image's patch rows ``[sum t h w, C T P P]``) and ``grid``
    (Qwen2-VL: each image's ``(t, h, w)``; Gemma 3: empty)."""

    pixel_values: np.ndarray
    grid: tuple[tuple[int, int, int], ...]


def image_messages(prompt: Any, count: int) -> list[dict]:
    """The chat messages of a prompt with ``count`` images: a string becomes one user message of
    ``count`` image parts and the text; messages must hold ``count`` image parts already."""
    if isinstance(prompt, str):
        parts = [{"type": "image"} for _ in range(count)] + [{"type": "text", "text": prompt}]
        return [{"role": "user", "content": parts}]
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt must be a string or a list of chat messages, got {type(prompt)}")
    found = sum(
        1
        for m in prompt
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )
    if found != count:
        raise ValueError(f"the messages have {found} image part(s), the row {count} image(s)")
    return list(prompt)


@dataclasses.dataclass(frozen=True)
class ImagePrompts:
    """How a run's rows become image prompts: ``field`` (the rows' image column), the model's
    ``processor`` (``Gemma3ImageProcessor`` / ``Qwen2VLImageProcessor``, from its directory),
    ``limits`` on each image, and what a bad image does (``bad_images``)."""

    field: str
    processor: Gemma3ImageProcessor | Qwen2VLImageProcessor
    limits: ImageLimits = ImageLimits()
    bad_images: Literal["reject", "drop"] = "reject"

    def __post_init__(self):
        if self.bad_images not in BAD_IMAGES:
            raise ValueError(f"bad_images must be one of {BAD_IMAGES}, got {self.bad_images!r}")

    def decode(self, row: Record) -> list[np.ndarray]:
        """The row's images (``ImageError`` naming the file, row and field)."""
        return record_images(row, self.field, limits=self.limits)

    def expand(self, text: str, images: Sequence[np.ndarray]) -> str:
        """``text`` (the rendered prompt) with each image's placeholder expanded to its tokens
        (counted from the images' sizes: their pixels are processed when a batch is made)."""
        p = self.processor
        if isinstance(p, Qwen2VLImageProcessor):
            return p.expand_prompt(text, p.grids(images))
        return p.expand_prompt(text, p.num_crops(images))

    def batch(self, sources: Sequence[Record]) -> ImageBatch:
        """The images of a batch's prompts (each the row ``prepare_prompts`` kept: its image
        field alone), decoded and processed again, in prompt order."""
        images = [image for row in sources for image in self.decode(row)]
        p = self.processor(images)
        if isinstance(self.processor, Qwen2VLImageProcessor):
            grid = tuple(tuple(int(x) for x in g) for g in p.image_grid_thw)
            return ImageBatch(p.pixel_values, grid)
        if any(p.num_crops):
            raise ValueError("pan-and-scan crops are not supported in training batches")
        return ImageBatch(p.pixel_values, ())


def processor_for(
    model_type: str, directory: str | PathLike
) -> Gemma3ImageProcessor | Qwen2VLImageProcessor:
    """The image processor of a vision-language ``model_type``, configured from ``directory``
    (Gemma 3: its image tokens per image checked against the model's, ``check_tokens_per_image``)."""
    if model_type == "gemma3":
        config = Gemma3ImageConfig.from_dir(directory)
        check_tokens_per_image(config, directory)
        return Gemma3ImageProcessor(config)
    if model_type in ("qwen2_5_vl", "qwen2_vl"):
        return Qwen2VLImageProcessor(Qwen2VLImageConfig.from_dir(directory))
    raise ValueError(f"{directory}: no image processor for model_type {model_type!r}")
