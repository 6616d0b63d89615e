"""Gemma 3 images: transformers' ``Gemma3ImageProcessorPil`` and ``Gemma3Processor``'s prompt text.

Pixels (``image_processing_pil_gemma3.py`` on ``PilBackend``): RGB, resize to ``height x width``
(``size``, default 224 x 224; the hub's Gemma 3 uses 896) with ``resample`` (default bilinear),
rescale by ``1/255``, normalize with mean = std = 0.5 per channel; ``pixel_values`` is
``float32 [n, 3, height, width]``, one row per image, or with pan-and-scan one per image followed
by its crops.

Pan-and-scan (off unless :class:`PanAndScan` is given): an image whose long side is at least
``min_ratio_to_activate`` times its short side is cut along the long side into
``k = clip(min(floor(ratio + 0.5), floor(long / min_crop_size)), 2, max_num_crops)`` crops of
``ceil(long / k)`` (the last one shorter), taken from the image before resizing, unless a crop
side would be under ``min_crop_size``. As in transformers 5.23, ``Gemma3Processor`` uses its own
defaults (off; 256, 4, 1.2) whatever ``do_pan_and_scan`` / ``pan_and_scan_*`` the saved image
processor config holds, so :meth:`Gemma3ImageConfig.from_dir` ignores those fields too: pass
``pan_and_scan`` to turn it on.

Prompt text (``processing_gemma3.py``): each ``boi_token`` (``<start_of_image>``) in the prompt
stands for one image and becomes ``"\\n\\n" + boi + image_token * image_seq_length + eoi +
"\\n\\n"``; an image with ``k`` crops becomes ``"Here is the original image " + seq + " and here
are some crops to help you see better " + " ".join([seq] * k)``. ``image_seq_length`` (default
256) is ``processor_config.json``'s field and must equal the model's ``mm_tokens_per_image``
(``check_tokens_per_image``: otherwise a prompt's image tokens and its images' features differ
in number, which transformers' model refuses and relax's jitted forward could not see).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Float, UInt8
from PIL import Image

from relax.data.images.pixels import (
    IMAGENET_STANDARD,
    MAX_SIDE,
    PROCESSOR_FILE,
    PixelSteps,
    pixel_steps,
    pixel_values,
    read_configs,
    resize,
    rgb_array,
    token,
)
from relax.data.images.prompt import expand_placeholders
from relax.models.hf.reader import ConfigReader, HFFormatError
from relax.models.hf.weights_io import read_json

_BILINEAR = int(Image.Resampling.BILINEAR)


@dataclasses.dataclass(frozen=True)
class PanAndScan:
    """Gemma 3's pan-and-scan settings, defaults of ``Gemma3Processor`` (module docstring)."""

    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def __post_init__(self):
        if self.min_crop_size < 1 or self.max_num_crops < 2:
            raise ValueError(f"PanAndScan needs min_crop_size >= 1 and max_num_crops >= 2: {self}")


@dataclasses.dataclass(frozen=True)
class Gemma3ImageConfig:
    """The image processor's size and pixel steps and the processor's prompt strings."""

    height: int = 224
    width: int = 224
    steps: PixelSteps = PixelSteps(_BILINEAR, IMAGENET_STANDARD, IMAGENET_STANDARD)
    image_seq_length: int = 256
    boi_token: str = "<start_of_image>"
    image_token: str = "<image_soft_token>"
    eoi_token: str = "<end_of_image>"
    pan_and_scan: PanAndScan | None = None

    @classmethod
    def from_dir(
        cls, directory: str | Path, *, pan_and_scan: PanAndScan | None = None
    ) -> Gemma3ImageConfig:
        """Read ``processor_config.json`` / ``preprocessor_config.json`` (``relax.data.images
        .pixels.read_configs``) and the image tokens of ``tokenizer_config.json``; absent fields
        take transformers' defaults."""
        files = read_configs(directory, "Gemma3ImageProcessor")
        height, width = _size(files.image)
        return cls(
            height=height,
            width=width,
            steps=pixel_steps(files.image, _BILINEAR, IMAGENET_STANDARD, IMAGENET_STANDARD),
            image_seq_length=files.processor.int_("image_seq_length", 256, lo=1, hi=MAX_SIDE),
            boi_token=token(files.tokenizer, "boi_token", cls.boi_token),
            image_token=token(files.tokenizer, "image_token", cls.image_token),
            eoi_token=token(files.tokenizer, "eoi_token", cls.eoi_token),
            pan_and_scan=pan_and_scan,
        )


def _size(r: ConfigReader) -> tuple[int, int]:
    """``size``: ``{"height", "width"}`` or one integer for both (``default_to_square``)."""
    size = r.get("size", {"height": 224, "width": 224})
    if isinstance(size, int) and not isinstance(size, bool):
        size = {"height": size, "width": size}
    if not isinstance(size, dict) or set(size) != {"height", "width"}:
        raise r.fail("size", f"must be {{'height': h, 'width': w}} for Gemma 3, got {size!r}")
    return tuple(r.int_(k, d=size, prefix="size.", lo=1, hi=MAX_SIDE) for k in ("height", "width"))


