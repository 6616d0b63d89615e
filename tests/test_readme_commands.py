"""The README's commands for the built-in tasks keep working.

``readme_commands`` reads README.md's ```bash blocks and takes every ``python examples/...``
command that needs nothing downloaded: no ``--model`` / ``--data`` / ``--teacher``, no placeholder
(``DIR``, ``HF_DIR``, ``...``). The slow test runs each of them in a subprocess, shrunk by flags
appended after the README's own (``shrink``: 2 steps, a small evaluation, the task's supervised
phase shortened), and checks that it exits 0 and writes ``summary.json``. The fast tests check
that the extraction finds the commands it should (a reformatted README must not leave the slow
test with nothing to run) and that every command, shrink flags included, parses with its
script's own command line without running it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NEEDS_DOWNLOADS = (
    "--model",
    "--data",
    "--teacher",
    "DIR",
    "...",
)  # a real model or data, or a placeholder
# Clients of a running `python -m relax.serve`: tests/test_serve_loop.py runs them against a server.
SERVICE_CLIENTS = ("examples/serve_grpo.py",)
SFT_STEPS = "20"
# Commands the README shows for the built-in tasks: each must be found (a subset, by script and flags).
EXPECTED = [
    ["examples/train_grpo.py"],  # make demo
    ["examples/train_grpo.py", "--task", "math"],
    ["examples/train_grpo.py", "--task", "code"],
    ["examples/train_agent.py"],
    ["examples/train_agent.py", "--algorithm", "ppo", "--ppo.critic", "shared"],
    [
        "examples/train_agent.py",
        "--agent.per-turn",
        "--task.max-turns",
        "4",
        "--agent.max-turns",
        "4",
    ],
    ["examples/train_grpo.py", "--async.staleness", "1"],
    ["examples/train_ppo.py"],
    *[
        [f"examples/train_{name}.py"]
        for name in ("sft", "dpo", "orpo", "kto", "reward_model", "distill")
    ],
    ["examples/train_grpo.py", "--lora.rank", "8", "--grpo.optimizer.learning-rate", "5e-3"],
]


def bash_lines(text: str) -> list[str]:
    """The lines of every ```bash block, continuation lines (ending in a backslash) joined."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        block = re.sub(r"\\\n\s*", " ", block)
        lines += [line.strip() for line in block.splitlines() if line.strip()]
    return lines


def make_recipe(target: str) -> str:
    """The first recipe line of a Makefile target, ``$(PY)`` read as ``python``."""
    found = re.search(
        rf"^{target}:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE
    )
    assert found, f"Makefile has no target {target!r}"
    return found.group(1).replace("$(PY)", "python")


def readme_commands(text: str) -> tuple[list[list[str]], list[str]]:
    """``(runnable, left_out)``: the ``python examples/...`` commands (``make demo``: its recipe)
    as argv without the interpreter (comments dropped), and the lines of such commands that need
    downloads."""
    runnable, left_out = [], []
    for line in bash_lines(text):
        if line.split("#")[0].split() == ["make", "demo"]:
            line = make_recipe("demo")
        words = line.split()
        at = next((i for i, w in enumerate(words[:3]) if w.startswith("examples/")), None)
        if (
            at is None
            or at == 0
            or not re.fullmatch(r"(\S*/)?python3?", words[at - 1])
            or words[at] in SERVICE_CLIENTS
        ):
            continue
        if any(marker in line.split("#")[0] for marker in NEEDS_DOWNLOADS):
            left_out.append(line)
            continue
        runnable.append(shlex.split(line, comments=True)[at:])
    return runnable, left_out


def flag(argv: list[str], name: str, default: str) -> str:
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name), default)


def shrink(argv: list[str], run_dir: Path) -> list[str]:
    """Flags that make the command ``argv`` (script first) small: 2 steps, a small evaluation, the
    built-in task's supervised phase shortened, its own run directory."""
    script = Path(argv[0]).stem
    common = [
        "--steps",
        "2",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    if script in ("train_grpo", "train_ppo"):
        task = flag(argv, "--task", "reverse")
        return common + [
            "--batch-size",
            "4",
            "--eval-max-prompts",
            "8",
            f"--{task}.sft-steps",
            SFT_STEPS,
        ]
    if script == "train_agent":
        return common + [
            "--batch-size",
            "2",
            "--task.sft-steps",
            SFT_STEPS,
            "--task.sft-batch",
            "8",
            "--task.num-train",
            "64",
            "--task.num-eval",
            "8",
        ]
    return common + [
        "--batch-size",
        "4",
        "--eval-max-examples",
        "16",
        "--reverse.sft-steps",
        SFT_STEPS,
    ]


class _Parsed(Exception):
    """Raised by the patched ``tyro.cli`` with the config a script built: parsed, not run."""

    def __init__(self, config):
        super().__init__("parsed")
        self.config = config


def parse(argv: list[str], monkeypatch) -> object:
    """The config ``argv``'s script builds from its flags (its own ``main``; nothing runs)."""
    import tyro

    path = ROOT / argv[0]
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real_cli = tyro.cli

    def cli(*args, **kwargs):
        raise _Parsed(real_cli(*args, **kwargs))

    monkeypatch.setattr(tyro, "cli", cli)
    try:
        module.main(argv[1:])
    except _Parsed as parsed:
        return parsed.config
    finally:
        monkeypatch.setattr(tyro, "cli", real_cli)
    raise AssertionError(f"{argv[0]}'s main did not parse its flags with tyro.cli")


COMMANDS, LEFT_OUT = readme_commands(README.read_text())


def test_extraction_finds_the_readme_commands():
    for expected in EXPECTED:
        assert expected in COMMANDS, (
            f"README.md no longer shows `python {' '.join(expected)}` in a ```bash block"
        )
    assert len(COMMANDS) >= len(EXPECTED)
    assert all((ROOT / argv[0]).is_file() for argv in COMMANDS)
    assert LEFT_OUT and all(any(m in line for m in NEEDS_DOWNLOADS) for line in LEFT_OUT)
    text = "```bash\npython examples/train_x.py --a 1 \\\n    --b 2   # a comment\npip install x\n```\n"
    assert readme_commands(text) == ([["examples/train_x.py", "--a", "1", "--b", "2"]], [])


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_each_command_parses_with_its_shrink_flags(argv, monkeypatch, tmp_path):
    config = parse(argv + shrink(argv, tmp_path / "run"), monkeypatch)
    assert config.steps == 2 and config.run_dir == str(tmp_path / "run")


@pytest.mark.slow
@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
def test_each_command_runs(argv, tmp_path):
    if (
        "--task" in argv
        and flag(argv, "--task", "") == "math"
        and importlib.util.find_spec("math_verify") is None
    ):
        pytest.skip(
            "--task math needs math-verify: pip install -e '.[math]' (the README's line before it)"
        )
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, *argv, *shrink(argv, run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (
        f"`python {' '.join(argv)}` exited {done.returncode}:\n{done.stderr[-4000:]}"
    )
    assert (run_dir / "summary.json").is_file()
