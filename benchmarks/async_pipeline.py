"""Wall-clock per GRPO iteration, synchronous (staleness 0) against pipelined (staleness s).

The small model shape (``small_config``, random weights; ``--sampler-devices`` moves the rollout
to devices of its own, ``relax.parallel``) samples ``--prompts`` x ``--generations`` completions of
``--new-tokens`` tokens; a host reward takes ``--reward-ms`` per sample (a sleep: an LLM judge, a
sandbox, a remote verifier), in ``--reward-workers`` pool processes (0: in the trainer process).
The pipeline (``relax.train.pipeline``) scores batch k + s while update k runs.

Each configuration runs ``--steps`` iterations; the first ``--warmup`` (compiles, the pipeline's
prologue) are left out and the median of the rest is reported, for ``--runs`` runs alternating
synchronous and pipelined.

    python benchmarks/async_pipeline.py
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402

from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.step import make_grpo_step  # noqa: E402
from relax.algorithms.online.batch import step_input  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.parallel import ParallelConfig, ShardedStep  # noqa: E402
from relax.rewards.functions import RewardFunction  # noqa: E402
from relax.rewards.pool import PoolConfig, RewardPool  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.pipeline import AsyncConfig, Pipeline  # noqa: E402
from relax.train.state import init_state  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 3
    steps: int = 8
    warmup: int = 2
    staleness: int = 1
    prompts: int = 8
    generations: int = 8
    prompt_tokens: int = 64
    new_tokens: int = 64
    reward_ms: float = 100.0
    reward_workers: int = 4
    sampler_devices: int = 0
    """>0: the rollout on the first N devices, the update on the rest (GPU hosts; on CPU set
    XLA_FLAGS=--xla_force_host_platform_device_count)."""


def slow_reward(prompts, completions, *, seconds: float, **fields):
    """``seconds`` of host time per sample (``--reward-ms``): the reward's latency, not its compute."""
    time.sleep(seconds * len(completions))
    return [float(len(c) % 3) for c in completions]


class Prompts:
    """The same ``[P, Lp]`` random prompts each step (``get_state``/``set_state`` for the pipeline)."""

    def __init__(self, a: Args, vocab: int):
        self.ids = jax.random.randint(jax.random.key(0), (a.prompts, a.prompt_tokens), 1, vocab)
        self.n = a.prompts

    def __next__(self):
        return step_input(self.ids, jnp.ones_like(self.ids), ["p"] * self.n, {})

    def get_state(self):
        return {}

    def set_state(self, state):
        pass


def run_once(a: Args, staleness: int, reward: RewardFunction, pool) -> list[float]:
    """Per-iteration wall-clock seconds of one run."""
    async_cfg = AsyncConfig(staleness=staleness)
    cfg = preset(
        "grpo",
        num_generations=a.generations,
        max_new_tokens=a.new_tokens,
        beta=0.0,
        remat=False,  # as every recorded figure ran (the trainers' default is on)
        optimizer=OptimizerConfig(learning_rate=1e-5),
    )
    model = init(small_config(), jax.random.key(0), std=0.02)
    state = init_state(model, cfg.optimizer.make(), key=jax.random.key(1))
    step = make_grpo_step(
        cfg,
        StepParts(
            reward_fns=[reward],
            decode=lambda t, m: ["x" * int(r.sum()) for r in m],
            eos_ids=(),
            pad_id=0,
            pool=pool,
            off_policy=async_cfg.off_policy,
            pipelined=staleness > 0,
        ),
    )
    if a.sampler_devices:
        mesh, sampler_mesh = ParallelConfig(sampler_devices=a.sampler_devices).meshes()
        step = ShardedStep(step, state, mesh, sampler_mesh=sampler_mesh)
        state = step.place(state)
    pipeline = Pipeline(step.segments, async_cfg, Prompts(a, model.config.vocab_size), lambda b: b)
    times = []
    t0 = time.perf_counter()
    for _state, _batch, _ in pipeline.run(state, 0, a.steps):
        t1 = time.perf_counter()
        times.append(t1 - t0)
        t0 = t1
    return times


def main(a: Args):
    reward = RewardFunction(
        functools.partial(slow_reward, seconds=a.reward_ms / 1000.0), name="slow"
    )
    pool = (
        RewardPool([reward], PoolConfig(num_workers=a.reward_workers)) if a.reward_workers else None
    )
    medians = {0: [], a.staleness: []}
    try:
        for _ in range(a.runs):
            for s in (0, a.staleness):  # alternating: the machine's noise hits both alike
                medians[s].append(statistics.median(run_once(a, s, reward, pool)[a.warmup :]))
    finally:
        if pool is not None:
            pool.close()
    sync, pipelined = statistics.median(medians[0]), statistics.median(medians[a.staleness])
    emit(
        {
            "bench": "async_pipeline",
            **dataclasses.asdict(a),
            "sync_s": sync,
            "pipelined_s": pipelined,
            "speedup": sync / pipelined,
            "sync_runs_s": medians[0],
            "pipelined_runs_s": medians[a.staleness],
            "host_reward_s_per_step": a.prompts
            * a.generations
            * a.reward_ms
            / 1000.0
            / max(1, a.reward_workers),
        }
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
