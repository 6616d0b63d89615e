"""Steps shared by the image processors, done as transformers' ``PilBackend`` does them, and the
reading of a model directory's processor config files.

For one image (a PIL image or an RGB ``uint8 [h, w, 3]`` array):

1. ``rgb_array``: a PIL image with an alpha band or a ``transparency`` entry is composited onto
   white (``transformers.image_transforms.convert_to_rgb``), any other is ``.convert("RGB")``;
2. ``resize``: through Pillow, ``Image.fromarray(uint8).resize((w, h), resample)``;
3. ``pixel_values`` (channels first): rescale ``x.astype(float64) * factor -> float32``, then
   normalize in float32 ``(x - mean) / std`` per channel, the dtypes transformers uses, so the
   values are bit-identical to its PIL processors.

Config files (:func:`read_configs`): the image processor's fields come from
``processor_config.json``'s ``"image_processor"`` object when there is one (what
``ProcessorMixin.save_pretrained`` writes in transformers 5.x), else from
``preprocessor_config.json`` (the hub's older layout), the priority of
``ImageProcessingMixin.get_image_processor_dict``. A ``null`` field means the class default, as
in transformers. Errors are ``HFFormatError`` naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Float, UInt8
from PIL import Image

from relax.models.hf.reader import ConfigReader, HFFormatError
from relax.models.hf.weights_io import read_json

PROCESSOR_FILE = "processor_config.json"
IMAGE_PROCESSOR_FILE = "preprocessor_config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # transformers' IMAGENET_STANDARD_MEAN / _STD
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_SIDE = 2**16  # bound on configured sizes


@dataclasses.dataclass(frozen=True)
class PixelSteps:
    """The per-pixel steps of transformers' image processors (their field names).

    ``resample``: a ``PIL.Image.Resampling`` value (0 nearest, 2 bilinear, 3 bicubic, ...);
    ``do_convert_rgb`` false accepts only RGB inputs (relax never keeps other channel counts).
    """

    resample: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    do_convert_rgb: bool = True

    def __post_init__(self):
        Image.Resampling(self.resample)  # ValueError on an unknown filter
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise ValueError(f"image_mean / image_std need 3 channels: {self}")


def rgb_array(image: Any, convert_rgb: bool = True) -> UInt8[np.ndarray, "h w 3"]:
    """A PIL image or an RGB ``uint8 [h, w, 3]`` array -> ``uint8 [h, w, 3]`` (module docstring)."""
    if isinstance(image, Image.Image):
        if image.mode != "RGB" and not convert_rgb:
            raise ValueError(f"a {image.mode} image needs do_convert_rgb")
        if "A" in image.getbands() or image.info.get("transparency") is not None:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            image = Image.alpha_composite(white, rgba)
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    a = np.asarray(image)
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[-1] != 3:
        raise ValueError(f"an image array must be uint8 [h, w, 3], got {a.dtype} {a.shape}")
    return a


def resize(
    image: UInt8[np.ndarray, "h w 3"], height: int, width: int, resample: int
) -> UInt8[np.ndarray, "height width 3"]:
    """Pillow's resize to ``height x width`` with filter ``resample``."""
    out = Image.fromarray(image).resize((width, height), resample=Image.Resampling(resample))
    return np.asarray(out, dtype=np.uint8)


def pixel_values(
    image: UInt8[np.ndarray, "h w 3"], steps: PixelSteps
) -> Float[np.ndarray, "3 h w"]:
    """Rescale then normalize, channels first: ``((x * factor)_f32 - mean_f32) / std_f32``."""
    x = np.moveaxis(image, -1, 0)
    if steps.do_rescale:
        x = (x.astype(np.float64) * steps.rescale_factor).astype(np.float32)
    x = x.astype(np.float32)
    if steps.do_normalize:
        mean = np.asarray(steps.image_mean, dtype=np.float32)[:, None, None]
        std = np.asarray(steps.image_std, dtype=np.float32)[:, None, None]
        x = (x - mean) / std
    return np.ascontiguousarray(x)


