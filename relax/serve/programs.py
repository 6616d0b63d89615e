"""The service's compiled programs: keyed by shape and structure, a request's numbers as arguments,
and a bounded number of them kept (least recently used first out).

    programs = ProgramCache(max_programs=64)
    grads, metrics = programs.run(("objective", "grpo", backward), step, {"beta": 0.04}, state, batch)

``step(options, *args)`` is traced once per key, the shapes, dtypes and shardings of ``args``,
and the names and types of ``numbers``; each number reaches it as an ``Option``: a stand-in that
computes with the traced scalar (``beta * kl`` is a traced product, so the program takes the
value as an argument and 40 requests with 40 values run one program) and answers comparisons
and conversions with the request's value, recording each answer as a guard (``beta > 0`` was
True). A later request reuses a program only where every guard of it answers the same, so a
branch in Python on a value (``if cfg.beta > 0``: compute the KL) picks the program that took
that branch, and a check in a config's ``__post_init__`` (``beta >= 0``) is re-asked of every
value: a negative one fails its guard, is traced anew and raises there. ``float(x)``,
``int(x)``, ``hash(x)`` or printing guard on the exact value (that program is the value's own).

A number the traced code cannot take as an argument (``jnp.minimum(r, cap)`` refuses a
stand-in; ``jnp`` functions take only arrays and Python scalars) is found by tracing again with
each number alone traced, the others as constants; the numbers found so are kept as constants
(exact guards) for that structure from then on, and said in the log. A program whose trace
fails with every number constant raises that error (the caller's request error).

A compiled program knows what it allocates when run (XLA's ``memory_analysis``: temporaries and
outputs); ``run(..., fits=...)`` asks the caller whether that fits before anything runs.

The cache holds at most ``max_programs`` compiled programs; the least recently used one is
evicted (counted and logged) to make room, so a client sending new shapes or new constants
costs a compile each and never unbounded memory.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import operator
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from relax.train.fits import allocated_bytes

__all__ = ["Option", "ProgramCache", "host_bytes", "shape_key"]

log = logging.getLogger("relax.serve")

_COMPARE = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
_ARITHMETIC = (
    "add",
    "sub",
    "mul",
    "truediv",
    "floordiv",
    "mod",
    "pow",
)


class Guard(NamedTuple):
    """The option ``name`` compared by ``op`` with ``other`` (a constant, or another option:
    ``("option", name)``) gave ``answer``."""

    name: str
    op: str
    other: Any
    answer: bool

    def holds(self, values: dict[str, Any]) -> bool:
        rhs = values[self.other[1]] if isinstance(self.other, tuple) else self.other
        return bool(_COMPARE[self.op](values[self.name], rhs)) == self.answer


class Option:
    """A request's number inside a trace (module docstring): arithmetic on the traced scalar,
    comparisons with Python numbers (or other options) on the request's value, guarded."""

    __slots__ = ("name", "value", "traced", "_guards")

    def __init__(self, name: str, value: int | float, traced: Any, guards: list):
        self.name, self.value, self.traced, self._guards = name, value, traced, guards

    def _exact(self):
        self._guards.append(Guard(self.name, "==", self.value, True))
        return self.value

    def _compare(self, op: str, other):
        if isinstance(other, Option):
            answer = bool(_COMPARE[op](self.value, other.value))
            self._guards.append(Guard(self.name, op, ("option", other.name), answer))
            return answer
        if isinstance(other, (int, float)):
            answer = bool(_COMPARE[op](self.value, other))
            self._guards.append(Guard(self.name, op, other, answer))
            return answer
        if isinstance(other, (jax.Array, np.ndarray)):
            return _COMPARE[op](self.traced, other)  # traced, element by element
        return NotImplemented  # None, a string: as a number compares with them

    def __lt__(self, other):
        return self._compare("<", other)

    def __le__(self, other):
        return self._compare("<=", other)

    def __gt__(self, other):
        return self._compare(">", other)

    def __ge__(self, other):
        return self._compare(">=", other)

    def __eq__(self, other):
        return self._compare("==", other)

    def __ne__(self, other):
        return self._compare("!=", other)

    def __bool__(self) -> bool:
        return self._compare("!=", 0)

    def __float__(self) -> float:
        return float(self._exact())

    def __int__(self) -> int:
        return int(self._exact())

    def __index__(self) -> int:
        return operator.index(self._exact())

    def __hash__(self) -> int:
        return hash(self._exact())

    def __repr__(self) -> str:  # unguarded: a check builds its message whether it fails or not
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __jax_array__(self):
        return self.traced

    def __neg__(self):
        return -self.traced

    def __pos__(self):
        return self.traced

    def __abs__(self):
        return abs(self.traced)


def _arithmetic(name: str):
    op = getattr(operator, name)

    def forward(self, other):
        return op(self.traced, other.traced if isinstance(other, Option) else other)

    def reflected(self, other):
        return op(other.traced if isinstance(other, Option) else other, self.traced)

    return forward, reflected


for _name in _ARITHMETIC:
    _fwd, _ref = _arithmetic(_name)
    setattr(Option, f"__{_name}__", _fwd)
    setattr(Option, f"__r{_name}__", _ref)


