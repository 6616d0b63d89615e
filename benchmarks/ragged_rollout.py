"""The sampler on completions of long-tailed lengths, with and without compaction of its decode
batch (``RolloutConfig.compactions``, ``relax.rollout.compaction``).

A model shape with random weights (``--model-shape small`` default: see ``train_step.py``),
float32, P prompts (default 8) x G completions (default 8) of 64-token prompts, a budget N
(default 1024). The weights are drawn small (std ``--std``), so the next-token distribution is
near uniform and each step stops a row with probability ``k / V`` (k stop ids): lengths are
geometric with mean about N/4 (``--mean-fraction``), a long exponential tail, and the longest of
the P x G rows usually reaches the budget. Modes, each one compiled program, timed alternating
(medians over ``--runs`` after the compile):

    compact<c>   the sampler with ``compactions=c`` (0: never; 2; the default 3)
    no_tail      every row runs round(mean length) steps with no stop id: the same real tokens
                 with no tail, what compaction approaches
    tail_floor   ONE row (one prompt, one completion) runs the longest completion's steps with no
                 stop id: what any scheduler of this batch pays at least, continuous batching
                 included (a completion's tokens are sequential; a finished row taking new work
                 does not shorten the longest one)
    partial<k>   partial rollouts (``relax.rollout.partial``, ``--async.partial k``): one rollout
                 of the steady state, which samples N / k tokens of k batches in progress (the
                 same prompts, new keys) and emits one complete batch; timed after 2k + 2
                 rollouts of warm-up (their compiles). ``prefill_s``: the recomputed prefix of the
                 continuing rows alone (a one-token call on the last rollout's continuation
                 prompts), what keeping their KV caches would save at most

    python benchmarks/ragged_rollout.py [--runs 3] [--model-shape small]
    python benchmarks/ragged_rollout.py --new-tokens 256 --runs 1        # quick

Prints one JSON line per mode: seconds (median, min, max), compile seconds, real tokens and
real tokens per second, the longest completion; the compacted modes' speedup over compact0 and
the share of rows whose tokens equal compact0's (compaction changes the float rounding of the
attention and the matmuls: with this near-uniform model a draw can fall within that rounding of
a token boundary, and the row goes on differently from there).
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
from train_step import SHAPES  # noqa: E402

from relax.models import init  # noqa: E402
from relax.rollout.partial import PartialRequest, PartialRollouts  # noqa: E402
from relax.rollout.sampler import RolloutConfig, compiled_generate  # noqa: E402


class Partial:
    """Steady-state rollouts of ``PartialRollouts`` over the same prompts: ``step()`` times one."""

    def __init__(self, model, ids, mask, cfg: RolloutConfig, k: int, key):
        prompts = (np.asarray(ids), np.asarray(mask), None)
        self.model, self.key, self.i = model, key, 0
        self.partial = PartialRollouts(iter(lambda: prompts, None), lambda item: item, cfg, k)
        for _ in range(2 * k + 2):
            self.step()

    def step(self) -> tuple[float, int]:
        """(seconds, real tokens of the batch it emits)."""
        t0 = time.perf_counter()
        done = self.partial.produce(
            self.model, self.i, jax.random.fold_in(self.key, self.i), PartialRequest(self.i)
        )
        self.i += 1
        return time.perf_counter() - t0, int(done.lengths.sum())

    def prefill_s(self, runs: int) -> float:
        """Median seconds of the continuing rows' prefill alone (a one-token call)."""
        ids, mask = self.partial.continuation_prompts(self.partial.running_rows())
        one = compiled_generate(dataclasses.replace(self.partial.cont_cfg, max_new_tokens=1))
        jax.block_until_ready(one(self.model, ids, mask, self.key))
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(one(self.model, ids, mask, self.key))
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 3
    model_shape: str = "small"
    """small | small-moe | smollm-135m"""
    prompts: int = 8
    generations: int = 8
    prompt_len: int = 64
    new_tokens: int = 1024
    """the completion budget N"""
    mean_fraction: float = 0.25
    """the lengths' mean as a fraction of N (the stop ids: V / (mean_fraction N) of the vocabulary)"""
    std: float = 0.002
    """the random weights' std: small, so the next-token distribution is near uniform"""
    compactions: tuple[int, ...] = (0, 2, 3)
    partial: tuple[int, ...] = (2, 4)
    """partial rollouts over k rollouts (empty: none)"""
    seed: int = 0


