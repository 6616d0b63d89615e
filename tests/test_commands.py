"""``relax <command>`` (``relax.commands``): the list, every command's ``--help``, the errors, the
trainers' parse against the ``examples/`` scripts that now delegate to it, the SIGTERM exit status,
and (in subprocesses) the installed console script, ``python -m relax`` and a light ``--help``."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax.commands import COMMANDS, Command, main

ROOT = Path(__file__).resolve().parents[1]
NAMES = [
    "grpo",
    "ppo",
    "sft",
    "dpo",
    "orpo",
    "kto",
    "rm",
    "distill",
    "agent",
    "rlhf",
    "serve",
    "plan",
    "eval",
]
TRAINERS = [name for name in NAMES if name not in ("serve", "plan", "eval")]
# The run config each trainer's parse returns, and the example script that is the same command.
CONFIGS = {
    "grpo": "relax.algorithms.grpo.run:GRPORunConfig",
    "ppo": "relax.algorithms.ppo.run:PPORunConfig",
    "sft": "relax.algorithms.sft.run:SFTRunConfig",
    "dpo": "relax.algorithms.dpo.run:DPORunConfig",
    "orpo": "relax.algorithms.dpo.run:DPORunConfig",
    "kto": "relax.algorithms.kto.run:KTORunConfig",
    "rm": "relax.algorithms.reward_model.run:RewardModelRunConfig",
    "distill": "relax.algorithms.distill.run:DistillRunConfig",
    "agent": "relax.algorithms.agent.run:AgentRunConfig",
    "rlhf": "relax.algorithms.rlhf.run:RLHFRunConfig",
}
SCRIPTS = {name: f"train_{name}.py" for name in TRAINERS} | {
    "rm": "train_reward_model.py",
    "rlhf": "rlhf.py",
}
# A flag every command's --help lists.
HELP_FLAG = {name: "--steps" for name in TRAINERS} | {
    "rlhf": "--sft.steps",
    "serve": "--port",
    "plan": "--target",
    "eval": "--task",
}
# Flags a trainer parses to the same config as its example script does.
FLAGS = {name: ["--steps", "3"] for name in TRAINERS} | {
    "grpo": ["--steps", "3", "--preset", "dapo", "--grpo.policy-loss.epsilon-high", "0.3"],
    "orpo": ["--steps", "3", "--dpo.orpo-lambda", "0.2"],
    "agent": ["--steps", "3", "--algorithm", "ppo"],
    "rlhf": ["--sft.steps", "3", "--algorithm", "grpo"],
}


def status(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether returned or raised (tyro's ``--help``)."""
    try:
        return main(argv)
    except SystemExit as e:
        return e.code


def config_class(name: str) -> type:
    module, _, cls = CONFIGS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def steps(name: str, cfg) -> int:
    return cfg.sft.steps if name == "rlhf" else cfg.steps


def test_the_registry_has_every_command():
    assert list(COMMANDS) == NAMES
    for name, command in COMMANDS.items():
        assert isinstance(command, Command) and command.name == name
        assert command.summary and "\n" not in command.summary
        assert command.trains == (name in TRAINERS) == (command.parse is not None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        COMMANDS["grpo"].name = "x"


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_the_commands(flag, capsys):
    assert main([flag]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in out and command.summary in out


def test_no_command_lists_them_as_an_error(capsys):
    assert main([]) == 2
    captured = capsys.readouterr()
    assert not captured.out and all(name in captured.err for name in NAMES)


def test_an_unknown_command_is_named(capsys):
    assert main(["nope", "--steps", "3"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'nope'" in err and all(f"  {name} " in err for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_every_command_has_help(name, capsys):
    if name == "serve":
        pytest.importorskip("starlette")
    assert status([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert HELP_FLAG[name] in out and f"relax {name}" in out


@pytest.mark.parametrize("name", TRAINERS)
def test_trainers_take_the_parallel_flags(name, capsys):
    assert status([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert "--parallel.mesh" in out and "--parallel.multihost" in out
    cfg = COMMANDS[name].parse(["--parallel.mesh", "data=2,fsdp=2"])
    assert cfg.parallel.mesh == "data=2,fsdp=2"


@pytest.mark.parametrize("name", TRAINERS)
def test_parse_returns_the_config_and_agrees_with_the_example(name, monkeypatch):
    cfg = COMMANDS[name].parse(FLAGS[name])
    assert type(cfg) is config_class(name) and steps(name, cfg) == 3
    assert example_config(SCRIPTS[name], FLAGS[name], monkeypatch) == cfg


def test_orpo_and_dpo_differ_only_by_the_loss():
    dpo, orpo = COMMANDS["dpo"].parse([]), COMMANDS["orpo"].parse([])
    assert (dpo.dpo.loss_type, orpo.dpo.loss_type) == ("sigmoid", "orpo")


class Parsed(Exception):
    def __init__(self, config):
        super().__init__("parsed")
        self.config = config


def example_config(script: str, argv: list[str], monkeypatch) -> object:
    """The config ``examples/<script>``'s ``main(argv)`` parses (``tyro.cli`` stopped after it)."""
    import tyro

    spec = importlib.util.spec_from_file_location(
        f"example_{Path(script).stem}", ROOT / "examples" / script
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = tyro.cli

    def cli(*args, **kwargs):
        raise Parsed(real(*args, **kwargs))

    monkeypatch.setattr(tyro, "cli", cli)
    with pytest.raises(Parsed) as parsed:
        module.main(argv)
    return parsed.value.config


def test_a_preempted_trainer_exits_143(monkeypatch, capsys):
    from relax.train.preemption import Preempted

    def preempted(argv):
        raise Preempted(f"stopped on SIGTERM after a checkpoint ({argv})")

    monkeypatch.setitem(COMMANDS, "sft", dataclasses.replace(COMMANDS["sft"], run=preempted))
    assert status(["sft", "--steps", "3"]) == 143
    assert "stopped on SIGTERM" in capsys.readouterr().err


def test_a_trainer_returns_0_and_plan_its_status(monkeypatch):
    monkeypatch.setitem(COMMANDS, "sft", dataclasses.replace(COMMANDS["sft"], run=lambda a: {}))
    assert main(["sft"]) == 0
    assert main(["plan"]) == 2 and main(["plan", "grpo", "--model", "config.json"]) == 2


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_console_script_lists_the_commands():
    script = Path(sys.executable).parent / "relax"
    if not script.is_file():
        pytest.skip(f"no {script}: pip install -e . installs the relax command")
    done = run([str(script), "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(f"  {name} " in done.stdout for name in NAMES)


HEAVY = ("relax.algorithms", "relax.train", "relax.plan", "relax.serve", "optax", "orbax", "tyro")


def test_python_m_relax_is_the_same_command_and_lists_without_the_training_stack():
    """``python -m relax --help`` lists the commands; ``-X importtime`` names every module it
    imported: no algorithm, training, planner or service module, no optimizer or flag parser."""
    done = run([sys.executable, "-X", "importtime", "-m", "relax", "--help"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(f"  {name} " in done.stdout for name in NAMES)
    imported = [line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line]
    assert "relax.commands.registry" in imported
    loaded = sorted({m for m in imported if m.startswith(HEAVY)})
    assert not loaded, f"relax --help loads {loaded}"
