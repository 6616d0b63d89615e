"""relax.rewards.judge: tests split so that the expected values and the comparing stay in the
trainer. The reference is Python itself: each assert, run the ordinary way against the same
solution, passes exactly when the split one is judged to pass."""

import json
import math
import secrets
import subprocess
import sys

import pytest

from relax.rewards.judge import (
    JudgeError,
    call_tests,
    decode,
    harness,
    judge,
    passed,
    plain_json,
    plan_test,
    read_results,
)

SOLUTION = """
def add(a, b):
    return a + b
def pair(x):
    return (x, -x)
def evens(n):
    return [i for i in range(n) if i % 2 == 0]
def ratio(a, b):
    return a / b
def table(n):
    return {i: str(i) for i in range(n)}
def nothing():
    return None
class Solution:
    def twice(self, x):
        return 2 * x
"""

ASSERTS = [
    "assert add(1, 2) == 3",
    "assert add(1, 2) == 4",
    "assert 3 == add(1, 2)",
    "assert add(2, 2) != 5",
    "assert pair(3) == (3, -3)",
    "assert pair(3) == [3, -3]",  # a tuple is not a list, in Python as here
    "assert evens(7) == [0, 2, 4, 6]",
    "assert len(evens(7)) == 4 and 6 in evens(7)",
    "assert sorted(evens(5), reverse=True) == [4, 2, 0]",
    "assert math.isclose(ratio(1, 3), 0.3333333, rel_tol=1e-6)",
    "assert math.isclose(ratio(1, 3), 0.3333, rel_tol=1e-6)",
    "assert abs(ratio(22, 7) - math.pi) < 1e-2",
    "assert table(2) == {0: '0', 1: '1'}",
    "assert table(2)[1] == '1'",
    "assert nothing() is None",
    "assert not evens(0)",
    "assert evens(3)",
    "x = add(2, 3)\nassert x == 5",
    "assert ratio(1, 0) == 0",  # raises: fails
    "assert set(evens(6)) == {0, 2, 4}",
    "assert -add(1, 1) == -2",
    "assert evens(10)[1:3] == [2, 4]",
]


def _python_verdict(test: str) -> bool:
    scope = {"math": math}
    exec(SOLUTION, scope)
    try:
        exec(test, scope)
        return True
    except Exception:  # noqa: BLE001
        return False


