"""The judge's sandbox side and the plain data it exchanges with the trainer.

``HARNESS`` runs in the sandbox after the program: it executes each test's steps there and writes
one line per step, its probes' values as tagged JSON; ``harness`` prefixes it with the per-step
time limit and ``read_results`` reads its lines back in the trainer, never trusting them beyond
being data. ``decode`` rebuilds plain data from that tagged JSON and ``plain_json`` writes it
(inputs sent into the sandbox). ``relax.rewards.judge`` splits the tests and judges the values.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax.rewards.judge import TestPlan

MAX_DEPTH = 64  # nesting of decoded data and of judged expressions
_RESULT_LINE = re.compile(r"([0-9]{1,9}) ([0-9]{1,9}) (.*)")


# ------------------------------------------------------------------------------ plain data


def decode(obj: Any, depth: int = 0) -> Any:
    """Plain data from the sandbox's tagged JSON (``HARNESS``'s ``plain``); ``ValueError`` for
    anything else. JSON objects are tags: ``{"l": [...]}`` list, ``{"t": [...]}`` tuple, ``{"s": [...]}``
    set, ``{"f": [...]}`` frozenset, ``{"d": [[k, v], ...]}`` dict, ``{"x": "nan" | "inf" | "-inf"}``."""
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deeply")
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise ValueError(f"not tagged plain data: {type(obj).__name__}")
    ((tag, body),) = obj.items()
    if tag == "x":
        return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[body]
    if not isinstance(body, list):
        raise ValueError(f"plain-data tag {tag!r} holds a {type(body).__name__}, not a list")
    items = [decode(v, depth + 1) for v in body] if tag != "d" else None
    if tag == "l":
        return items
    if tag in ("t", "s", "f"):
        return {"t": tuple, "s": set, "f": frozenset}[tag](items)
    if tag == "d":
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in body}
    raise ValueError(f"unknown plain-data tag {tag!r}")


def plain_json(value: Any) -> str:
    """The tagged JSON of trainer-side plain data (inputs sent into the sandbox): the encoding
    ``decode`` reads and ``HARNESS`` writes."""
    return json.dumps(_tag(value), allow_nan=False)


def _tag(v: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise ValueError("plain data nested too deeply")
    if v is None or type(v) in (bool, int, str):
        return v
    if type(v) is float:
        return v if math.isfinite(v) else {"x": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    tags = {list: "l", tuple: "t", set: "s", frozenset: "f"}
    if type(v) in tags:
        return {tags[type(v)]: [_tag(x, depth + 1) for x in v]}
    if type(v) is dict:
        return {"d": [[_tag(k, depth + 1), _tag(x, depth + 1)] for k, x in v.items()]}
    raise ValueError(f"not plain data: {type(v).__name__}")


# ------------------------------------------------------------------------------ the sandbox side

# Runs in the sandbox after the program (``src/solution.py``), with its tests' steps
# (``src/steps.json``: per test, a list of {"exec": src} / {"probes": [src]}), and writes one line
# per step: ``<nonce> <test> <step> <json>``, the JSON ``{"ok": true, "values": [...]}`` or
# ``{"ok": false}``. Nothing it writes is trusted beyond being data: the trainer decodes it and
# judges it (``passed``).
HARNESS = r"""
import json, math, signal, sys
nonce = sys.stdin.readline().strip()
sys.stdin.close()
out = sys.__stdout__
steps = json.load(open("src/steps.json"))
dumps, loads = json.dumps, json.loads
def plain(v, depth=0):
    if depth > 64:
        raise ValueError("nested too deeply")
    t = type(v)
    if v is None or t is bool or t is int or t is str:
        return v
    if t is float:
        return v if math.isfinite(v) else {"x": "nan" if v != v else ("inf" if v > 0 else "-inf")}
    tags = {list: "l", tuple: "t", set: "s", frozenset: "f"}
    if t in tags:
        return {tags[t]: [plain(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[plain(k, depth + 1), plain(x, depth + 1)] for k, x in v.items()]}
    raise TypeError("not plain data: " + t.__name__)
def unplain(o):
    if isinstance(o, dict):
        (tag, body), = o.items()
        if tag == "x":
            return float(body)
        if tag == "d":
            return {unplain(k): unplain(v) for k, v in body}
        return {"l": list, "t": tuple, "s": set, "f": frozenset}[tag](unplain(x) for x in body)
    return o
def alarm(signum, frame):
    raise TimeoutError("test timed out")
signal.signal(signal.SIGALRM, alarm)
scope = {"__name__": "__solution__"}
def call(name, args):
    if name in scope:
        return scope[name](*args)
    return getattr(scope["Solution"](), name)(*args)
try:
    exec(compile(open("src/solution.py").read(), "solution.py", "exec"), scope)
except BaseException:
    sys.exit(0)
for t, test in enumerate(steps):
    local = dict(scope, __call__=call, __decode__=lambda s: unplain(loads(s)))
    for k, step in enumerate(test):
        signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
        try:
            if "exec" in step:
                exec(compile(step["exec"], "test_%d" % t, "exec"), local)
                line = {"ok": True}
            else:
                line = {"ok": True, "values": [plain(eval(compile(p, "test_%d" % t, "eval"), local))
                                               for p in step["probes"]]}
            text = dumps(line)
        except BaseException:
            text = '{"ok": false}'
        signal.setitimer(signal.ITIMER_REAL, 0)
        out.write("\n%s %d %d %s\n" % (nonce, t, k, text))
        out.flush()
        if not text.startswith('{"ok": true'):
            break
"""


def harness(timeout_s: float) -> str:
    """The sandbox-side runner with a per-step time limit of ``timeout_s`` seconds."""
    return f"TIMEOUT = {float(timeout_s)!r}\n" + HARNESS


def read_results(stdout: str, nonce: str, plans: Sequence[TestPlan]) -> list[list[dict | None]]:
    """Per test, per step, the sandbox's JSON line (None where absent; ``{"ok": False}`` where its
    JSON does not load); the first line for a step counts. Never raises on any ``stdout``: the
    program writes it too."""
    results: list[list[dict | None]] = [[None] * len(p.steps) for p in plans]
    prefix = nonce + " "
    for line in stdout.splitlines():
        found = _RESULT_LINE.fullmatch(line[len(prefix) :]) if line.startswith(prefix) else None
        if found is None:
            continue
        t, k = int(found[1]), int(found[2])
        if t < len(plans) and k < len(plans[t].steps) and results[t][k] is None:
            try:
                results[t][k] = json.loads(found[3])
            except (
                ValueError,
                RecursionError,
            ):  # JSONDecodeError, or an int over Python's 4300 digits
                results[t][k] = {"ok": False}
    return results