def shape_key(tree: Any) -> tuple:
    """What a compiled program is specialised on: the pytree structure of ``tree`` and each
    leaf's shape, dtype, weak type and sharding (a Python scalar: its type)."""
    leaves, treedef = jax.tree.flatten(tree)
    out = []
    for x in leaves:
        if isinstance(x, jax.Array):
            out.append((x.shape, x.dtype, getattr(x, "weak_type", False), x.sharding))
        elif hasattr(x, "shape") and hasattr(x, "dtype"):
            out.append((x.shape, x.dtype))
        else:
            out.append(type(x))
    return treedef, tuple(out)


@dataclasses.dataclass
class _Program:
    guards: tuple[Guard, ...]
    compiled: Any
    need: int | None  # bytes per device it allocates when run (XLA's memory analysis)


def host_bytes(tree: Any) -> int:
    """Bytes of the host (numpy) arrays in ``tree``: what a run copies to the devices."""
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, np.ndarray))


class ProgramCache:
    """Compiled programs by key (module docstring), at most ``max_programs`` of them."""

    def __init__(self, max_programs: int):
        if max_programs < 1:
            raise ValueError(f"max_programs must be >= 1, got {max_programs}")
        self.max_programs = max_programs
        self.compiles = self.evictions = 0
        self._programs: collections.OrderedDict[tuple, list[_Program]] = collections.OrderedDict()
        self._constant: dict[tuple, frozenset[str]] = {}  # numbers kept constant, per structure
        self._lock = threading.RLock()

    def __len__(self) -> int:
        return sum(len(v) for v in self._programs.values())

    def run(self, key: tuple, step: Callable, numbers: dict[str, Any], *args, fits=None):
        """``step(options, *args)`` compiled (or found) for ``key`` and ``args``' shapes, run;
        ``fits(bytes)`` first (it raises to refuse): what the program allocates by XLA's own
        count, and the host arrays it copies in."""
        numbers = dict(sorted(numbers.items()))
        program, constant = self._program(key, step, numbers, args)
        if fits is not None and program.need is not None:
            fits(program.need + host_bytes(args))
        return program.compiled({k: v for k, v in numbers.items() if k not in constant}, *args)

    def _program(self, key: tuple, step: Callable, numbers: dict, args: tuple):
        """The program for this request (found, else compiled and kept) and its constants."""
        structure = (key, tuple((k, type(v)) for k, v in numbers.items()))
        shapes = shape_key(args)
        with self._lock:
            constant = self._constant.get(structure, frozenset())
            full = (structure, constant, shapes)
            for program in self._programs.get(full, ()):
                if all(g.holds(numbers) for g in program.guards):
                    self._programs.move_to_end(full)
                    return program, constant
            program = self._compile(structure, step, numbers, args)
            constant = self._constant.get(structure, frozenset())
            full = (structure, constant, shapes)
            self._programs.setdefault(full, []).append(program)
            self._programs.move_to_end(full)
            self._evict()
            return program, constant

    def _lower(self, step: Callable, numbers: dict, constant: frozenset, args: tuple):
        guards: list[Guard] = []

        def program(traced: dict, *args):
            options = {
                k: v if k in constant else Option(k, v, traced[k], guards)
                for k, v in numbers.items()
            }
            return step(options, *args)

        traced = {k: v for k, v in numbers.items() if k not in constant}
        lowered = jax.jit(program).trace(traced, *args).lower()
        exact = tuple(Guard(k, "==", numbers[k], True) for k in sorted(constant))
        return lowered, exact + tuple(dict.fromkeys(guards))  # each answer once

    def _compile(self, structure: tuple, step: Callable, numbers: dict, args: tuple) -> _Program:
        constant = self._constant.get(structure, frozenset())
        try:
            lowered, guards = self._lower(step, numbers, constant, args)
        except Exception:
            if constant == frozenset(numbers):
                raise  # every number a constant: the step's own error
            constant = self._find_constants(structure, step, numbers, constant, args)
            try:
                lowered, guards = self._lower(step, numbers, constant, args)
            except Exception:  # the numbers that trace alone do not trace together
                constant = frozenset(numbers)
                lowered, guards = self._lower(step, numbers, constant, args)
            self._constant[structure] = constant
            log.info(
                "%s: options %s are compiled as constants (the traced code cannot take them "
                "as arguments): each new value compiles its own program",
                structure[0],
                ", ".join(sorted(constant)),
            )
        self.compiles += 1
        compiled = lowered.compile()
        return _Program(guards, compiled, allocated_bytes(compiled))

    def _find_constants(self, structure, step, numbers, constant, args) -> frozenset[str]:
        """The numbers that cannot be traced: each tried alone as an argument (the rest
        constants); raises the step's error if it fails with every number constant."""
        everything = frozenset(numbers)
        self._lower(step, numbers, everything, args)  # the step's own error, if any
        found = set(constant)
        for name in sorted(everything - constant):
            try:
                self._lower(step, numbers, everything - {name}, args)
            except Exception:
                found.add(name)
        return frozenset(found)

    def _evict(self) -> None:
        while len(self) > self.max_programs:
            key = next(iter(self._programs))
            programs = self._programs[key]
            programs.pop(0)
            if not programs:
                del self._programs[key]
            self.evictions += 1
            log.info(
                "compiled-program cache full (%d, --limits.max-programs): evicted the least "
                "recently used program of %s (%d evicted so far)",
                self.max_programs,
                key[0][0],
                self.evictions,
            )
