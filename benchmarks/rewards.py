"""Scoring off the critical path: reward throughput with the worker pool, and a GRPO step with a
slow reward, with and without overlap.

``--part throughput``: samples/s of ``code_exec`` (the built-in code task's teacher completions,
right and wrong, each run in the sandbox against 4 asserts) and ``math_verify`` (the math task's
boxed answers, right and wrong), in the trainer process (``workers=0``) and in a pool of 1, 2, 4
workers; ``--samples`` per batch, medians of ``--runs`` batches after one warm-up batch.

``--part step``: one GRPO iteration on the small model shape (``train_step.py``'s: random
weights, P x G completions of ``--new-tokens``, KL beta 0.04 so the reference forward runs) with
a reward that sleeps ``--sleep-ms`` per sample: in the trainer process (serial); in a pool of
``--workers`` with the score as one stage before the reference forward (no overlap); and with the
step as GRPO builds it, the reference forward dispatched between handing the batch to the pool
and collecting it (overlap). Reports the iteration and the score's share of it.

    python benchmarks/rewards.py --part throughput
    python benchmarks/rewards.py --part step --workers 16
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402

from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.step import make_advantage, make_grpo_step, make_update_stage  # noqa: E402
from relax.algorithms.online.batch import step_input  # noqa: E402
from relax.algorithms.online.stages import make_reference, make_rollout, make_score  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.compose import compose  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.rewards.code_exec import CodeExec  # noqa: E402
from relax.rewards.functions import RewardFunction, score  # noqa: E402
from relax.rewards.math_answers import MathVerify  # noqa: E402
from relax.rewards.pool import PoolConfig, RewardPool  # noqa: E402
from relax.tasks import code, math  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.state import init_state  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    part: str = "throughput"
    """throughput | step"""
    runs: int = 3
    samples: int = 128
    worker_counts: tuple[int, ...] = (0, 1, 2, 4)
    chunk_size: int = 8
    workers: int = 16
    """step: pool size for the slow reward"""
    sleep_ms: float = 100.0
    prompts: int = 8
    generations: int = 8
    new_tokens: int = 64


def code_batch(n: int):
    rows, _ = code.make_splits(code.CodeTask())
    rng = np.random.default_rng(0)
    picked = [rows[i % len(rows)] for i in range(n)]
    completions = code.teacher(code.CodeTask(teacher_accuracy=0.5))(picked, rng)
    return [r["prompt"] for r in picked], completions, {"tests": [r["tests"] for r in picked]}


def math_batch(n: int):
    rows, _ = math.make_splits(math.MathTask())
    rng = np.random.default_rng(0)
    picked = [rows[i % len(rows)] for i in range(n)]
    completions = [
        f"Working it out step by step. {t}"
        for t in math.teacher(math.MathTask(teacher_accuracy=0.5))(picked, rng)
    ]
    return [r["prompt"] for r in picked], completions, {"answer": [r["answer"] for r in picked]}


def throughput(args: Args) -> None:
    for name, fn, make in (
        ("code_exec", CodeExec(), code_batch),
        ("math_verify", MathVerify(), math_batch),
    ):
        prompts, completions, fields = make(args.samples)
        rf = RewardFunction(fn, name=name)
        for workers in args.worker_counts:
            pool = None
            if workers:
                pool = RewardPool(
                    [rf],
                    PoolConfig(num_workers=workers, chunk_size=args.chunk_size, timeout_s=60.0),
                )
            try:
                times, mean = [], None
                for i in range(args.runs + 1):
                    t0 = time.perf_counter()
                    total, _, _ = score(
                        [rf],
                        prompts,
                        completions,
                        fields,
                        pool=pool,
                        timeout_s=60.0 if workers else None,
                    )
                    if i:  # the first batch starts the workers' sandboxes and imports
                        times.append(time.perf_counter() - t0)
                    mean = float(np.nanmean(total))
            finally:
                if pool is not None:
                    pool.close()
            med = statistics.median(times)
            emit(
                {
                    "bench": "reward_throughput",
                    "reward": name,
                    "workers": workers,
                    "samples": args.samples,
                    "chunk_size": args.chunk_size,
                    "median_s": med,
                    "samples_per_s": args.samples / med,
                    "min_s": min(times),
                    "max_s": max(times),
                    "mean_reward": mean,
                    "runs": args.runs,
                },
                table=["reward", "workers", "median_s", "samples_per_s", "mean_reward"],
            )


def slow_reward(sleep_s: float):
    def slow(prompts, completions, **fields):
        time.sleep(sleep_s * len(completions))
        return [float(len(c) % 2) for c in completions]

    return slow


def decode(tokens, mask):
    return [" ".join(map(str, row[m > 0])) for row, m in zip(tokens, mask)]


def step_case(args: Args, mode: str) -> dict:
    mcfg = small_config()
    cfg = preset(
        "grpo",
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        beta=0.04,
        remat=False,  # as every recorded figure ran (the trainers' default is on)
        optimizer=OptimizerConfig(learning_rate=1e-6),
    )
    state = init_state(
        init(mcfg, jax.random.key(0)),
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
    )
    rf = RewardFunction(slow_reward(args.sleep_ms / 1000), name="slow")
    pool = (
        None
        if mode == "serial"
        else RewardPool([rf], PoolConfig(num_workers=args.workers, chunk_size=1, timeout_s=60.0))
    )
    passes = choose_passes()
    if mode == "overlap":
        step = make_grpo_step(
            cfg,
            StepParts(
                reward_fns=[rf], decode=decode, eos_ids=(), pad_id=0, pool=pool, timeout_s=60.0
            ),
        )
    else:  # the score as one stage, before the reference forward
        step = compose(
            make_rollout(cfg.generation.rollout(eos_ids=(), pad_id=0)),
            make_score([rf], decode, pool=pool, timeout_s=60.0 if pool else None),
            make_reference(passes, cfg.forward, temperature=cfg.generation.temperature),
            make_advantage(cfg),
            make_update_stage(cfg, passes),
        )
    ids = jax.random.randint(jax.random.key(2), (args.prompts, 64), 0, mcfg.vocab_size)
    batch = step_input(ids, jnp.ones_like(ids), ["x"] * args.prompts, {})
    try:
        runs = []
        for i in range(args.runs + 1):
            times, b = {}, batch
            for seg in step.segments:
                t0 = time.perf_counter()
                state, b = seg.run(state, b)
                jax.block_until_ready((state, b.device))  # the host record holds no device work
                times["+".join(seg.names)] = time.perf_counter() - t0
            if i:
                runs.append(times)
    finally:
        if pool is not None:
            pool.close()
    total = statistics.median(sum(r.values()) for r in runs)
    score_s = statistics.median(sum(v for k, v in r.items() if "score" in k) for r in runs)
    return emit(
        {
            "bench": "reward_step",
            "mode": mode,
            "workers": 0 if pool is None else args.workers,
            "sleep_ms": args.sleep_ms,
            "P": args.prompts,
            "G": args.generations,
            "N": args.new_tokens,
            "iteration_s": total,
            "score_s": score_s,
            "score_frac": score_s / total,
            "stages": {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]},
            "runs": args.runs,
        },
        table=["mode", "workers", "iteration_s", "score_s", "score_frac"],
    )


def main(args: Args) -> None:
    if args.part == "throughput":
        throughput(args)
    elif args.part == "step":
        for mode in ("serial", "no_overlap", "overlap"):
            step_case(args, mode)
    else:
        raise SystemExit(f"--part {args.part!r}: throughput or step")


if __name__ == "__main__":
    main(tyro.cli(Args))
