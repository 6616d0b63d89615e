"""The judge's sandbox side.

``HARNESS`` runs in the sandbox after the program: it executes each test's steps there and writes
one line per step, its probes' values as tagged JSON; ``harness`` prefixes it with the per-step
time limit and ``read_results`` reads its lines back in the trainer, never trusting them beyond
being data. The tagged JSON is ``relax.rewards.plain_data``'s (``decode`` and ``plain_json`` are
importable from here too); ``relax.rewards.judge`` splits the tests and judges the values.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from relax.rewards.plain_data import (
    MAX_DEPTH,
    Budget,
    JsonObject,
    decode,
    loads,
    plain_json,
)

if TYPE_CHECKING:
    from relax.rewards.assert_forms import TestPlan

__all__ = ["HARNESS", "MAX_DEPTH", "decode", "harness", "plain_json", "read_results"]
_RESULT_LINE = re.compile(r"([0-9]{1,9}) ([0-9]{1,9}) (.*)")


# ------------------------------------------------------------------------------ the sandbox side

# Runs in the sandbox after the program (``src/solution.py``), with its tests' steps
# (``src/steps.json``: per test, a list of {"exec": src} / {"probes": [probe, ...]}, a probe being
# an expression's source, or ``[lambda source, tagged JSON of its arguments]`` for one element of
# a split comprehension or loop), and writes one line per step: ``<nonce> <test> <step> <json>``,
# the JSON ``{"ok": true, "values": [...]}`` (a probe that raised an exception or whose value is
# not plain data: ``{"e": 0}``) or ``{"ok": false}`` (a statement that raised, a time-out, an
# exit). Nothing it writes is trusted beyond being data: the trainer decodes it and judges it
# (``relax.rewards.judge.passed``).
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
def probe(p, local, each, name):
    if type(p) is str:
        return eval(compile(p, name, "eval"), local)
    if p[0] not in each:
        each[p[0]] = eval(compile(p[0], name, "eval"), local)
    return each[p[0]](*unplain(loads(p[1])))
try:
    exec(compile(open("src/solution.py").read(), "solution.py", "exec"), scope)
except BaseException:
    sys.exit(0)
for t, test in enumerate(steps):
    local = dict(scope, __call__=call, __decode__=lambda s: unplain(loads(s)))
    each, name = {}, "test_%d" % t
    for k, step in enumerate(test):
        signal.setitimer(signal.ITIMER_REAL, TIMEOUT)
        try:
            if "exec" in step:
                exec(compile(step["exec"], name, "exec"), local)
                line = {"ok": True}
            else:
                values = []
                for p in step["probes"]:
                    try:
                        values.append(plain(probe(p, local, each, name)))
                    except TimeoutError:
                        raise
                    except Exception:
                        values.append({"e": 0})
                line = {"ok": True, "values": values}
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


def read_results(
    stdout: str, nonce: str, plans: Sequence[TestPlan], budget: Budget | None = None
) -> list[list[dict | None]]:
    """Per test, per step, the sandbox's JSON line (None where absent; ``{"ok": False}`` where its
    JSON does not load, is not an object of at most two keys, or is past ``budget``'s characters);
    the first line for a step counts. Never raises on any ``stdout``: the program writes it too."""
    results: list[list[dict | None]] = [[None] * len(p.steps) for p in plans]
    prefix = nonce + " "
    for line in stdout.splitlines():
        found = _RESULT_LINE.fullmatch(line[len(prefix) :]) if line.startswith(prefix) else None
        if found is None:
            continue
        t, k = int(found[1]), int(found[2])
        if t < len(plans) and k < len(plans[t].steps) and results[t][k] is None:
            results[t][k] = _result(found[3], budget)
    return results


def _result(text: str, budget: Budget | None) -> dict:
    """One result line's JSON object, its values left as ``JsonObject`` pairs for ``decode``."""
    if budget is not None and not budget.read(len(text)):
        return {"ok": False}
    try:
        obj = loads(text)
    except (ValueError, RecursionError):  # JSONDecodeError, or an int over Python's 4300 digits
        return {"ok": False}
    if not isinstance(obj, JsonObject) or len(obj) > 2:
        return {"ok": False}
    return dict(obj)
