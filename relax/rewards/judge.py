"""Tests judged outside the program: the checking logic of a test runs in the trainer, over plain
data; only the program's own code runs in the sandbox.

A test is a Python snippet, e.g. ``"assert add(1, 2) == 3"`` (MBPP / HumanEval-style assert lists).
``plan_test`` splits it in the trainer, with ``ast``, never executing it:

- statements that are not ``assert`` (``x = make(3)``, ``import math``) run in the sandbox, in
  order, after the program;
- each ``assert E`` is cut into its *judge* and its *probes*. The judge is the part made of
  comparisons (``== != < <= > >= in``, ``not in``, ``is`` / ``is not`` against None, True, False),
  ``and`` / ``or`` / ``not``, arithmetic on numbers, literals and displays, subscripts, and calls of
  a few pure functions (``JUDGE_CALLS``: ``abs``, ``len``, ``sorted``, ``math.isclose``, ...); it is
  evaluated in the trainer by this module's own small interpreter (``judge``). Every other
  sub-expression (a call of the program's function, a name or attribute it defines) is a probe:
  its source goes to the sandbox, which evaluates it there and returns its value as plain data.

So ``assert add(1, 2) == 3`` sends ``add(1, 2)`` into the sandbox and keeps ``== 3`` out of it:
the program never holds an expected value nor the code that compares. Call-based tests
(``{"fn_name": f, "inputs": [[args], ...], "outputs": [out, ...]}``, APPS / TACO style) are probes
``f(*args)`` compared with their output in the trainer (``call_tests``).

Plain data is None, bool, int, float (NaN and infinities too), str, and lists, tuples, sets,
frozensets and dicts of plain data, of the exact built-in types; the sandbox encodes it as tagged
JSON (``HARNESS``) and ``decode`` rebuilds it in the trainer. Anything else (an object whose
``__eq__`` is always true, a subclass of int, ...) is not plain: the probe fails, and so does its
test. A program can make its probes return whatever plain data it computes, print anything, exit
early, or kill itself: none of it passes a test whose expected values it has to compute to match.

The sandbox side (``HARNESS``, ``harness``, ``read_results``) and the plain-data encoding
(``decode``, ``plain_json``) live in ``relax.rewards.harness``; they are importable from here too.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
from collections.abc import Sequence
from typing import Any

from relax.rewards.harness import (
    HARNESS,
    MAX_DEPTH,
    decode,
    harness,
    plain_json,
    read_results,
)

__all__ = [
    "HARNESS",
    "JUDGE_CALLS",
    "JUDGE_NAMES",
    "MAX_DEPTH",
    "MAX_SIZE",
    "JudgeError",
    "Probe",
    "Step",
    "TestPlan",
    "call_tests",
    "decode",
    "harness",
    "judge",
    "passed",
    "plain_json",
    "plan_test",
    "read_results",
]


class JudgeError(ValueError):
    """A test cannot be judged outside the program (the message says which part and why)."""


def _round(number: Any, ndigits: Any = None) -> Any:
    """``round``, refused for an ``ndigits`` past 4096 either way (``round(n, -10**9)`` computes
    ``10**10**9``)."""
    if type(ndigits) is int and abs(ndigits) > 4096:
        raise JudgeError("a judged round() to over 4096 digits")
    return round(number, ndigits)


def _sum(items: Any, start: Any = 0) -> Any:
    """``sum`` of numbers only (a sum of sequences is quadratic in their number)."""
    items = list(items)
    if not all(type(x) in (int, float, bool) for x in [*items, start]):
        raise JudgeError("sum() is judged over numbers only")
    return sum(items, start)


JUDGE_CALLS = {
    "abs": abs,
    "len": len,
    "round": _round,
    "sorted": sorted,
    "set": set,
    "frozenset": frozenset,
    "tuple": tuple,
    "list": list,
    "min": min,
    "max": max,
    "sum": _sum,
    "all": all,
    "any": any,
    "bool": bool,
    "int": int,
    "float": float,
    "str": str,
    "isclose": math.isclose,
    "math.isclose": math.isclose,
}
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
JUDGE_NAMES = {
    "math.pi": math.pi,
    "math.e": math.e,
    "math.tau": math.tau,
    "math.inf": math.inf,
    "math.nan": math.nan,
}
_SINGLETONS = (None, True, False)
MAX_SIZE = 1 << 20  # the most items a judged * may make, bits a judged ** may make, digits a judged
# % may pad to (an adversarial probe value must not exhaust the trainer: "a" * 10**12, 2 ** 10**12)
_WIDE_FORMAT = re.compile(
    r"%(\([^)]*\))?[-#0 +]*(\*|[0-9]{7}|[0-9]*\.(\*|[0-9]{7}))"
)  # width from the
# data, or of a million characters or more


@dataclasses.dataclass(frozen=True)
class Probe:
    """A placeholder in a judge: the value of the ``index``-th probe of its test."""

    index: int


@dataclasses.dataclass(frozen=True)
class Step:
    """One statement of a test: ``exec`` (run in the sandbox) or an assert's ``probes`` (sources
    evaluated in the sandbox) with its ``judge`` (an ``ast`` expression whose probe leaves are
    ``Probe`` names, evaluated in the trainer)."""

    exec: str | None = None
    probes: tuple[str, ...] = ()
    judge: Any = None


@dataclasses.dataclass(frozen=True)
class TestPlan:
    """A test split into its steps; ``num_probes`` over all of them."""

    source: str
    steps: tuple[Step, ...]

    @property
    def probes(self) -> list[str]:
        return [p for s in self.steps for p in s.probes]

    def sandbox_steps(self) -> list[dict]:
        """What the sandbox runs, in order: ``{"exec": src}`` or ``{"probes": [src, ...]}``."""
        return [
            {"exec": s.exec} if s.exec is not None else {"probes": list(s.probes)}
            for s in self.steps
        ]


# ------------------------------------------------------------------------------ splitting


def plan_test(source: str) -> TestPlan:
    """Split a test snippet into sandbox statements and outside-judged asserts (module docstring);
    ``JudgeError`` when it does not parse or holds nothing to judge."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise JudgeError(f"test does not parse: {exc.msg} (line {exc.lineno})") from None
    steps, asserts = [], 0
    for stmt in tree.body:
        if isinstance(stmt, ast.Assert):
            probes: list[str] = []
            judge = _cut(stmt.test, source, probes, depth=0)
            steps.append(Step(probes=tuple(probes), judge=judge))
            asserts += 1
        else:
            steps.append(Step(exec=ast.get_source_segment(source, stmt)))
    if not asserts:
        raise JudgeError(f"test {source[:80]!r} has no assert statement: nothing to judge")
    return TestPlan(source, tuple(steps))