# ------------------------------------------------------------------------------- config files


@dataclasses.dataclass(frozen=True)
class ConfigFiles:
    """A model directory's processor configs: ``image`` reads the image processor's fields
    (nulls dropped), ``processor`` the processor's own (``{}`` without the file), ``tokenizer``
    ``tokenizer_config.json`` (``{}`` without it)."""

    image: ConfigReader
    processor: ConfigReader
    tokenizer: ConfigReader


def _object(path: Path) -> dict:
    d = read_json(path)
    if not isinstance(d, dict):
        raise HFFormatError(f"{path}: expected a JSON object, got {type(d).__name__}")
    return d


def read_configs(directory: str | Path, type_prefix: str) -> ConfigFiles:
    """The config files of ``directory``; an ``image_processor_type`` not starting with
    ``type_prefix`` (e.g. another model's processor) is refused."""
    directory = Path(directory)
    proc_path, image_path = directory / PROCESSOR_FILE, directory / IMAGE_PROCESSOR_FILE
    processor = _object(proc_path) if proc_path.is_file() else {}
    if isinstance(processor.get("image_processor"), dict):
        image, source = processor["image_processor"], f"{proc_path}: image_processor"
    elif image_path.is_file():
        image, source = _object(image_path), str(image_path)
    else:
        raise HFFormatError(
            f"{directory}: no image processor config ({IMAGE_PROCESSOR_FILE}, or "
            f"{PROCESSOR_FILE} with an 'image_processor' object)"
        )
    kind = image.get("image_processor_type")
    if kind is not None and not (isinstance(kind, str) and kind.startswith(type_prefix)):
        raise HFFormatError(
            f"{source}: field 'image_processor_type' is {kind!r}, not {type_prefix}"
        )
    tok_path = directory / TOKENIZER_CONFIG_FILE
    tokenizer = _object(tok_path) if tok_path.is_file() else {}
    return ConfigFiles(
        image=ConfigReader({k: v for k, v in image.items() if v is not None}, source),
        processor=ConfigReader(processor, str(proc_path)),
        tokenizer=ConfigReader(tokenizer, str(tok_path)),
    )


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer beyond float64
        return False


def channels(r: ConfigReader, field: str, default: tuple[float, float, float]) -> tuple:
    """A per-channel value: one number for all three channels, or a list of three."""
    v = r.get(field, default)
    v = [v] * 3 if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    if not isinstance(v, (list, tuple)) or len(v) != 3:
        raise r.fail(field, f"must be a number or a list of 3 numbers, got {v!r}")
    out = []
    for i, x in enumerate(v):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not _finite(x):
            raise r.fail(f"{field}[{i}]", f"must be a finite number, got {x!r}")
        out.append(float(x))
    if field == "image_std" and 0.0 in out:
        raise r.fail(field, f"must not hold 0 (it divides), got {v!r}")
    return tuple(out)


def pixel_steps(r: ConfigReader, resample: int, mean: tuple, std: tuple) -> PixelSteps:
    """The :class:`PixelSteps` fields of an image processor config, with the class defaults."""
    resample = r.int_("resample", resample, lo=0, hi=5)
    factor = r.float_("rescale_factor", 1 / 255)
    return PixelSteps(
        resample=resample,
        image_mean=channels(r, "image_mean", mean),
        image_std=channels(r, "image_std", std),
        do_resize=r.bool_("do_resize", True),
        do_rescale=r.bool_("do_rescale", True),
        rescale_factor=factor,
        do_normalize=r.bool_("do_normalize", True),
        do_convert_rgb=r.bool_("do_convert_rgb", True),
    )


def token(r: ConfigReader, field: str, default: str) -> str:
    """A special token's text from ``tokenizer_config.json`` (a string or an AddedToken dict)."""
    v = r.get(field, default)
    v = v.get("content", v) if isinstance(v, dict) else v
    if not isinstance(v, str) or not v:
        raise r.fail(field, f"must be a non-empty token string, got {v!r}")
    return v
