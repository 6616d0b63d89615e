"""``code_exec``: the completion's code runs in the sandbox; the row's tests are judged outside it.

    reward = CodeExec(tests_field="tests", scoring="fraction", sandbox=SandboxConfig(wall_s=10))
    reward(prompts, completions, tests=[...])            # TRL's signature; one value per completion

The code is the completion's LAST fenced block whose language tag is one of the language's
names (``python``, ``py``, ``python3``) or empty; a completion without one scores 0.0.

The tests of a row (column ``tests_field``: a list or a dict, or its JSON text) take one of three forms:

- **asserts** (MBPP / HumanEval-style lists), Python only: ``["assert add(1, 2) == 3", ...]``.
  ``relax.rewards.judge.plan_test`` splits each in the trainer, with ``ast``: the sub-expressions
  that are not judge logic (``add(1, 2)``), the *probes*, are evaluated in the sandbox and come back
  as plain data; the rest of the assert (``== 3``), the *judge*, is evaluated in the trainer over
  those values. A test's statements that are not top-level asserts (``x = make(3)``, ``import
  math``) run in the sandbox, in order. Comprehensions and generator expressions in an assert
  (``all(add(i, 1) == i + 1 for i in range(3))``), ``for`` loops of asserts over values known
  before the run and HumanEval's ``check(candidate)`` function are split per element
  (``relax.rewards.assert_forms``); a form that cannot be split safely fails its test, counted
  in a ``JudgeWarning`` naming the row, the test and the reason. A test passes when each of its
  statements completes (no exception, within ``test_timeout_s``), each probe the judge reads
  completed with a value of plain data, and each assert's judge is true.
- **call-based** (APPS / TACO style), Python only: ``{"fn_name": "f", "inputs": [[args], ...],
  "outputs": [out, ...]}``, or the JSON text of it (APPS's ``input_output``). Case ``i`` is the probe
  ``f(*inputs[i])`` (a top-level function ``f``, else the method ``f`` of a class ``Solution``), its
  inputs sent into the sandbox as data, judged ``== outputs[i]`` in the trainer (an output written
  as a one-element list also matches its element; ``relax.rewards.judge.call_tests``).
- **stdin/stdout** (APPS / CodeContests / LiveCodeBench style): ``[{"input": str, "output": str}, ...]``,
  or APPS's ``{"inputs": [str, ...], "outputs": [str, ...]}`` without ``fn_name``.
  One sandboxed run per pair, the input on stdin; it passes when the program exits 0 within the
  limits and its stdout equals the output up to trailing whitespace on each line and trailing
  blank lines (``same_output``, in the trainer).

Asserts and call-based tests take ONE sandboxed run per completion: ``src/solution.py`` (the code),
``src/steps.json`` (per test, its sandbox steps: statements and probe sources, nothing else) and
``src/harness.py`` (``relax.rewards.judge.harness``), with a fresh random nonce on stdin. The harness
loads the code, then runs each test's steps with a SIGALRM of ``test_timeout_s`` each, and writes
one line per step, ``<nonce> <test> <step> <tagged JSON of the probes' values>``; a test stops at
its first failed step. In the trainer, the first line for a step counts, and a test whose lines
are missing or malformed fails (``relax.rewards.judge.read_results`` and ``passed``).

Score of a completion with T tests of which k pass::

    scoring="fraction":  r = k / T            scoring="all":  r = 1.0 if k == T else 0.0

What the program can and cannot influence. Nothing the sandbox returns is trusted beyond being
data: its stdout is the program's output (stdin/stdout tests) or probe values (asserts,
call-based), and no output makes the reward raise.

- It cannot see an assert's expected values written in the judged part: the literals, names of
  ``relax.rewards.judge.JUDGE_NAMES`` and judged calls that a probe is compared with (``3`` in
  ``add(1, 2) == 3``, ``0.25`` in ``math.isclose(ratio(1, 4), 0.25)``) stay in the trainer; nor the
  outputs of call-based and stdin/stdout tests, which never enter the sandbox (unless the
  dataset itself is in its view: the last point).
- It can see the probes' source and their arguments (``add(1, 2)``, and for a split loop the
  loop values that probe uses), the inputs of call-based tests, its stdin, and every statement
  of a test that is not an assert the judge splits, with any value that statement computes in
  the sandbox. Such values are under its control, and so is an assert's outcome when its
  expected value is only computed there: a probe that is not the program's own call
  (``expected`` set by ``expected = [1, 2]``, a helper the test defines, a call the judge does
  not evaluate, such as ``numpy.allclose(f(x), [1, 2])`` with its literal), or an assert nested
  in a statement the judge does not split (an ``if``, a ``while``, a ``def`` other than
  HumanEval's inlined ``check``, a ``for`` over values only the sandbox knows), which runs in the
  sandbox with it.
- A wrong value it returns or prints is judged as wrong whatever it does to its own process:
  rewriting the harness's steps (through ``__main__``, ``gc.get_objects()``, ``sys._getframe()``),
  replacing ``compile``, ``eval`` or ``json.dumps``, exiting early (``sys.exit``, ``os._exit``,
  ``atexit``), or printing lines stamped with the nonce (which it can read) changes only which
  values come back, one per probe (the first line counts), or drops them (the test fails). A
  value it claims passes exactly when returning that value would.
- Values are plain data only: None, bool, int, float, str, and lists, tuples, sets, frozensets and
  dicts of plain data, of the exact built-in types; anything else (an object whose ``__eq__`` is
  always true, a subclass of ``int``, but also bytes and complex numbers) fails its probe, and
  the assert that reads it.
- The judge evaluates, in the trainer, with Python's own operators on plain data (``3.0 == 3``,
  ``True == 1``, ``(1, 2) != [1, 2]``): comparisons (``== != < <= > >= in not in``, ``is`` / ``is
  not`` against None, True, False), ``and or not``, ``x if c else y``, ``+ - * / // % **``,
  literals and displays, subscripts and slices, comprehensions, and the pure functions of
  ``relax.rewards.judge.JUDGE_CALLS`` (``abs``, ``len``, ``sorted``, ``math.isclose``, ``range``,
  ...) with constant keyword arguments. A judged operation that would exhaust the trainer (``"a"
  * 10**12``, ``2 ** 10**12``) fails its test, and so does whatever makes decoding and judging a
  run's results outlast its budget (``relax.rewards.plain_data``: ``JUDGE_S`` seconds,
  ``MAX_ITEMS`` items, ``MAX_RESULT_CHARS`` characters; sets and dicts built without hashing
  collisions the program chose), so its results cannot slow the trainer.
- All of the above holds only while the dataset itself is out of the program's view. Under
  bwrap and unshare the program sees ``/usr``, its interpreter and its own files, nothing else
  (``relax.rewards.isolation``). Under ``none`` (opted into with ``allow_unisolated``) the host's
  file system is in view: a world-readable copy of the dataset holds the expected values of
  every format, and a program that finds it can return or print them (tests/test_code_exec.py
  runs that attack under bwrap and unshare).

Time: a row costs at most one sandboxed run (asserts, call-based) or one per pair (stdin/stdout),
each killed at ``sandbox.wall_s``, and ``JUDGE_S`` to judge the results of a run of asserts or
call-based tests; ``time_bound_s(fields)`` adds them up (plus ``RUN_OVERHEAD_S`` per run and one
run for the sandbox's start-up probe), and the reward pool and ``score`` wait at
least that long for a chunk (``relax.rewards.functions.call_timeout_s``), so slow but legitimate
samples are not cut by ``--reward-timeout-s``.

Rows whose tests are None or empty are missing (None). Malformed tests (not a list or dict, mixed
forms, an assert test that does not parse or holds no assert, a call-based dict without
``fn_name`` or with inputs and outputs of different lengths, asserts or call-based tests with a
language other than python) raise ``ValueError`` naming the column, the row and the problem (and
the test's index for an assert).
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from relax.choices import check_choice
from relax.rewards.columns import column
from relax.rewards.judge import (
    JUDGE_S,
    Budget,
    JudgeError,
    TestPlan,
    call_tests,
    harness,
    passed,
    plan_test,
    read_results,
)
from relax.rewards.sandbox import SandboxConfig, sandbox_for

SCORING = ("fraction", "all")
LANGUAGES = {  # name -> (fence tags, file name, command)
    "python": (
        ("python", "py", "python3", ""),
        "solution.py",
        ("{python}", "-I", "src/solution.py"),
    ),
    "bash": (("bash", "sh", "shell", ""), "solution.sh", ("bash", "src/solution.sh")),
}
RUN_OVERHEAD_S = (
    1.0  # a sandboxed run's start (namespaces, interpreter) and teardown beyond its wall_s
)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def last_code_block(text: str, tags: Sequence[str]) -> str | None:
    """The body of the last fenced block (```tag ... ```) whose tag is in ``tags``, or None."""
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in tags]
    return blocks[-1] if blocks else None


def parse_tests(raw: Any, field: str, row: int) -> list[TestPlan] | list[dict] | None:
    """A row's tests (module docstring): ``TestPlan``s for asserts and call-based tests, ``{"input",
    "output"}`` dicts (strings) for stdin/stdout pairs; None when there are none. ``ValueError``
    naming the column, the row (and an assert's index) for anything else."""
    where = f"column {field!r}, row {row}"
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: tests are not a list, a dict or its JSON ({exc})") from None
    if raw is None:
        return None
    if isinstance(raw, Mapping):
        return _call_based(raw, where)
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"{where}: tests must be a list or a dict, got {type(raw).__name__}")
    if not raw:
        return None
    if all(isinstance(t, str) for t in raw):
        return _plans(raw, where)
    if all(isinstance(t, Mapping) and {"input", "output"} <= set(t) for t in raw):
        return [{"input": str(t["input"]), "output": str(t["output"])} for t in raw]
    raise ValueError(
        f"{where}: each test must be an assert string, or every test a dict with 'input' and "
        "'output' (stdin/stdout); call-based tests are one dict with 'fn_name', 'inputs', 'outputs'"
    )


