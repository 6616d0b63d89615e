"""Decode attention against a shared prompt vs a repeated prompt (the sampler's prompt block).

One decode step of ``relax.models.attention.blocks.partial_attention`` over the prompt's keys and
values, for P prompts with G completions each:

    shared    queries folded to [P, Hkv, G*R, D] against ONE copy of the prompt [P, Hkv, Lp, D]
              (what relax's prefix-shared sampler does: one dense matmul per KV head)
    repeated  queries [P*G, Hkv, R, D] against G copies of the prompt [P*G, Hkv, Lp, D]
              (what a sampler that repeats every prompt G times does)

Decode attention is bound by reading K and V, so the figure of merit is bytes read per
second: ``kv_bytes`` = K + V bytes actually read (G times fewer for shared), ``gb_per_s`` =
kv_bytes / time and ``logical_gb_per_s`` = the repeated layout's bytes / time (how fast the
shared kernel serves the same attention). ``frac_of_bw`` compares ``gb_per_s`` with the
measured read bandwidth on CPU (datasheet HBM elsewhere).

    .venv/bin/python benchmarks/attention.py
    .venv/bin/python benchmarks/attention.py --lps 4096 --runs 20
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tyro  # noqa: E402

TABLE = [
    "layout",
    "P",
    "G",
    "Lp",
    "q_shape",
    "kv_shape",
    "median_us",
    "spread",
    "kv_mb",
    "gb_per_s",
    "logical_gb_per_s",
    "frac_of_bw",
    "speedup_vs_repeated",
]


@dataclasses.dataclass
class Args:
    lps: str = "256,1024,4096"
    """comma-separated prompt lengths"""
    prompts: int = 4
    """P"""
    generations: int = 16
    """G"""
    kv_heads: int = 4
    """Hkv"""
    q_per_kv: int = 2
    """R: query heads per KV head"""
    head_dim: int = 64
    """D"""
    runs: int = 20
    """timed runs per case (median reported)"""


def main(args: Args) -> None:
    from relax.models.attention.blocks import partial_attention

    P, G, H, R, D = args.prompts, args.generations, args.kv_heads, args.q_per_kv, args.head_dim
    bw, bw_source = harness.peak_bandwidth()
    fn = jax.jit(partial_attention)
    for Lp in [int(x) for x in args.lps.split(",") if x]:
        keys = jax.random.split(jax.random.key(Lp), 3)
        q = jax.random.normal(keys[0], (P * G, H, R, D), jnp.float32)
        k = jax.random.normal(keys[1], (P, H, Lp, D), jnp.float32)
        v = jax.random.normal(keys[2], (P, H, Lp, D), jnp.float32)
        # shared: the G completions of a prompt fold into the query rows of each KV head
        q_shared = q.reshape(P, G, H, R, D).transpose(0, 2, 1, 3, 4).reshape(P, H, G * R, D)
        allowed = jnp.ones((P, 1, 1, Lp), bool)
        # repeated: every completion carries its own copy of the prompt's keys/values
        k_rep, v_rep = jnp.repeat(k, G, axis=0), jnp.repeat(v, G, axis=0)
        allowed_rep = jnp.ones((P * G, 1, 1, Lp), bool)
        logical = 2 * k_rep.size * 4
        res = {}
        for layout, args_ in (
            ("repeated", (q, k_rep, v_rep, allowed_rep)),
            ("shared", (q_shared, k, v, allowed)),
        ):
            r = harness.measure(fn, *args_, warmup=2, runs=args.runs)
            kv_bytes = 2 * args_[1].size * 4
            res[layout] = r["median_s"]
            harness.emit(
                {
                    "bench": "attention",
                    "layout": layout,
                    "P": P,
                    "G": G,
                    "Hkv": H,
                    "R": R,
                    "D": D,
                    "Lp": Lp,
                    "q_shape": "x".join(map(str, args_[0].shape)),
                    "kv_shape": "x".join(map(str, args_[1].shape)),
                    "median_us": r["median_s"] * 1e6,
                    "min_us": r["min_s"] * 1e6,
                    "max_us": r["max_s"] * 1e6,
                    "spread": r["spread"],
                    "compile_s": r["compile_s"],
                    "runs": r["runs"],
                    "kv_mb": round(kv_bytes / 2**20, 2),
                    "gb_per_s": kv_bytes / r["median_s"] / 1e9,
                    "logical_gb_per_s": logical / r["median_s"] / 1e9,
                    "frac_of_bw": kv_bytes / r["median_s"] / bw,
                    "peak_gb_per_s": bw / 1e9,
                    "bw_source": bw_source,
                    "speedup_vs_repeated": res["repeated"] / r["median_s"],
                    "flops": 4 * P * G * H * R * Lp * D,
                },
                TABLE,
            )


if __name__ == "__main__":
    main(tyro.cli(Args))
