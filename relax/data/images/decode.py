"""A data row's image field -> an RGB ``uint8`` array ``[h, w, 3]``, decoded by Pillow.

A field holds one image as

- a file path, relative to the data file's folder (to the working directory for rows given as
  plain dicts, ``relax.data.files.RECORDS_LABEL``);
- raw bytes (``bytes`` / ``bytearray`` / ``memoryview``), or a Hugging Face ``datasets`` image
  struct ``{"bytes": ..., "path": ...}`` (the bytes when present, else the path);
- a base64 string, with a ``data:image/<type>;base64,`` prefix or without one. A string without
  the prefix is base64 when it is made of base64 characters only and either is longer than any
  path (4,096 characters) or decodes to the signature of a known image format (PNG, JPEG, GIF,
  WebP, BMP, TIFF); anything else is a path (a path with a ``.`` in it never reads as base64).

Decoding follows ``transformers.image_utils.load_image`` (the route a path or base64 string
takes into transformers' processors): ``Image.open``, ``ImageOps.exif_transpose``, then
``.convert("RGB")``: an alpha channel is dropped, not composited, but a colour-keyed transparency
(a palette, grayscale or RGB PNG / GIF with a ``tRNS`` entry) survives as the RGB image's
``transparency``, and the processors (``do_convert_rgb``, on by default and in the hub's Gemma 3 and
Qwen2.5-VL) composite those pixels onto white: so does the decoding here
(``relax.data.images.pixels.rgb_array``), which equals transformers with ``do_convert_rgb`` on.
The first frame of an animated file is taken. Base64 is decoded strictly (``validate=True``):
where transformers' ``base64.decodebytes`` skips characters outside the alphabet, relax refuses.

Limits (:class:`ImageLimits`): the encoded size (file size, byte count, decoded base64 size) and
the pixel count ``w * h`` read from the header, checked before any pixel is decoded. This is
Pillow's decompression-bomb guard (``Image.MAX_IMAGE_PIXELS``) with our limit, applied per call
instead of through Pillow's process-wide setting; Pillow's own ``DecompressionBombError`` (over
twice its limit) is reported the same way. Only the formats in ``ImageLimits.formats`` are
tried (no EPS: Pillow would run Ghostscript on it).

Every failure raises :class:`ImageError` (a ``ValueError``) whose message names the source (data
file, row, field, and the path or "bytes" / "base64") and the cause.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import UInt8
from PIL import Image, ImageOps

from relax.data.files import RECORDS_LABEL, Record
from relax.data.images.pixels import rgb_array

PATH_MAX = 4096  # a string longer than this is never a path
_DATA_URI = re.compile(r"data:image/[A-Za-z0-9.+-]+;base64,")
_BASE64 = re.compile(r"[A-Za-z0-9+/\s]+={0,2}\s*")
_SIGNATURES = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"GIF8",
    b"RIFF",
    b"BM",
    b"II*\x00",
    b"MM\x00*",
)


class ImageError(ValueError):
    """An image that cannot be used; the message names its source and the cause."""


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """Bounds on one image: ``max_bytes`` of encoded data (file, bytes or decoded base64),
    ``max_pixels`` = ``w * h`` (Pillow's default warning threshold, ~89.5 M, by default) and the
    Pillow ``formats`` tried."""

    max_bytes: int = 64 * 2**20
    max_pixels: int = 89_478_485
    formats: tuple[str, ...] = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")

    def __post_init__(self):
        for name in ("max_bytes", "max_pixels"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive integer, got {v!r}")
        if not self.formats or not all(isinstance(f, str) for f in self.formats):
            raise ValueError(f"ImageLimits.formats must name Pillow formats, got {self.formats!r}")


class _Cause(Exception):
    """Why an image failed, before the source is known to name it."""


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} characters)"


def _over(n: int, limit: int, what: str) -> _Cause:
    return _Cause(f"{what} is {n} bytes, over the limit of {limit} bytes")


def read_file(path: Path, limits: ImageLimits) -> bytes:
    """The bytes of ``path``, refusing a file over ``limits.max_bytes`` before reading it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_bytes:
                raise _over(size, limits.max_bytes, "the file")
            data = f.read(limits.max_bytes + 1)
    except OSError as e:
        raise _Cause(f"cannot read the file: {e.strerror or e}") from e
    if len(data) > limits.max_bytes:  # grew since fstat
        raise _over(len(data), limits.max_bytes, "the file")
    return data


def from_base64(text: str, limits: ImageLimits) -> bytes:
    """Strict base64 (optionally behind a ``data:image/...;base64,`` prefix) -> bytes."""
    if text.startswith("data:"):
        m = _DATA_URI.match(text)
        if m is None:
            raise _Cause(
                f"a data URI must start data:image/<type>;base64, got {_short(text, 40)!r}"
            )
        text = text[m.end() :]
    payload = "".join(text.split())
    if len(payload) > 4 * (limits.max_bytes // 3 + 1):
        raise _Cause(f"the base64 text is over {limits.max_bytes} bytes once decoded")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _Cause(f"not valid base64 ({e})") from e
    if len(data) > limits.max_bytes:
        raise _over(len(data), limits.max_bytes, "the decoded base64")
    return data


def is_base64(text: str) -> bool:
    """Whether a field string without a data-URI prefix reads as base64 (module docstring)."""
    if text.startswith("data:"):
        return True
    if _BASE64.fullmatch(text) is None:
        return len(text) > PATH_MAX
    if len(text) > PATH_MAX:
        return True
    head = "".join(text[:64].split())[:16]
    try:
        return base64.b64decode(head[: len(head) // 4 * 4]).startswith(_SIGNATURES)
    except (binascii.Error, ValueError):
        return False


def decode_bytes(data: bytes, limits: ImageLimits) -> UInt8[np.ndarray, "h w 3"]:
    """Encoded image bytes -> RGB ``uint8 [h, w, 3]`` as ``load_image`` and the processors' RGB
    conversion give it (module docstring)."""
    try:
        with Image.open(io.BytesIO(data), formats=list(limits.formats)) as im:
            w, h = im.size
            if w * h > limits.max_pixels:
                raise _Cause(
                    f"{w}x{h} = {w * h} pixels, over the limit of {limits.max_pixels} pixels"
                )
            rgb = ImageOps.exif_transpose(im).convert("RGB")
    except _Cause:
        raise
    except Image.DecompressionBombError as e:
        raise _Cause(f"over Pillow's pixel limit ({e})") from e
    except Image.UnidentifiedImageError as e:
        raise _Cause(f"not an image in a known format {limits.formats} ({e})") from e
    except Exception as e:  # Pillow's plugins raise OSError, SyntaxError, struct.error, ...
        raise _Cause(f"unreadable image data ({type(e).__name__}: {e})") from e
    if rgb.width * rgb.height > limits.max_pixels:  # a frame or an EXIF turn larger than the header
        raise _Cause(f"{rgb.width}x{rgb.height} pixels once decoded, over {limits.max_pixels}")
    return rgb_array(rgb).copy()  # a colour key composited onto white, as the processors do


def _classify(value: Any) -> tuple[str, Any]:
    """``(kind, payload)`` with kind "path", "bytes" or "base64" (module docstring)."""
    if isinstance(value, dict) and ("bytes" in value or "path" in value):
        if value.get("bytes") is not None:
            return _classify(value["bytes"])
        value = value.get("path")
        if not isinstance(value, (str, os.PathLike)):
            raise _Cause(f"an image struct needs bytes or a path, got path={value!r}")
        return "path", value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "bytes", bytes(value)
    if isinstance(value, os.PathLike):
        return "path", value
    if isinstance(value, str):
        return ("base64", value) if is_base64(value) else ("path", value)
    raise _Cause(
        f"expected a path, bytes or a base64 string, got {type(value).__name__} {_short(repr(value))}"
    )


def decode_image(
    value: Any,
    *,
    where: str = "decode_image",
    base_dir: str | os.PathLike[str] | None = None,
    limits: ImageLimits = ImageLimits(),
) -> UInt8[np.ndarray, "h w 3"]:
    """One field value -> RGB ``uint8 [h, w, 3]``. ``where`` starts every error message (e.g.
    "data.jsonl row 3, field 'image'"); a relative path is taken from ``base_dir`` (default: the
    working directory)."""
    kind, label = "value", ""
    try:
        kind, payload = _classify(value)
        if kind == "path":
            path = Path(payload)
            if base_dir is not None and not path.is_absolute():
                path = Path(base_dir) / path
            label = f" {_short(str(path), 200)!r}"
            data = read_file(path, limits)
        elif kind == "base64":
            data = from_base64(payload, limits)
        else:
            data = payload
            if len(data) > limits.max_bytes:
                raise _over(len(data), limits.max_bytes, "the data")
        return decode_bytes(data, limits)
    except _Cause as e:
        raise ImageError(f"{where}: image ({kind}{label}): {e}") from e.__cause__


def record_images(
    record: Record, field: str, *, limits: ImageLimits = ImageLimits()
) -> list[UInt8[np.ndarray, "h w 3"]]:
    """The images of ``record[field]``: one value or a list of them (none for ``null`` / ``[]``),
    paths relative to the folder of the record's data file."""
    where = f"{record.file} row {record.row}, field {field!r}"
    if field not in record.record:
        raise ImageError(f"{where}: the row has no such field")
    value = record.record[field]
    if value is None:
        return []
    base = None if record.file == RECORDS_LABEL else Path(record.file).parent
    many = isinstance(value, Sequence) and not isinstance(
        value, (str, bytes, bytearray, memoryview)
    )
    if not many:
        return [decode_image(value, where=where, base_dir=base, limits=limits)]
    return [
        decode_image(v, where=f"{where}[{i}]", base_dir=base, limits=limits)
        for i, v in enumerate(value)
    ]
