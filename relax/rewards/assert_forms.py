"""Asserts split, in the trainer, into what runs in the sandbox and what the trainer judges.

``plan_test(source)`` reads a test snippet with ``ast``, never executing it, into steps:

- each ``assert E`` is cut into its *judge* (the forms ``relax.rewards.judge_eval`` evaluates:
  comparisons, ``and or not``, arithmetic, literals, ``if``-``else``, ``JUDGE_CALLS``, ...) and its
  *probes*: every other sub-expression (a call of the program's function, a name it defines),
  whose source goes to the sandbox and comes back as plain data;
- **comprehensions and generator expressions** in a judge (``all(f(i) == i + 1 for i in
  range(3))``, ``[f(x) for x in xs] == [...]``, ``sorted(...)``, ``sum(...)``, any kind, any
  depth, with ``if`` clauses, several ``for`` clauses, ``zip`` / ``enumerate``, tuple targets) are
  split too, never sent whole: where no probe uses a loop variable, the loop runs in the judge
  (``Iterate``, over a judged value or a probe's); where one does, the loop is *unrolled*
  (``Unrolled``): its iterable must be judged before the run (literals, ``range``, ``zip``,
  names of enclosing unrolled loops, ...), and each element gets its own probes, sent as
  ``lambda i: f(i)`` with only the loop values that probe uses (never the expected ones);
- **``for`` statements** over such iterables whose body holds an assert are unrolled the same
  way (``for x in range(3): assert f(x) == x``); a ``for`` over values only the sandbox knows runs
  there whole, its asserts with it, as any other statement;
- **HumanEval's check function**: ``def check(candidate): <body>`` called once as
  ``check(fn)`` is inlined, ``candidate = fn`` then its body, so its asserts are judged here and
  its source never enters the sandbox;
- every other statement runs in the sandbox, in order (preceded, inside an unrolled loop, by
  the loop values it uses).

A form that cannot be split safely (a probe that uses a loop variable whose values only the
sandbox knows, a loop past ``MAX_UNROLL`` elements, an iterable that raises) is never compared
in the sandbox: its step is *refused* (``Step.refused``, the reason), and its test fails.
"""

from __future__ import annotations

import ast
import dataclasses
import textwrap
from typing import Any

from relax.rewards.judge_eval import (
    BINARY,
    JUDGE_CALLS,
    JUDGE_NAMES,
    JUDGE_TYPES,
    Each,
    Iterate,
    JudgeError,
    Unrolled,
    bind,
    judge,
)
from relax.rewards.plain_data import MAX_DEPTH, Budget, plain_json

MAX_UNROLL = 10_000  # loop elements a test may unroll into, and probes one assert may hold
_JUDGED = (
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
    ast.IfExp,
)
_COMPREHENSIONS = {
    ast.ListComp: "list",
    ast.SetComp: "set",
    ast.DictComp: "dict",
    ast.GeneratorExp: "gen",
}


@dataclasses.dataclass(frozen=True)
class Probe:
    """A placeholder in a judge: the value of the ``index``-th probe of its step."""

    index: int


@dataclasses.dataclass(frozen=True)
class Step:
    """One statement of a test: ``exec`` (run in the sandbox), or an assert's ``probes`` (sources
    evaluated in the sandbox; ``(lambda source, tagged JSON of its arguments)`` for a split
    loop's element) with its ``judge`` (evaluated in the trainer), or ``refused`` (the reason an
    assert cannot be judged outside the program: the step fails)."""

    exec: str | None = None
    probes: tuple[str | tuple[str, str], ...] = ()
    judge: Any = None
    refused: str | None = None


