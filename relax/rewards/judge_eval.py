"""The judge's interpreter: an assert's judged part evaluated in the trainer over plain data.

``judge(node, values)`` evaluates the judge expression that ``relax.rewards.assert_forms`` cut
out of an assert, its probe leaves (``__probe_k`` names) replaced by ``values[k]``: the plain data
the sandbox returned for them (``relax.rewards.plain_data.decode``). Only these forms exist here,
and Python's own operators do the comparing:

- comparisons (``== != < <= > >= in not in``, ``is`` / ``is not`` against None, True, False),
  ``and or not``, ``x if c else y``, unary ``- +``, ``+ - * / // % **``, literals and displays,
  subscripts, slices;
- calls of the pure functions of ``JUDGE_CALLS`` (``abs``, ``len``, ``sorted``, ``math.isclose``,
  ``range``, ``zip``, ``isinstance``, ...) with constant keyword arguments, the constants of
  ``JUDGE_NAMES`` and the plain types of ``JUDGE_TYPES`` (``int``, ``str``, ...);
- split comprehensions (``Each``): list, set and dict comprehensions and generator expressions,
  their loops either unrolled before the run (``Unrolled``: the loop values known, each element's
  probes its own) or iterated here over judged values (``Iterate``: the loop variables bound in
  ``env``, no probe depending on them). A generator expression stays lazy, so ``all`` and
  ``any`` stop where Python's stop.

Nothing here can be made slow or huge by the values judged: every node evaluated and every item of
a value built (a repetition, a concatenation, ``sorted``, a comprehension) is counted against the
run's ``Budget`` (items and a deadline); sets and dicts are built by ``bounded_set`` and friends;
``*``, ``**``, ``%``, ``round``, ``sum`` and ``range`` refuse results past ``MAX_SIZE``. A probe
that raised in the sandbox (``RAISED``) raises ``JudgeError`` when read, so an unread one (after
``or``, ``any``, a comprehension's false ``if``) costs nothing, as in Python.
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re
from collections.abc import Iterator, Sequence
from typing import Any

from relax.rewards.plain_data import (
    MAX_DEPTH,
    Budget,
    bounded_dict,
    bounded_frozenset,
    bounded_set,
)

MAX_SIZE = 1 << 20  # the most items a judged * or range may make, bits a judged ** may make,
# digits a judged % may pad to (an adversarial probe value must not exhaust the trainer: "a" *
# 10**12, 2 ** 10**12)
_WIDE_FORMAT = re.compile(r"%(\([^)]*\))?[-#0 +]*(\*|[0-9]{7}|[0-9]*\.(\*|[0-9]{7}))")  # width
# from the data, or of a million characters or more
_SINGLETONS = (None, True, False)
RAISED = type("Raised", (), {"__repr__": lambda self: "RAISED"})()  # a probe that raised


class JudgeError(ValueError):
    """A test cannot be judged outside the program (the message says which part and why)."""


@dataclasses.dataclass(frozen=True)
class Unrolled:
    """A comprehension's loop with its values known before the run: per value, the ``conds`` left
    to judge (those with probes) and the ``inner`` loop or element, the loop values substituted."""

    items: tuple[tuple[tuple[Any, ...], Any], ...]


@dataclasses.dataclass(frozen=True)
class Iterate:
    """A comprehension's loop judged here: ``target`` (an ``ast`` target) bound to each item of
    ``iter`` in ``env``, then ``conds``, then ``inner`` (the next loop or the element)."""

    target: Any
    iter: Any
    conds: tuple[Any, ...]
    inner: Any


@dataclasses.dataclass(frozen=True)
class Each:
    """A split comprehension: ``kind`` list | set | dict | gen, ``loop`` its first loop. A dict
    comprehension's element is a ``(key, value)`` pair of nodes."""

    kind: str
    loop: Unrolled | Iterate


# ------------------------------------------------------------------------------ judged calls


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


def _range(*args: Any) -> range:
    """``range``, refused past ``MAX_SIZE`` items."""
    r = range(*args)
    if len(r) > MAX_SIZE:
        raise JudgeError("a judged range() over MAX_SIZE items")
    return r


def _dict(*args: Any, **kwargs: Any) -> dict:
    """``dict``, built as ``bounded_dict``."""
    if len(args) > 1:
        raise TypeError(f"dict expected at most 1 argument, got {len(args)}")
    pairs = list(args[0].items() if isinstance(args[0], dict) else args[0]) if args else []
    return bounded_dict(pairs + list(kwargs.items()))