def _is_judge_call(node: ast.Call) -> bool:
    """A call of a ``JUDGE_CALLS`` function whose keyword arguments are all ``name=constant`` (no
    ``**mapping``): the judge evaluates it; any other call is a probe."""
    name = ast.unparse(node.func)
    return name in JUDGE_CALLS and all(
        k.arg is not None and isinstance(k.value, ast.Constant) for k in node.keywords
    )


def _cut(node: ast.AST, source: str, probes: list[str], depth: int) -> ast.AST:
    """``node`` with every sub-expression that is not judge logic replaced by a ``Probe`` name."""
    if depth > MAX_DEPTH:
        raise JudgeError("test expression nested too deeply")
    judged = (
        ast.Compare,
        ast.BoolOp,
        ast.UnaryOp,
        ast.BinOp,
        ast.Constant,
        ast.List,
        ast.Tuple,
        ast.Set,
        ast.Dict,
        ast.Subscript,
        ast.Slice,
    )
    if ast.unparse(node) in JUDGE_NAMES and isinstance(node, ast.Attribute):
        return node
    if isinstance(node, ast.Call) and _is_judge_call(node) or isinstance(node, judged):
        if isinstance(node, ast.UnaryOp) and not isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            return _probe(node, source, probes)
        if isinstance(node, ast.BinOp) and type(node.op) not in _BINARY:
            return _probe(node, source, probes)
        if isinstance(node, ast.Dict) and None in node.keys:
            return _probe(node, source, probes)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)) and any(
            isinstance(e, ast.Starred) for e in node.elts
        ):
            return _probe(
                node, source, probes
            )  # ``[*f(x)]``: a starred item alone is no expression
        fields = {}
        for name, value in ast.iter_fields(node):
            if name == "func" or name == "ctx" or name == "op" or name == "ops":
                fields[name] = value
            elif isinstance(value, list):
                fields[name] = [
                    _cut(v, source, probes, depth + 1) if isinstance(v, ast.expr) else v
                    for v in value
                ]
            elif isinstance(value, ast.expr):
                fields[name] = _cut(value, source, probes, depth + 1)
            else:
                fields[name] = value
        if isinstance(node, ast.Call):
            fields["keywords"] = node.keywords  # constants only (``_is_judge_call``)
        return type(node)(**fields)
    return _probe(node, source, probes)


