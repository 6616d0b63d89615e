"""Tests judged outside the program: the checking logic of a test runs in the trainer, over plain
data; only the program's own code runs in the sandbox.

A test is a Python snippet, e.g. ``"assert add(1, 2) == 3"`` (MBPP / HumanEval-style assert lists).
``plan_test`` (``relax.rewards.assert_forms``) splits it in the trainer, with ``ast``, never
executing it:

- statements that are not ``assert`` (``x = make(3)``, ``import math``) run in the sandbox, in
  order, after the program;
- each ``assert E`` is cut into its *judge* and its *probes*. The judge is the part made of
  comparisons (``== != < <= > >= in``, ``not in``, ``is`` / ``is not`` against None, True, False),
  ``and`` / ``or`` / ``not``, ``x if c else y``, arithmetic on numbers, literals and displays,
  subscripts, calls of a few pure functions (``JUDGE_CALLS``: ``abs``, ``len``, ``sorted``,
  ``math.isclose``, ``range``, ``zip``, ...) and comprehensions of these; it is evaluated in the
  trainer by a small interpreter (``judge``, ``relax.rewards.judge_eval``). Every other
  sub-expression (a call of the program's function, a name it defines) is a probe: its source
  goes to the sandbox, which evaluates it there and returns its value as plain data;
- a comprehension or generator expression is split per element (``all(f(i) == i + 1 for i in
  range(3))``: probes ``f(0)``, ``f(1)``, ``f(2)``, each compared here), and so is a ``for`` loop of
  asserts over values known before the run and HumanEval's ``check(candidate)`` function; a form
  that cannot be split safely fails its test (``Step.refused``), never compared in the sandbox.

So ``assert add(1, 2) == 3`` sends ``add(1, 2)`` into the sandbox and keeps ``== 3`` out of it:
the program never holds an expected value nor the code that compares. Call-based tests
(``{"fn_name": f, "inputs": [[args], ...], "outputs": [out, ...]}``, APPS / TACO style) are probes
``f(*args)`` compared with their output in the trainer (``call_tests``).

Plain data is None, bool, int, float (NaN and infinities too), str, and lists, tuples, sets,
frozensets and dicts of plain data, of the exact built-in types; the sandbox encodes it as tagged
JSON (``HARNESS``) and ``decode`` (``relax.rewards.plain_data``) rebuilds it in the trainer, in
time linear in its size and within the run's ``Budget``. Anything else (an object whose ``__eq__``
is always true, a subclass of int, ...) is not plain: reading that probe fails its assert. A
program can make its probes return whatever plain data it computes, print anything, exit early,
or kill itself: none of it passes a test whose expected values it has to compute to match.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import Any

from relax.rewards.assert_forms import MAX_UNROLL, Probe, Step, TestPlan, Unsplittable, plan_test
from relax.rewards.harness import HARNESS, harness, read_results
from relax.rewards.judge_eval import (
    JUDGE_CALLS,
    JUDGE_NAMES,
    MAX_SIZE,
    RAISED,
    JudgeError,
    judge,
)
from relax.rewards.plain_data import (
    JUDGE_S,
    MAX_DEPTH,
    MAX_ITEMS,
    MAX_LINE_CHARS,
    MAX_PROBE_ITEMS,
    MAX_RESULT_CHARS,
    Budget,
    JsonObject,
    decode,
    decode_probe,
    plain_json,
)

__all__ = [
    "HARNESS",
    "JUDGE_CALLS",
    "JUDGE_NAMES",
    "JUDGE_S",
    "MAX_DEPTH",
    "MAX_ITEMS",
    "MAX_LINE_CHARS",
    "MAX_PROBE_ITEMS",
    "MAX_RESULT_CHARS",
    "MAX_SIZE",
    "MAX_UNROLL",
    "Budget",
    "JudgeError",
    "Probe",
    "Step",
    "TestPlan",
    "Unsplittable",
    "call_tests",
    "decode",
    "harness",
    "judge",
    "passed",
    "plain_json",
    "plan_test",
    "read_results",
]


def passed(plan: TestPlan, results: Sequence[dict | None], budget: Budget | None = None) -> bool:
    """Whether a test passed: every step ran (``results[k]`` for step ``k``: ``{"ok": True,
    "values": [...]}`` from the sandbox, None when absent), none was refused, and every assert's
    judge is true, its values decoded and judged within ``budget`` (the run's; a fresh one if
    None). A probe that raised in the sandbox (``{"e": ...}``) fails its assert if the judge
    reads it."""
    budget = budget or Budget()
    if len(results) != len(plan.steps):
        return False
    for step, result in zip(plan.steps, results):
        if step.refused is not None:
            return False
        if not isinstance(result, dict) or result.get("ok") is not True:
            return False
        if step.exec is not None:
            continue
        try:
            raw = result["values"]
            if not isinstance(raw, list) or len(raw) != len(step.probes):
                return False
            values = [RAISED if _raised(v) else decode_probe(v, budget) for v in raw]
            if not judge(step.judge, values, budget):
                return False
        except Exception:  # noqa: BLE001 - a judge that raises is a failed assert, as in Python
            return False
    return True


def _raised(value: Any) -> bool:
    """The harness's mark of a probe that raised or whose value was not plain data."""
    pairs = list(value.items()) if isinstance(value, dict) else value
    return isinstance(value, (JsonObject, dict)) and len(pairs) == 1 and pairs[0][0] == "e"


# ------------------------------------------------------------------------------ call-based tests


def call_tests(raw: dict, where: str) -> list[TestPlan]:
    """``{"fn_name", "inputs", "outputs"}`` -> one plan per case: the probe ``fn_name(*inputs[i])``
    judged ``== outputs[i]`` in the trainer (APPS convention: an output given as a one-element list
    also matches its element). The inputs reach the sandbox as data, never as code."""
    name, inputs, outputs = raw.get("fn_name"), raw.get("inputs"), raw.get("outputs")
    if not (isinstance(name, str) and name.isidentifier()):
        raise JudgeError(f"{where}: fn_name must be a Python identifier, got {name!r}")
    if not (
        isinstance(inputs, list)
        and isinstance(outputs, list)
        and len(inputs) == len(outputs)
        and inputs
    ):
        raise JudgeError(f"{where}: inputs and outputs must be non-empty lists of the same length")
    plans = []
    for i, (args, out) in enumerate(zip(inputs, outputs)):
        args = args if isinstance(args, list) else [args]
        try:
            call = f"__call__({name!r}, __decode__({plain_json(args)!r}))"
        except ValueError as exc:
            raise JudgeError(f"{where}: input {i} is not plain data ({exc})") from None
        expected = ast.parse(repr(out), mode="eval").body if _literal(out) else None
        if expected is None:
            raise JudgeError(f"{where}: output {i} is not plain data")
        judge_node = ast.Compare(
            left=ast.Name("__probe_0", ast.Load()), ops=[ast.Eq()], comparators=[expected]
        )
        if isinstance(out, list) and len(out) == 1:
            alt = ast.Compare(
                left=ast.Name("__probe_0", ast.Load()),
                ops=[ast.Eq()],
                comparators=[ast.parse(repr(out[0]), mode="eval").body],
            )
            judge_node = ast.BoolOp(op=ast.Or(), values=[judge_node, alt])
        plans.append(
            TestPlan(f"{name}(*{args!r}) == {out!r}", (Step(probes=(call,), judge=judge_node),))
        )
    return plans


def _literal(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