class JudgeWarning(UserWarning):
    """An assert of a dataset's test that cannot be judged outside the program: the test fails."""


def _plan(test: str, where: str, index: int) -> TestPlan:
    try:
        return plan_test(test)
    except JudgeError as exc:
        raise JudgeError(f"{where}, test {index}: {exc}") from None


def _plans(tests: Sequence[str], where: str) -> list[TestPlan]:
    """A row's assert tests, planned; those with an assert that cannot be judged outside the
    program (it always fails) counted in a ``JudgeWarning`` (once per message, Python's default
    filter), with the first one's reason."""
    plans = [_plan(t, where, i) for i, t in enumerate(tests)]
    refused = [(i, p.refused[0]) for i, p in enumerate(plans) if p.refused]
    if refused:
        warnings.warn(
            f"{where}: {len(refused)} of {len(plans)} tests always fail, an assert in them "
            f"cannot be judged outside the program (test {refused[0][0]}: {refused[0][1]})",
            JudgeWarning,
            stacklevel=3,
        )
    return plans


def _call_based(raw: Mapping, where: str) -> list[TestPlan] | list[dict] | None:
    if "fn_name" not in raw:
        inputs, outputs = raw.get("inputs"), raw.get("outputs")
        if (
            isinstance(inputs, list)
            and isinstance(outputs, list)
            and len(inputs) == len(outputs)
            and all(isinstance(x, str) for x in inputs + outputs)
        ):  # APPS's stdin/stdout form
            return [{"input": i, "output": o} for i, o in zip(inputs, outputs)] or None
        raise ValueError(
            f"{where}: a dict of tests is call-based and needs 'fn_name' (with 'inputs' and "
            f"'outputs'), or holds stdin/stdout strings as 'inputs' and 'outputs' of one length; "
            f"got keys {sorted(map(str, raw))}"
        )
    if raw.get("inputs") == [] and raw.get("outputs") == []:
        return None
    return call_tests(dict(raw), where)


