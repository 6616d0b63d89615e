"""Qwen2-VL / Qwen2.5-VL images: transformers' ``Qwen2VLImageProcessorPil`` and the prompt text
of ``Qwen2_5_VLProcessor``.

Pixels (``image_processing_pil_qwen2_vl.py``): RGB; :func:`smart_resize` to ``H x W``, multiples
of ``factor = patch_size * merge_size`` (14 * 2 = 28) with ``min_pixels <= H * W <= max_pixels``
(as far as rounding allows), resampled bicubic by default; rescale by ``1/255``; normalize with
OpenAI CLIP's mean/std; then patches. The image ``[C, H, W]`` (``gh = H / P``, ``gw = W / P``
patches, ``M`` = merge_size, ``T`` = temporal_patch_size) is viewed as
``[C, gh/M, M, P, gw/M, M, P]``, transposed to ``[gh/M, gw/M, M, M, C, P, P]``, repeated ``T``
times along a new axis before the ``P, P`` ones (a still image is ``T`` equal frames), and
flattened to ``[gh * gw, C * T * P * P]``: rows run over merge blocks in raster order and, within
a block, over its ``M x M`` patches; a row is ``(c, t, py, px)`` with ``px`` fastest.
``image_grid_thw`` is ``(1, gh, gw)``; the image takes ``gh * gw / M**2`` tokens.

Config: ``size = {"shortest_edge": min_pixels, "longest_edge": max_pixels}`` (default 56 * 56
and 28 * 28 * 1280), overridden by top-level ``min_pixels`` / ``max_pixels`` (the hub's
Qwen2.5-VL files give those: 3136 and 12845056), as ``Qwen2VLImageProcessorPil.__init__`` does.

Prompt text (``processing_qwen2_5_vl.py``): each ``<|image_pad|>`` (the tokenizer's
``image_token`` when ``tokenizer_config.json`` names one) becomes that token repeated to its
image's token count; ``<|vision_start|>`` / ``<|vision_end|>`` around it are the prompt's own.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jaxtyping import Float, Int, UInt8
from PIL import Image

from relax.data.images.pixels import (
    MAX_SIDE,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PixelSteps,
    pixel_steps,
    pixel_values,
    read_configs,
    resize,
    rgb_array,
    token,
)
from relax.data.images.prompt import expand_placeholders

_BICUBIC = int(Image.Resampling.BICUBIC)
MAX_PIXELS_BOUND = 2**40  # bound on configured pixel counts


@dataclasses.dataclass(frozen=True)
class Qwen2VLImageConfig:
    """The image processor's sizes, patch geometry and pixel steps, and the image token."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    steps: PixelSteps = PixelSteps(_BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    image_token: str = "<|image_pad|>"

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, directory: str | Path) -> Qwen2VLImageConfig:
        """Read ``processor_config.json`` / ``preprocessor_config.json`` (``relax.data.images
        .pixels.read_configs``) and ``tokenizer_config.json``'s ``image_token``; absent fields
        take transformers' defaults."""
        files = read_configs(directory, "Qwen2VLImageProcessor")
        r = files.image
        size = r.get("size", {"shortest_edge": cls.min_pixels, "longest_edge": cls.max_pixels})
        if not isinstance(size, dict):
            raise r.fail("size", f"must be an object, got {size!r}")
        size = {k: v for k, v in size.items() if v is not None}
        bounds = dict(lo=1, hi=MAX_PIXELS_BOUND)
        lo = r.int_("min_pixels", None, nullable=True, **bounds)
        hi = r.int_("max_pixels", None, nullable=True, **bounds)
        if lo is None:
            lo = r.int_("shortest_edge", d=size, prefix="size.", **bounds)
        if hi is None:
            hi = r.int_("longest_edge", d=size, prefix="size.", **bounds)
        patch = dict(lo=1, hi=MAX_SIDE)
        return cls(
            min_pixels=lo,
            max_pixels=hi,
            patch_size=r.int_("patch_size", cls.patch_size, **patch),
            temporal_patch_size=r.int_("temporal_patch_size", cls.temporal_patch_size, **patch),
            merge_size=r.int_("merge_size", cls.merge_size, **patch),
            steps=pixel_steps(r, _BICUBIC, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD),
            image_token=token(files.tokenizer, "image_token", cls.image_token),
        )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """``(H, W)``: multiples of ``factor`` near ``(height, width)`` (Python's round, half to
    even), scaled down (floor) by ``sqrt(h * w / max_pixels)`` when over ``max_pixels``, up
    (ceil) by ``sqrt(min_pixels / (h * w))`` when under ``min_pixels``; aspect ratio <= 200."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(
    x: Float[np.ndarray, "c h w"], c: Qwen2VLImageConfig
) -> Float[np.ndarray, "gh*gw c*t*p*p"]:
    """``[C, H, W]`` -> ``[gh * gw, C * T * P * P]`` in the order of the module docstring."""
    ch, h, w = x.shape
    p, m, t = c.patch_size, c.merge_size, c.temporal_patch_size
    if h % (p * m) or w % (p * m):
        raise ValueError(f"an image of {h}x{w} is not made of {p * m}-pixel merge blocks")
    gh, gw = h // p, w // p
    blocks = x.reshape(ch, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return frames.reshape(gh * gw, ch * t * p * p)


class QwenImages(NamedTuple):
    """Processed images: every image's patch rows, concatenated, and its ``(t, h, w)`` grid."""

    pixel_values: Float[np.ndarray, "patches dim"]
    image_grid_thw: Int[np.ndarray, "n 3"]