JUDGE_CALLS = {
    "abs": abs,
    "len": len,
    "round": _round,
    "sorted": sorted,
    "set": bounded_set,
    "frozenset": bounded_frozenset,
    "dict": _dict,
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
    "range": _range,
    "zip": zip,
    "enumerate": enumerate,
    "reversed": reversed,
    "isinstance": isinstance,
    "isclose": math.isclose,
    "math.isclose": math.isclose,
    "math.fabs": math.fabs,
    "math.floor": math.floor,
    "math.ceil": math.ceil,
    "math.sqrt": math.sqrt,
    "math.isnan": math.isnan,
    "math.isinf": math.isinf,
}
JUDGE_TYPES = {t.__name__: t for t in (int, float, str, bool, list, tuple, dict, set, frozenset)}
JUDGE_NAMES = {
    "math.pi": math.pi,
    "math.e": math.e,
    "math.tau": math.tau,
    "math.inf": math.inf,
    "math.nan": math.nan,
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
BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_SIZED = (str, list, tuple, set, frozenset, dict, range)


# ------------------------------------------------------------------------------ evaluating


def judge(
    node: Any,
    values: Sequence[Any],
    budget: Budget | None = None,
    env: dict[str, Any] | None = None,
) -> Any:
    """Evaluate a judge expression over its probes' ``values`` (plain data, or ``RAISED``) in the
    trainer (module docstring); ``env`` binds the loop variables of judged comprehensions.
    ``JudgeError`` for a form that does not exist here, ``BudgetExceeded`` past ``budget``."""
    return _Judge(values, budget or Budget()).eval(node, env or {}, 0)


@dataclasses.dataclass
class _Judge:
    values: Sequence[Any]
    budget: Budget

    def eval(self, node: Any, env: dict[str, Any], depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise JudgeError("judged expression nested too deeply")
        self.budget.spend()
        value = self._eval(node, env, depth + 1)
        if type(value) in _SIZED and not isinstance(node, (ast.Name, ast.Constant)):
            self.budget.spend(len(value))  # what a judged operation built
        return value

    def _eval(self, node: Any, env: dict[str, Any], depth: int) -> Any:
        sub = lambda n: self.eval(n, env, depth)  # noqa: E731
        if isinstance(node, ast.Name):
            return self._name(node.id, env)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Attribute) and ast.unparse(node) in JUDGE_NAMES:
            return JUDGE_NAMES[ast.unparse(node)]
        if isinstance(node, (ast.List, ast.Tuple)):
            return (list if isinstance(node, ast.List) else tuple)(sub(e) for e in node.elts)
        if isinstance(node, ast.Set):
            return bounded_set(sub(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return bounded_dict((sub(k), sub(v)) for k, v in zip(node.keys, node.values))
        if isinstance(node, ast.BoolOp):
            result = isinstance(node.op, ast.And)
            for v in node.values:
                result = sub(v)
                if bool(result) != isinstance(node.op, ast.And):
                    return result
            return result
        if isinstance(node, ast.UnaryOp):
            v = sub(node.operand)
            return {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos}[
                type(node.op)
            ](v)
        if isinstance(node, ast.IfExp):
            return sub(node.body) if sub(node.test) else sub(node.orelse)
        if isinstance(node, ast.BinOp):
            return binary(node.op, sub(node.left), sub(node.right))
        if isinstance(node, ast.Compare):
            return self._compare(node, sub)
        if isinstance(node, ast.Subscript):
            return sub(node.value)[sub(node.slice)]
        if isinstance(node, ast.Slice):
            return slice(
                *(None if n is None else sub(n) for n in (node.lower, node.upper, node.step))
            )
        if isinstance(node, ast.Call):
            kwargs = {k.arg: k.value.value for k in node.keywords}
            return JUDGE_CALLS[ast.unparse(node.func)](*[sub(a) for a in node.args], **kwargs)
        if isinstance(node, Each):
            return self._each(node, env, depth)
        raise JudgeError(f"cannot judge {type(node).__name__} outside the program")

    def _name(self, name: str, env: dict[str, Any]) -> Any:
        if name.startswith("__probe_"):
            value = self.values[int(name.removeprefix("__probe_"))]
            if value is RAISED:
                raise JudgeError(f"probe {name.removeprefix('__probe_')} raised in the sandbox")
            return value
        if name in env:
            return env[name]
        if name in JUDGE_TYPES:  # isinstance(f(x), int)
            return JUDGE_TYPES[name]
        raise JudgeError(f"name {name!r} is not judged outside the program")

    def _compare(self, node: ast.Compare, sub: Any) -> bool:
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

    def _each(self, node: Each, env: dict[str, Any], depth: int) -> Any:
        """A split comprehension's value: its elements yielded lazily by ``_loop``."""
        items = self._loop(node.loop, node.kind, env, depth)
        if node.kind == "gen":
            return items
        return {"list": list, "set": bounded_set, "dict": bounded_dict}[node.kind](items)

    def _loop(self, loop: Any, kind: str, env: dict[str, Any], depth: int) -> Iterator[Any]:
        if isinstance(loop, Unrolled):
            for conds, inner in loop.items:
                if all(self.eval(c, env, depth) for c in conds):
                    yield from self._loop(inner, kind, env, depth)
        elif isinstance(loop, Iterate):
            for item in self.eval(loop.iter, env, depth):
                self.budget.spend(len(item) if type(item) in _SIZED else 1)
                scope = dict(env)
                bind(loop.target, item, scope)
                if all(self.eval(c, scope, depth) for c in loop.conds):
                    yield from self._loop(loop.inner, kind, scope, depth)
        elif kind == "dict":
            yield self.eval(loop[0], env, depth), self.eval(loop[1], env, depth)
        else:
            yield self.eval(loop, env, depth)


def bind(target: ast.AST, value: Any, scope: dict[str, Any]) -> None:
    """Python's assignment of ``value`` to a loop target in ``scope``: a name, or a tuple / list of
    targets (``ValueError`` / ``TypeError`` as Python's when the value does not unpack)."""
    if isinstance(target, ast.Name):
        scope[target.id] = value
        return
    items = list(value)
    if len(items) != len(target.elts):
        raise ValueError(f"cannot unpack {len(items)} values into {len(target.elts)} targets")
    for t, v in zip(target.elts, items):
        bind(t, v, scope)


def binary(op: ast.operator, a: Any, b: Any) -> Any:
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
    return BINARY[type(op)](a, b)
