"""Red team of the judge (relax.rewards.judge): a program that tries to slow the trainer's judge
with its own probe lines, and asserts in the forms HumanEval and MBPP use, each scored for a right
solution, a wrong one and objects whose ``==`` is rigged, through CodeExec and the real sandbox
under every isolation mechanism this machine has."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest

from relax.rewards.code_exec import CodeExec, JudgeWarning, parse_tests
from relax.rewards.isolation import SandboxUnavailable, works
from relax.rewards.judge import Budget, passed, plain_json, plan_test, read_results
from relax.rewards.plain_data import (
    MAX_LINE_CHARS,
    MAX_PROBE_ITEMS,
    MAX_SAME_HASH,
    decode,
    loads,
)
from relax.rewards.sandbox import NOBODY, SandboxConfig, sandbox_for

M = (1 << 61) - 1  # hash(i * M) == 0 for every int i: 40,000 of them collide in any set or dict
COLLIDING = [i * M for i in range(1, 40001)]


def _line(*values) -> str:
    """A result line as a program that read the nonce would print it (tagged JSON values)."""
    return json.dumps({"ok": True, "values": list(values)})


LINEAR_S = 3.0  # per probe line: linear time is ~0.2 s here, the quadratic decode was 9.2 s


def _judged_in(plan, line: str) -> tuple[bool, float]:
    t0 = time.perf_counter()
    budget = Budget()
    ok = passed(plan, read_results("n 0 0 " + line, "n", [plan], budget)[0], budget)
    return ok, time.perf_counter() - t0


def test_colliding_hashes_are_judged_in_linear_time():
    """A probe line of 40,000 values of one hash, as a set, a frozenset, dict keys, a set of
    tuples or of frozensets, or a list the judge turns into a set: judged (failed) in about 0.2 s
    each on this 2-core host, bounded at ``LINEAR_S`` so a loaded CI worker does not fail it (1.5 s
    seen beside the full suite). The set took 9.2 s to decode before (quadratic: every insert
    compared with every earlier element), outside any time bound."""
    ints = [{"s": COLLIDING}, {"f": COLLIDING}, {"d": [[k, 0] for k in COLLIDING]}]
    nested = [{"s": [{"t": [k]} for k in COLLIDING]}, {"s": [{"f": [k]} for k in COLLIDING]}]
    for value in ints + nested:
        ok, seconds = _judged_in(plan_test("assert f() == {1, 2}"), _line(value))
        assert not ok and seconds < LINEAR_S, (str(value)[:30], seconds)
    judged = ["assert set(f()) == {1}", "assert {x for x in f()} == {1}", "assert 1 in dict(f())"]
    for test, value in zip(judged, [COLLIDING, COLLIDING, [[k, 0] for k in COLLIDING]]):
        ok, seconds = _judged_in(plan_test(test), _line(json.loads(plain_json(value))))
        assert not ok and seconds < LINEAR_S, (test, seconds)


def test_sets_and_dicts_still_compare_as_python_does():
    """Within the bound, sets and dicts are Python's own: equal hashes of unequal values
    (-1 and -2, 1 and 2**61, up to MAX_SAME_HASH of them), duplicates, nesting."""
    cases = [
        ("assert f() == {1, 2}", {2, 1}, True),
        ("assert f() == {1, 2}", {1, 3}, False),
        ("assert f() == {'a': 1}", {"a": 1}, True),
        ("assert f() == {'a': 1}", {"a": 2}, False),
        ("assert f() == {(1, 2), (3, 4)}", {(3, 4), (1, 2)}, True),
        (
            "assert f() == frozenset({frozenset({1}), frozenset()})",
            {frozenset(), frozenset({1})},
            True,
        ),
        ("assert f() == {-1, -2}", {-2, -1}, True),  # hash(-1) == hash(-2)
        ("assert f() == {1, 2**61}", {1, 2**61}, True),  # hash(2**61) == 1
        ("assert f() == {-1, -2}", {-1, -3}, False),
        (f"assert f() == set(range(0, {M} * 16, {M}))", set(range(0, M * 16, M)), True),
        ("assert set(f()) == {0}", [0] * 40000, True),  # one value many times: linear
        ("assert len(set(f())) == 2", [-1, -2] * 20000, True),
        ("assert f() == {1: {2: {3}}}", {1: {2: {3}}}, True),
    ]
    for test, value, verdict in cases:
        ok, seconds = _judged_in(plan_test(test), _line(json.loads(plain_json(value))))
        assert ok is verdict and seconds < LINEAR_S, (test, seconds)
    assert MAX_SAME_HASH == 16
    over = {"s": list(range(0, M * 17, M))}  # 17 distinct values of one hash: refused
    with pytest.raises(ValueError, match="of one hash"):
        decode(loads(json.dumps(over)))


def test_what_a_run_may_cost_the_judge_is_capped():
    """Characters parsed, items decoded or built, and seconds: past any, the test fails, fast."""
    plan = plan_test("assert len(f()) > 0")
    line = _line({"l": list(range(5000))})
    assert _judged_in(plan, line)[0]
    small = Budget(chars=1000)
    assert not passed(plan, read_results("n 0 0 " + line, "n", [plan], small)[0], small)
    few = Budget(items=1000)
    assert not passed(plan, read_results("n 0 0 " + line, "n", [plan], few)[0], few)
    for n in (MAX_PROBE_ITEMS, MAX_PROBE_ITEMS + 1):  # one probe's value; under the run's items
        assert _judged_in(plan, _line({"l": [0] * n}))[0] is (n == MAX_PROBE_ITEMS)
    long = _line({"l": ["x" * 1000] * (MAX_LINE_CHARS // 1000)})  # one line past its cap
    assert len(long) > MAX_LINE_CHARS and not _judged_in(plan, long)[0]
    # quadratic judged work (20,000 x 20,000 comparisons, ~10 s): cut at the deadline
    slow = plan_test("assert all(x in f(1) for x in f(2))")
    values = [{"l": list(range(20000))}, {"l": list(range(-1, -20001, -1))}]
    t0 = time.perf_counter()
    budget = Budget(seconds=0.3)
    assert not passed(slow, [{"ok": True, "values": values}], budget)
    assert time.perf_counter() - t0 < 1.5
    flood = "\nn 0 0 ".join(_line(k) for k in range(100000))  # only the first line counts
    assert _judged_in(plan_test("assert f() == 0"), flood)[0]


# ------------------------------------------------------------------------------ in the sandbox


def _config(mechanism: str) -> SandboxConfig:
    """A working sandbox of ``mechanism``, or the test skips."""
    if works(mechanism, NOBODY, NOBODY) is not None:
        pytest.skip(f"{mechanism}: {works(mechanism, NOBODY, NOBODY)}")
    cfg = SandboxConfig(isolation=mechanism, cpu_s=4, wall_s=8.0, memory_mb=512, max_processes=16)
    try:
        sandbox_for(cfg)
    except SandboxUnavailable as exc:  # e.g. unshare as a non-root trainer: refused by default
        pytest.skip(f"{mechanism}: {exc}")
    return cfg


def fenced(code: str) -> str:
    return f"```python\n{code}\n```"


SLOW_JUDGE = (
    "import __main__, json, sys\nM = (1 << 61) - 1\n"
    "def add(a, b):\n"
    "    v = {TAG: [ITEM for i in range(1, 40001)]}\n"
    "    line = json.dumps({'ok': True, 'values': [v]})\n"
    "    if a == 1:  # once: the test's first probe\n"
    "        sys.__stdout__.write('\\n%s 0 0 %s\\n' % (__main__.nonce, line))\n"
    "        sys.__stdout__.flush()\n"
    "    return a + b\n"
)
ADD = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]


@pytest.mark.parametrize("mechanism", ["bwrap", "unshare"])
def test_a_program_that_prints_colliding_probe_lines(mechanism):
    """The attack as a program writes it: it reads the nonce and prints, before the harness's own
    line, a probe line of 40,000 colliding values (a set, dict keys). Its test fails, the judge
    answers within its bound, and the right program in the same call still scores."""
    attacks = [
        SLOW_JUDGE.replace("TAG", "'s'").replace("ITEM", "i * M"),
        SLOW_JUDGE.replace("TAG", "'d'").replace("ITEM", "[i * M, 0]"),
    ]
    cfg = dataclasses.replace(_config(mechanism), max_output_bytes=4 << 20)
    reward = CodeExec(sandbox=cfg, test_timeout_s=2.0)
    right = "def add(a, b):\n    return a + b\n"
    t0 = time.perf_counter()
    got = reward(["p"] * 3, [fenced(c) for c in [*attacks, right]], tests=[ADD] * 3)
    seconds = time.perf_counter() - t0
    assert got == [0.5, 0.5, 1.0]  # the forged line fails test 0; test 1 is judged as usual
    assert seconds < 6.0, seconds  # three sandboxed runs; the two forged lines took 18 s before


# ------------------------------------------------------------------------------ assert forms
# (assert, right solution, wrong solution, hand verdicts: right, wrong, rigged), in the styles of
# MBPP (plain asserts, set(), math.isclose, a statement before the assert) and HumanEval (abs(...)
# < 1e-6, ``is True``, ``not``, check(candidate), loops, generator expressions).

TABLE = [
    (
        "assert remove_occ('hello', 'l') == 'heo'",
        "def remove_occ(s, c):\n    return s.replace(c, '')",
        "def remove_occ(s, c):\n    return s.replace(c, '', 1)",
        (1, 0, 0),
    ),
    (
        "assert abs(truncate_number(3.5) - 0.5) < 1e-6",
        "def truncate_number(x):\n    return x % 1.0",
        "def truncate_number(x):\n    return x // 1.0",
        (1, 0, 0),
    ),
    (
        "assert math.isclose(area_circle(10), 314.1592653589793, rel_tol=0.001)",
        "def area_circle(r):\n    return math.pi * r * r",
        "def area_circle(r):\n    return 2 * math.pi * r",
        (1, 0, 0),
    ),
    (
        "assert set(similar_elements((3, 4, 5, 6), (5, 7, 4, 10))) == set((4, 5))",
        "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
        "def similar_elements(a, b):\n    return tuple(set(a) | set(b))",
        (1, 0, 0),
    ),
    (
        "assert sorted(unique([5, 3, 5, 2, 3, 3, 9, 0, 123])) == [0, 2, 3, 5, 9, 123]",
        "def unique(xs):\n    return list(set(xs))",
        "def unique(xs):\n    return xs",
        (1, 0, 0),
    ),
    (
        "assert is_not_prime(2) == False",
        "def is_not_prime(n):\n    return any(n % d == 0 for d in range(2, int(n ** 0.5) + 1))",
        "def is_not_prime(n):\n    return n % 2 == 0",
        (1, 0, 0),
    ),
    (
        "assert has_close_elements([1.0, 2.0, 3.9, 4.0, 5.0, 2.2], 0.3) is True",
        "def has_close_elements(xs, t):\n"
        "    return any(abs(a - b) < t for i, a in enumerate(xs) for b in xs[i + 1:])",
        "def has_close_elements(xs, t):\n    return 1",  # 1 == True, but 1 is not True
        (1, 0, 0),
    ),
    (
        "assert not below_zero([1, 2, -3, 1, 2, -3])",
        "def below_zero(ops):\n    s = 0\n    for op in ops:\n        s += op\n"
        "        if s < 0:\n            return True\n    return False",
        "def below_zero(ops):\n    return min(ops) < 0",
        (1, 0, 0),
    ),
    (
        "METADATA = {'author': 'jt', 'dataset': 'test'}\n\n\ndef check(candidate):\n"
        "    assert candidate([], 7) == []\n"
        "    assert candidate([5, 6, 3, 2], 8) == [5, 8, 6, 8, 3, 8, 2]\n"
        "    assert candidate([2, 2, 2], 2) == [2, 2, 2, 2, 2]\n\ncheck(intersperse)",
        "def intersperse(xs, d):\n    out = []\n    for x in xs:\n        out += [x, d]\n"
        "    return out[:-1]",
        "def intersperse(xs, d):\n    return xs",
        (1, 0, 0),
    ),
    (
        "assert all(add_one(i) == i + 1 for i in range(3))",
        "def add_one(x):\n    return x + 1",
        "def add_one(x):\n    return x + 2",
        (1, 0, 0),
    ),
    (
        "assert all([double(i) == 2 * i for i in range(4)])",
        "def double(x):\n    return 2 * x",
        "def double(x):\n    return x * x",
        (1, 0, 0),
    ),
    (
        "assert any(is_palindrome(s) for s in ['ab', 'aba'])",
        "def is_palindrome(s):\n    return s == s[::-1]",
        "def is_palindrome(s):\n    return False",
        (1, 0, 0),
    ),
    (
        "assert 0 < sum_digits(123) < 10",
        "def sum_digits(n):\n    return sum(map(int, str(n)))",
        "def sum_digits(n):\n    return n",
        (1, 0, 0),
    ),
    (
        "assert 'b' in split_words('a b c')",
        "def split_words(s):\n    return s.split()",
        "def split_words(s):\n    return s.split(',')",
        (1, 0, 0),
    ),
    (
        "assert flip_case('Hello').lower() == 'hello'",
        "def flip_case(s):\n    return s.swapcase()",
        "def flip_case(s):\n    return s[::-1]",
        (1, 0, 0),
    ),
    (
        "assert min_max([3, 1, 2]) == (1, 3)",
        "def min_max(xs):\n    return (min(xs), max(xs))",
        "def min_max(xs):\n    return [min(xs), max(xs)]",  # a list is not the tuple
        (1, 0, 0),
    ),
    (
        "assert count_chars('aab') == {'a': 2, 'b': 1}",
        "def count_chars(s):\n    return {c: s.count(c) for c in s}",
        "def count_chars(s):\n    return {c: 1 for c in s}",
        (1, 0, 0),
    ),
    (
        "assert sum(square(i) for i in range(4)) == 14",
        "def square(x):\n    return x * x",
        "def square(x):\n    return x + x",
        (1, 0, 0),
    ),
    (
        "assert sorted(cube(x) for x in [-2, 1, 2]) == [-8, 1, 8]",
        "def cube(x):\n    return x ** 3",
        "def cube(x):\n    return abs(x) ** 3",
        (1, 0, 0),
    ),
    (
        "assert [triple(x) for x in [1, 2, 3]] == [3, 6, 9]",
        "def triple(x):\n    return 3 * x",
        "def triple(x):\n    return x + 3",
        (1, 0, 0),
    ),
    (
        "for x in range(2, 6):\n    assert is_even(2 * x)\n    assert not is_even(2 * x + 1)",
        "def is_even(n):\n    return n % 2 == 0",
        "def is_even(n):\n    return n > 0",
        (1, 0, 0),
    ),
    (
        "assert math.fabs(poly([1, 2], find_zero([1, 2]))) < 1e-4",
        "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
        "def find_zero(xs):\n    return -xs[0] / xs[1]",
        "def poly(xs, x):\n    return sum(c * x ** i for i, c in enumerate(xs))\n"
        "def find_zero(xs):\n    return 0.0",
        (1, 0, 0),
    ),
    (
        "assert all(fib(n) == e for n, e in zip(range(1, 6), [1, 1, 2, 3, 5]))",
        "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a",
        "def fib(n):\n    return n",
        (1, 0, 0),
    ),
    (
        "assert {x: sq_map(x) for x in range(3)} == {0: 0, 1: 1, 2: 4}",
        "def sq_map(x):\n    return x * x",
        "def sq_map(x):\n    return x",
        (1, 0, 0),
    ),
    (
        "tup = (1, 5, 3)\nassert max_of(tup) == 5",
        "def max_of(t):\n    return max(t)",
        "def max_of(t):\n    return t[-1]",
        (1, 0, 0),
    ),
    (
        "assert isinstance(to_int('7'), int) and to_int('7') == 7",
        "def to_int(s):\n    return int(s)",
        "def to_int(s):\n    return s",
        (1, 0, 0),
    ),
    (
        "assert round(avg([1, 2, 4]), 2) == 2.33",
        "def avg(xs):\n    return sum(xs) / len(xs)",
        "def avg(xs):\n    return sum(xs) // len(xs)",
        (1, 0, 0),
    ),
    (
        "assert all(x >= 3 for x in top_k([5, 1, 3], 2))",
        "def top_k(xs, k):\n    return sorted(xs)[-k:]",
        "def top_k(xs, k):\n    return sorted(xs)[:k]",
        (1, 0, 0),
    ),
]
FUNCTIONS = sorted(
    {
        line.split("(")[0][4:]
        for _, r, _, _ in TABLE
        for line in r.splitlines()
        if line[:4] == "def "
    }
)
RIGGED = {
    "always-equal object": "class R:\n"
    + "".join(
        f"    def {m}(self, *a): return {v}\n"
        for m, v in [
            ("__eq__", True),
            ("__ne__", False),
            ("__lt__", True),
            ("__le__", True),
            ("__gt__", True),
            ("__ge__", True),
            ("__bool__", True),
            ("__sub__", "self"),
            ("__rsub__", "self"),
            ("__abs__", 0),
            ("__round__", "self"),
            ("__contains__", True),
            ("__getitem__", "self"),
            ("__len__", 3),
            ("__iter__", "iter([self])"),
            ("lower", "self"),
            ("__float__", 0.0),
        ]
    )
    + "    __hash__ = object.__hash__\n",
    "int subclass": "class R(int):\n    def __eq__(self, o): return True\n"
    "    def __ne__(self, o): return False\n    __hash__ = int.__hash__\n",
    "str subclass": "class R(str):\n    def __eq__(self, o): return True\n"
    "    def __ne__(self, o): return False\n    def lower(self): return self\n"
    "    __hash__ = str.__hash__\n",
    "list subclass": "class R(list):\n    def __eq__(self, o): return True\n"
    "    def __ne__(self, o): return False\n",
}
PROGRAMS = {
    "right": "import math\n" + "\n".join(r for _, r, _, _ in TABLE),
    "wrong": "import math\n" + "\n".join(w for _, _, w, _ in TABLE),
    **{
        name: "import math\n"
        + cls
        + "".join(f"def {f}(*a, **k):\n    return R()\n" for f in FUNCTIONS)
        for name, cls in RIGGED.items()
    },
}
_COLUMN = {"right": 0, "wrong": 1}


def _python_verdict(program: str, test: str) -> bool:
    scope: dict = {}
    exec(program, scope)
    try:
        exec(test, scope)
        return True
    except Exception:  # noqa: BLE001
        return False


def test_the_hand_verdicts_are_pythons():
    """The table's right and wrong verdicts are what Python gives running each assert itself, and
    the rigged objects are a real attack: in Python they pass most of the table."""
    tests = [t for t, _, _, _ in TABLE]
    for name in ("right", "wrong"):
        expected = [bool(v[_COLUMN[name]]) for _, _, _, v in TABLE]
        assert [_python_verdict(PROGRAMS[name], t) for t in tests] == expected, name
    fooled = [_python_verdict(PROGRAMS["always-equal object"], t) for t in tests]
    assert sum(fooled) >= 15, fooled
    assert len(TABLE) >= 25 and len(FUNCTIONS) >= len(TABLE)


@pytest.mark.parametrize("mechanism", ["bwrap", "unshare"])
def test_assert_forms_score_as_the_table_says(mechanism):
    """Each program against every test of the table in one sandboxed run: the right one passes
    each, the wrong one none, and the rigged objects (always-equal, int / str / list subclasses)
    none."""
    plans = parse_tests([t for t, _, _, _ in TABLE], "tests", 0)
    assert not [p.refused for p in plans if p.refused]
    reward = CodeExec(sandbox=_config(mechanism), test_timeout_s=2.0)
    for name, program in PROGRAMS.items():
        column = _COLUMN.get(name, 2)
        expected = [bool(v[column]) for _, _, _, v in TABLE]
        assert reward.verdicts(fenced(program), plans) == expected, name


@pytest.mark.slow
@pytest.mark.parametrize("mechanism", ["bwrap", "unshare"])
def test_assert_forms_score_row_by_row(mechanism):
    """The table as a dataset of one test per row, scored by the reward itself: 1.0 for the right
    program, 0.0 for the wrong one and for each rigged one."""
    reward = CodeExec(sandbox=_config(mechanism), test_timeout_s=2.0)
    rows = [[t] for t, _, _, _ in TABLE]
    for name, program in PROGRAMS.items():
        column = _COLUMN.get(name, 2)
        got = reward(["p"] * len(rows), [fenced(program)] * len(rows), tests=rows)
        assert got == [float(v[column]) for _, _, _, v in TABLE], name


def test_unsplittable_forms_fail_with_a_warning_naming_the_row_and_test():
    """A call over loop values only the program knows cannot be judged outside it: the test
    fails, and the reward warns once, naming the column, row, test and reason."""
    tests = ["assert f(1) == 1", "assert all(g(x) == x for x in f(3))"]
    match = r"column 'tests', row 4: 1 of 2 tests always fail.*\(test 1: 'g\(x\)' calls.* loop"
    with pytest.warns(JudgeWarning, match=match):
        plans = parse_tests(tests, "tests", 4)
    assert plans[1].refused and not plans[0].refused
    assert not passed(plans[1], [{"ok": True, "values": []}])