class Gemma3Images(NamedTuple):
    """Processed images: ``pixel_values`` (each image, then its crops) and ``num_crops`` per
    input image (all 0 without pan-and-scan)."""

    pixel_values: Float[np.ndarray, "n 3 height width"]
    num_crops: tuple[int, ...]


def pan_and_scan_crops(
    image: UInt8[np.ndarray, "h w 3"], p: PanAndScan
) -> list[UInt8[np.ndarray, "ch cw 3"]]:
    """The crops of ``image`` (none when it is not elongated enough), as transformers cuts them."""
    height, width = image.shape[:2]
    long, short = max(width, height), min(width, height)
    if long / short < p.min_ratio_to_activate:
        return []
    k = min(int(math.floor(long / short + 0.5)), int(math.floor(long / p.min_crop_size)))
    k = min(p.max_num_crops, max(2, k))
    n_w, n_h = (k, 1) if width >= height else (1, k)
    crop_w, crop_h = int(math.ceil(width / n_w)), int(math.ceil(height / n_h))
    if min(crop_w, crop_h) < p.min_crop_size:
        return []
    return [
        image[crop_h * i : crop_h * (i + 1), crop_w * j : crop_w * (j + 1)]
        for i in range(n_h)
        for j in range(n_w)
    ]


class Gemma3ImageProcessor:
    """Images -> :class:`Gemma3Images`; prompt text -> its expanded text (module docstring)."""

    def __init__(self, config: Gemma3ImageConfig = Gemma3ImageConfig()):
        self.config = config

    def _one(self, image: UInt8[np.ndarray, "h w 3"]) -> Float[np.ndarray, "3 height width"]:
        c = self.config
        if c.steps.do_resize:
            image = resize(image, c.height, c.width, c.steps.resample)
        return pixel_values(image, c.steps)

    def __call__(self, images: Sequence[Any]) -> Gemma3Images:
        """``images``: PIL images or RGB ``uint8 [h, w, 3]`` arrays."""
        c, rows, num_crops = self.config, [], []
        for image in images:
            image = rgb_array(image, c.steps.do_convert_rgb)
            crops = pan_and_scan_crops(image, c.pan_and_scan) if c.pan_and_scan else []
            rows += [self._one(x) for x in [image, *crops]]
            num_crops.append(len(crops))
        if len({r.shape for r in rows}) > 1:
            raise ValueError(f"images of different sizes need do_resize: {[r.shape for r in rows]}")
        empty = np.zeros((0, 3, c.height, c.width), np.float32)
        return Gemma3Images(np.stack(rows) if rows else empty, tuple(num_crops))

    def num_crops(self, images: Sequence[UInt8[np.ndarray, "h w 3"]]) -> tuple[int, ...]:
        """Each RGB image's pan-and-scan crop count (``__call__``'s ``num_crops``), without pixels."""
        c = self.config
        return tuple(
            len(pan_and_scan_crops(x, c.pan_and_scan)) if c.pan_and_scan else 0 for x in images
        )

    def image_text(self, num_crops: int = 0) -> str:
        """The text one image (with ``num_crops`` crops) becomes in the prompt."""
        c = self.config
        seq = f"\n\n{c.boi_token}{c.image_token * c.image_seq_length}{c.eoi_token}\n\n"
        if not num_crops:
            return seq
        return (
            f"Here is the original image {seq} and here are some crops to help you see better "
            + " ".join([seq] * num_crops)
        )

    def expand_prompt(self, text: str, num_crops: Sequence[int]) -> str:
        """Each ``boi_token`` of ``text`` -> its image's text, in order; one per image."""
        return expand_placeholders(
            text, self.config.boi_token, [self.image_text(k) for k in num_crops]
        )


def check_tokens_per_image(config: Gemma3ImageConfig, directory: str | Path) -> None:
    """Raise ``HFFormatError`` naming both files when the processor's ``image_seq_length`` (the
    image tokens a prompt gets per image) is not the model's ``mm_tokens_per_image`` (the
    features an image gives; ``config.json``, transformers' default 256 when absent). A
    directory without ``config.json`` (a processor alone) has nothing to agree with."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return
    d = read_json(path)
    if not isinstance(d, dict):
        raise HFFormatError(f"{path}: must hold a JSON object")
    tokens = ConfigReader(d, str(path)).int_("mm_tokens_per_image", 256, lo=1)
    if tokens != config.image_seq_length:
        raise ConfigReader({}, str(Path(directory) / PROCESSOR_FILE)).fail(
            "image_seq_length",
            f"= {config.image_seq_length} (256 when the file or field is absent, as "
            f"Gemma3Processor's default) disagrees with {path}: mm_tokens_per_image = {tokens}; "
            "an image's tokens in the prompt must be as many as its features",
        )
