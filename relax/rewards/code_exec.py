"""``code_exec``: run the completion's code against the row's tests, in the sandbox.

    reward = CodeExec(tests_field="tests", scoring="fraction", sandbox=SandboxConfig(wall_s=10))
    reward(prompts, completions, tests=[...])            # TRL's signature; one value per completion

The code is the completion's LAST fenced block whose language tag is one of the language's
names (``python``, ``py``, ``python3``) or empty; a completion without one scores 0.0. The tests of a
row (column ``tests_field``; a list, or its JSON text) are either

- assert-based: a list of code strings (``"assert add(1, 2) == 3"``), Python only. One sandboxed
  process runs the code, then each test in turn with at most ``test_timeout_s`` seconds each
  (SIGALRM); a test passes when it completes without raising. A solution that raises (``SystemExit``
  included) passes nothing; the harness reports each verdict on a line stamped with a random
  nonce, so printed fake verdicts, ``sys.exit(0)`` and ``os._exit(0)`` count as failures;
- stdin/stdout pairs: a list of ``{"input": str, "output": str}``. One sandboxed process per pair; it
  passes when the program exits 0 within the limits and its output equals the expected output
  up to trailing whitespace on each line and trailing blank lines.

Score of a completion with T tests of which k pass::

    scoring="fraction":  r = k / T            scoring="all":  r = 1.0 if k == T else 0.0

Time: a row costs at most one sandboxed run (asserts) or one per pair (stdin/stdout), each killed
at ``sandbox.wall_s``; ``time_bound_s(fields)`` adds them up (plus ``RUN_OVERHEAD_S`` per run and
one run for the sandbox's start-up probe), and the reward pool and ``score`` wait at least that
long for a chunk (``relax.rewards.functions.call_timeout_s``), so slow but legitimate samples
are not cut by ``--reward-timeout-s``.

A timeout or crash fails the tests it did not complete; rows whose tests are None or empty are
missing (None). Rows with malformed tests raise ``ValueError`` naming the column, the row and the
problem. The verdicts come from inside the sandbox: code that inspects the harness (its frames,
the garbage collector) can forge them; the sandbox bounds what code can do, not what it claims.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from relax.choices import check_choice
from relax.rewards.columns import column
from relax.rewards.sandbox import SandboxConfig, SandboxResult, sandbox_for

SCORING = ("fraction", "all")
LANGUAGES = {  # name -> (fence tags, file name, command)
    "python": (("python", "py", "python3", ""), "solution.py", ("{python}", "-I", "src/solution.py")),
    "bash": (("bash", "sh", "shell", ""), "solution.sh", ("bash", "src/solution.sh")),
}
RUN_OVERHEAD_S = 1.0  # a sandboxed run's start (namespaces, interpreter) and teardown beyond its wall_s
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = """\
import json, signal, sys
nonce = sys.stdin.readline().strip()
sys.stdin.close()
out = sys.__stdout__
def alarm(signum, frame):
    raise TimeoutError("test timed out")
signal.signal(signal.SIGALRM, alarm)
tests = json.load(open("src/tests.json"))
scope = {"__name__": "__solution__"}
try:
    exec(compile(open("src/solution.py").read(), "solution.py", "exec"), scope)
except BaseException:
    sys.exit(0)
for i, test in enumerate(tests):
    signal.setitimer(signal.ITIMER_REAL, %(timeout)r)
    try:
        exec(compile(test, "test_%%d" %% i, "exec"), scope)
        passed = True
    except BaseException:
        passed = False
    signal.setitimer(signal.ITIMER_REAL, 0)
    out.write("\\n%%s %%d %%d\\n" %% (nonce, i, passed))
    out.flush()
