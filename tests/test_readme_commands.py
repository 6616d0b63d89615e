"""Every command in README.md and docs/ is parsed (and the built-in-task ones run) by a test.

``doc_lines`` reads the ```bash blocks of README.md and of every page under docs/ (continuation
lines joined, comments dropped) and ``classify`` sorts each line into one kind, by these rules; a
line that fits none fails ``test_every_line_is_checked``:

* ``relax <command> FLAGS``, ``python examples/<script>.py FLAGS`` (the same command: ``SCRIPTS``),
  ``python -m relax <command>``, ``python -m relax.serve`` / ``relax.plan`` (any path before
  ``relax`` / ``python``, environment assignments before it): parsed with the command's own
  parser, nothing run. A trainer's flags go through ``relax.commands.COMMANDS[name].parse`` (a
  ``--model`` / ``--data`` that names files not downloaded still parses: only the flags are
  read); ``relax serve`` through tyro on ``ServeConfig`` (needs the ``serve`` extra, skipped
  without it); ``relax plan <algorithm>`` through ``relax.plan.plan.parse_run`` with its
  ``--target`` checked by ``Target.parse`` (or a chip kind of ``relax.plan.search.SLICES``);
  ``relax --help`` / ``relax <command> --help`` by the command's existence;
  ``examples/serve_grpo.py`` (a client of a running service) through tyro on its ``LoopConfig``.
  ``...`` stands for the run's other flags and is dropped before parsing.
* ``make <target>``: the Makefile has the target (``make demo`` is also its recipe's command).
* ``pip install``: every ``-e '.[a,b]'`` extra is one of pyproject.toml's, and a pinned
  ``jax...==V`` is pyproject's jax version; ``source <venv>/bin/activate``; ``python3 -m venv``.
* ``hf download ... --local-dir D`` / ``hf auth login``: on each page, every ``--model`` /
  ``--data`` / ``--eval-data`` under ``models/`` or ``data/`` lies in a directory a ``hf
  download`` line of that page fills.
* ``python benchmarks/<script>.py``: the script exists; ``python -m pytest ... tests/x.py``: the
  test files exist.

The slow test runs each trainer command that needs nothing downloaded (``runnable``: no
``--model`` / ``--data`` / ``--teacher``, no placeholder such as ``DIR`` or ``...``, not
``--resume``, ``--eval-only`` or ``--help``; not ``relax rlhf``, which chains three runs:
``tests/test_rlhf.py`` runs it; nor those ``RUN_ELSEWHERE`` names, which another slow test runs
through the same example on the same task), each distinct command once, as its example script in a
subprocess, shrunk by flags appended after the page's own (``shrink``: 2 steps, a small
evaluation, the task's supervised phase shortened), and checks that it exits 0 and writes
``summary.json``. The fast tests check that the extraction finds the commands it should
(``EXPECTED``: a reformatted page must not leave the slow test with nothing to run) and
that every command, shrink flags included, parses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# The example script that is the same command as `relax <name>`.
SCRIPTS = {
    "grpo": "examples/train_grpo.py",
    "ppo": "examples/train_ppo.py",
    "sft": "examples/train_sft.py",
    "dpo": "examples/train_dpo.py",
    "orpo": "examples/train_orpo.py",
    "kto": "examples/train_kto.py",
    "rm": "examples/train_reward_model.py",
    "distill": "examples/train_distill.py",
    "agent": "examples/train_agent.py",
    "rlhf": "examples/rlhf.py",
}
COMMAND_OF_SCRIPT = {script: name for name, script in SCRIPTS.items()}
# Clients of a running `relax serve`: tests/test_serve_loop.py runs them against a server.
SERVICE_CLIENTS = ("examples/serve_grpo.py",)
MODULES = {"relax.serve": "serve", "relax.plan": "plan"}  # python -m <module> = relax <command>
NEEDS_DOWNLOADS = (
    "--model",
    "--data",
    "--teacher",
    "DIR",
    "...",
)  # a real model or data, a placeholder
NOT_RUN = ("--resume", "--eval-only", "--help")  # an earlier run read, or nothing trained
SFT_STEPS = "20"
# Commands the pages show for the built-in tasks: each must be found (command and flags).
EXPECTED = [
    ["grpo"],  # make demo
    ["grpo", "--task", "math"],
    ["grpo", "--task", "code"],
    ["agent"],
    ["agent", "--algorithm", "ppo", "--ppo.critic", "shared"],
    ["agent", "--agent.per-turn", "--task.max-turns", "4", "--agent.max-turns", "4"],
    ["grpo", "--async.staleness", "1"],
    ["ppo"],
    *[[name] for name in ("sft", "dpo", "orpo", "kto", "rm", "distill")],
    ["grpo", "--lora.rank", "8", "--grpo.optimizer.learning-rate", "5e-3"],
    ["grpo", "--reverse.num-experts", "4"],
]


def bash_lines(text: str) -> list[str]:
    """The commands of every ```bash block: continuation lines (ending in a backslash) joined,
    comments and blank lines dropped, ``a && b`` as two commands."""
    lines = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE):
        block = re.sub(r"\\\n\s*", " ", block)
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                lines.append(shlex.join(words[:end]))
                words = words[end + 1 :]
    return lines


def doc_lines() -> list[tuple[str, str]]:
    """``(page, line)`` for every bash line of every page (``page`` relative to the repository)."""
    return [
        (str(page.relative_to(ROOT)), line)
        for page in PAGES
        for line in bash_lines(page.read_text())
    ]


def make_recipe(target: str) -> str:
    """The first recipe line of a Makefile target, ``$(PY)`` read as ``python``."""
    found = re.search(
        rf"^{target}:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE
    )
    assert found, f"Makefile has no target {target!r}"
    return found.group(1).replace("$(PY)", "python")


@dataclasses.dataclass(frozen=True)
class Command:
    """A ``relax`` command as written: ``name`` (``grpo``, ``serve``, ``plan``, ``help``,
    ``client``), its flags with ``...`` dropped, and whether the line had a ``...``."""

    page: str
    line: str
    name: str
    flags: tuple[str, ...]
    elided: bool

    @property
    def argv(self) -> list[str]:
        return [self.name, *self.flags]

    @property
    def runnable(self) -> bool:
        return (
            self.name in SCRIPTS
            and self.name != "rlhf"
            and not any(m in self.line for m in NEEDS_DOWNLOADS)
            and not any(f in self.flags for f in NOT_RUN)
        )


def _program(word: str, name: str) -> bool:
    """``word`` is the program ``name``, bare or by a path (``.venv/bin/relax``)."""
    return re.fullmatch(rf"(\S*/)?{name}", word) is not None


def classify(page: str, line: str) -> tuple[str, object]:
    """``(kind, detail)`` of one bash line (module docstring); kind ``"unknown"`` fails the test."""
    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before a command
        words = words[1:]
    if not words:
        return "unknown", line
    head, rest = words[0], words[1:]
    python = _program(head, "python3?")
    elided = "..." in rest
    rest = [w for w in rest if w != "..."]
    if _program(head, "relax"):
        if not rest or rest[0] in ("-h", "--help"):
            return "command", Command(page, line, "help", tuple(rest), elided)
        return "command", Command(page, line, rest[0], tuple(rest[1:]), elided)
    if python and rest[:1] and rest[0] in COMMAND_OF_SCRIPT:
        return "command", Command(page, line, COMMAND_OF_SCRIPT[rest[0]], tuple(rest[1:]), elided)
    if python and rest[:1] and rest[0] in SERVICE_CLIENTS:
        return "command", Command(page, line, "client", tuple(rest[1:]), elided)
    if python and rest[:2] == ["-m", "relax"] and len(rest) > 2:
        return "command", Command(page, line, rest[2], tuple(rest[3:]), elided)
    if python and rest[:1] == ["-m"] and rest[1:2] and rest[1] in MODULES:
        return "command", Command(page, line, MODULES[rest[1]], tuple(rest[2:]), elided)
    if python and rest[:2] == ["-m", "venv"]:
        return "venv", rest[2:]
    if python and rest[:2] == ["-m", "pytest"]:
        return "pytest", [w for w in rest if w.startswith("tests/")]
    if python and rest[:1] and rest[0].startswith("benchmarks/"):
        return "benchmark", rest[0]
    if head == "make":
        return "make", rest
    if head == "source":
        return "source", rest
    if _program(head, "hf"):
        return "hf", rest
    if _program(head, "pip") or (python and rest[:3] == ["-m", "pip", "install"]):
        return "pip", words
    return "unknown", line


LINES = doc_lines()
KINDS = [(page, line, *classify(page, line)) for page, line in LINES]
COMMANDS = [detail for _, _, kind, detail in KINDS if kind == "command"]
for _page, _line, _kind, _detail in list(KINDS):
    if _kind == "make" and _detail[:1] == ["demo"]:  # make demo: its recipe is a command too
        COMMANDS.append(classify(_page, make_recipe("demo"))[1])
# Each distinct built-in-task command once (several pages show `relax grpo`).
# Commands another slow test already runs end to end, through the same example's ``main`` on the
# same built-in task (with more steps, and asserting it learns): the slow run here would repeat it.
# command (its argv) -> the test that runs it. ``test_covering_tests_exist`` keeps the table true.
RUN_ELSEWHERE: dict[tuple[str, ...], str] = {
    ("grpo", "--task", "math"): "tests/test_verifiable_tasks.py::test_grpo_runs_the_builtin_task",
    ("grpo", "--task", "code"): "tests/test_verifiable_tasks.py::test_grpo_runs_the_builtin_task",
    ("grpo", "--reverse.num-experts", "4"): (
        "tests/test_moe_run.py::test_builtin_task_with_a_moe_base_learns_and_exports"
    ),
    ("grpo", "--async.staleness", "1"): (
        "tests/test_run.py::test_pipelined_run_resumes_after_kill_9_bit_for_bit"
    ),
    ("ppo",): "tests/test_ppo.py::test_ppo_learns_the_builtin_task",
    ("agent",): "tests/test_agent_run.py::test_train_agent_learns_to_use_the_tool",
    ("agent", "--algorithm", "ppo", "--ppo.critic", "shared"): (
        "tests/test_agent_run.py::test_train_agent_runs"
    ),
    ("orpo",): "tests/test_offline.py::test_preference_trainers_learn_the_chosen_behaviour",
    ("kto",): "tests/test_offline.py::test_kto_learns_from_unpaired_feedback",
    ("rm",): "tests/test_offline.py::test_reward_model_learns_and_exports_for_transformers",
    ("distill",): "tests/test_offline.py::test_distillation_brings_a_fresh_student_to_its_teacher",
}

RUNNABLE: list[Command] = []
for _command in COMMANDS:
    if (
        _command.runnable
        and _command.argv not in [c.argv for c in RUNNABLE]
        and tuple(_command.argv) not in RUN_ELSEWHERE
    ):
        RUNNABLE.append(_command)


def flag(argv: list[str], name: str, default: str) -> str:
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == name), default)


def shrink(argv: list[str], run_dir: Path) -> list[str]:
    """Flags that make the trainer command ``argv`` (its name first) small: 2 steps, a small
    evaluation, the built-in task's supervised phase shortened, its own run directory."""
    name = argv[0]
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
    if name in ("grpo", "ppo"):
        task = flag(argv, "--task", "reverse")
        return common + [
            "--batch-size",
            "4",
            "--eval-max-prompts",
            "8",
            f"--{task}.sft-steps",
            SFT_STEPS,
        ]
    if name == "agent":
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


def parse(command: Command, extra: list[str] = ()) -> object:
    """What ``command`` parses to (module docstring: each kind by its own parser); nothing runs."""
    from relax.commands import COMMANDS as RELAX

    flags = [*command.flags, *extra]
    if command.name == "help":
        assert not flags or flags == ["--help"] or flags == ["-h"], command.line
        return RELAX
    if command.name == "client":
        import tyro

        module = load_script(SERVICE_CLIENTS[0])
        return tyro.cli(module.LoopConfig, args=flags)
    assert command.name in RELAX, f"{command.page}: `{command.line}`: no command {command.name!r}"
    if flags in (["--help"], ["-h"]):
        return RELAX[command.name]
    if command.name == "serve":
        pytest.importorskip("starlette", reason="relax serve needs the serve extra")
        import tyro

        from relax.serve.server import ServeConfig

        return tyro.cli(ServeConfig, args=flags)
    if command.name == "plan":
        return parse_plan(flags)
    if command.name == "eval":
        import tyro

        from relax.eval.harness.run import HarnessConfig

        return tyro.cli(HarnessConfig, args=flags)
    return RELAX[command.name].parse(flags)


def parse_plan(flags: list[str]) -> object:
    """``relax plan <algorithm> --target T [--exact] [--no-suggest] [--json F] [run flags]``."""
    from relax.plan.plan import parse_run
    from relax.plan.search import SLICES
    from relax.plan.targets import Target

    algorithm, rest = flags[0], list(flags[1:])
    target = flag(rest, "--target", None)
    assert target is not None, "relax plan needs --target"
    for name, takes_value in (("--target", True), ("--json", True), ("--exact", False)):
        if name in rest:
            at = rest.index(name)
            del rest[at : at + 1 + takes_value]
    rest = [a for a in rest if a != "--no-suggest"]
    if target not in SLICES:
        Target.parse(target)
    return parse_run(algorithm, rest)


def load_script(path: str):
    spec = importlib.util.spec_from_file_location(f"doc_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations there
    spec.loader.exec_module(module)
    return module


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_line_is_checked():
    unknown = [f"{page}: `{line}`" for page, line, kind, _ in KINDS if kind == "unknown"]
    assert not unknown, "bash lines no rule of this test checks:\n  " + "\n  ".join(unknown)
    assert {page for page, *_ in KINDS} >= {"README.md", "docs/getting-started.md"}


def test_extraction_finds_the_built_in_commands():
    found = [c.argv for c in COMMANDS if c.runnable]
    for expected in EXPECTED:
        assert expected in found, f"no page shows `relax {' '.join(expected)}` in a ```bash block"
    assert all(c.name in SCRIPTS and (ROOT / SCRIPTS[c.name]).is_file() for c in RUNNABLE)
    assert any(not c.runnable and c.name in SCRIPTS for c in COMMANDS)  # the --model ones
    text = (
        "```bash\nrelax grpo --a 1 \\\n    --b 2   # a comment\n"
        "python examples/train_sft.py ... --c\nmake demo\n```\n"
    )
    kinds = [classify("x", line) for line in bash_lines(text)]
    assert [k for k, _ in kinds] == ["command", "command", "make"]
    assert kinds[0][1].argv == ["grpo", "--a", "1", "--b", "2"] and kinds[0][1].runnable
    assert kinds[1][1].argv == ["sft", "--c"] and not kinds[1][1].runnable