def _probe(node: ast.AST, source: str, probes: list[str]) -> ast.AST:
    probes.append(ast.get_source_segment(source, node) or ast.unparse(node))
    return ast.Name(id=f"__probe_{len(probes) - 1}", ctx=ast.Load())


# ------------------------------------------------------------------------------ judging


def judge(node: ast.AST, values: Sequence[Any], depth: int = 0) -> Any:
    """Evaluate a judge expression over its probes' ``values`` (plain data) in the trainer. Only
    the forms of the module docstring exist here; Python's own operators do the comparing."""
    if depth > MAX_DEPTH:
        raise JudgeError("judged expression nested too deeply")
    sub = lambda n: judge(n, values, depth + 1)  # noqa: E731
    if isinstance(node, ast.Name) and node.id.startswith("__probe_"):
        return values[int(node.id.removeprefix("__probe_"))]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and ast.unparse(node) in JUDGE_NAMES:
        return JUDGE_NAMES[ast.unparse(node)]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        items = [sub(e) for e in node.elts]
        return {ast.List: list, ast.Tuple: tuple, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict):
        return {sub(k): sub(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.BoolOp):
        result = isinstance(node.op, ast.And)
        for v in node.values:
            result = sub(v)
            if bool(result) != isinstance(node.op, ast.And):
                return result
        return result
    if isinstance(node, ast.UnaryOp):
        v = sub(node.operand)
        return (
            not v if isinstance(node.op, ast.Not) else (-v if isinstance(node.op, ast.USub) else +v)
        )
    if isinstance(node, ast.BinOp):
        return _binary(node.op, sub(node.left), sub(node.right))
    if isinstance(node, ast.Compare):
        left = sub(node.left)
        for op, right_node in zip(node.ops, node.comparators):
            right = sub(right_node)
            if isinstance(op, (ast.Is, ast.IsNot)) and not any(
                right is s or left is s for s in _SINGLETONS
            ):
                raise JudgeError("'is' is judged only against None, True or False")
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        return sub(node.value)[sub(node.slice)]
    if isinstance(node, ast.Slice):
        return slice(*(None if n is None else sub(n) for n in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        kwargs = {k.arg: k.value.value for k in node.keywords}
        return JUDGE_CALLS[ast.unparse(node.func)](*[sub(a) for a in node.args], **kwargs)
    raise JudgeError(f"cannot judge {type(node).__name__} outside the program")


def _binary(op: ast.operator, a: Any, b: Any) -> Any:
    """``a op b`` of the judge, refused when its result would be huge (``MAX_SIZE``)."""
    if isinstance(op, ast.Mult):
        n, seq = (a, b) if type(a) is int else (b, a)
        if type(n) is int and isinstance(seq, (str, list, tuple)) and n * len(seq) > MAX_SIZE:
            raise JudgeError("a judged repetition over MAX_SIZE items")
    if (
        isinstance(op, ast.Pow)
        and type(b) is int
        and type(a) is int
        and abs(a) > 1
        and abs(b) * a.bit_length() > MAX_SIZE
    ):
        raise JudgeError("a judged power over MAX_SIZE bits")
    if isinstance(op, ast.Mod) and isinstance(a, str) and _WIDE_FORMAT.search(a):
        raise JudgeError("a judged %-format with a width or precision over MAX_SIZE")
    return _BINARY[type(op)](a, b)


def passed(plan: TestPlan, results: Sequence[dict | None]) -> bool:
    """Whether a test passed: every step ran (``results[k]`` for step ``k``: ``{"ok": True,
    "values": [...]}`` from the sandbox, None when absent) and every assert's judge is true."""
    if len(results) != len(plan.steps):
        return False
    for step, result in zip(plan.steps, results):
        if not isinstance(result, dict) or result.get("ok") is not True:
            return False
        if step.exec is not None:
            continue
        try:
            values = [decode(v) for v in result["values"]]
            if len(values) != len(step.probes) or not judge(step.judge, values):
                return False
        except Exception:  # noqa: BLE001 - a judge that raises is a failed assert, as in Python
            return False
    return True


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
