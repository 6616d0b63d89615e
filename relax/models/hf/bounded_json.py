"""JSON text parsed within bounds: what every reader of a user's JSON (``config.json``, safetensors
headers, tokenizer configs, jsonl data rows) parses with, so that no file can crash or stall it.

``loads`` is ``json.loads`` that refuses, as a :class:`JSONLimitError` (a ``json.JSONDecodeError``,
so a ``ValueError``, with the line and column), what the standard parser accepts or fails on
without a place:

- nesting deeper than ``MAX_DEPTH`` (128, serde_json's limit, which the ``tokenizers`` library
  reads ``tokenizer.json`` with) arrays/objects: found by a linear scan before parsing, so a
  100,000- or 10,000,000-deep line is named instead of raising a bare ``RecursionError`` (CPython's
  decoder raises one past ~1,000 levels), and a parsed value is shallow enough for any recursive
  code downstream;
- ``NaN`` / ``Infinity`` (not JSON; Python's parser accepts them) and a number beyond float64
  (``1e400`` would parse as ``inf``);
- an integer of more than ``sys.get_int_max_str_digits()`` digits (4,300: Python's parser raises a
  bare ``ValueError`` naming no place).

The depth scan: a byte is inside a string when an odd number of unescaped quotes precede it (a
quote is escaped when an odd run of backslashes precedes it); the depth at a byte is the running
sum of ``[``/``{`` (+1) and ``]``/``}`` (-1) outside strings. Numpy does each step over a
megabyte at once; texts with at most ``MAX_DEPTH`` opening brackets skip it (their depth cannot exceed it).
"""

from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

import numpy as np

__all__ = ["MAX_DEPTH", "JSONLimitError", "loads", "nesting_error"]

MAX_DEPTH = 128
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))
_CHUNK = 1 << 20  # bytes scanned at once: the scan's memory is about 30 times this


class JSONLimitError(json.JSONDecodeError):
    """JSON text beyond relax's bounds (``loads``); ``msg``, ``lineno`` and ``colno`` say what and where."""


class _Refused(Exception):
    """Raised inside the parser's hooks: the literal to point at and why it is refused."""

    def __init__(self, literal: str, msg: str):
        super().__init__(msg)
        self.literal, self.msg = literal, msg


def _finite_float(literal: str) -> float:
    value = float(literal)
    if math.isinf(value):
        raise _Refused(literal, f"number {literal[:40]} is beyond float64's range")
    return value


def _no_constant(literal: str) -> float:
    raise _Refused(literal, f"{literal} is not JSON (no NaN or Infinity)")


def _escaped(raw: np.ndarray, run: int) -> tuple[np.ndarray, int]:
    """Per byte of ``raw``, whether an odd run of backslashes ends just before it, given the
    ``run`` of backslashes that ends ``raw``'s predecessor; and the run ending ``raw``."""
    idx = np.arange(raw.size, dtype=np.int64)
    last_other = np.maximum.accumulate(np.where(raw == _BACKSLASH, -1 - run, idx))
    runs = idx - last_other  # the backslash run ending at each byte
    escaped = np.empty(raw.size, bool)
    escaped[0], escaped[1:] = run % 2 == 1, runs[:-1] % 2 == 1
    return escaped, int(runs[-1])


def nesting_error(text: str, max_depth: int = MAX_DEPTH) -> JSONLimitError | None:
    """The error for the first bracket of ``text`` nested deeper than ``max_depth`` (outside
    strings), or None; linear in the text's length, in chunks of ``_CHUNK`` bytes (the depth,
    whether a string is open and the trailing backslash run carried from one to the next)."""
    if text.count("[") + text.count("{") <= max_depth:
        return None
    data = text.encode("utf-8", "surrogatepass")
    depth, inside, run = 0, False, 0
    for start in range(0, len(data), _CHUNK):
        raw = np.frombuffer(data, np.uint8, min(_CHUNK, len(data) - start), start)
        quote = raw == _QUOTE
        escaped, run = _escaped(raw, run)
        quote &= ~escaped
        in_string = np.logical_xor.accumulate(quote) ^ inside  # opening quote .. closing one
        inside = bool(in_string[-1])
        step = np.isin(raw, _OPEN).astype(np.int32) - np.isin(raw, _CLOSE)
        step[in_string] = 0
        level = np.cumsum(step) + depth
        depth = int(level[-1])
        over = level > max_depth
        if over.any():
            pos = len(data[: start + int(over.argmax())].decode("utf-8", "replace"))
            msg = f"arrays/objects nested deeper than {max_depth} levels"
            return JSONLimitError(msg, text, pos)
    return None


def loads(text: str) -> Any:
    """``json.loads(text)`` within the bounds of the module docstring; ``JSONLimitError`` beyond
    them, ``json.JSONDecodeError`` for text that is not JSON (both name the line and column)."""
    too_deep = nesting_error(text)
    if too_deep is not None:
        raise too_deep
    try:
        return json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except _Refused as e:
        raise JSONLimitError(e.msg, text, max(text.find(e.literal), 0)) from None
    except RecursionError:  # only when called with the Python stack nearly full
        raise JSONLimitError("nested too deeply for the Python stack", text, 0) from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits()
        limit = sys.get_int_max_str_digits()
        long = re.search(rf"\d{{{limit + 1},}}", text)
        raise JSONLimitError(
            f"an integer of more than {limit} digits", text, long.start() if long else 0
        ) from None