def test_the_scripts_are_the_commands():
    """``python examples/<script>`` is ``relax <name>``: each script runs ``COMMANDS[name]``."""
    from relax.commands import COMMANDS as RELAX

    assert set(SCRIPTS) <= set(RELAX)
    for name, script in SCRIPTS.items():
        assert f'COMMANDS["{name}"]' in (ROOT / script).read_text(), script


@pytest.mark.parametrize(
    "command", [c for c in COMMANDS if not c.runnable], ids=lambda c: f"{c.page}: {c.line}"
)
def test_each_command_parses(command):
    assert parse(command) is not None


@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: f"{c.page}: {c.line}")
def test_each_built_in_command_parses_with_its_shrink_flags(command, tmp_path):
    config = parse(command, shrink(command.argv, tmp_path / "run"))
    assert config.steps == 2 and config.run_dir == str(tmp_path / "run")


def test_make_targets_and_extras_exist():
    makefile = (ROOT / "Makefile").read_text()
    extras = set(pyproject()["project"]["optional-dependencies"])
    jax_pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("jax=="))
    checked = {"make": 0, "pip": 0}
    for page, line, kind, detail in KINDS:
        if kind == "make":
            for target in detail:
                assert re.search(rf"^{re.escape(target)}:", makefile, flags=re.MULTILINE), (
                    f"{page}: `{line}`: the Makefile has no target {target!r}"
                )
            checked["make"] += 1
        elif kind == "pip":
            for word in detail:
                found = re.fullmatch(r"\.\[([\w,-]+)\]", word)
                if found:
                    missing = set(found.group(1).split(",")) - extras
                    assert not missing, f"{page}: `{line}`: no extra {sorted(missing)}"
                    assert "-e" in detail, f"{page}: `{line}`: install the checkout with -e"
                pinned = re.fullmatch(r"jax[\w\[\]-]*==(\S+)", word)
                if pinned and not word.startswith("jax-cuda"):
                    assert pinned.group(1) == jax_pin.split("==")[1], f"{page}: `{line}`"
                elif word.startswith("jax-cuda12-plugin=="):
                    assert word.split("==")[1] == jax_pin.split("==")[1], f"{page}: `{line}`"
                assert not re.fullmatch(r"relax\[.*\]", word), (
                    f"{page}: `{line}`: relax[...] resolves on the package index; use -e '.[...]'"
                )
            checked["pip"] += 1
        elif kind == "source":
            assert detail and re.fullmatch(r"(\S*/)?\.venv/bin/activate", detail[0]), line
        elif kind == "benchmark":
            assert (ROOT / detail).is_file(), f"{page}: `{line}`"
        elif kind == "pytest":
            assert detail and all((ROOT / t.split("::")[0]).is_file() for t in detail), line
    assert checked["make"] and checked["pip"]