@dataclasses.dataclass(frozen=True)
class TestPlan:
    """A test split into its steps."""

    source: str
    steps: tuple[Step, ...]

    @property
    def probes(self) -> list[str | tuple[str, str]]:
        return [p for s in self.steps for p in s.probes]

    @property
    def refused(self) -> list[str]:
        """Why steps of this test cannot be judged outside the program (each fails it)."""
        return [s.refused for s in self.steps if s.refused is not None]

    def sandbox_steps(self) -> list[dict]:
        """What the sandbox runs, in order: ``{"exec": src}`` or ``{"probes": [probe, ...]}``."""
        return [
            {"exec": s.exec} if s.exec is not None else {"probes": [_wire(p) for p in s.probes]}
            for s in self.steps
        ]


def _wire(probe: str | tuple[str, str]) -> str | list[str]:
    return probe if isinstance(probe, str) else list(probe)


class Unsplittable(JudgeError):
    """A form that cannot be judged outside the program: its step is refused (and fails)."""


class _LoopProbe(Unsplittable):
    """A probe that uses loop variables judged only at run time (``names``)."""

    def __init__(self, names: set[str], source: str):
        super().__init__(
            f"{source!r} calls the program with loop variable(s) {', '.join(sorted(names))} "
            "whose values are known only after the run"
        )
        self.names, self.source = names, source


def plan_test(source: str) -> TestPlan:
    """Split a test snippet into sandbox statements and outside-judged asserts (module docstring);
    ``JudgeError`` when it does not parse or holds nothing to judge."""
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise JudgeError(f"test does not parse: {exc.msg} (line {exc.lineno})") from None
    splitter = _Splitter(source)
    steps = splitter.statements(_inline_checks(tree.body), {})
    if not any(s.exec is None for s in steps):
        raise JudgeError(f"test {source[:80]!r} has no assert statement: nothing to judge")
    return TestPlan(source, tuple(steps))


# ------------------------------------------------------------------------------ statements


class _Splitter:
    """The statements of one test, split (``plan_test``); ``unrolled`` counts loop elements."""

    def __init__(self, source: str):
        self.source = source
        self.unrolled = 0
        self.budget = Budget()  # for judging loops' iterables and conditions before the run

    def statements(self, body: list[ast.stmt], static: dict[str, Any]) -> list[Step]:
        """Steps of ``body``; ``static`` (updated) binds names of enclosing unrolled loops."""
        steps: list[Step] = []
        for stmt in body:
            if isinstance(stmt, ast.Assert):
                steps.append(self.assertion(stmt.test, static))
            elif isinstance(stmt, ast.For) and _unrollable(stmt):
                steps.extend(self.loop(stmt, static))
            else:
                steps.append(self.exec(stmt, static))
                for name in _stored(stmt):
                    static.pop(name, None)
        return steps

    def assertion(self, test: ast.expr, static: dict[str, Any]) -> Step:
        cut = _Cut(self, [])
        try:
            node = cut.cut(test, static, frozenset(), 0)
        except Unsplittable as exc:
            return Step(refused=str(exc))
        return Step(probes=tuple(cut.probes), judge=node)

    def exec(self, stmt: ast.stmt, static: dict[str, Any]) -> Step:
        """A statement for the sandbox, after the loop values it uses."""
        segment = ast.get_source_segment(self.source, stmt, padded=True)
        src = textwrap.dedent(segment) if segment is not None else ast.unparse(stmt)
        used = sorted({n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)} & static.keys())
        try:
            prefix = "".join(f"{n} = __decode__({plain_json(static[n])!r})\n" for n in used)
        except ValueError as exc:
            return Step(refused=f"a loop value used by a statement is not plain data ({exc})")
        return Step(exec=prefix + src)

    def loop(self, stmt: ast.For, static: dict[str, Any]) -> list[Step]:
        """A ``for`` statement: unrolled when its iterable is judged before the run, else run in
        the sandbox whole. ``static`` ends as Python's would: the target at its last value."""
        cut = _Cut(self, [])
        try:
            node = cut.cut(stmt.iter, static, frozenset(), 0)
            known = not cut.probes  # judged before the run: no probe in it
        except Unsplittable:
            known = False
        if not known:
            step = self.exec(stmt, static)
            for name in _stored(stmt):
                static.pop(name, None)
            return [step]
        try:
            values = self.values(node)
        except Unsplittable as exc:
            return [Step(refused=str(exc))]
        steps: list[Step] = []
        for value in values:
            scope = dict(static)
            try:
                bind(stmt.target, value, scope)
            except (ValueError, TypeError) as exc:
                return [*steps, Step(refused=f"a loop target cannot take {value!r} ({exc})")]
            steps.extend(self.statements(stmt.body, scope))
            static.clear()
            static.update(scope)
        return steps

    def values(self, node: Any) -> list[Any]:
        """A judged iterable's items, before the run, at most ``MAX_UNROLL`` of them all told."""
        try:
            items = []
            for item in judge(node, [], self.budget):
                self.unrolled += 1
                if self.unrolled > MAX_UNROLL:
                    raise Unsplittable(f"loops of over {MAX_UNROLL} elements in one test")
                items.append(item)
            return items
        except Unsplittable:
            raise
        except Exception as exc:  # noqa: BLE001 - as the assert would raise in Python
            raise Unsplittable(f"a loop's iterable raises {type(exc).__name__}: {exc}") from None


