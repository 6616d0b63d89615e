"""The checks of a request's numbers, strings and maps, each in the type it is used in.

    lr = float32("adam_params.learning_rate", 1e-4, low=F32_TINY, high=1.0)
    seed = integer("seed", 7, 0, SEED_END)
    check_keys(request, "body")                     # every map's keys are strings

Floats are used as float32 on the devices: a value is refused (``RequestError`` naming the field)
unless ``np.float32(value)`` is finite (``|x| <= 3.4e38``) and, where a bound is asked for,
within it there, so that ``1e300`` (inf in float32) and ``1e-320`` (0 in float32) are refused
rather than turned into inf or 0 on the device. Integers must be Python ints (not bools) in
their range: a seed in ``[0, 2**32)`` (JAX keys take 32 bits of it: ``2**32`` would draw as 0),
sizes in int32. Strings that name files have no NUL byte. A map's keys are strings everywhere
in a request (a bytes key is refused, never compared with a string).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from relax.serve.wire import RequestError

__all__ = [
    "F32_MAX",
    "F32_TINY",
    "INT32_MAX",
    "SEED_END",
    "check_keys",
    "float32",
    "integer",
    "text",
]

F32_MAX = float(np.finfo(np.float32).max)  # 3.4028235e38
F32_TINY = float(np.finfo(np.float32).tiny)  # 1.1754944e-38, the smallest normal float32
INT32_MAX = int(np.iinfo(np.int32).max)
SEED_END = 2**32
_RANGE = f"float32: |x| <= {F32_MAX:.4g}, and 0 or |x| >= {F32_TINY:.4g}"


def float32(
    field: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """``value`` as a float, checked finite in float32 and in ``[low, high]`` there (``open_*``:
    the bound excluded); a nonzero value that float32 would make 0 is refused too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(field, f"a number is needed, got {value!r}")
    x = float(value)
    with np.errstate(over="ignore", under="ignore"):
        f = np.float32(x)
    if not math.isfinite(x) or not np.isfinite(f) or (x != 0 and (f == 0 or abs(x) < F32_TINY)):
        raise RequestError(field, f"{value!r} is outside the range of {_RANGE}")
    if low is not None and (f <= np.float32(low) if open_low else f < np.float32(low)):
        raise RequestError(field, f"must be {'>' if open_low else '>='} {low:g}, got {value!r}")
    if high is not None and (f >= np.float32(high) if open_high else f > np.float32(high)):
        raise RequestError(field, f"must be {'<' if open_high else '<='} {high:g}, got {value!r}")
    return x


def integer(field: str, value: Any, low: int, end: int) -> int:
    """``value`` checked an int (not a bool) in ``[low, end)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < end:
        raise RequestError(field, f"an integer in [{low}, {end}) is needed, got {value!r}")
    return value


def text(field: str, value: Any, *, max_chars: int = 4096) -> str:
    """``value`` checked a string of at most ``max_chars`` characters without a NUL byte."""
    if not isinstance(value, str) or "\0" in value or len(value) > max_chars:
        raise RequestError(
            field, f"a string of at most {max_chars} characters without NUL is needed"
        )
    return value


def check_keys(obj: Any, where: str) -> None:
    """Every map in ``obj`` (through maps and lists, without recursion: depth is the client's)
    has string keys; the first that does not is named (``where``: ``obj``'s field, "" for a
    request's top: its keys are fields, a bad one is ``body``'s)."""
    stack = [(obj, where)]
    while stack:
        x, at = stack.pop()
        if isinstance(x, dict):
            for k, v in x.items():
                if not isinstance(k, str):
                    raise RequestError(at or "body", f"map keys must be strings, got {k!r:.40}")
                if isinstance(v, (dict, list)):
                    stack.append((v, f"{at}.{k}" if at else k))
        elif isinstance(x, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(x) if isinstance(v, (dict, list)))
