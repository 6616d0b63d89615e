"""``examples/train_agent.py --async.staleness 1``: the multi-turn trainer pipelined
(``relax.train.pipeline``: the rollout with its environments is the producer). Two runs are the
same bit for bit and every batch is at most one version old; (slow) a run killed with -9 and
resumed equals the uninterrupted one, and the default run learns the task pipelined.

The kill runs this file as a script: ``rollout_trajectories`` of the training step is wrapped to
kill the process at its given call (the held-out evaluation has its own, unwrapped)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
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
    "--batch-size",
    "2",
    "--grpo.num-generations",
    "2",
    "--eval-every",
    "0",
    "--no-export-hf",
    "--grpo.optimizer.learning-rate",
    "5e-3",
]
PIPELINED = ["--async.staleness", "1", "--async.correction.kind", "tis"]


def _train_lines(run_dir) -> dict:
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        x = json.loads(line)
        if "loss" in x:  # training lines; timings differ run to run
            out[x["step"]] = {
                k: v
                for k, v in x.items()
                if k not in ("time", "tokens_per_s", "compiles") and not k.startswith("time")
            }
    return out


def _main(run_dir, steps, *extra):
    return train_agent.main(
        FAST + PIPELINED + ["--steps", str(steps), "--run-dir", str(run_dir), *extra]
    )


@pytest.mark.slow
def test_pipelined_agent_runs_are_reproducible_and_one_version_behind(tmp_path):
    a = _main(tmp_path / "a", 3, "--checkpoint-every", "3")
    _main(tmp_path / "b", 3, "--checkpoint-every", "3")
    assert a["staleness_histogram"] == {"0": 1, "1": 2}
    lines_a, lines_b = _train_lines(tmp_path / "a"), _train_lines(tmp_path / "b")
    assert sorted(lines_a) == [1, 2, 3] and lines_a == lines_b
    assert [lines_a[s]["staleness"] for s in (1, 2, 3)] == [0, 1, 1]
    assert all(lines_a[s]["turns"] > 0 for s in (1, 2, 3))


@pytest.mark.slow  # make test-all
def test_pipelined_agent_run_resumes_after_kill_9_bit_for_bit(tmp_path):
    every = ("--checkpoint-every", "1")
    _main(tmp_path / "straight", 5, *every)
    killed = tmp_path / "killed"
    args = FAST + PIPELINED + ["--steps", "5", "--run-dir", str(killed), *every]
    proc = subprocess.run(
        [sys.executable, __file__, "kill9", "4", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    done = sorted(_train_lines(killed))
    assert done and done[-1] < 5, done
    _main(killed, 5, "--resume", *every)
    a, b = _train_lines(tmp_path / "straight"), _train_lines(killed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5]
    for step in a:
        assert a[step] == b[step], step


@pytest.mark.slow  # make test-all: the default run, pipelined
def test_pipelined_agent_learns_the_task(tmp_path):
    summary = train_agent.main(PIPELINED + ["--run-dir", str(tmp_path / "run")])
    before, after = summary["before"], summary["after"]
    assert after["success"] >= before["success"] + 0.3 and after["tool_use"] > before["tool_use"], (
        before,
        after,
    )
    assert summary["staleness_histogram"]["1"] > 0


if __name__ == "__main__" and sys.argv[1] == "kill9":  # kill at the training rollout's given call
    from relax.algorithms.agent import step as agent_step

    at, calls, real = int(sys.argv[2]), [], agent_step.rollout_trajectories

    def rollout_trajectories(*a, **kw):
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **kw)

    agent_step.rollout_trajectories = rollout_trajectories
    train_agent.main(sys.argv[3:])