def _unrollable(stmt: ast.For) -> bool:
    """A ``for`` whose body holds an assert, without ``else``, ``break`` or ``continue``."""
    return (
        not stmt.orelse
        and _target_ok(stmt.target)
        and any(isinstance(n, ast.Assert) for n in ast.walk(stmt))
        and not any(isinstance(n, (ast.Break, ast.Continue)) for n in ast.walk(stmt))
    )


def _target_ok(target: ast.AST) -> bool:
    """A name, or a tuple / list of such targets (no ``*rest``, attribute or subscript)."""
    if isinstance(target, ast.Name):
        return True
    return isinstance(target, (ast.Tuple, ast.List)) and all(_target_ok(t) for t in target.elts)


def _names(target: ast.AST) -> frozenset[str]:
    return frozenset(n.id for n in ast.walk(target) if isinstance(n, ast.Name))


def _stored(stmt: ast.stmt) -> set[str]:
    """Names a statement binds in its scope (not in functions, lambdas or comprehensions it holds)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            return
        if isinstance(node, (ast.Lambda, *_COMPREHENSIONS)):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            names.add(node.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(stmt)
    return names


def _inline_checks(body: list[ast.stmt]) -> list[ast.stmt]:
    """HumanEval's ``def check(candidate): ...`` + ``check(fn)``: the call replaced by
    ``candidate = fn`` and the function's body, the definition dropped (module docstring)."""
    defs = {s.name: s for s in body if isinstance(s, ast.FunctionDef) and _inlinable(s)}
    uses: dict[str, int] = {}
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.Name) and node.id in defs:
            uses[node.id] = uses.get(node.id, 0) + 1
    calls = {id(s): s.value for s in body if _call_of(s, defs) and uses[s.value.func.id] == 1}
    inlined = {c.func.id for c in calls.values()}
    out: list[ast.stmt] = []
    for stmt in body:
        if id(stmt) in calls:
            fn, arg = defs[calls[id(stmt)].func.id], calls[id(stmt)].args[0]
            param = ast.Name(id=fn.args.args[0].arg, ctx=ast.Store())
            out.append(ast.Assign(targets=[param], value=arg, type_comment=None, lineno=0))
            out.extend(fn.body)
        elif not (isinstance(stmt, ast.FunctionDef) and stmt.name in inlined):
            out.append(stmt)
    return out


def _call_of(stmt: ast.stmt, defs: dict[str, ast.FunctionDef]) -> bool:
    """``stmt`` is ``f(arg)`` for a function ``f`` of ``defs``."""
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in defs
        and len(call.args) == 1
        and not isinstance(call.args[0], ast.Starred)
        and not call.keywords
    )


