"""Token log-probs from hidden states: chunked (relax) vs naive full log-softmax.

    chunked  ``relax.models.decoder.logprobs.logprobs_from_hidden`` - row chunks of ``chunk_size``,
             each chunk's logits rematerialised in the backward pass
    naive    ``take_along_axis(jax.nn.log_softmax(h @ W.T), targets)`` - a [T, V] float32
             logits tensor (and its softmax) alive at once

Timed: forward + backward, ``jax.grad`` of the summed log-probs with respect to both the
hidden states and the head weights (what the trainer needs). Hidden size 256; vocab and
token count grow. Each case runs in its own subprocess so the resident-set peak is its own;
``xla_temp_mb`` is XLA's own count of the program's scratch + output buffers.

FLOPs: 3 matmuls of 2*T*V*D (forward, grad of h, grad of W); the chunked version's backward
recomputes the logits of every chunk, a single one included (4 matmuls) - ``matmul_gflop``
counts what ran.

    .venv/bin/python benchmarks/logprobs.py
    .venv/bin/python benchmarks/logprobs.py --vocabs 32768 --tokens 8192 --runs 5
"""

from __future__ import annotations

import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx  # noqa: E402
import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tyro  # noqa: E402

METHODS = ("chunked", "naive")
TABLE = [
    "method",
    "V",
    "T",
    "D",
    "median_s",
    "spread",
    "compile_s",
    "peak_mem_mb",
    "xla_temp_mb",
    "logits_mb",
    "achieved_gflops",
    "frac_of_peak",
    "error",
]


@dataclasses.dataclass
class Args:
    vocabs: str = "4096,32768"
    """comma-separated vocabulary sizes"""
    tokens: str = "1024,8192"
    """comma-separated token (row) counts"""
    hidden: int = 256
    """hidden size D"""
    methods: str = "chunked,naive"
    """comma-separated subset of: chunked, naive"""
    chunk_size: int = 1024
    """rows per chunk for the chunked method"""
    runs: int = 3
    """timed runs per case (median reported)"""
    budget_s: float = 40.0
    """stop starting timed runs of one case once they would pass this many seconds"""
    single: str = ""
    """internal: 'METHOD:V:T' runs one case in this process"""


def run_one(method: str, V: int, T: int, args: Args) -> dict:
    from relax import models
    from relax.models.decoder.logprobs import logprobs_from_hidden

    D = args.hidden
    cfg = models.small_config(vocab_size=V, hidden_size=D, num_layers=1)
    model = models.init(cfg, jax.random.key(0))
    h = jax.random.normal(jax.random.key(1), (T, D), jnp.float32)
    targets = jax.random.randint(jax.random.key(2), (T,), 0, V, jnp.int32)
    W = model.lm_head

    if method == "chunked":

        def loss(h, W):
            m = eqx.tree_at(lambda m: m.lm_head, model, W)
            return jnp.sum(logprobs_from_hidden(m, h, targets, chunk_size=args.chunk_size))

        matmuls = 4  # the custom backward recomputes the logits
    else:

        def loss(h, W):
            logp = jax.nn.log_softmax(jnp.einsum("td,vd->tv", h, W), axis=-1)
            return jnp.sum(jnp.take_along_axis(logp, targets[:, None], axis=-1))

        matmuls = 3

    fn = jax.jit(jax.grad(loss, argnums=(0, 1)))
    r = harness.measure(fn, h, W, warmup=1, runs=args.runs, budget_s=args.budget_s)
    flops = matmuls * 2.0 * T * V * D
    peak, peak_source = harness.peak_flops()
    return {
        "bench": "logprobs",
        "method": method,
        "V": V,
        "T": T,
        "D": D,
        "chunk_size": args.chunk_size if method == "chunked" else None,
        "median_s": r["median_s"],
        "min_s": r["min_s"],
        "max_s": r["max_s"],
        "spread": r["spread"],
        "compile_s": r["compile_s"],
        "runs": r["runs"],
        "peak_mem_mb": round(r["peak_mem_bytes"] / 2**20, 1)
        if r["peak_mem_bytes"] is not None
        else None,
        "xla_temp_mb": round(r.get("xla_temp_bytes", 0) / 2**20, 1),
        "logits_mb": round(T * V * 4 / 2**20, 1),
        "matmul_gflop": flops / 1e9,
        "achieved_gflops": flops / r["median_s"] / 1e9,
        "peak_gflops": peak / 1e9,
        "frac_of_peak": flops / r["median_s"] / peak,
        "peak_mem_how": r["peak_mem_how"],
        "peak_source": peak_source,
    }


def main(args: Args) -> None:
    if args.single:
        method, V, T = args.single.split(":")
        harness.emit(run_one(method, int(V), int(T), args), TABLE)
        return
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; valid: {METHODS}")
    cases = [(int(v), int(t)) for v in args.vocabs.split(",") for t in args.tokens.split(",")]
    for V, T in sorted(cases, key=lambda c: c[0] * c[1]):  # small to large
        for m in methods:
            argv = [
                "--single",
                f"{m}:{V}:{T}",
                "--runs",
                str(args.runs),
                "--hidden",
                str(args.hidden),
                "--chunk-size",
                str(args.chunk_size),
                "--budget-s",
                str(args.budget_s),
            ]
            harness.run_isolated(os.path.abspath(__file__), argv, table=TABLE)


if __name__ == "__main__":
    main(tyro.cli(Args))
