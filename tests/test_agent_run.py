"""``examples/train_agent.py``: the built-in calculator task end to end (fast: a tiny supervised
phase and two steps), and (slow) the default run learning to use the tool."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import train_agent  # noqa: E402

FAST = ["--task.sft-steps", "20", "--task.sft-batch", "8", "--task.num-train", "64", "--task.num-eval", "8",
        "--steps", "2", "--batch-size", "2", "--grpo.num-generations", "2", "--eval-every", "0",
        "--checkpoint-every", "2", "--no-export-hf"]


@pytest.mark.parametrize("algorithm", ["grpo", pytest.param("ppo", marks=pytest.mark.slow)])  # PPO: test_agent_step
def test_train_agent_runs(tmp_path, algorithm):
    extra = ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "64", "--ppo.critic", "shared"] \
        if algorithm == "ppo" else []
    summary = train_agent.main(FAST + extra + ["--algorithm", algorithm, "--run-dir", str(tmp_path / "run")])
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["steps"] == 2 and set(summary["before"]) >= {"success", "tool_use", "turns"}
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [x for x in lines if "turns" in x]
    assert len(trained) == 2 and all(x["sampled_tokens"] > 0 for x in trained)


@pytest.mark.slow
def test_train_agent_learns_to_use_the_tool(tmp_path):
    summary = train_agent.main(["--run-dir", str(tmp_path / "run")])
    before, after = summary["before"], summary["after"]
    assert after["success"] >= before["success"] + 0.3 and after["tool_use"] > before["tool_use"]
    assert summary["run_time_s"] < 600