def _inlinable(fn: ast.FunctionDef) -> bool:
    """One positional parameter, no decorator, and nothing that means something else outside a
    function (``return``, ``yield``, ``global``, ``nonlocal``) in its own body."""
    a = fn.args
    if fn.decorator_list or len(a.args) != 1 or a.posonlyargs or a.vararg or a.kwonlyargs:
        return False
    if a.kwarg or a.defaults:
        return False
    local = [n for s in fn.body for n in _own_nodes(s)]
    return not any(
        isinstance(n, (ast.Return, ast.Yield, ast.YieldFrom, ast.Global, ast.Nonlocal, ast.Await))
        for n in local
    )


def _own_nodes(node: ast.AST) -> list[ast.AST]:
    """``node`` and its descendants outside nested functions, lambdas and classes."""
    found = [node]
    for child in ast.iter_child_nodes(node):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            found.extend(_own_nodes(child))
    return found


# ------------------------------------------------------------------------------ expressions


class _Cut:
    """One expression cut into a judge and its probes (appended to ``probes``)."""

    def __init__(self, splitter: _Splitter, probes: list):
        self.splitter = splitter
        self.probes = probes

    def cut(self, node: ast.AST, static: dict, dynamic: frozenset, depth: int) -> Any:
        """``node`` with every sub-expression that is not judge logic replaced by a probe name;
        ``static`` names become their values, ``dynamic`` ones stay names of the judge."""
        if depth > MAX_DEPTH:
            raise JudgeError("test expression nested too deeply")
        if isinstance(node, ast.Name) and node.id in dynamic:
            return node
        if isinstance(node, ast.Name) and node.id in static:
            return ast.Constant(value=static[node.id])
        if isinstance(node, ast.Attribute) and ast.unparse(node) in JUDGE_NAMES:
            return node
        if isinstance(node, ast.Name) and node.id in JUDGE_TYPES:
            return node
        if type(node) in _COMPREHENSIONS:
            return self.comprehension(node, static, dynamic, depth)
        if not (isinstance(node, _JUDGED) or isinstance(node, ast.Call) and _is_judge_call(node)):
            return self.probe(node, static, dynamic)
        if (
            isinstance(node, ast.UnaryOp)
            and not isinstance(node.op, (ast.Not, ast.USub, ast.UAdd))
            or isinstance(node, ast.BinOp)
            and type(node.op) not in BINARY
            or isinstance(node, ast.Dict)
            and None in node.keys
            or isinstance(node, (ast.List, ast.Tuple, ast.Set))
            and any(isinstance(e, ast.Starred) for e in node.elts)  # ``[*f(x)]``: no expression
        ):
            return self.probe(node, static, dynamic)
        fields = {}
        for name, value in ast.iter_fields(node):
            if isinstance(value, list) and name != "ops":
                fields[name] = [
                    self.cut(v, static, dynamic, depth + 1) if isinstance(v, ast.expr) else v
                    for v in value
                ]
            elif isinstance(value, ast.expr) and name != "func":
                fields[name] = self.cut(value, static, dynamic, depth + 1)
            else:
                fields[name] = value
        if isinstance(node, ast.Call):
            fields["keywords"] = node.keywords  # constants only (``_is_judge_call``)
        return type(node)(**fields)

    def probe(self, node: ast.AST, static: dict, dynamic: frozenset) -> ast.Name:
        """A probe for ``node``: its source, or ``lambda <loop names>: <source>`` with the
        values of the static loop names it uses."""
        src = ast.get_source_segment(self.splitter.source, node) or ast.unparse(node)
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if names & dynamic:
            raise _LoopProbe(names & dynamic, src)
        if len(self.probes) >= MAX_UNROLL:
            raise Unsplittable(f"an assert of over {MAX_UNROLL} probes")
        free = sorted(names & static.keys())
        if free:
            try:
                args = plain_json([static[n] for n in free])
            except ValueError as exc:
                raise Unsplittable(f"a loop value {src!r} uses is not plain data ({exc})") from None
            self.probes.append((f"lambda {', '.join(free)}: ({src})", args))
        else:
            self.probes.append(src)
        return ast.Name(id=f"__probe_{len(self.probes) - 1}", ctx=ast.Load())

    def comprehension(self, node: ast.AST, static: dict, dynamic: frozenset, depth: int) -> Each:
        kind = _COMPREHENSIONS[type(node)]
        for g in node.generators:
            if g.is_async or not _target_ok(g.target):
                raise Unsplittable(f"a comprehension loop 'for {ast.unparse(g.target)} in ...'")
        elt = (node.key, node.value) if kind == "dict" else node.elt
        return Each(kind, self.level(node.generators, 0, elt, kind, static, dynamic, depth + 1))

    def level(self, gens, k, elt, kind, static, dynamic, depth) -> Any:
        """The ``k``-th loop of a comprehension: iterated by the judge when no probe uses its
        variables, else unrolled; past the last loop, the element."""
        if k == len(gens):
            if kind == "dict":
                return tuple(self.cut(e, static, dynamic, depth) for e in elt)
            return self.cut(elt, static, dynamic, depth)
        g, names = gens[k], _names(gens[k].target)
        before = len(self.probes)
        iterable = self.cut(g.iter, static, dynamic, depth)
        known = len(self.probes) == before and not _uses(g.iter, dynamic)  # judged before the run
        inner = {n: v for n, v in static.items() if n not in names}
        mark = len(self.probes)
        try:
            conds = tuple(self.cut(c, inner, dynamic | names, depth) for c in g.ifs)
            rest = self.level(gens, k + 1, elt, kind, inner, dynamic | names, depth)
            return Iterate(g.target, iterable, conds, rest)
        except _LoopProbe as exc:
            if not exc.names & names:
                raise
            if not known:
                outer = _uses(g.iter, dynamic)
                if outer:  # known once the enclosing loop is unrolled (``range(i)``)
                    raise _LoopProbe(outer | (exc.names - names), exc.source) from None
                raise Unsplittable(f"{exc} (the loop is over the program's values)") from None
            del self.probes[mark:]
        return self.unroll(g, iterable, gens, k, elt, kind, inner, dynamic - names, depth)

    def unroll(self, g, iterable, gens, k, elt, kind, static, dynamic, depth) -> Unrolled:
        """Each value of a loop judged before the run: its conditions judged now while they
        can be (a false one drops the value), the rest kept with the value substituted."""
        items = []
        for value in self.splitter.values(iterable):
            scope = dict(static)
            try:
                bind(g.target, value, scope)
            except (ValueError, TypeError) as exc:
                raise Unsplittable(f"a loop target cannot take {value!r} ({exc})") from None
            conds, keep = [], True
            for c in g.ifs:
                mark = len(self.probes)
                node = self.cut(c, scope, dynamic, depth)
                if not conds and len(self.probes) == mark and not _uses(c, dynamic):
                    try:
                        keep = bool(judge(node, [], self.splitter.budget))
                        if not keep:
                            break
                        continue
                    except Exception:  # noqa: BLE001 - judged at run time, raising there
                        pass
                conds.append(node)
            if keep:
                rest = self.level(gens, k + 1, elt, kind, scope, dynamic, depth)
                items.append((tuple(conds), rest))
        return Unrolled(tuple(items))


def _uses(node: ast.AST, names: frozenset) -> set[str]:
    """The ``names`` that ``node`` mentions."""
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & names


def _is_judge_call(node: ast.Call) -> bool:
    """A call of a ``JUDGE_CALLS`` function whose keyword arguments are all ``name=constant`` (no
    ``**mapping``): the judge evaluates it; any other call is a probe."""
    name = ast.unparse(node.func)
    return name in JUDGE_CALLS and all(
        k.arg is not None and isinstance(k.value, ast.Constant) for k in node.keywords
    )