class Qwen2VLImageProcessor:
    """Images -> :class:`QwenImages`; prompt text -> its expanded text (module docstring)."""

    def __init__(self, config: Qwen2VLImageConfig = Qwen2VLImageConfig()):
        self.config = config

    def _one(self, image: UInt8[np.ndarray, "h w 3"]) -> Float[np.ndarray, "3 H W"]:
        c = self.config
        if c.steps.do_resize:
            h, w = smart_resize(*image.shape[:2], c.factor, c.min_pixels, c.max_pixels)
            image = resize(image, h, w, c.steps.resample)
        return pixel_values(image, c.steps)

    def __call__(self, images: Sequence[Any]) -> QwenImages:
        """``images``: PIL images or RGB ``uint8 [h, w, 3]`` arrays."""
        c = self.config
        rows, grids = [], []
        for image in images:
            x = self._one(rgb_array(image, c.steps.do_convert_rgb))
            rows.append(patchify(x, c))
            grids.append((1, x.shape[1] // c.patch_size, x.shape[2] // c.patch_size))
        dim = 3 * c.temporal_patch_size * c.patch_size**2
        pixels = np.concatenate(rows) if rows else np.zeros((0, dim), np.float32)
        return QwenImages(pixels, np.array(grids, dtype=np.int64).reshape(-1, 3))

    def grids(self, images: Sequence[UInt8[np.ndarray, "h w 3"]]) -> Int[np.ndarray, "n 3"]:
        """The ``image_grid_thw`` ``__call__`` gives for RGB ``images``, from their sizes alone."""
        c = self.config
        sizes = [
            smart_resize(*x.shape[:2], c.factor, c.min_pixels, c.max_pixels)
            if c.steps.do_resize
            else x.shape[:2]
            for x in images
        ]
        grid = [(1, h // c.patch_size, w // c.patch_size) for h, w in sizes]
        return np.array(grid, dtype=np.int64).reshape(-1, 3)

    def num_tokens(self, image_grid_thw: Int[np.ndarray, "n 3"]) -> tuple[int, ...]:
        """Each image's token count, ``t * h * w / merge_size**2``."""
        return tuple(int(n) // self.config.merge_size**2 for n in np.prod(image_grid_thw, axis=1))

    def expand_prompt(self, text: str, image_grid_thw: Int[np.ndarray, "n 3"]) -> str:
        """Each ``image_token`` of ``text`` -> repeated to its image's token count, in order."""
        tok = self.config.image_token
        return expand_placeholders(text, tok, [tok * n for n in self.num_tokens(image_grid_thw)])