"""


def last_code_block(text: str, tags: Sequence[str]) -> str | None:
    """The body of the last fenced block (```tag ... ```) whose tag is in ``tags``, or None."""
    blocks = [m.group(2) for m in _FENCE.finditer(text) if m.group(1).lower() in tags]
    return blocks[-1] if blocks else None


def parse_tests(raw: Any, field: str, row: int) -> list | None:
    """A row's tests as a list of assert strings or of ``{"input", "output"}`` dicts (one kind);
    None when there are none."""
    if raw is None:
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"column {field!r}, row {row}: tests are not a list or its JSON ({exc})") from None
    if not isinstance(raw, (list, tuple)):
        raise ValueError(f"column {field!r}, row {row}: tests must be a list, got {type(raw).__name__}")
    if not raw:
        return None
    if all(isinstance(t, str) for t in raw):
        return list(raw)
    if all(isinstance(t, dict) and {"input", "output"} <= set(t) for t in raw):
        return [{"input": str(t["input"]), "output": str(t["output"])} for t in raw]
    raise ValueError(f"column {field!r}, row {row}: each test must be an assert string, or every test a dict "
                     "with 'input' and 'output'")


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
    ``language`` the code's language (assert tests need python), ``scoring`` fraction | all,
    ``test_timeout_s`` bounds each assert test, ``sandbox`` the isolation and limits of each run."""

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

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        tests = [parse_tests(t, self.tests_field, i) for i, t in enumerate(column(fields, self.tests_field, "code_exec"))]
        return [None if t is None else self.score(c, t) for c, t in zip(completions, tests)]

    def time_bound_s(self, fields: Mapping[str, Sequence[Any]]) -> float | None:
        """The most seconds scoring these rows can take in one process: every sandboxed run at
        ``sandbox.wall_s`` + ``RUN_OVERHEAD_S``, one more for the sandbox's start-up probe. None
        without the tests column (the call itself then raises, naming it)."""
        if self.tests_field not in fields:
            return None
        runs = sum(_runs(raw, self.tests_field, i) for i, raw in enumerate(fields[self.tests_field]))
        return (runs + 1) * (self.sandbox.wall_s + RUN_OVERHEAD_S)

    def score(self, completion: str, tests: list) -> float:
        """The completion's score on its (parsed, non-empty) tests."""
        tags, _, _ = LANGUAGES[self.language]
        code = last_code_block(completion, tags)
        if code is None:
            return 0.0
        passed = self._run_asserts(code, tests) if isinstance(tests[0], str) else self._run_stdio(code, tests)
        k = sum(passed)
        return k / len(tests) if self.scoring == "fraction" else float(k == len(tests))

    def _run_asserts(self, code: str, tests: list[str]) -> list[bool]:
        if self.language != "python":
            raise ValueError(f"assert-based tests need language 'python', not {self.language!r}")
        nonce = secrets.token_hex(16)
        files = {"solution.py": code, "tests.json": json.dumps(tests),
                 "harness.py": _HARNESS % {"timeout": self.test_timeout_s}}
        result = sandbox_for(self.sandbox).run(files, ["{python}", "-I", "src/harness.py"], stdin=nonce + "\n")
        return verdicts(result, nonce, len(tests))

    def _run_stdio(self, code: str, tests: list[dict]) -> list[bool]:
        _, name, argv = LANGUAGES[self.language]
        box = sandbox_for(self.sandbox)
        runs = (box.run({name: code}, argv, stdin=t["input"]) for t in tests)
        return [r.ok and same_output(r.stdout, t["output"]) for r, t in zip(runs, tests)]


def _runs(raw: Any, field: str, row: int) -> int:
    """Sandboxed runs a row's tests take at most: 1 for asserts, one per stdin/stdout pair, 0 for
    none; 1 for malformed tests (scoring raises on them)."""
    try:
        tests = parse_tests(raw, field, row)
    except ValueError:
        return 1
    if not tests:
        return 0
    return 1 if isinstance(tests[0], str) else len(tests)


def verdicts(result: SandboxResult, nonce: str, n: int) -> list[bool]:
    """Per-test verdicts from the harness's nonce-stamped lines (absent: failed)."""
    passed = [False] * n
    for line in result.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == nonce and parts[1].isdigit() and int(parts[1]) < n:
            passed[int(parts[1])] = parts[2] == "1"
    return passed


code_exec = CodeExec()
