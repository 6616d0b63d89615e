"""The file layer under Hugging Face checkpoints and PEFT adapters: safetensors and JSON.

Safetensors are parsed here (8-byte little-endian header length, JSON header, raw data), not
through a framework, so bfloat16 reads as ``ml_dtypes.bfloat16`` and a write -> read round trip
is bit-exact: ``SafetensorsFile`` validates a header and reads tensors lazily through a memory
map, ``write_safetensors`` writes one file, ``open_weights`` finds every tensor of a model
directory (``model.safetensors``, or shards listed by ``model.safetensors.index.json``; pickles
are never read), and ``read_json`` / ``write_json`` read (within ``relax.models.hf.bounded_json``'s
bounds) and durably write the JSON beside them.
Every error about a file is an :class:`HFFormatError` naming it and the tensor or field.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from relax.models.hf.bounded_json import loads
from relax.models.hf.config import HFFormatError

__all__ = [
    "FLOAT_DTYPES",
    "INDEX",
    "WEIGHTS",
    "SafetensorsFile",
    "open_weights",
    "read_json",
    "write_json",
    "write_safetensors",
]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
_PICKLE = re.compile(r"^(pytorch_model|model|consolidated).*\.(bin|pt|pth)$|\.bin\.index\.json$")

_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "F4": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}
# the safetensors dtypes relax reads as weights (floating point), by code
FLOAT_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16"}


MAX_HEADER = 100_000_000  # bytes: the safetensors format's limit on a header


def _is_count(x) -> bool:
    """A non-negative integer (a dimension or a byte offset), bool excluded."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


class SafetensorsFile:
    """A parsed, validated safetensors header; tensors are read lazily through a memory map."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise HFFormatError(
                    f"{path}: truncated safetensors file ({size} bytes; no 8-byte header length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise HFFormatError(
                    f"{path}: corrupt safetensors file: header length {n} exceeds the format's "
                    f"limit of {MAX_HEADER} bytes"
                )
            if n > size - 8:
                raise HFFormatError(
                    f"{path}: corrupt or truncated safetensors file: header length {n} "
                    f"goes beyond the end of the file ({size} bytes)"
                )
            raw = f.read(n)
        try:
            header = loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise HFFormatError(f"{path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise HFFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.data_start, data_len = 8 + n, size - 8 - n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                code, shape, (b, end) = e["dtype"], tuple(e["shape"]), e["data_offsets"]
                if not all(_is_count(x) for x in (*shape, b, end)):
                    raise ValueError
            except (TypeError, KeyError, ValueError):
                raise HFFormatError(
                    f"{path}: tensor {name!r}: malformed header entry {e!r} (shape and "
                    "data_offsets must be non-negative integers)"
                ) from None
            if code not in _ITEMSIZE:
                raise HFFormatError(
                    f"{path}: tensor {name!r} has unknown safetensors dtype {code!r}"
                )
            nbytes = math.prod(shape) * _ITEMSIZE[code]
            if not 0 <= b <= end or end - b != nbytes:
                raise HFFormatError(
                    f"{path}: tensor {name!r}: data_offsets [{b}, {end}] do not hold "
                    f"{code} {list(shape)} ({nbytes} bytes)"
                )
            if end > data_len:
                raise HFFormatError(
                    f"{path}: corrupt or truncated safetensors file: tensor {name!r} "
                    f"data_offsets [{b}, {end}] go beyond the end of the data ({data_len} bytes)"
                )
            self.entries[name] = (code, shape, b, end)
        self._map = None

    def read(self, name: str) -> np.ndarray:
        """A read-only view of the tensor (copy it before keeping it)."""
        code, shape, b, end = self.entries[name]
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, mode="r")
        raw = self._map[self.data_start + b : self.data_start + end]
        return raw.view(FLOAT_DTYPES[code]).reshape(shape)


def write_safetensors(
    path: Path, tensors: list[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]]
) -> None:
    """Write ``(name, shape, dtype, make_array)`` tensors, largest itemsize first (aligned offsets)."""
    tensors = sorted(tensors, key=lambda t: -t[2].itemsize)  # stable: keeps transformers' order
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dt, _ in tensors:
        nbytes = math.prod(shape) * dt.itemsize
        header[name] = {
            "dtype": _CODE[dt.name],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, shape, dt, make in tensors:
            a = np.ascontiguousarray(make())
            assert a.shape == tuple(shape) and a.dtype == dt, (name, a.shape, a.dtype)
            f.write(a.reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path):
    """The parsed JSON file at ``path``: ``HFFormatError`` naming it, the line and the column when
    it is not valid JSON or beyond ``relax.models.hf.bounded_json``'s bounds (nesting, numbers)."""
    try:
        with open(path, encoding="utf-8") as f:
            return loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HFFormatError(f"{path}: not valid JSON ({e})") from None


def write_json(path: Path, obj: Any, *, sort_keys: bool = True, ensure_ascii: bool = True) -> None:
    """Write ``obj`` to ``path`` as indented UTF-8 JSON, durably: into a temporary file beside it,
    synced to disk, then renamed over ``path`` (a reader finds the old file or the whole new one,
    never a part). Keys sorted and non-ASCII escaped by default, as transformers writes
    ``config.json``; ``sort_keys=False, ensure_ascii=False`` keeps a mapping's order and text (a
    tokenizer config)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_weights(root: Path) -> tuple[dict[str, SafetensorsFile], str]:
    """Tensor name -> file holding it, and the file to name when a tensor is missing."""
    single, index = root / WEIGHTS, root / INDEX
    if single.is_file():
        f = SafetensorsFile(single)
        return dict.fromkeys(f.entries, f), str(single)
    if index.is_file():
        wm = read_json(index)
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise HFFormatError(
                f"{index}: field 'weight_map' is missing or not an object of tensor -> shard file"
            )
        files: dict[str, SafetensorsFile] = {}
        for shard in sorted(set(wm.values())):
            if Path(shard).name != shard or shard in ("", ".", ".."):
                raise HFFormatError(
                    f"{index}: weight_map names shard {shard!r} outside the directory"
                )
            if not (root / shard).is_file():
                first = next(n for n, s in wm.items() if s == shard)
                raise HFFormatError(
                    f"{index}: weight_map points at missing shard {shard!r} (for tensor {first!r})"
                )
            files[shard] = SafetensorsFile(root / shard)
        where = {n: f for f in files.values() for n in f.entries}
        for name, shard in wm.items():
            if name not in files[shard].entries:
                raise HFFormatError(
                    f"{root / shard}: tensor {name!r} is not in this shard, "
                    f"though {INDEX} maps it there"
                )
            where[name] = files[shard]
        return where, str(index)
    pickles = sorted(p.name for p in root.iterdir() if _PICKLE.search(p.name))
    if pickles:
        raise HFFormatError(
            f"{root}: no {WEIGHTS} or {INDEX}, only PyTorch pickle weights {pickles}; "
            "relax reads safetensors only (it never unpickles). Convert them first, "
            "e.g. transformers' model.save_pretrained(dir, safe_serialization=True)"
        )
    raise HFFormatError(f"{root}: no {WEIGHTS} or {INDEX} (safetensors weights are required)")
