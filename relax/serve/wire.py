"""The training service's wire format: msgpack bodies, arrays as ``dtype / shape / bytes``.

    body = to_msgpack({"loss_fn": "grpo", "batch": encode_batch(rows)})
    request = from_msgpack(body)                       # RequestError on anything malformed
    rows = decode_batch(request["batch"], "batch")

Nothing is ever unpickled: a body is msgpack's maps, lists, strings, numbers and bytes, and an
array is the map ``{"__ndarray__": dtype name, "shape": [...], "data": raw bytes}`` with a dtype
from ``DTYPES`` (little-endian, C order). A typed batch (``BATCHES``: the batch types of the named
objectives, ``relax.serve.objectives``) travels as ``{"type": class name, "fields": {...}}`` and
is rebuilt only from that list; its fields are checked against the class's annotations (integer
or float, the named dimensions equal across fields, every float finite) and a bad one is a
``RequestError`` naming ``<where>.<field>``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

import msgpack
import numpy as np

from relax.algorithms.online.batch import LossRows
from relax.data.pairs import PairBatch, UnpairedBatch
from relax.data.supervised import PackedBatch
from relax.serve.objectives import ValueRows

__all__ = [
    "BATCHES",
    "DTYPES",
    "RequestError",
    "decode_array",
    "decode_batch",
    "encode_array",
    "encode_batch",
    "materialize",
    "to_msgpack",
    "from_msgpack",
]

DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "int32",
    "uint32",
    "int64",
    "float16",
    "float32",
    "float64",
)
BATCHES: dict[str, type] = {
    cls.__name__: cls for cls in (LossRows, PairBatch, UnpairedBatch, PackedBatch, ValueRows)
}
_TAG = "__ndarray__"


class RequestError(ValueError):
    """A request the service refuses; ``field`` names what is wrong in it (``batch.tokens``);
    ``status``: the HTTP status it is refused with (400; 413 for a request over a size limit,
    429 for one over a count or quota)."""

    def __init__(self, field: str, message: str, *, status: int = 400):
        super().__init__(f"{field}: {message}")
        self.field, self.status = field, status


def encode_array(a) -> dict:
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.name not in DTYPES:
        a = a.astype(np.float32) if a.dtype.kind == "f" else a  # bfloat16 -> float32
    if a.dtype.name not in DTYPES:
        raise TypeError(f"cannot send an array of dtype {a.dtype}; valid: {', '.join(DTYPES)}")
    return {
        _TAG: a.dtype.name,
        "shape": list(a.shape),
        "data": a.astype(a.dtype.newbyteorder("<")).tobytes(),
    }


def decode_array(d: dict, where: str) -> np.ndarray:
    dtype, shape, data = d.get(_TAG), d.get("shape"), d.get("data")
    if dtype not in DTYPES:
        raise RequestError(where, f"array dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (
        isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)
    ) or not isinstance(data, bytes):
        raise RequestError(where, "an array needs a shape (list of sizes) and its data (bytes)")
    want = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if len(data) != want:
        raise RequestError(where, f"array of {dtype} {shape} needs {want} bytes, got {len(data)}")
    return np.frombuffer(data, np.dtype(dtype).newbyteorder("<")).reshape(shape).astype(dtype)


def _default(obj):
    if isinstance(obj, np.generic):
        return obj.item()
    if hasattr(obj, "__array__"):
        return encode_array(obj)
    raise TypeError(f"cannot send a {type(obj).__name__}")


def _hook(d: dict):
    return decode_array(d, "body") if _TAG in d else d


def to_msgpack(obj: Any) -> bytes:
    """msgpack bytes of ``obj`` (dicts, lists, scalars, strings, bytes; numpy or jax arrays)."""
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def from_msgpack(body: bytes) -> Any:
    """The object of a msgpack body; a malformed one is a ``RequestError`` (field ``body``)."""
    try:
        return msgpack.unpackb(body, object_hook=_hook, raw=False, strict_map_key=True)
    except RequestError:
        raise
    except Exception as e:  # msgpack's own errors: ExtraData, FormatError, ValueError, ...
        raise RequestError("body", f"not a msgpack body ({type(e).__name__}: {e})") from None


def materialize(obj: Any) -> Any:
    """``obj`` with every encoded array (``encode_array``'s map) decoded, as ``from_msgpack`` would give
    it: for a body that is handed over in-process instead of sent."""
    if isinstance(obj, dict):
        return (
            decode_array(obj, "body")
            if _TAG in obj
            else {k: materialize(v) for k, v in obj.items()}
        )
    if isinstance(obj, (list, tuple)):
        return [materialize(v) for v in obj]
    return obj


def encode_batch(batch) -> dict:
    """``{"type", "fields"}`` of a typed batch (its array fields; None ones left out)."""
    name = type(batch).__name__
    if BATCHES.get(name) is not type(batch):
        raise TypeError(
            f"the service takes batches of {', '.join(BATCHES)}, got {type(batch).__name__}"
        )
    fields = {
        f.name: encode_array(getattr(batch, f.name))
        for f in dataclasses.fields(batch)
        if getattr(batch, f.name) is not None
    }
    return {"type": name, "fields": fields}


def _array_specs(annotation) -> list:
    """The jaxtyping array types an annotation allows (``X | Y | None`` gives X and Y)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    return [a for a in args if hasattr(a, "dims") and hasattr(a, "dtypes")]


def _kind(spec) -> str:
    name = spec.__name__.split("[")[0]
    return {"Int": "i", "Float": "f", "Bool": "b"}[name]


def _bind(spec, a: np.ndarray, sizes: dict[str, tuple[int, str]], where: str) -> str | None:
    """Why ``a`` does not fit ``spec`` given the sizes bound so far by earlier fields (None: it fits,
    and its new dimension names are bound)."""
    dims = [
        str(getattr(d, "name", getattr(d, "size", "?"))) for d in spec.dims
    ]  # a name, or a fixed size
    if a.ndim != len(dims):
        return f"needs {len(dims)} dimensions [{' '.join(dims)}], got shape {list(a.shape)}"
    new = dict(sizes)
    for name, size in zip(dims, a.shape):
        if name.isdigit():
            if size != int(name):
                return f"shape {list(a.shape)} for [{' '.join(dims)}]: a dimension of size {name} is {size} here"
            continue
        bound, by = new.setdefault(name, (size, where))
        if bound != size:
            return (
                f"shape {list(a.shape)} for [{' '.join(dims)}]: dimension {name!r} is {size} here "
                f"but {bound} in {by}"
            )
    sizes.update(new)
    return None


def _field(
    where: str, spec_list: list, a: np.ndarray, sizes: dict[str, tuple[int, str]]
) -> np.ndarray:
    kinds = {"i": "iub", "f": "fiu", "b": "biu"}
    errors = []
    for spec in spec_list:
        kind = _kind(spec)
        if a.dtype.kind not in kinds[kind]:
            errors.append(
                f"needs {'integer' if kind == 'i' else 'float' if kind == 'f' else 'bool'} values, "
                f"got {a.dtype}"
            )
            continue
        why = _bind(spec, a, sizes, where)
        if why is None:
            if kind == "f":
                a = a.astype(np.float32)
                bad = ~np.isfinite(a)
                if bad.any():
                    raise RequestError(
                        where,
                        f"{int(bad.sum())} non-finite value(s), first at index "
                        f"{list(map(int, np.argwhere(bad)[0]))}",
                    )
                return a
            return a.astype(np.int32) if kind == "i" else a.astype(bool)
        errors.append(why)
    raise RequestError(where, "; or ".join(errors))


def decode_batch(d: Any, where: str):
    """The typed batch of ``encode_batch``'s map, every field checked (module docstring)."""
    if not isinstance(d, dict) or not isinstance(d.get("fields"), dict):
        raise RequestError(where, "a batch is a map {'type': class name, 'fields': {name: array}}")
    cls = BATCHES.get(d.get("type"))
    if cls is None:
        raise RequestError(
            f"{where}.type", f"unknown batch type {d.get('type')!r}; valid: {', '.join(BATCHES)}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(d["fields"]) - set(fields))
    if unknown:
        raise RequestError(
            f"{where}.{unknown[0]}",
            f"{cls.__name__} has no field {unknown[0]!r}; its fields: {', '.join(fields)}",
        )
    sizes: dict[str, tuple[int, str]] = {}
    values = {}
    for name, f in fields.items():
        at = f"{where}.{name}"
        specs = _array_specs(hints[name])
        if name not in d["fields"]:
            if f.default is dataclasses.MISSING:
                raise RequestError(at, f"{cls.__name__} needs this field")
            continue
        a = d["fields"][name]
        if not isinstance(a, np.ndarray):
            raise RequestError(at, f"an array is needed, got {type(a).__name__}")
        if not specs:
            raise RequestError(at, "this field is computed by the service, not sent")
        values[name] = _field(at, specs, a, sizes)
    return cls(**values)
