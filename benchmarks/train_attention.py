"""Training-time attention of G completions over their shared prompt: forward and forward+backward.

Per layer of the update's prefix-shared forward, the query rows of every completion attend to
their group's prompt keys and their own causal keys. Two implementations, same math:

    group      ``relax.models.attention.group.prefix_group_attention``: one prompt group at a
               time (``lax.map``), masks rebuilt from positions in each tile, a custom backward
               that recomputes the probabilities from the saved log-sum-exp
    group_saved  the same with ``save_probabilities=True``: the backward reads the forward's
               probabilities (what relax's CPU update uses, one group per pass)
    unblocked  the whole batch at once: prompt block and own block as two partial softmaxes
               merged exactly (``attention.merge_stats``), differentiated by autodiff (relax's training forward
               before the group kernel; it keeps every [P*G, Hkv, R*N, Lp+N] intermediate)

``xla_temp_mb`` is XLA's scratch + output allocation for the program (exact, noise-free);
``score_mb`` the size of one float32 score tensor over the whole batch, for scale.

    .venv/bin/python benchmarks/train_attention.py
    .venv/bin/python benchmarks/train_attention.py --cases "8,8,64,128;4,8,512,256" --runs 10
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
    "impl",
    "pass",
    "P",
    "G",
    "Lp",
    "N",
    "median_ms",
    "spread",
    "xla_temp_mb",
    "score_mb",
    "speedup",
]


@dataclasses.dataclass
class Args:
    cases: str = "8,8,64,128;4,8,512,256"
    """semicolon-separated P,G,Lp,N cases (the first is benchmarks/train_step.py's batch)"""
    kv_heads: int = 4
    """Hkv"""
    q_per_kv: int = 2
    """R: query heads per KV head"""
    head_dim: int = 32
    """D"""
    runs: int = 5
    """timed runs per case (median reported)"""


def _unblocked(P, G, H, R, Lp, N, D):
    from relax.models.attention import blocks as attn

    B = P * G

    def f(q, pk, pv, ck, cv):
        qb = q.transpose(0, 2, 1, 3, 4).reshape(B, H, R * N, D)
        kb = ck.transpose(0, 2, 1, 3, 4).reshape(B, H, N, D)
        vb = cv.transpose(0, 2, 1, 3, 4).reshape(B, H, N, D)
        t = jnp.arange(N)
        own = jnp.broadcast_to(
            (t[:, None] >= t[None, :])[None, None, None], (B, 1, R, N, N)
        ).reshape(B, 1, R * N, N)
        own_block = attn.block_stats(qb, kb, vb, own)
        prompt_block = attn.shared_prefix_attention(qb, pk, pv, jnp.ones((P, 1, 1, Lp), bool), G)
        out = attn.merge_stats([prompt_block, own_block])
        return out.reshape(P, G, H, R * N, D).transpose(0, 2, 1, 3, 4)

    return f


def main(args: Args) -> None:
    from relax.models.attention.group import prefix_group_attention

    H, R, D = args.kv_heads, args.q_per_kv, args.head_dim
    for case in [c for c in args.cases.split(";") if c]:
        P, G, Lp, N = (int(x) for x in case.split(","))
        xs, pos = harness.group_attention_inputs(P, G, H, R, Lp, N, D)
        w = jax.random.normal(jax.random.key(9), xs[0].shape)
        impls = {
            "unblocked": _unblocked(P, G, H, R, Lp, N, D),
            "group": lambda *a: prefix_group_attention(*a, *pos),
            "group_saved": lambda *a: prefix_group_attention(*a, *pos, save_probabilities=True),
        }
        got = {name: f(*xs) for name, f in impls.items()}
        err = max(
            float(jnp.max(jnp.abs(got[g] - got["unblocked"]))) for g in ("group", "group_saved")
        )
        times = {}
        for pass_ in ("forward", "forward+backward"):
            for name, f in impls.items():
                fn = (
                    jax.jit(f)
                    if pass_ == "forward"
                    else jax.jit(jax.grad(lambda *a, f=f: jnp.sum(w * f(*a)), argnums=range(5)))
                )
                r = harness.measure(fn, *xs, warmup=1, runs=args.runs)
                times[(pass_, name)] = r["median_s"]
                harness.emit(
                    {
                        "bench": "train_attention",
                        "impl": name,
                        "pass": pass_,
                        "P": P,
                        "G": G,
                        "Hkv": H,
                        "R": R,
                        "D": D,
                        "Lp": Lp,
                        "N": N,
                        "median_ms": r["median_s"] * 1e3,
                        "min_ms": r["min_s"] * 1e3,
                        "spread": r["spread"],
                        "compile_s": r["compile_s"],
                        "runs": r["runs"],
                        "xla_temp_mb": round(r.get("xla_temp_bytes", 0) / 2**20, 1),
                        "score_mb": round(P * G * H * R * N * (Lp + N) * 4 / 2**20, 1),
                        "speedup": times[(pass_, "unblocked")] / r["median_s"],
                        "max_abs_diff": err,
                    },
                    TABLE,
                )


if __name__ == "__main__":
    main(tyro.cli(Args))
