"""The training service's wire format: msgpack bodies, arrays as ``dtype / shape / bytes``.

    body = to_msgpack({"loss_fn": "grpo", "batch": encode_batch(rows)})
    request = decode_request(body)                     # RequestError on anything malformed
    rows = decode_batch(request["batch"], "batch")
    reply = from_msgpack(response_body)                # a response, as the client reads it

Nothing is ever unpickled: a body is msgpack's maps, lists, strings, numbers and bytes, and an
array is the map ``{"__ndarray__": dtype name, "shape": [...], "data": raw bytes}`` with a dtype
from ``DTYPES`` (little-endian, C order). A typed batch (``BATCHES``: the batch types of the named
objectives, ``relax.serve.objectives``) travels as ``{"type": class name, "fields": {...}}`` and
is rebuilt only from that list; its fields are checked against the class's annotations (integer
or float, the named dimensions equal across fields, every float finite) and a bad one is a
``RequestError`` naming ``<where>.<field>``.

A request body (``decode_request``) is checked as it is decoded, so that nothing in it can fail
later with anything but a ``RequestError`` naming its field: a map at the top, string keys only,
at most ``MAX_DEPTH`` levels deep and ``MAX_VALUES`` values (maps, lists and their items: each
costs a Python object, up to ~70 times its byte on the wire), integers within int64, numbers
finite in float32 (the dtype every number of a request is used in), strings without NUL bytes,
no msgpack extension types, arrays whose shape, dtype and byte count agree.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
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
    "decode_request",
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
MAX_DEPTH = 32
"""Levels of maps and lists a request may nest (a body's own are 5 deep)."""
MAX_VALUES = 1 << 18
"""Maps, lists and items in one request outside arrays' bytes (a datum costs ~20)."""
VALUE_BYTES = 100
"""What one value of a decoded body is charged (``decode_request``'s ``charge``): a Python
object and its slot in a list or map (an int 36 bytes, a float 32, a dict entry and its key ~100)."""
MAX_DIMS = 32
_INT64 = (-(1 << 63), (1 << 63) - 1)
_INT32 = (-(1 << 31), (1 << 31) - 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


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
    """The array of ``encode_array``'s map; a ``RequestError`` naming ``where`` if its dtype, shape
    (at most ``MAX_DIMS`` sizes, each >= 0) and bytes do not agree."""
    dtype, shape, data = d.get(_TAG), d.get("shape"), d.get("data")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise RequestError(where, f"array dtype {dtype!r:.40} is not one of {', '.join(DTYPES)}")
    if not (
        isinstance(shape, list)
        and len(shape) <= MAX_DIMS
        and all(type(s) is int and s >= 0 for s in shape)
    ) or not isinstance(data, bytes):
        raise RequestError(
            where,
            f"an array needs a shape (a list of at most {MAX_DIMS} sizes) and its data (bytes)",
        )
    itemsize = np.dtype(dtype).itemsize
    if math.prod(max(s, 1) for s in shape) * itemsize >= 1 << 62:  # numpy's bound, even if empty
        raise RequestError(where, f"array shape {shape} is too large for any array")
    want = math.prod(shape) * itemsize
    if len(data) != want:
        raise RequestError(where, f"array of {dtype} {shape} needs {want} bytes, got {len(data)}")
    if dtype == "bool":  # a byte other than 0 or 1 is no bool numpy should hold
        return np.frombuffer(data, np.uint8).reshape(shape) != 0
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
    """The object of a msgpack body (a response; a request's: ``decode_request``); a malformed
    one is a ``RequestError`` (field ``body``)."""
    try:
        return msgpack.unpackb(body, object_hook=_hook, raw=False, strict_map_key=True)
    except RequestError:
        raise
    except Exception as e:  # msgpack's own errors: ExtraData, FormatError, ValueError, ...
        raise RequestError("body", f"not a msgpack body ({type(e).__name__}: {e})") from None


class _Count:
    """msgpack's hooks: each map and list counted (and charged) as it is decoded, so that a body
    of many small values is refused before it is decoded whole (``MAX_VALUES``)."""

    def __init__(self, charge: Callable[[int], None] | None):
        self.values, self.charge = 0, charge

    def add(self, n: int) -> None:
        self.values += n
        if self.values > MAX_VALUES:
            raise RequestError(
                "body",
                f"more than {MAX_VALUES} values (maps, lists and their items) in one request; "
                "send numbers as arrays (encode_array)",
                status=413,
            )
        if self.charge is not None:
            self.charge(n * VALUE_BYTES)

    def map(self, d: dict) -> dict:
        self.add(1 + 2 * len(d))
        return d

    def list(self, items: list) -> list:
        self.add(1 + len(items))
        return items


def _no_ext(code: int, data: bytes):
    raise RequestError("body", f"msgpack extension type {code} is not taken")


def decode_request(body, *, charge: Callable[[int], None] | None = None) -> dict:
    """The map of a request body (bytes or a bytearray), every value checked (module docstring);
    a ``RequestError`` naming the field at fault otherwise. ``charge(n)`` is called with the bytes
    the decoded values are estimated to take as they are made (``VALUE_BYTES`` each): the server's
    in-flight budget, which may refuse by raising."""
    count = _Count(charge)
    try:
        obj = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=True,
            object_hook=count.map,
            list_hook=count.list,
            ext_hook=_no_ext,
            max_array_len=MAX_VALUES,
            max_map_len=MAX_VALUES,
            timestamp=0,
        )
    except RequestError:
        raise
    except msgpack.StackError:
        raise RequestError("body", f"nested too deep (at most {MAX_DEPTH} levels)") from None
    except Exception as e:  # msgpack's own errors: ExtraData, FormatError, ValueError, ...
        raise RequestError("body", f"not a msgpack body ({type(e).__name__}: {e})") from None
    out = _checked(obj, "", 0) if isinstance(obj, (dict, list)) else obj
    if not isinstance(out, dict):
        raise RequestError("body", f"the body must be a map, got a {type(out).__name__}")
    return out


def _checked(obj: dict | list, where: str, depth: int):
    """``obj`` with its arrays decoded, every value checked; ``where``: its field (``data[0]``)."""
    if depth >= MAX_DEPTH:
        raise RequestError(where, f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(obj, dict):
        if _TAG in obj:
            return decode_array(obj, where or "body")
        items = list(obj.items())
        for key, value in items:
            if not isinstance(key, str) or "\0" in key:
                raise RequestError(
                    where or "body", f"a map key must be a string without NUL, got {key!r:.40}"
                )
            at = f"{where}.{key:.40}" if where else f"{key:.40}"
            if isinstance(value, (dict, list)):
                obj[key] = _checked(value, at, depth + 1)
            elif (why := _bad_scalar(value)) is not None:
                raise RequestError(at, why)
        return obj
    for i, value in enumerate(obj):
        if isinstance(value, (dict, list)):
            obj[i] = _checked(value, f"{where}[{i}]", depth + 1)
        elif (why := _bad_scalar(value)) is not None:
            raise RequestError(f"{where}[{i}]", why)
    return obj


def _bad_scalar(v) -> str | None:
    """Why ``v`` is no value a request may hold (None: it is one)."""
    if v is None or isinstance(v, (bool, bytes)):
        return None
    if isinstance(v, int):
        return None if _INT64[0] <= v <= _INT64[1] else f"integer {v} is beyond int64"
    if isinstance(v, float):
        if math.isfinite(v) and abs(v) <= _FLOAT32_MAX:
            return None
        return f"{v!r} is not a finite float32 (numbers are used as float32)"
    if isinstance(v, str):
        return "a string with a NUL byte" if "\0" in v else None
    return f"a {type(v).__name__} is not taken (msgpack extension types are not)"


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
                with np.errstate(over="ignore"):  # beyond float32: inf, refused just below
                    a = a.astype(np.float32)
                bad = ~np.isfinite(a)
                if bad.any():
                    raise RequestError(
                        where,
                        f"{int(bad.sum())} non-finite value(s), first at index "
                        f"{list(map(int, np.argwhere(bad)[0]))}",
                    )
                return a
            if kind == "b":
                return a.astype(bool)
            if a.size and a.dtype.kind in "iu" and (a.min() < _INT32[0] or a.max() > _INT32[1]):
                raise RequestError(where, f"values from {a.min()} to {a.max()} are beyond int32")
            return a.astype(np.int32)
        errors.append(why)
    raise RequestError(where, "; or ".join(errors))


def decode_batch(d: Any, where: str):
    """The typed batch of ``encode_batch``'s map, every field checked (module docstring)."""
    if not isinstance(d, dict) or not isinstance(d.get("fields"), dict):
        raise RequestError(where, "a batch is a map {'type': class name, 'fields': {name: array}}")
    cls = BATCHES.get(d["type"]) if isinstance(d.get("type"), str) else None
    if cls is None:
        raise RequestError(
            f"{where}.type",
            f"unknown batch type {d.get('type')!r:.40}; valid: {', '.join(BATCHES)}",
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
