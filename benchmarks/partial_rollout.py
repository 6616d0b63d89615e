"""Seconds per GRPO iteration on long-tailed completion lengths: every batch sampled whole in one
rollout against partial rollouts (``--async.partial K``, ``relax.rollout.partial``).

The small model shape with weights drawn small (``--std``), so the next-token distribution is near
uniform and stop ids covering ``V / (mean_fraction N)`` of the vocabulary make the lengths
geometric with mean about ``mean_fraction * N`` (``benchmarks/ragged_rollout.py``): P x G
completions of a budget N (default 8 x 8, 1024), 64-token prompts, a reward in the trainer process
(``len % 3``: no host cost), the GRPO preset without a reference (beta 0), packed update (the
CPU default). Modes, both one batch ahead of their update (pipeline depth 1):

    whole        --async.staleness 1: each batch sampled whole (compaction 3)
    partial<K>   --async.staleness K --async.partial K: each rollout samples N / K tokens of the K
                 batches in progress

Each run makes ``--warmup`` + ``--steps`` iterations (partial: ``2K + 2`` warm-up iterations at
least, their compiles); reported: the median seconds of the measured iterations (the pipeline's
``time/step``), real (sampled) tokens per second of the batches they updated on, and their
staleness. Runs alternate modes.

    python benchmarks/partial_rollout.py [--runs 2] [--partial 2 4]
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402

from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.step import make_grpo_step  # noqa: E402
from relax.algorithms.online.batch import step_input  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.compose import split_host  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.objectives.off_policy import OffPolicyConfig  # noqa: E402
from relax.rollout.partial import PartialRollouts  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.pipeline import AsyncConfig, Pipeline  # noqa: E402
from relax.train.run import CompileCounter  # noqa: E402
from relax.train.state import init_state  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 2
    steps: int = 5
    """measured iterations per run"""
    warmup: int = 6
    """iterations left out first (compiles: the packed update meets several layouts)"""
    prompts: int = 8
    generations: int = 8
    prompt_tokens: int = 64
    new_tokens: int = 1024
    mean_fraction: float = 0.25
    std: float = 0.002
    partial: tuple[int, ...] = (2, 4)


class Prompts:
    """The same random prompts each step (``get_state`` / ``set_state`` for the pipeline)."""

    def __init__(self, a: Args, vocab: int):
        self.ids = jax.random.randint(jax.random.key(1), (a.prompts, a.prompt_tokens), 0, vocab)
        self.n = a.prompts

    def __next__(self):
        return step_input(self.ids, jnp.ones_like(self.ids), ["p"] * self.n, {})

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def reward(prompts, completions, **fields):
    return [float(len(c) % 3) for c in completions]


def run_once(a: Args, k: int) -> dict:
    """One run of mode ``k`` (1: whole rollouts): medians of its measured iterations."""
    cfg_model = small_config()
    v, n = cfg_model.vocab_size, a.new_tokens
    stops = tuple(
        int(i) for i in np.linspace(1, v - 1, max(1, round(v / (a.mean_fraction * n)))).astype(int)
    )
    async_cfg = AsyncConfig(
        staleness=k, partial=k, correction=OffPolicyConfig(kind="tis")
    )  # depth 1 either way
    cfg = preset(
        "grpo",
        num_generations=a.generations,
        max_new_tokens=n,
        beta=0.0,
        remat=False,  # as every recorded figure ran (the trainers' default is on)
        optimizer=OptimizerConfig(learning_rate=1e-5),
    )
    state = init_state(
        init(cfg_model, jax.random.key(0), std=a.std), cfg.optimizer.make(), key=jax.random.key(2)
    )
    data, partial = Prompts(a, v), None
    if k > 1:
        to_prompts = lambda w: (
            np.asarray(w.device.prompt_ids),
            np.asarray(w.device.prompt_mask),
            w.host,
        )  # noqa: E731
        data = partial = PartialRollouts(
            data, to_prompts, cfg.generation.rollout(eos_ids=stops, pad_id=0), k
        )
    step = make_grpo_step(
        cfg,
        StepParts(
            reward_fns=[reward],
            decode=lambda t, m: ["x" * int(r.sum()) for r in m],
            eos_ids=stops,
            pad_id=0,
            off_policy=async_cfg.off_policy,
            pipelined=True,
            partial=partial,
        ),
    )
    pipeline = Pipeline(step.segments, async_cfg, data, lambda b: b)
    warmup = max(a.warmup, 2 * k + 2) if k > 1 else a.warmup
    seconds, tokens, lags, compiles = [], [], [], 0
    run = pipeline.run(state, 0, warmup + a.steps)
    for j in range(warmup + a.steps):
        with CompileCounter() as counter:
            state, out, timings = next(run)
        if j >= warmup:
            seconds.append(timings["time/step"])
            tokens.append(int(jnp.sum(split_host(out)[1].batch.mask)))
            lags.append(timings["staleness"])
            compiles += counter.count
    return {
        "median_s": statistics.median(seconds),
        "tokens_per_s": sum(tokens) / sum(seconds),
        "real_tokens_per_batch": statistics.mean(tokens),
        "staleness": max(lags),
        "stop_ids": len(stops),
        "compiles_measured": compiles,
    }


def main(a: Args) -> list[dict]:
    modes = (1, *a.partial)
    results: dict[int, list[dict]] = {k: [] for k in modes}
    for _ in range(a.runs):
        for k in modes:  # alternating: the machine's noise hits every mode alike
            results[k].append(run_once(a, k))
    base = statistics.median(r["median_s"] for r in results[1])
    records = []
    for k in modes:
        med = statistics.median(r["median_s"] for r in results[k])
        records.append(
            emit(
                {
                    "bench": "partial_rollout",
                    "mode": "whole" if k == 1 else f"partial{k}",
                    **dataclasses.asdict(a),
                    "median_s": med,
                    "runs_s": [r["median_s"] for r in results[k]],
                    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results[k]),
                    "real_tokens_per_batch": statistics.median(
                        r["real_tokens_per_batch"] for r in results[k]
                    ),
                    "staleness": results[k][0]["staleness"],
                    "stop_ids": results[k][0]["stop_ids"],
                    "compiles_measured": sum(r["compiles_measured"] for r in results[k]),
                    "speedup_vs_whole": base / med,
                }
            )
        )
    return records


if __name__ == "__main__":
    main(tyro.cli(Args))
