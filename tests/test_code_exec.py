"""code_exec: the completion's code against the row's tests, in the sandbox, scored as documented;
and the red-team suite of the judge (each attack a real program, through CodeExec and the real
sandbox, under every isolation mechanism this machine has)."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from relax.rewards import judge
from relax.rewards.code_exec import CodeExec, last_code_block, parse_tests, same_output
from relax.rewards.isolation import SandboxUnavailable, works
from relax.rewards.sandbox import NOBODY, SandboxConfig, sandbox_for

# a machine with neither bwrap nor unshare cannot run generated code at all (the sandbox refuses)
pytestmark = pytest.mark.skipif(
    all(works(m, NOBODY, NOBODY) for m in ("bwrap", "unshare")),
    reason="no namespace isolation here (neither bwrap nor unshare works)",
)

SANDBOX = SandboxConfig(cpu_s=2, wall_s=4.0, memory_mb=256, max_processes=16, tmpfs_mb=8)
ASSERTS = [
    "assert add(1, 2) == 3",
    "assert add(0, 0) == 0",
    "assert add(-1, 1) == 0",
    "assert add(2, 2) == 4",
]
STDIO = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "5 5", "output": "10"},
    {"input": "0 -4\n", "output": "-4"},
]
CALLS = {"fn_name": "add", "inputs": [[1, 2], [5, 5], [-4, 9]], "outputs": [3, 10, 5]}


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nDone."


def score(completions, tests, **kw):
    reward = CodeExec(sandbox=SANDBOX, test_timeout_s=0.5, **kw)
    return reward(["p"] * len(completions), completions, tests=[tests] * len(completions))


def test_assert_tests_pass_fail_timeout_crash():
    right = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return a * b")  # right on (0, 0) and (2, 2): 2 of 4
    hangs = fenced(
        "def add(a, b):\n    if a < 0:\n        while True:\n            pass\n    return a + b"
    )
    crashes = fenced("import ctypes\nctypes.string_at(0)")  # segfault while loading: nothing passes
    raises = fenced("raise RuntimeError('bad')\ndef add(a, b):\n    return a + b")
    assert score([right, wrong, hangs, crashes, raises], ASSERTS) == [1.0, 0.5, 0.75, 0.0, 0.0]
    assert score([right, wrong, hangs], ASSERTS, scoring="all") == [1.0, 0.0, 0.0]


def test_forged_verdicts_and_early_exit_fail():
    tricks = [
        fenced(
            "print('\\n0 0 1\\n1 1 1\\n2 1 1\\n3 1 1')\ndef add(a, b):\n    return 0"
        ),  # lines without the nonce
        fenced("import sys\nsys.exit(0)"),
        fenced("import os\nos._exit(0)"),
        fenced("def add(a, b):\n    import os\n    os._exit(0)"),
    ]
    assert score(tricks, ASSERTS) == [
        0.5,
        0.0,
        0.0,
        0.0,
    ]  # the first is right on (0, 0) and (-1, 1) only


def test_stdio_tests():
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    trailing = fenced("a, b = map(int, input().split())\nprint(a + b, '   ')\nprint()")
    wrong = fenced("a, b = map(int, input().split())\nprint(a - b)")
    exits_1 = fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)")
    assert score([right, trailing, wrong, exits_1], STDIO) == pytest.approx([1.0, 1.0, 0.0, 0.0])
    bash = fenced("read a b\necho $((a + b))", tag="bash")
    assert score([bash], STDIO, language="bash") == [1.0]


def test_call_based_tests():
    right = fenced("def add(a, b):\n    return a + b")
    method = fenced(
        "class Solution:\n    def add(self, a, b):\n        return a + b"
    )  # LeetCode style
    wrong = fenced("def add(a, b):\n    return a * b if a > 0 else a + b")  # right on (-4, 9) only
    tuple_back = fenced("def add(a, b):\n    return (a + b,)")  # a tuple is not the list [3]
    assert score([right, method, wrong, tuple_back], CALLS) == pytest.approx([1.0, 1.0, 1 / 3, 0.0])
    apps = json.dumps(
        {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], [5]]}
    )  # APPS input_output
    assert score([right], apps) == pytest.approx(
        [0.5]
    )  # [3] matches 3 (APPS's one-element list); 4 != 5


def test_apps_stdin_dict_reads_as_pairs():
    """APPS's ``input_output`` without ``fn_name``: stdin/stdout strings, the same as a list of pairs."""
    assert parse_tests(
        json.dumps({"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}), "t", 0
    ) == [{"input": "1 2\n", "output": "3\n"}, {"input": "3 4\n", "output": "7\n"}]


def test_missing_and_malformed_tests():
    reward = CodeExec(sandbox=SANDBOX)
    code = fenced("def add(a, b):\n    return a + b")
    empty_calls = {"fn_name": "add", "inputs": [], "outputs": []}
    assert reward(
        ["p"] * 5, [code] * 5, tests=[None, [], json.dumps(ASSERTS[:1]), "null", empty_calls]
    ) == [None, None, 1.0, None, None]
    bad = {
        r"column 'tests', row 1: each test": [1, 2],
        r"row 1: tests are not a list, a dict or its JSON": "assert True",
        r"row 1: tests must be a list or a dict, got int": 7,
        r"column 'tests', row 1, test 1: test 'print\(add\(1, 2\)\)' has no assert": [
            "assert True",
            "print(add(1, 2))",
        ],
        r"row 1, test 0: test does not parse": ["assert add(1, 2) =="],
        r"row 1: a dict of tests is call-based and needs 'fn_name'": {
            "inputs": [[1, 2]],
            "outputs": [3],
        },
        r"row 1: fn_name must be a Python identifier": {
            "fn_name": "os.system",
            "inputs": [[1]],
            "outputs": [1],
        },
        r"row 1: inputs and outputs must be non-empty lists of the same length": {
            **CALLS,
            "outputs": [3],
        },
    }
    for message, tests in bad.items():
        with pytest.raises(ValueError, match=message):
            reward(["p", "p"], [code] * 2, tests=[ASSERTS, tests])
    with pytest.raises(judge.JudgeError, match="row 0, test 0"):  # JudgeError is a ValueError
        reward(["p"], [code], tests=[["x = 1"]])
    with pytest.raises(KeyError, match="needs the dataset column 'cases'"):
        CodeExec(tests_field="cases", sandbox=SANDBOX)(["p"], [code], tests=[ASSERTS])
    for tests in (ASSERTS, CALLS):
        with pytest.raises(
            ValueError, match="row 0: assert and call-based tests need language 'python'"
        ):
            CodeExec(language="bash", sandbox=SANDBOX)(
                ["p"], [fenced("echo", "bash")], tests=[tests]
            )


def test_code_block_extraction():
    text = "```python\nfirst\n```\ntext\n```\nsecond\n```\n```js\nthird\n```"
    assert last_code_block(text, ("python", "")) == "second\n"
    assert last_code_block("no code here", ("python", "")) is None
    assert score(["def add(a, b): return a + b"], ASSERTS) == [0.0]  # no fenced block
    assert parse_tests(STDIO, "tests", 0) == STDIO
    plans = parse_tests(json.dumps(ASSERTS), "tests", 0)
    assert all(isinstance(p, judge.TestPlan) for p in plans) and plans[0].probes == ["add(1, 2)"]
    assert [p.probes for p in parse_tests(CALLS, "tests", 0)][0] == [
        "__call__('add', __decode__('{\"l\": [1, 2]}'))"
    ]
    assert same_output("1  \n2\n\n", "1\n2") and not same_output("1 2", "12")


def test_pickles():
    reward = CodeExec(sandbox=SANDBOX, scoring="all")
    clone = pickle.loads(pickle.dumps(reward))
    assert clone == reward and clone.__name__ == "code_exec"


def test_time_bound_counts_the_sandboxed_runs():
    reward = CodeExec(sandbox=SandboxConfig(wall_s=4.0))
    rows = [ASSERTS, STDIO, None, json.dumps(STDIO), [], "not json", CALLS, json.dumps(CALLS)]
    # 1 + 3 + 0 + 3 + 0 + 1 (it raises) + 1 + 1 runs, + the start-up probe; 1 s overhead each;
    # and the judging of the 3 runs of asserts or call-based tests
    assert reward.time_bound_s({"tests": rows}) == (10 + 1) * (4.0 + 1.0) + 3 * judge.JUDGE_S
    assert reward.time_bound_s({"other": rows}) is None  # the call raises, naming the column


SLOW_ADD = "import time\ntime.sleep(0.7)\ndef add(a, b):\n    return a + b"


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.slow
def test_slow_but_legitimate_samples_outlast_the_reward_timeout(pooled):
    """Three samples of ~0.7 s each in one chunk, each within the sandbox's wall_s, with a 1 s
    --reward-timeout-s: the chunk's timeout is raised to their worst case, and they score."""
    from relax.rewards.functions import RewardFunction
    from relax.rewards.functions import score as score_batch
    from relax.rewards.pool import PoolConfig, RewardPool

    reward = RewardFunction(
        CodeExec(
            sandbox=SandboxConfig(cpu_s=2, wall_s=3.0, memory_mb=256, max_processes=16, tmpfs_mb=8)
        )
    )
    args = (["p"] * 3, [fenced(SLOW_ADD)] * 3, {"tests": [ASSERTS] * 3})
    if pooled:
        with RewardPool([reward], PoolConfig(num_workers=1, timeout_s=1.0, chunk_size=3)) as pool:
            _, per, info = score_batch([reward], *args, pool=pool)
    else:
        _, per, info = score_batch([reward], *args, timeout_s=1.0)
    assert (
        info["timeouts"] == 0 and info["time_s/code_exec"] > 1.0
    )  # past --reward-timeout-s, not cut
    np.testing.assert_array_equal(per["code_exec"], [1.0, 1.0, 1.0])


# ------------------------------------------------------------------------------ red team: the judge
# Each attack is a program that defines a WRONG add() (a * b: wrong on every case of ADD and of
# CALLS) and tries to score anyway; the right add() scores 1.0 in the same call. The old harness
# (verdicts reported from inside the sandbox, the asserts in the sandbox's tests.json) gave each
# of these 1.0. Which mechanism stops what: relax/rewards/code_exec.py's docstring.

ADD = ["assert add(1, 2) == 3", "assert add(5, 5) == 10", "assert add(-4, 9) == 5"]
WRONG = "def add(a, b):\n    return a * b\n"
RIGHT = "def add(a, b):\n    return a + b\n"
# what a lookup-table attack looks for: "add(1, 2) == 3" anywhere it can read
LOOKUP = r"add\((-?\d+), ?(-?\d+)\)\s*==\s*(-?\d+)"
ATTACKS = {
    "rewrite the steps through __main__": "import __main__\n"
    "__main__.steps[:] = [[{'probes': ['True']}] for _ in __main__.steps]\n" + WRONG,
    "gc: rewrite every step dict": "import gc\n"
    "for o in gc.get_objects():\n"
    "    if type(o) is dict and 'probes' in o:\n        o['probes'] = ['True' for _ in o['probes']]\n"
    "    elif type(o) is dict and 'exec' in o:\n        o['exec'] = 'pass'\n" + WRONG,
    "gc: clear every list": "import gc\nfor o in gc.get_objects():\n    if type(o) is list:\n        o.clear()\n"
    + WRONG,
    "sys._getframe up to the harness": "import sys\n"
    "def add(a, b):\n    f = sys._getframe()\n"
    "    while f is not None and 'nonce' not in f.f_globals:\n        f = f.f_back\n"
    "    f.f_globals['plain'] = lambda v, depth=0: True\n"
    "    f.f_globals['steps'][:] = [[{'exec': 'pass'}]] * len(f.f_globals['steps'])\n"
    "    return a * b\n",
    "replace builtins.compile": "import builtins\n_compile = builtins.compile\n"
    "builtins.compile = lambda src, name, mode, *a, **k: _compile('True' if mode == 'eval' else 'pass', name, mode)\n"
    + WRONG,
    "replace builtins.eval": "import builtins\nbuiltins.eval = lambda *a, **k: True\n" + WRONG,
    "replace json.dumps": "import json, __main__\n"
    'json.dumps = __main__.dumps = lambda *a, **k: \'{"ok": true, "values": [true]}\'\n' + WRONG,
    "atexit(os._exit, 0) + sys.exit(0)": "import atexit, os, sys\natexit.register(os._exit, 0)\n"
    + WRONG
    + "sys.exit(0)\n",
    "os._exit(0) mid-test": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "always-true __eq__": "class Anything:\n    def __eq__(self, other):\n        return True\n"
    "    def __ne__(self, other):\n        return False\n    __hash__ = object.__hash__\n"
    "def add(a, b):\n    return Anything()\n",
    "int subclass": "class Int(int):\n    def __eq__(self, other):\n        return True\n"
    "    __hash__ = int.__hash__\ndef add(a, b):\n    return Int(a * b)\n",
    "lookup table from every file in the working directory (steps.json too)": "import os, re\ntable = {}\n"
    "for root, _, names in os.walk('.'):\n    for name in names:\n"
    "        text = open(os.path.join(root, name), errors='ignore').read()\n"
    f"        for a, b, c in re.findall({LOOKUP!r}, text):\n"
    "            table[int(a), int(b)] = int(c)\n"
    "def add(a, b):\n    return table.get((a, b), a * b)\n",
    "forged lines with the nonce from __main__": "import __main__, sys\nn = __main__.nonce\n"
    'claims = [\'{"ok": true}\', \'{"ok": true, "values": [true]}\']\n'
    'claims += [\'{"ok": true, "values": [%d]}\' % v for v in range(-20, 21)]\n'
    "for t in range(3):\n    for c in claims:\n        sys.__stdout__.write(f'\\n{n} {t} 0 {c}\\n')\n"
    "sys.__stdout__.flush()\n" + WRONG,
}


def _mechanism_config(mechanism: str) -> SandboxConfig:
    """A working sandbox of ``mechanism``, or the test skips."""
    if works(mechanism, NOBODY, NOBODY) is not None:
        pytest.skip(f"{mechanism}: {works(mechanism, NOBODY, NOBODY)}")
    cfg = SandboxConfig(
        isolation=mechanism, cpu_s=2, wall_s=4.0, memory_mb=256, max_processes=16, tmpfs_mb=8
    )
    try:
        sandbox_for(cfg)
    except (
        SandboxUnavailable
    ) as exc:  # e.g. unshare as a non-root trainer (its own uid): refused by default
        pytest.skip(f"{mechanism}: {exc}")
    return cfg


# What each attack does to the harness, seen in the harness's first two lines for ADD (None: no
# line): the attack ran and took effect, and still scores nothing (test_attacks_on_the_judge_...).
TRUE, OK = '{"ok": true, "values": [true]}', '{"ok": true}'
RAISED = '{"ok": true, "values": [{"e": 0}]}'
EFFECT = {
    "rewrite the steps through __main__": (TRUE, TRUE),  # its probes now evaluate True
    "gc: rewrite every step dict": (TRUE, TRUE),
    "gc: clear every list": (None, None),  # the harness has no steps left
    "sys._getframe up to the harness": (
        '{"ok": true, "values": [2]}',
        OK,
    ),  # then steps without probes
    "replace builtins.compile": (TRUE, TRUE),
    "replace builtins.eval": (TRUE, TRUE),
    "replace json.dumps": (TRUE, TRUE),
    "atexit(os._exit, 0) + sys.exit(0)": (None, None),
    "os._exit(0) mid-test": (None, None),
    "always-true __eq__": (RAISED, RAISED),  # not plain data: the probe's mark, read as failed
    "int subclass": (RAISED, RAISED),
    "lookup table from every file in the working directory (steps.json too)": (
        '{"ok": true, "values": [2]}',
        '{"ok": true, "values": [25]}',
    ),
    "forged lines with the nonce from __main__": (OK, TRUE),  # its own claims come first
}


def test_each_attack_takes_effect(tmp_path):
    """The attacks run as written (not a syntax error scoring 0.0 by accident): the harness, run
    with each here as a plain subprocess, shows its effect. The lookup finds every expected value
    where the asserts are in its reach (the old harness's tests.json) and none in steps.json."""
    assert len(re.findall(LOOKUP, json.dumps(ADD))) == len(ADD)
    plans = parse_tests(ADD, "tests", 0)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "steps.json").write_text(json.dumps([p.sandbox_steps() for p in plans]))
    (tmp_path / "src" / "harness.py").write_text(judge.harness(0.5))
    assert set(EFFECT) == set(ATTACKS)
    for name, code in ATTACKS.items():
        (tmp_path / "src" / "solution.py").write_text(code)
        out = subprocess.run(
            [sys.executable, "-I", "src/harness.py"],
            input="n0nce\n",
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        lines = [line.split(" ", 3)[3] for line in out.splitlines() if line.startswith("n0nce ")]
        assert tuple(lines[:2] + [None, None])[:2] == EFFECT[name], name


@pytest.mark.parametrize("mechanism", ["bwrap", "unshare"])
def test_attacks_on_the_judge_score_nothing(mechanism):
    """Every attack of ATTACKS, on an assert row and on a call-based row, in one CodeExec call."""
    reward = CodeExec(sandbox=_mechanism_config(mechanism), test_timeout_s=0.5)
    programs = [*ATTACKS.values(), RIGHT]
    rows = [ADD, CALLS]
    completions = [fenced(p) for p in programs for _ in rows]
    got = reward(["p"] * len(completions), completions, tests=rows * len(programs))
    scores = {
        (name, kind): got[2 * i + j]
        for i, name in enumerate([*ATTACKS, "right"])
        for j, kind in enumerate(["asserts", "call-based"])
    }
    assert scores == {key: 1.0 if key[0] == "right" else 0.0 for key in scores}


def _dataset_thieves(path: Path) -> dict[str, str]:
    """Programs that open the dataset by its absolute path and return / print the expected output
    they find there for their input (a * b, wrong, when they cannot)."""
    stdio = (
        "import json\na, b = map(int, input().split())\nfound = a * b\ntry:\n"
        f"    for line in open({str(path)!r}):\n        for t in json.loads(line)['tests']:\n"
        "            if isinstance(t, dict) and t['input'].split() == [str(a), str(b)]:\n"
        "                found = t['output']\nexcept OSError:\n    pass\nprint(found)\n"
    )
    calls = (
        "import json\ndef add(a, b):\n    try:\n"
        f"        for line in open({str(path)!r}):\n            t = json.loads(line)['tests']\n"
        "            if isinstance(t, dict):\n                return dict(zip(map(tuple, t['inputs']), "
        "t['outputs']))[(a, b)]\n    except OSError:\n        pass\n    return a * b\n"
    )
    return {"stdio": stdio, "call-based": calls}


@pytest.fixture
def dataset():
    """The dataset, world-readable, as a training run's data would be. (pytest's tmp_path is under
    /tmp/pytest-of-<user>, mode 0700: it would hide the file from ``nobody`` by accident.)"""
    with tempfile.TemporaryDirectory(prefix="relax-dataset-") as folder:
        os.chmod(folder, 0o755)
        path = Path(folder) / "rows.jsonl"
        path.write_text(
            "".join(json.dumps({"prompt": "add", "tests": t}) + "\n" for t in (STDIO, CALLS))
        )
        path.chmod(0o644)
        yield path


@pytest.mark.parametrize("mechanism", ["bwrap", "unshare"])
def test_a_program_that_reads_the_dataset(mechanism, dataset):
    """The expected outputs of stdin/stdout and call-based rows never enter the sandbox; a copy of
    the dataset in the program's view gives them away, and only then do the thieves score."""
    thieves = _dataset_thieves(dataset)
    host = subprocess.run(
        [sys.executable, "-c", thieves["stdio"]], input="5 5\n", capture_output=True, text=True
    )
    assert (
        host.stdout == "10\n"
    )  # the attack works where the file is in view (a * b would print 25)
    cfg = _mechanism_config(mechanism)
    look = sandbox_for(cfg).run(
        {"look.py": f"import os\nprint(os.path.exists({str(dataset)!r}))"},
        ["{python}", "-I", "src/look.py"],
    )
    assert look.stdout == "False\n"  # not mounted, under either mechanism
    reward = CodeExec(sandbox=cfg, test_timeout_s=0.5)
    right = "a, b = map(int, input().split())\nprint(a + b)\n"
    completions = [fenced(c) for c in (thieves["stdio"], thieves["call-based"], right, RIGHT)]
    got = reward(["p"] * 4, completions, tests=[STDIO, CALLS, STDIO, CALLS])
    # out of view, the thieves fall back to a * b: wrong, and scored so
    assert got == [0.0, 0.0, 1.0, 1.0]