def test_downloaded_directories_are_the_ones_used():
    """On each page, a ``--model`` / ``--data`` / ``--eval-data`` under ``models/`` or ``data/`` lies in
    a directory a ``hf download ... --local-dir`` line of the page fills."""
    downloads: dict[str, set[str]] = {}
    for page, line, kind, detail in KINDS:
        if kind == "hf":
            assert detail[:1] in (["download"], ["auth"]), f"{page}: `{line}`"
            if detail[0] == "download":
                downloads.setdefault(page, set()).add(flag(detail, "--local-dir", "").rstrip("/"))
    used = 0
    for command in COMMANDS:
        for name in ("--model", "--data", "--eval-data"):
            path = flag(list(command.flags), name, "")
            if path.startswith(("models/", "data/")):
                used += 1
                assert any(
                    path == d or path.startswith(d + "/") for d in downloads.get(command.page, ())
                ), f"{command.page}: `{command.line}`: nothing downloads {path}"
    assert used


def test_covering_tests_exist():
    """Every entry of ``RUN_ELSEWHERE`` names a slow test that exists and calls the command's
    example, and names a command the docs still show."""
    shown = {tuple(c.argv) for c in COMMANDS if c.runnable}
    for argv, test in RUN_ELSEWHERE.items():
        assert argv in shown, f"RUN_ELSEWHERE names {argv}, which no page shows any more"
        path, name = test.split("::")
        source = (ROOT / path).read_text()
        body = source[source.index(f"def {name}(") :]
        decorators = source[: source.index(f"def {name}(")].rsplit("\n\n\n", 1)[-1]
        assert "mark.slow" in decorators, f"{test} is not a slow test"
        script = "agent" if argv[0] == "agent" else {"rm": "reward_model"}.get(argv[0], argv[0])
        own = decorators + body[:1500]  # the example named in the test or its parameters
        assert f'"{script}"' in own or (script == "agent" and "train_agent" in own), (test, argv)


@pytest.mark.slow
@pytest.mark.parametrize("command", RUNNABLE, ids=lambda c: f"{c.page}: {c.line}")
def test_each_command_runs(command, tmp_path):
    argv = command.argv
    if flag(argv, "--task", "") == "math" and importlib.util.find_spec("math_verify") is None:
        pytest.skip("--task math needs math-verify: pip install -e '.[math]'")
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, SCRIPTS[command.name], *command.flags, *shrink(argv, run_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (
        f"`relax {' '.join(argv)}` exited {done.returncode}:\n{done.stderr[-4000:]}"
    )
    assert (run_dir / "summary.json").is_file()