def main(args: Args) -> list[dict]:
    cfg = SHAPES[args.model_shape]()
    model = init(cfg, jax.random.key(args.seed), std=args.std)
    v, n = cfg.vocab_size, args.new_tokens
    k = max(1, round(v / (args.mean_fraction * n)))
    stops = tuple(int(i) for i in np.linspace(1, v - 1, k).astype(int))
    ids = jax.random.randint(jax.random.key(1), (args.prompts, args.prompt_len), 0, v)
    mask = jnp.ones_like(ids)
    key = jax.random.key(2)

    def rollout_cfg(c, eos, budget):
        return RolloutConfig(
            num_generations=args.generations, max_new_tokens=budget, eos_ids=eos, compactions=c
        )

    programs, compile_s, inputs = {}, {}, {}

    def build(name, rc, rows=args.prompts):
        t0 = time.perf_counter()
        inputs[name] = (ids[:rows], mask[:rows])
        programs[name] = compiled_generate(rc).lower(model, *inputs[name], key).compile()
        compile_s[name] = time.perf_counter() - t0

    for c in args.compactions:
        build(f"compact{c}", rollout_cfg(c, stops, n))
    first = programs[f"compact{args.compactions[0]}"](model, ids, mask, key)
    lengths = np.asarray(first.lengths)
    real = int(lengths.sum())
    build("no_tail", rollout_cfg(0, (), max(1, round(float(lengths.mean())))))
    one = RolloutConfig(num_generations=1, max_new_tokens=int(lengths.max()), compactions=0)
    build("tail_floor", one, rows=1)
    partials = {}
    for kk in args.partial:
        t0 = time.perf_counter()
        partials[f"partial{kk}"] = Partial(model, ids, mask, rollout_cfg(3, stops, n), kk, key)
        compile_s[f"partial{kk}"] = (
            time.perf_counter() - t0
        )  # the warm-up rollouts, compiles included
    times: dict[str, list[float]] = {name: [] for name in [*programs, *partials]}
    outs, partial_tokens = {}, {name: [] for name in partials}
    for _ in range(args.runs):
        for name, prog in programs.items():  # alternating: each run sees the same machine load
            t0 = time.perf_counter()
            outs[name] = jax.block_until_ready(prog(model, *inputs[name], key))
            times[name].append(time.perf_counter() - t0)
        for name, part in partials.items():
            seconds, tokens = part.step()
            times[name].append(seconds)
            partial_tokens[name].append(tokens)
    same = {}  # rows whose completion equals compact<first>'s: all but draws within rounding of a CDF boundary
    for name, out in outs.items():
        if name not in ("no_tail", "tail_floor"):
            rows_equal = np.all(np.asarray(out.tokens) == np.asarray(first.tokens), axis=-1)
            same[name] = float(rows_equal.mean())
    base = statistics.median(times[f"compact{args.compactions[0]}"])
    records = []
    for name, ts in times.items():
        med = statistics.median(ts)
        if (
            name in partials
        ):  # each rollout emits a batch of its own: its real tokens, per second of its time
            tokens = round(statistics.mean(partial_tokens[name]))
            extra = {
                "prefill_s": partials[name].prefill_s(args.runs),
                "tokens_per_s_total": sum(partial_tokens[name]) / sum(ts),
            }
        else:
            tokens = (
                real
                if name not in ("no_tail", "tail_floor")
                else int(np.asarray(outs[name].lengths).sum())
            )
            extra = {}
        records.append(
            emit(
                {
                    "bench": "ragged_rollout",
                    "mode": name,
                    "model_shape": args.model_shape,
                    "prompts": args.prompts,
                    "generations": args.generations,
                    "budget": n,
                    "stop_ids": k,
                    "mean_length": float(lengths.mean()),
                    "longest": int(lengths.max()),
                    "median_length": float(np.median(lengths)),
                    "real_tokens": tokens,
                    "median_s": med,
                    "min_s": min(ts),
                    "max_s": max(ts),
                    "compile_s": compile_s[name],
                    "tokens_per_s": tokens / med,
                    "speedup_vs_first": base / med,
                    "runs": len(ts),
                    "rows_same_as_first": same.get(name),
                    **extra,
                }
            )
        )
    return records


if __name__ == "__main__":
    main(tyro.cli(Args))
