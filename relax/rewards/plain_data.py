"""Plain data between the sandbox and the trainer, decoded in time linear in its size.

Plain data is None, bool, int, float (NaN and infinities too), str, and lists, tuples, sets,
frozensets and dicts of plain data, of the exact built-in types. The sandbox writes it as tagged
JSON: JSON objects are tags, ``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"s": [...]}`` set,
``{"f": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict, ``{"x": "nan" | "inf" | "-inf"}``.

Everything decoded here was written by the program, so decoding must not be slowed by it:

- **no attacker-chosen hashing.** A set, frozenset or dict is built only after its elements'
  hashes are sorted and each run of equal hashes is checked to hold at most ``MAX_SAME_HASH``
  distinct values (``bounded_set`` and friends: ``O(n log n)`` hash comparisons, at most
  ``MAX_SAME_HASH`` equality tests per element). Python's own set is then built from those
  elements, so it costs at most ``MAX_SAME_HASH`` comparisons per insert: 40,000 integers of one
  hash (``i * (2**61 - 1)``), which took 9 s to decode as a set, are refused in milliseconds;
  ``{-1, -2}`` (equal hashes, unequal values) still decodes. JSON objects are read as lists of
  pairs (``loads``), never as dicts keyed by the program's strings.
- **a budget per sandboxed run** (``Budget``): at most ``MAX_RESULT_CHARS`` characters of result
  lines are parsed (``MAX_LINE_CHARS`` in one line: one step's probes), ``MAX_ITEMS`` elements
  decoded or built by the judge (``MAX_PROBE_ITEMS`` for one probe's value), and all of it within
  ``JUDGE_S`` seconds of wall-clock time; past any of them the test being judged fails, and so
  does every later one of that run past the run's limits (``BudgetExceeded``).
  ``relax.rewards.code_exec`` counts ``JUDGE_S`` in its time bound.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from typing import Any

MAX_DEPTH = 64  # nesting of decoded data and of judged expressions
MAX_SAME_HASH = 16  # distinct values of one hash in a decoded or judged set, frozenset or dict
MAX_ITEMS = 1 << 21  # elements decoded, and items of values the judge builds, per sandboxed run
MAX_RESULT_CHARS = 1 << 24  # characters of result lines parsed per sandboxed run
MAX_LINE_CHARS = 1 << 22  # characters of one result line (one step's probes): one JSON parse
MAX_PROBE_ITEMS = 1 << 20  # elements decoded for one probe's value
JUDGE_S = 2.0  # seconds of the trainer's time to decode and judge one sandboxed run's results
_TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
_SCALARS = (type(None), bool, int, float, str)


class BudgetExceeded(ValueError):
    """Judging a run's results spent its ``Budget`` (items, characters or time)."""


class JsonObject(list):
    """A JSON object as the list of its ``(key, value)`` pairs (``loads``): no dict is built from
    keys the program chose."""


def loads(text: str) -> Any:
    """``json.loads`` with objects read as ``JsonObject`` pair lists."""
    return json.loads(text, object_pairs_hook=JsonObject)


class Budget:
    """What judging one sandboxed run may still spend (module docstring): ``items`` decoded or
    built, ``chars`` of result lines parsed, and time up to ``deadline`` (``time.monotonic``)."""

    def __init__(
        self, seconds: float = JUDGE_S, items: int = MAX_ITEMS, chars: int = MAX_RESULT_CHARS
    ):
        self.deadline = time.monotonic() + seconds
        self.items = items
        self.chars = chars

    def spend(self, items: int = 1) -> None:
        """Count ``items`` against the budget and check the clock."""
        self.items -= items
        if self.items < 0:
            raise BudgetExceeded(f"judging spent its {MAX_ITEMS} items")
        if time.monotonic() > self.deadline:
            raise BudgetExceeded("judging ran past its deadline")

    def read(self, chars: int) -> bool:
        """Whether a result line of ``chars`` characters may be parsed (counted if so): at most
        ``MAX_LINE_CHARS``, within the run's characters and before the deadline."""
        self.chars -= chars
        return chars <= MAX_LINE_CHARS and self.chars >= 0 and time.monotonic() <= self.deadline


# ------------------------------------------------------------------------------ bounded hashing


