"""code_exec: the completion's code against the row's tests, in the sandbox, scored as documented."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from relax.rewards.code_exec import CodeExec, last_code_block, parse_tests, same_output
from relax.rewards.isolation import works
from relax.rewards.sandbox import NOBODY, SandboxConfig

# a machine with neither bwrap nor unshare cannot run generated code at all (the sandbox refuses)
pytestmark = pytest.mark.skipif(all(works(m, NOBODY, NOBODY) for m in ("bwrap", "unshare")),
                                reason="no namespace isolation here (neither bwrap nor unshare works)")

SANDBOX = SandboxConfig(cpu_s=2, wall_s=4.0, memory_mb=256, max_processes=16)
ASSERTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
STDIO = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"}, {"input": "0 -4\n", "output": "-4"}]


def fenced(code: str, tag: str = "python") -> str:
    return f"Here is my solution.\n```{tag}\n{code}\n```\nDone."


def score(completions, tests, **kw):
    reward = CodeExec(sandbox=SANDBOX, test_timeout_s=0.5, **kw)
    return reward(["p"] * len(completions), completions, tests=[tests] * len(completions))


def test_assert_tests_pass_fail_timeout_crash():
    right = fenced("def add(a, b):\n    return a + b")
    wrong = fenced("def add(a, b):\n    return a * b")  # right on (0, 0) and (2, 2): 2 of 4
    hangs = fenced("def add(a, b):\n    if a < 0:\n        while True:\n            pass\n    return a + b")
    crashes = fenced("import ctypes\nctypes.string_at(0)")  # segfault while loading: nothing passes
    raises = fenced("raise RuntimeError('bad')\ndef add(a, b):\n    return a + b")
    assert score([right, wrong, hangs, crashes, raises], ASSERTS) == [1.0, 0.5, 0.75, 0.0, 0.0]
    assert score([right, wrong, hangs], ASSERTS, scoring="all") == [1.0, 0.0, 0.0]


def test_forged_verdicts_and_early_exit_fail():
    tricks = [
        fenced("print('\\n0 0 1\\n1 1 1\\n2 1 1\\n3 1 1')\ndef add(a, b):\n    return 0"),  # fake verdict lines
        fenced("import sys\nsys.exit(0)"),
        fenced("import os\nos._exit(0)"),
        fenced("def add(a, b):\n    import os\n    os._exit(0)"),
    ]
    assert score(tricks, ASSERTS) == [0.5, 0.0, 0.0, 0.0]  # the first is right on (0, 0) and (-1, 1) only


def test_stdio_tests():
    right = fenced("a, b = map(int, input().split())\nprint(a + b)")
    trailing = fenced("a, b = map(int, input().split())\nprint(a + b, '   ')\nprint()")
    wrong = fenced("a, b = map(int, input().split())\nprint(a - b)")
    exits_1 = fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)")
    assert score([right, trailing, wrong, exits_1], STDIO) == pytest.approx([1.0, 1.0, 0.0, 0.0])
    bash = fenced("read a b\necho $((a + b))", tag="bash")
    assert score([bash], STDIO, language="bash") == [1.0]


def test_missing_and_malformed_tests():
    reward = CodeExec(sandbox=SANDBOX)
    code = fenced("def add(a, b):\n    return a + b")
    assert reward(["p", "p", "p"], [code] * 3, tests=[None, [], json.dumps(ASSERTS[:1])]) == [None, None, 1.0]
    with pytest.raises(ValueError, match=r"column 'tests', row 1: each test"):
        reward(["p", "p"], [code] * 2, tests=[ASSERTS, [1, 2]])
    with pytest.raises(ValueError, match="row 0: tests are not a list"):
        reward(["p"], [code], tests=["assert True"])
    with pytest.raises(KeyError, match="needs the dataset column 'cases'"):
        CodeExec(tests_field="cases", sandbox=SANDBOX)(["p"], [code], tests=[ASSERTS])
    with pytest.raises(ValueError, match="need language 'python'"):
        CodeExec(language="bash", sandbox=SANDBOX)(["p"], [fenced("echo", "bash")], tests=[ASSERTS])


def test_code_block_extraction():
    text = "```python\nfirst\n```\ntext\n```\nsecond\n```\n```js\nthird\n```"
    assert last_code_block(text, ("python", "")) == "second\n"
    assert last_code_block("no code here", ("python", "")) is None
    assert score(["def add(a, b): return a + b"], ASSERTS) == [0.0]  # no fenced block
    assert parse_tests(STDIO, "tests", 0) == STDIO
    assert same_output("1  \n2\n\n", "1\n2") and not same_output("1 2", "12")


def test_pickles():
    reward = CodeExec(sandbox=SANDBOX, scoring="all")
    clone = pickle.loads(pickle.dumps(reward))
    assert clone == reward and clone.__name__ == "code_exec"


def test_time_bound_counts_the_sandboxed_runs():
    reward = CodeExec(sandbox=SandboxConfig(wall_s=4.0))
    rows = [ASSERTS, STDIO, None, json.dumps(STDIO), [], "not json"]  # 1 + 3 + 0 + 3 + 0 + 1 (it raises) runs
    assert reward.time_bound_s({"tests": rows}) == (8 + 1) * (4.0 + 1.0)  # + the start-up probe; 1 s overhead each
    assert reward.time_bound_s({"other": rows}) is None  # the call raises, naming the column


SLOW_ADD = "import time\ntime.sleep(0.7)\ndef add(a, b):\n    return a + b"


@pytest.mark.parametrize("pooled", [True, False])
def test_slow_but_legitimate_samples_outlast_the_reward_timeout(pooled):
    """Three samples of ~0.7 s each in one chunk, each within the sandbox's wall_s, with a 1 s
    --reward-timeout-s: the chunk's timeout is raised to their worst case, and they score."""
    from relax.rewards.functions import RewardFunction, score as score_batch
    from relax.rewards.pool import PoolConfig, RewardPool
    reward = RewardFunction(CodeExec(sandbox=SandboxConfig(cpu_s=2, wall_s=3.0, memory_mb=256, max_processes=16)))
    args = (["p"] * 3, [fenced(SLOW_ADD)] * 3, {"tests": [ASSERTS] * 3})
    if pooled:
        with RewardPool([reward], PoolConfig(num_workers=1, timeout_s=1.0, chunk_size=3)) as pool:
            _, per, info = score_batch([reward], *args, pool=pool)
    else:
        _, per, info = score_batch([reward], *args, timeout_s=1.0)
    assert info["timeouts"] == 0 and info["time_s/code_exec"] > 1.0  # past --reward-timeout-s, not cut
    np.testing.assert_array_equal(per["code_exec"], [1.0, 1.0, 1.0])
