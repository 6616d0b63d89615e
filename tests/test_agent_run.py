"""``examples/train_agent.py``: the built-in calculator task end to end (fast: a tiny supervised
phase and two steps), and (slow) the default run learning to use the tool."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_agent  # noqa: E402

FAST = [
    "--task.sft-steps",
    "20",
    "--task.sft-batch",
    "8",
    "--task.num-train",
    "64",
    "--task.num-eval",
    "8",
    "--steps",
    "2",
    "--batch-size",
    "2",
    "--grpo.num-generations",
    "2",
    "--eval-every",
    "0",
    "--checkpoint-every",
    "2",
    "--no-export-hf",
]


@pytest.mark.parametrize(
    "algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)]
)  # PPO: test_agent_step
def test_train_agent_runs(tmp_path, algorithm):
    extra = (
        ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "64", "--ppo.critic", "shared"]
        if algorithm == "ppo"
        else []
    )
    summary = train_agent.main(
        FAST + extra + ["--algorithm", algorithm, "--run-dir", str(tmp_path / "run")]
    )
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["steps"] == 2 and set(summary["before"]) >= {"success", "tool_use", "turns"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "turns" in x]
    assert len(trained) == 2 and all(x["sampled_tokens"] > 0 for x in trained)
    report = (
        tmp_path / "run" / "startup.txt"
    ).read_text()  # the start-up report, as every trainer writes it
    assert (
        "== tools" in report
        and "multiply: Multiply two integers." in report
        and "--steps 2" in report
    )
    assert json.loads((tmp_path / "run" / "config.json").read_text())["algorithm"] == algorithm


@pytest.mark.slow
def test_train_agent_learns_to_use_the_tool(tmp_path):
    summary = train_agent.main(["--run-dir", str(tmp_path / "run")])
    before, after = summary["before"], summary["after"]
    assert after["success"] >= before["success"] + 0.3 and after["tool_use"] > before["tool_use"]
    assert summary["run_time_s"] < 600


def _parse(argv):
    return train_agent.cli(
        train_agent.AgentRunConfig, default=train_agent.builtin_defaults(), args=argv
    )


def test_builtin_budgets_fit_the_model_and_an_overflow_names_the_flag():
    from relax.algorithms.agent.run import AgentRunConfig
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.ppo.config import PPOConfig
    from relax.tasks.agent import max_positions

    for algorithm in (
        "grpo",
        "ppo",
    ):  # the README's `--algorithm ppo --ppo.critic shared` among them
        cfg = _parse(["--algorithm", algorithm, "--ppo.critic", "shared"])
        assert cfg.algorithm_config.generation.max_new_tokens == 64 < max_positions(cfg.task)
    with pytest.raises(
        ValueError,
        match=r"--ppo.max-new-tokens 256 leaves no room for the prompt: .* 256 positions",
    ):
        AgentRunConfig(algorithm="ppo", ppo=configure(PPOConfig, max_new_tokens=256))
    assert (
        _parse(["--lora.rank", "4", "--lora.alpha", "8"]).lora.rank == 4
    )  # every trainer takes --lora.*


@pytest.mark.slow
def test_train_agent_trains_lora_adapters(tmp_path):
    fast = [a for a in FAST if a != "--no-export-hf"]
    summary = train_agent.main(
        fast + ["--lora.rank", "4", "--lora.alpha", "8", "--run-dir", str(tmp_path / "run")]
    )
    assert summary["steps"] == 2
    final = tmp_path / "run" / "final_hf"
    assert (final / "config.json").exists()  # the merged model
    config = json.loads(
        (final / "adapter" / "adapter_config.json").read_text()
    )  # the adapters, PEFT's format
    assert config["r"] == 4 and config["lora_alpha"] == 8