def same_output(got: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""

    def norm(s: str) -> list[str]:
        lines = [line.rstrip() for line in s.replace("\r\n", "\n").split("\n")]
        while lines and not lines[-1]:
            lines.pop()
        return lines

    return norm(got) == norm(expected)


@dataclasses.dataclass(frozen=True)
class CodeExec:
    """The ``code_exec`` reward (module docstring): ``tests_field`` names the tests column,
    ``language`` the code's language (asserts and call-based tests need python), ``scoring``
    fraction | all, ``test_timeout_s`` bounds each step of an assert or call-based test,
    ``sandbox`` the isolation and limits of each run."""

    tests_field: str = "tests"
    language: str = "python"
    scoring: str = "fraction"
    test_timeout_s: float = 5.0
    sandbox: SandboxConfig = SandboxConfig()

    def __post_init__(self):
        check_choice("language", self.language, tuple(LANGUAGES))
        check_choice("scoring", self.scoring, SCORING)
        if not self.test_timeout_s > 0:
            raise ValueError(f"test_timeout_s must be > 0, got {self.test_timeout_s}")

    @property
    def __name__(self) -> str:
        return "code_exec"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        rows = column(fields, self.tests_field, "code_exec")
        tests = [
            self._check_language(parse_tests(raw, self.tests_field, i), i)
            for i, raw in enumerate(rows)
        ]
        return [None if t is None else self.score(c, t) for c, t in zip(completions, tests)]

    def _check_language(self, tests: list | None, row: int | None) -> list | None:
        if tests and isinstance(tests[0], TestPlan) and self.language != "python":
            where = "" if row is None else f"column {self.tests_field!r}, row {row}: "
            raise ValueError(
                f"{where}assert and call-based tests need language 'python', not {self.language!r}"
            )
        return tests

    def time_bound_s(self, fields: Mapping[str, Sequence[Any]]) -> float | None:
        """The most seconds scoring these rows can take in one process: every sandboxed run at
        ``sandbox.wall_s`` + ``RUN_OVERHEAD_S``, one more for the sandbox's start-up probe, and
        ``JUDGE_S`` to judge each run of asserts or call-based tests. None without the tests
        column (the call itself then raises, naming it)."""
        if self.tests_field not in fields:
            return None
        runs = [_runs(raw, self.tests_field, i) for i, raw in enumerate(fields[self.tests_field])]
        judged = sum(judge_s for _, judge_s in runs)
        return (sum(n for n, _ in runs) + 1) * (self.sandbox.wall_s + RUN_OVERHEAD_S) + judged

    def score(self, completion: str, tests: list) -> float:
        """The completion's score on its (parsed, non-empty) tests (``parse_tests``)."""
        k = sum(self.verdicts(completion, tests))
        return k / len(tests) if self.scoring == "fraction" else float(k == len(tests))

    def verdicts(self, completion: str, tests: list) -> list[bool]:
        """Whether the completion passes each of its (parsed, non-empty) tests: all False
        without a code block."""
        self._check_language(tests, None)
        code = last_code_block(completion, LANGUAGES[self.language][0])
        if code is None:
            return [False] * len(tests)
        if isinstance(tests[0], TestPlan):
            return self._run_plans(code, tests)
        return self._run_stdio(code, tests)

    def _run_plans(self, code: str, plans: list[TestPlan]) -> list[bool]:
        """One sandboxed run of the harness over every test's steps; the verdicts judged here."""
        nonce = secrets.token_hex(16)
        files = {
            "solution.py": code,
            "steps.json": json.dumps([p.sandbox_steps() for p in plans]),
            "harness.py": harness(self.test_timeout_s),
        }
        result = sandbox_for(self.sandbox).run(
            files, ["{python}", "-I", "src/harness.py"], stdin=nonce + "\n"
        )
        if result.memory_exceeded:  # a process of the run was killed for memory: no verdict
            return [False] * len(plans)
        budget = Budget()  # the judging of this run's results: JUDGE_S, counted in time_bound_s
        results = read_results(result.stdout, nonce, plans, budget)
        return [passed(p, r, budget) for p, r in zip(plans, results)]

    def _run_stdio(self, code: str, tests: list[dict]) -> list[bool]:
        """One sandboxed run per pair; the expected output stays here."""
        _, name, argv = LANGUAGES[self.language]
        box = sandbox_for(self.sandbox)
        runs = (box.run({name: code}, argv, stdin=t["input"]) for t in tests)
        return [r.ok and same_output(r.stdout, t["output"]) for r, t in zip(runs, tests)]


def _runs(raw: Any, field: str, row: int) -> tuple[int, float]:
    """Sandboxed runs a row's tests take at most (1 for asserts and call-based tests, one per
    stdin/stdout pair, 0 for none; 1 for malformed tests: scoring raises on them), and the
    seconds judging them may take (``JUDGE_S`` for asserts and call-based tests)."""
    try:
        tests = parse_tests(raw, field, row)
    except ValueError:
        return 1, 0.0
    if not tests:
        return 0, 0.0
    return (1, JUDGE_S) if isinstance(tests[0], TestPlan) else (len(tests), 0.0)


code_exec = CodeExec()