def check_hashes(items: list) -> None:
    """``ValueError`` when more than ``MAX_SAME_HASH`` distinct values of ``items`` share a hash
    (``TypeError`` for an unhashable one, as Python). Cost: a sort of the hashes (plain ints, no
    hashing of them) and at most ``MAX_SAME_HASH`` equality tests per item."""
    if len(items) <= MAX_SAME_HASH:
        return
    hashes = [hash(x) for x in items]
    distinct: list = []
    previous = None
    for i in sorted(range(len(items)), key=hashes.__getitem__):
        if hashes[i] != previous:
            distinct, previous = [], hashes[i]
        x = items[i]
        if not any(x is d or x == d for d in distinct):
            distinct.append(x)
            if len(distinct) > MAX_SAME_HASH:
                raise ValueError(
                    f"over {MAX_SAME_HASH} distinct values of one hash in a set or dict"
                )


def bounded_set(items: Iterable = ()) -> set:
    """``set(items)``, refused when it would cost more than linear time (``check_hashes``)."""
    items = list(items)
    check_hashes(items)
    return set(items)


def bounded_frozenset(items: Iterable = ()) -> frozenset:
    """``frozenset(items)``, refused as ``bounded_set``."""
    items = list(items)
    check_hashes(items)
    return frozenset(items)


def bounded_dict(pairs: Iterable) -> dict:
    """``dict(pairs)`` (the last value of a key wins), its keys checked as ``bounded_set``'s."""
    pairs = [tuple(p) for p in pairs]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("a dict item is not a (key, value) pair")
    check_hashes([k for k, _ in pairs])
    return dict(pairs)


# ------------------------------------------------------------------------------ decoding


def decode_probe(obj: Any, budget: Budget) -> Any:
    """One probe's value (``decode``), refused past ``MAX_PROBE_ITEMS`` elements."""
    before = budget.items
    value = decode(obj, budget)
    if before - budget.items > MAX_PROBE_ITEMS:
        raise BudgetExceeded(f"a probe's value of over {MAX_PROBE_ITEMS} elements")
    return value


def decode(obj: Any, budget: Budget | None = None, depth: int = 0) -> Any:
    """Plain data from the sandbox's tagged JSON (module docstring), in time linear in its size;
    ``ValueError`` (``TypeError`` for an unhashable set element or key) for anything else, and
    ``BudgetExceeded`` past ``budget``. Accepts JSON objects as dicts or ``JsonObject`` pairs."""
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    pairs = list(obj.items()) if isinstance(obj, dict) else obj
    if not (isinstance(pairs, JsonObject) or isinstance(obj, dict)) or len(pairs) != 1:
        raise ValueError(f"not tagged plain data: {type(obj).__name__}")
    ((tag, body),) = pairs
    if tag == "x":
        if body not in ("nan", "inf", "-inf"):
            raise ValueError(f"plain-data tag 'x' holds {body!r}")
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[body]
    if not isinstance(body, list) or isinstance(body, JsonObject):
        raise ValueError(f"plain-data tag {tag!r} holds a {type(body).__name__}, not a list")
    if budget is not None:
        budget.spend(len(body))
    if tag == "d":
        if not all(
            isinstance(p, list) and not isinstance(p, JsonObject) and len(p) == 2 for p in body
        ):
            raise ValueError("plain-data tag 'd' holds an item that is not a [key, value] pair")
        return bounded_dict(
            (decode(k, budget, depth + 1), decode(v, budget, depth + 1)) for k, v in body
        )
    builder = {"l": list, "t": tuple, "s": bounded_set, "f": bounded_frozenset}.get(tag)
    if builder is None:
        raise ValueError(f"unknown plain-data tag {tag!r}")
    if all(type(v) in _SCALARS for v in body):  # the common case, without a call per item
        return builder(body)
    return builder([decode(v, budget, depth + 1) for v in body])


def plain_json(value: Any) -> str:
    """The tagged JSON of trainer-side plain data (inputs sent into the sandbox): the encoding
    ``decode`` reads and the sandbox's harness writes."""
    return json.dumps(_tag(value), allow_nan=False)


def _tag(v: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deeply")
    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"x": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    if type(v) in _TAGS:
        return {_TAGS[type(v)]: [_tag(x, depth + 1) for x in v]}
    if type(v) is dict:
        return {"d": [[_tag(k, depth + 1), _tag(x, depth + 1)] for k, x in v.items()]}
    raise ValueError(f"not plain data: {type(v).__name__}")