def _run_harness(tmp_path, code: str, plans, timeout=5.0):
    """The sandbox side, run as a plain subprocess (the sandbox itself: tests/test_code_exec.py)."""
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "solution.py").write_text(code)
    (src / "steps.json").write_text(json.dumps([p.sandbox_steps() for p in plans]))
    (src / "harness.py").write_text(harness(timeout))
    nonce = secrets.token_hex(8)
    out = subprocess.run(
        [sys.executable, "-I", "src/harness.py"],
        input=nonce + "\n",
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    return [passed(p, r) for p, r in zip(plans, read_results(out, nonce, plans))]


def test_split_asserts_judge_as_python_does(tmp_path):
    plans = [plan_test(t) for t in ASSERTS]
    got = _run_harness(tmp_path, "import math\n" + SOLUTION, plans)
    assert got == [_python_verdict(t) for t in ASSERTS]
    assert got.count(True) >= 15 and got.count(False) >= 4  # both verdicts exercised


def test_expected_values_never_reach_the_sandbox():
    plan = plan_test("assert add(1, 2) == 31337 and math.isclose(ratio(1, 3), 0.271828)")
    assert plan.probes == ["add(1, 2)", "ratio(1, 3)"]
    text = json.dumps([plan.sandbox_steps()])
    assert "31337" not in text and "271828" not in text and "isclose" not in text


def test_wrong_solutions_that_attack_the_judge_score_nothing(tmp_path):
    """What a reward-hacking policy writes, with a wrong add(): none of it passes."""
    tests = [
        "assert add(1, 2) == 3",
        "assert add(5, 5) == 10",
        "assert math.isclose(ratio(1, 4), 0.25)",
    ]
    plans = [plan_test(t) for t in tests]
    attacks = {
        "always-equal object": "class E:\n def __eq__(s, o): return True\n def __sub__(s, o): return 0\n"
        "def add(a, b): return E()\ndef ratio(a, b): return E()",
        "int subclass": "class I(int):\n def __eq__(s, o): return True\ndef add(a, b): return I(999)\n"
        "def ratio(a, b): return I(9)",
        "exit early": "import sys, atexit, os\natexit.register(lambda: os._exit(0))\ndef add(a, b): sys.exit(0)",
        # the harness's own line format and nonce, with what a program can claim without computing
        # the answer (a line with the right value is worth what returning that value is)
        "forged lines": "import sys, __main__\ndef add(a, b):\n n = __main__.nonce\n"
        ' for v in (\'{"ok": true}\', \'{"ok": true, "values": [true]}\'):\n'
        "  sys.__stdout__.write(f'\\n{n} 0 0 {v}\\n{n} 1 0 {v}\\n')\n return 999",
        "rewrite the steps": "import gc\nfor o in gc.get_objects():\n if isinstance(o, list):\n  o.clear()\n"
        "def add(a, b): return 999",
        "patched builtins": "import builtins\nbuiltins.compile = lambda *a, **k: compile('True', 'x', 'eval')\n"
        "def add(a, b): return 999",
        "read the tests": "import json\nsteps = json.load(open('src/steps.json'))\n"
        "def add(a, b): return {'l': steps}",
    }
    for name, code in attacks.items():
        got = _run_harness(tmp_path, code, plans)
        assert got[:2] == [False, False], name
    honest = "def add(a, b): return a + b\ndef ratio(a, b): return a / b"
    assert _run_harness(tmp_path, honest, plans) == [True, True, True]


def test_call_based_tests_are_judged_outside(tmp_path):
    plans = call_tests(
        {"fn_name": "twice", "inputs": [[2], [5], [0]], "outputs": [4, [10], 1]}, "row 1"
    )
    assert _run_harness(tmp_path, SOLUTION, plans) == [
        True,
        True,
        False,
    ]  # [10]: APPS's one-element list
    assert "10" not in json.dumps([p.sandbox_steps() for p in plans][1])
    with pytest.raises(JudgeError, match="row 3: fn_name"):
        call_tests({"fn_name": "os.system", "inputs": [[1]], "outputs": [1]}, "row 3")


def test_plain_data_round_trips_and_nothing_else_decodes():
    for value in [
        None,
        True,
        3,
        -2.5,
        math.inf,
        "s",
        [1, (2, 3)],
        {1: {"a"}},
        frozenset({1}),
        {"k": [None]},
    ]:
        assert decode(json.loads(plain_json(value))) == value
    assert math.isnan(decode(json.loads(plain_json(math.nan))))
    for bad in [{"q": []}, {"l": [1], "t": [2]}, [1, 2], {"d": [[[1], 2]]}]:
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


def test_judge_refuses_what_would_exhaust_the_trainer():
    plan = plan_test("assert 'a' * n(1) == 'aa'")
    assert passed(plan, [{"ok": True, "values": [10**12]}]) is False
    plan = plan_test("assert 2 ** n(1) > 0")
    assert passed(plan, [{"ok": True, "values": [10**12]}]) is False
    assert passed(plan, [{"ok": True, "values": [10]}]) is True


def test_tests_without_an_assert_are_refused():
    with pytest.raises(JudgeError, match="no assert"):
        plan_test("print(add(1, 2))")
    with pytest.raises(JudgeError, match="does not parse"):
        plan_test("assert add(1, 2) ==")
    assert judge(plan_test("assert f() is None").steps[0].judge, [None]) is True


def test_results_from_any_stdout_never_raise():
    """The program writes the stdout read_results reads: nothing in it may make the reward raise."""
    plans = [plan_test("assert f(1) == 3")]
    hostile = [
        'n 0 0 {"ok": true, "values": [' + "9" * 5000 + "]}",  # over Python's int-digit limit
        "n ² 0 {}",
        "n ٣ 0 {}",
        "n 0 0 " + "[" * 100000,
        "n 99999999999999999999 0 {}",
        "n 0 0 NaN",
        "n 0",
        "n -1 0 {}",
        "\x00" * 10,
    ]
    for line in hostile:
        assert not passed(plans[0], read_results(line, "n", plans)[0]), line
    ok = read_results(
        'noise\nn 0 0 {"ok": true, "values": [3]}\nn 0 0 {"ok": true, "values": [4]}', "n", plans
    )
    assert passed(plans[0], ok[0])  # the first line for a step counts


def test_forms_the_judge_cannot_evaluate_go_to_the_sandbox_whole(tmp_path):
    """``**mapping`` in a judged call, a starred item in a display: probed as a whole, and judged as
    Python judges them (they failed for a right solution before)."""
    tests = [
        "assert sorted(evens(5), **{'reverse': True}) == [4, 2, 0]",
        "assert [*evens(5)] == [0, 2, 4]",
        "assert (*evens(3), 9) == (0, 2, 9)",
        "assert [*evens(5)] == [0, 2]",
    ]
    plans = [plan_test(t) for t in tests]
    assert plans[0].probes == ["sorted(evens(5), **{'reverse': True})"] and plans[1].probes == [
        "[*evens(5)]"
    ]
    assert (
        _run_harness(tmp_path, SOLUTION, plans)
        == [_python_verdict(t) for t in tests]
        == [True, True, True, False]
    )


def test_judged_work_that_would_exhaust_the_trainer_fails_fast():
    """A probe value chosen to make a judged operation huge: refused (a failed test) in well under
    a second, where Python would take minutes or all the memory."""
    import time

    cases = [
        ("assert f(1) ** f(2) > 0", [int("7" * 4000), 4096]),  # 17 s of CPU before
        ("assert f(1) % 3 == 'x'", ["%0999999999d"]),
        ("assert f(1) % (5, 1) == 'x'", ["%*d"]),
        ("assert round(f(1), f(2)) == 0", [10**4000, -(10**9)]),
        ("assert sum(f(1), []) == []", [[[1]] * 100000]),
    ]
    for test, values in cases:
        plan = plan_test(test)
        assert (
            passed(plan, [{"ok": True, "values": [json.loads(plain_json(v)) for v in values]}])
            is False
        )
        t0 = time.perf_counter()
        with pytest.raises(JudgeError):
            judge(plan.steps[0].judge, values)
        assert time.perf_counter() - t0 < 1.0, test
    fine = [
        ("assert f(1) ** 3 == 27", [3]),
        ("assert '%5.1f' % f(1) == '  2.5'", [2.5]),
        ("assert round(f(1), 2) == 0.33", [1 / 3]),
        ("assert sum(f(1)) == 6", [[1, 2, 3]]),
    ]
    for test, values in fine:
        assert passed(
            plan_test(test), [{"ok": True, "values": [json.loads(plain_json(v)) for v in values]}]
        ), test


def test_call_based_inputs_that_are_not_plain_data_name_the_row_and_input():
    with pytest.raises(JudgeError, match=r"row 2: input 1 is not plain data"):
        call_tests({"fn_name": "f", "inputs": [[1], [object()]], "outputs": [1, 2]}, "row 2")
    for bad in ({"l": "abc"}, {"d": 5}):
        with pytest.raises(ValueError, match="not a list"):
            decode(bad)


# ------------------------------------------------------------------------------ split loops

COMPREHENSIONS = [
    "assert all(add(i, 1) == i + 1 for i in range(3))",
    "assert all([add(i, 1) == i + 1 for i in range(3)])",
    "assert all(add(i, 1) == i + 2 for i in range(3))",
    "assert any(add(i, i) == 4 for i in range(5))",
    "assert not any(add(i, i) == 3 for i in range(5))",
    "assert sum(add(i, i) for i in range(4)) == 12",
    "assert sorted(pair(x)[1] for x in [3, 1, 2]) == [-3, -2, -1]",
    "assert [add(x, 1) for x in (1, 2)] == [2, 3]",
    "assert [add(x, 1) for x in (1, 2)] == [2, 4]",
    "assert list(add(x, x) for x in range(3)) == [0, 2, 4]",
    "assert tuple(pair(x) for x in range(2)) == ((0, 0), (1, -1))",
    "assert {x: table(3)[x] for x in range(3)} == {0: '0', 1: '1', 2: '2'}",
    "assert {add(x, 0) for x in [1, 1, 2]} == {1, 2}",
    "assert len([evens(n) for n in range(4)]) == 4",
    "assert max(ratio(x, 2) for x in range(1, 5)) == 2.0",
    "assert min(add(x, -x) for x in range(3)) == 0",
    "assert all(add(a, b) == c for a, b, c in [(1, 2, 3), (2, 5, 7)])",
    "assert all(add(a, b) == c for (a, b), c in zip([(1, 2), (2, 5)], [3, 7]))",
    "assert all(add(i, j) == i + j for i in range(4) for j in range(i) if j % 2)",
    "assert all(all(add(i, j) >= i for j in range(3)) for i in range(3))",
    "assert all(x % 2 == 0 for x in evens(9))",
    "assert all(add(x, 0) == x for x in [y * 2 for y in range(3)])",
    "assert all(i == x // 2 for i, x in enumerate(evens(9)))",
    "assert all(ratio(1, x) > 0 for x in range(-2, 3) if x > 0)",
    "assert any(ratio(1, x) == 1 for x in [1, 0])",  # ratio(1, 0) raises, and is never read
    "assert all(ratio(1, x) == 1 for x in [1, 0])",
    "assert (add(1, 1) == 2) if evens(3) else False",
    "assert isinstance(add(1, 2), int) and not isinstance(ratio(1, 2), int)",
    "for x in range(3):\n    assert add(x, 1) == x + 1",
    "for x, y in [(1, 2), (2, 5)]:\n    assert add(x, x) == y",
    "for x in range(3):\n    y = add(x, x)\n    assert y == 2 * x\nassert x == 2",
    "def check(candidate):\n    assert candidate(1, 2) == 3\n"
    "    assert all(candidate(i, 0) == i for i in range(3))\ncheck(add)",
    "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 5\ncheck(add)",
]


def test_comprehensions_and_loops_judge_as_python_does(tmp_path):
    """Generator expressions, comprehensions, ``for`` loops of asserts and HumanEval's check
    function: split per element, each verdict the one Python gives running the assert itself."""
    plans = [plan_test(t) for t in COMPREHENSIONS]
    assert not [p.refused for p in plans if p.refused]
    got = _run_harness(tmp_path, "import math\n" + SOLUTION, plans)
    assert got == [_python_verdict(t) for t in COMPREHENSIONS]
    assert got.count(True) >= 25 and got.count(False) >= 4


RIGGED = {
    "always-equal object": "class R:\n    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n    def __lt__(self, other): return True\n"
    "    def __gt__(self, other): return True\n    def __le__(self, other): return True\n"
    "    def __ge__(self, other): return True\n    def __bool__(self): return True\n"
    "    def __getitem__(self, i): return self\n    def __add__(self, o): return self\n"
    "    __radd__ = __add__\n    __hash__ = object.__hash__\n",
    "int subclass": "class R(int):\n    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n    __hash__ = int.__hash__\n",
    "str subclass": "class R(str):\n    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n    __hash__ = str.__hash__\n",
    "list subclass": "class R(list):\n    def __eq__(self, other): return True\n"
    "    def __ne__(self, other): return False\n",
}


def test_rigged_values_fail_every_split_form(tmp_path):
    """Each function returns an object whose ``==`` is always true: in Python itself (the attack
    is real) the comprehension forms pass; judged here, none does, the right solution's all do."""
    forms = [t for t in COMPREHENSIONS if "== i + 2" not in t and "== 5" not in t]
    forms = [t for t in forms if "ratio(1, x) == 1 for x in [1, 0]" not in t]
    plans = [plan_test(t) for t in forms]
    for name, rigged in RIGGED.items():
        code = rigged + "".join(
            f"def {f}(*args):\n    return R()\n" for f in ("add", "pair", "evens", "ratio", "table")
        )
        assert _run_harness(tmp_path, code, plans) == [False] * len(forms), name
    assert _python_verdict_of(RIGGED["always-equal object"], forms[1])  # the list-comp form
    assert _run_harness(tmp_path, "import math\n" + SOLUTION, plans) == [
        _python_verdict(t) for t in forms
    ]


def _python_verdict_of(rigged: str, test: str) -> bool:
    scope = {"math": math}
    exec(rigged + "def add(*args):\n    return R()\n", scope)
    try:
        exec(test, scope)
        return True
    except Exception:  # noqa: BLE001
        return False


def test_split_loops_send_only_the_values_their_calls_use():
    """The expected values of a split loop stay in the trainer: each element's probe is its call,
    with the loop values that call uses; a HumanEval check function never enters the sandbox."""
    plan = plan_test("assert all(add(a, b) == c for a, b, c in [(1, 2, 31337), (4, 5, 27182)])")
    assert plan.probes == [
        ("lambda a, b: (add(a, b))", '{"l": [1, 2]}'),
        ("lambda a, b: (add(a, b))", '{"l": [4, 5]}'),
    ]
    check = plan_test("def check(candidate):\n    assert candidate(1, 2) == 31337\ncheck(add)")
    for p in (plan, check):
        text = json.dumps([p.sandbox_steps()])
        assert "31337" not in text and "27182" not in text, text
    assert check.sandbox_steps() == [{"exec": "candidate = add"}, {"probes": ["candidate(1, 2)"]}]


def test_forms_that_cannot_be_split_fail_closed(tmp_path):
    """A call over loop values only the sandbox knows, or a loop past MAX_UNROLL: refused (the
    test fails, with a reason), never compared in the sandbox. A loop whose body calls nothing
    is judged here whatever its size."""
    refused = [
        "assert all(add(i, x) == i + x for i, x in enumerate(evens(6)))",
        "assert all(add(i, 0) == i for i in range(20000))",
        "assert [add(x, 1) for x in evens(4)] == [1, 3]",
    ]
    plans = [plan_test(t) for t in refused]
    reasons = [p.refused for p in plans]
    assert "loop variable(s) i, x" in reasons[0][0] and "over 10000" in reasons[1][0], reasons
    assert _run_harness(tmp_path, SOLUTION, plans) == [False, False, False]
    assert [_python_verdict(t) for t in refused] == [True, True, True]  # Python's own verdict
    big = plan_test("assert sorted(evens(10)) == [x for x in range(10000) if x % 2 == 0][:5]")
    assert not big.refused and _run_harness(tmp_path, SOLUTION, [big]) == [True]


def test_unread_probes_that_raised_do_not_fail_the_assert():
    """A probe that raised in the sandbox ({"e": 0}) fails its assert only where the judge reads
    it: not after ``or``, nor past where ``any`` stops."""
    plan = plan_test("assert f(1) == 1 or f(2) == 2")
    assert passed(plan, [{"ok": True, "values": [1, {"e": 0}]}])
    assert not passed(plan, [{"ok": True, "values": [{"e": 0}, 2]}])
    assert not passed(plan, [{"ok": True, "values": [[{"e": 0}], 2]}])  # not a mark: not data
