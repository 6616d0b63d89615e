"""The GRPO demo's learning curve per wall-clock second, synchronous against pipelined.

Runs the built-in demo (``examples/train_grpo.py`` with no model: the reverse task) once with
``--async.staleness 0`` and once with ``--async.staleness S`` from the same base model (trained
once, copied), optionally with a host reward delay per sample (``--reward-ms``: the demo's
exact-match reward then sleeps, as an LLM judge or a sandbox would take). Training time is the
sum of the iterations' ``time/step``, leaving out those that compiled (the first one, whose
time also holds the pipeline's prologue) and evaluations; ``median_step_s`` leaves out the first
two. ``--from-runs`` re-reads the run directories instead of training. Prints one JSON line per
staleness (the held-out greedy accuracy before/after, steps, seconds, the curve) and writes
``--plot`` (training reward and held-out accuracy against seconds).

    python benchmarks/async_curve.py --plot benchmarks/async_curve.png
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402

from relax.algorithms.grpo.run import builtin_defaults, run  # noqa: E402
from relax.rewards import builtin  # noqa: E402
from relax.train.pipeline import AsyncConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    staleness: int = 1
    steps: int = 60
    reward_ms: float = 0.0
    """Host delay per sample added to the demo's reward (0: the demo as it is)."""
    run_dir: str = "runs/async-curve"
    plot: str | None = None
    from_runs: bool = False


def delayed(seconds: float):
    """The exact-match reward of the demo, taking ``seconds`` more per sample."""
    exact = builtin.make_exact_match("answer")

    def reward(prompts, completions, **fields):
        time.sleep(seconds * len(completions))
        return exact(prompts, completions, **fields)

    return reward


def curve(run_dir: Path) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [line for line in lines if "loss" in line]
    seconds, total = [], 0.0
    for line in train:
        total += 0.0 if line["compiles"] else line["time/step"]  # compiling iterations left out
        seconds.append(total)
    at = dict(zip((line["step"] for line in train), seconds))
    evals = [
        (at.get(line["step"], 0.0), line["eval/greedy/accuracy"])
        for line in lines
        if "eval/greedy/accuracy" in line
    ]
    return {
        "seconds": seconds,
        "step_s": [line["time/step"] for line in train],
        "reward": [line["reward"] for line in train],
        "staleness": [line.get("staleness", 0.0) for line in train],
        "eval": evals,
    }


def main(a: Args):
    root = Path(a.run_dir)
    results = {}
    for s in (0, a.staleness):
        run_dir = root / f"staleness-{s}"
        shared = root / "staleness-0" / "base_model"
        if s and shared.exists() and not (run_dir / "base_model").exists():
            shutil.copytree(shared, run_dir / "base_model")
        if a.reward_ms:
            builtin.BUILTIN_REWARDS["delayed"] = delayed(a.reward_ms / 1000.0)
        cfg = dataclasses.replace(
            builtin_defaults(),
            steps=a.steps,
            run_dir=str(run_dir),
            export_hf=False,
            async_=AsyncConfig(staleness=s),
            reward_workers=0,
            **({"reward": ("delayed",)} if a.reward_ms else {}),
        )
        summary = json.loads((run_dir / "summary.json").read_text()) if a.from_runs else run(cfg)
        c = curve(run_dir)
        results[s] = c
        emit(
            {
                "bench": "async_curve",
                "staleness": s,
                "steps": a.steps,
                "reward_ms": a.reward_ms,
                "train_s": c["seconds"][-1],
                "median_step_s": statistics.median(c["step_s"][2:]),
                "before": summary["before"]["greedy/accuracy"],
                "after": summary["after"]["greedy/accuracy"],
                "eval": c["eval"],
            }
        )
    if a.plot:
        plot(results, a)


def plot(results: dict, a: Args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for s, c in results.items():
        label = "synchronous" if s == 0 else f"pipelined, staleness {s}"
        left.plot(c["seconds"], c["reward"], label=label, alpha=0.8)
        right.plot(*zip(*c["eval"]), marker="o", label=label)
    left.set(
        xlabel="training seconds", ylabel="training reward (exact match)", title="GRPO demo: reward"
    )
    right.set(
        xlabel="training seconds", ylabel="held-out greedy accuracy", title="held-out accuracy"
    )
    for ax in (left, right):
        ax.legend()
        ax.grid(alpha=0.3)
    extra = f", reward +{a.reward_ms:g} ms/sample" if a.reward_ms else ""
    fig.suptitle(f"reverse task, {a.steps} steps{extra} (2 CPU cores)")
    fig.tight_layout()
    fig.savefig(a.plot, dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
