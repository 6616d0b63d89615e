"""Reading a Hugging Face config dict: :class:`HFFormatError` and :class:`ConfigReader`.

The reader gives typed access to one parsed ``config.json`` / ``generation_config.json`` (used by
``relax.models.hf.config``, ``relax.models.hf.rope`` and ``relax.models.hf.moe``); every error it
raises is an :class:`HFFormatError` naming the file and the field.
"""

from __future__ import annotations

import math
from typing import Any

ABSENT = object()
"""The default that marks a field required: ``ConfigReader.get`` raises when it is missing."""


def _finite(v: int | float) -> bool:
    """Whether ``v`` is a finite float64 (an integer beyond float64's range is not)."""
    try:
        return math.isfinite(float(v))
    except OverflowError:
        return False


class HFFormatError(ValueError):
    """A Hugging Face checkpoint relax cannot read; the message names the file and the field or tensor."""


class ConfigReader:
    """Typed access to one config dict (also ``relax.models.hf.moe``'s); errors name ``source`` and the field."""

    def __init__(self, d: dict, source: str):
        if not isinstance(d, dict):
            raise HFFormatError(f"{source}: expected a JSON object, got {type(d).__name__}")
        self.d, self.source = d, source

    def fail(self, field: str, msg: str) -> HFFormatError:
        return HFFormatError(f"{self.source}: field {field!r} {msg}")

    def get(
        self, field: str, default: Any = ABSENT, d: dict | None = None, prefix: str = ""
    ) -> Any:
        d = self.d if d is None else d
        if field in d:
            return d[field]
        if default is ABSENT:
            raise self.fail(prefix + field, "is required but missing")
        return default

    def int_(self, field, default=ABSENT, *, nullable=False, d=None, prefix="", lo=None, hi=None):
        """An integer (a float with an integral value too), at least ``lo`` and at most ``hi``
        where given."""
        given = v = self.get(field, default, d, prefix)
        if v is None and nullable:
            return None
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if not isinstance(v, int) or isinstance(v, bool):
            raise self.fail(prefix + field, f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise self.fail(prefix + field, f"must be >= {lo}, got {given!r}")
        if hi is not None and v > hi:
            raise self.fail(prefix + field, f"must be at most {hi}, got {given!r}")
        return v

    def float_(self, field, default=ABSENT, *, d=None, prefix=""):
        """A finite number (JSON's parser in relax refuses NaN and Infinity; a value given in
        Python may still be one)."""
        v = self.get(field, default, d, prefix)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not _finite(v):
            raise self.fail(prefix + field, f"must be a finite number, got {v!r}")
        return float(v)

    def bool_(self, field, default=ABSENT):
        v = self.get(field, default)
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, got {v!r}")
        return v

    def token_ids(self, field, default):
        v = self.get(field, default)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            return v
        if isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            return v[0] if len(v) == 1 else tuple(v)
        raise self.fail(field, f"must be an integer, a list of integers or null, got {v!r}")
