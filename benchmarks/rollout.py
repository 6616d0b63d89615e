"""Rollout throughput: prefix-shared KV cache vs repeated prompts vs no cache.

Cases (the rollout issue's small config: Llama arch, vocab 4096, hidden 256, 4 layers,
8 heads / 4 KV heads, float32, random weights; stop ids unreachable, so every completion
runs the whole budget):

  a  P=8 prompts of 64 random tokens,  G=8,  N=128 new tokens
  b  P=4 prompts of 1024 random tokens, G=16, N=128 new tokens

Modes:

  prefix   ``relax.rollout.sampler.compiled_generate(RolloutConfig(num_generations=G, ...))``: each
           prompt prefilled once, its KV stored once and shared by its G completions
  repeat   the same sampler on the prompts repeated G times with ``num_generations=1``
  nocache  ``relax.rollout.naive``: a full forward over the whole buffer per new token. It is
           quadratic, so it runs ``--nocache-tokens`` new tokens and the time is scaled to N
           by the ratio of executed weight-matmul FLOPs (``extrapolated_from_new_tokens``).
  lora     prefix, on a policy with rank ``--lora-rank`` adapters on every linear layer, run
           beside the fused weights (``RolloutConfig(merge_adapters=False)``)
  lora_merged  the same with ``merge_adapters=True`` (the default): ``W + s A B`` folded into the
           per-rollout fused weights (FLOPs for both count the base weights only)

Each (case, mode) runs in its own subprocess so its peak memory is its own.

FLOPs counted are those of the weight matmuls only (attention scores are excluded):
2 * (layer params + head params) per decoded token, plus 2 * layer params per prefilled
token (prefill computes logits at the last position only; rows = P for prefix, P*G for
repeat). For nocache, every step runs all layers and the head over the whole buffer.

    .venv/bin/python benchmarks/rollout.py                       # all cases and modes
    .venv/bin/python benchmarks/rollout.py --cases a --modes prefix,repeat --runs 5
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

CASES = {"a": dict(P=8, Lp=64, G=8, N=128), "b": dict(P=4, Lp=1024, G=16, N=128)}
NOCACHE_TOKENS = {"a": 16, "b": 2}  # new tokens the quadratic no-cache sampler really generates
HEAVY = {("b", "repeat"), ("b", "nocache"), ("a", "nocache")}  # many seconds a call: no warmup run
MODES = ("prefix", "repeat", "nocache", "lora", "lora_merged")
TABLE = [
    "case",
    "mode",
    "P",
    "G",
    "Lp",
    "N",
    "tokens_per_s",
    "median_s",
    "spread",
    "compile_s",
    "peak_mem_mb",
    "xla_temp_mb",
    "achieved_gflops",
    "frac_of_peak",
    "extrapolated_from_new_tokens",
    "skipped",
]


@dataclasses.dataclass
class Args:
    cases: str = "a,b"
    """comma-separated subset of: a (64-token prompts), b (1024-token prompts)"""
    modes: str = "prefix,repeat,nocache"
    """comma-separated subset of: prefix, repeat, nocache"""
    runs: int = 3
    """timed runs per (case, mode); the median is reported"""
    nocache_tokens: int = 0
    """new tokens the no-cache sampler really generates, time scaled to N (0: a=16, b=2)"""
    lora_rank: int = 16
    """adapter rank of the lora modes"""
    nocache_b: bool = True
    """run nocache on case b too (~40 s, ~4 GB: [64, 8, 1026, 1026] float32 scores per layer)"""
    budget_s: float = 50.0
    """stop starting timed runs of one (case, mode) once they would pass this many seconds"""
    single: str = ""
    """internal: 'CASE:MODE' runs one measurement in this process"""


def param_counts(cfg) -> tuple[int, int]:
    """(all decoder-layer weights, LM-head weights): the matmul weights one token passes through."""
    d = cfg.hidden_size
    per_layer = (
        d * cfg.head_dim * 2 * (cfg.num_heads + cfg.num_kv_heads) + 3 * d * cfg.intermediate_size
    )
    return cfg.num_layers * per_layer, cfg.vocab_size * d


def matmul_flops(cfg, mode: str, P: int, G: int, Lp: int, N: int) -> float:
    layers, head = param_counts(cfg)
    if mode == "nocache":  # step t: full forward (all positions, logits everywhere) over Lp + N
        return 2.0 * (layers + head) * P * G * (Lp + N) * N
    prefill_rows = P * G if mode == "repeat" else P
    return (
        2.0 * layers * prefill_rows * Lp
        + 2.0 * head * prefill_rows
        + 2.0 * (layers + head) * P * G * (N - 1)
    )


def _with_adapters(model, rank: int):
    """``model`` with rank-``rank`` adapters whose B is random too (a trained adapter)."""
    import dataclasses

    from relax.models.adapters.operations import add_lora, with_adapters
    from relax.models.layers.lora import LoRAConfig, LoRAWeights

    ad = add_lora(model, LoRAConfig(rank=rank), jax.random.key(3)).layers.lora
    ws = {
        f: LoRAWeights(w.a, 0.01 * jax.random.normal(jax.random.key(i), w.b.shape))
        for i, (f, w) in enumerate(ad.weights().items())
    }
    return with_adapters(model, dataclasses.replace(ad, **ws))


def run_one(case: str, mode: str, args: Args) -> dict:
    from relax import models
    from relax.rollout import naive as rollout_naive
    from relax.rollout import sampler as rollout

    c = CASES[case]
    P, Lp, G, N = c["P"], c["Lp"], c["G"], c["N"]
    cfg = models.small_config()
    model = models.init(cfg, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (P, Lp), 1, cfg.vocab_size, jnp.int32)
    mask = jnp.ones((P, Lp), jnp.int32)
    key = jax.random.key(2)
    n_run = N
    if mode in ("prefix", "lora", "lora_merged"):
        if mode != "prefix":
            model = _with_adapters(model, args.lora_rank)
        fn = rollout.compiled_generate(
            rollout.RolloutConfig(
                num_generations=G,
                max_new_tokens=N,
                eos_ids=(),
                merge_adapters=mode == "lora_merged",
            )
        )
    elif mode == "repeat":
        ids, mask = jnp.repeat(ids, G, axis=0), jnp.repeat(mask, G, axis=0)
        fn = rollout.compiled_generate(
            rollout.RolloutConfig(num_generations=1, max_new_tokens=N, eos_ids=())
        )
    else:
        n_run = min(args.nocache_tokens or NOCACHE_TOKENS[case], N)
        fn = rollout_naive._compiled(
            rollout.RolloutConfig(num_generations=G, max_new_tokens=n_run, eos_ids=())
        )
    r = harness.measure(
        fn,
        model,
        ids,
        mask,
        key,
        warmup=0 if (case, mode) in HEAVY else 1,
        runs=args.runs,
        budget_s=args.budget_s,
    )
    flops_run = matmul_flops(cfg, mode, P, G, Lp, n_run)
    flops = matmul_flops(cfg, mode, P, G, Lp, N)
    scale = flops / flops_run
    med = r["median_s"] * scale
    peak, peak_source = harness.peak_flops()
    rec = {
        "bench": "rollout",
        "case": case,
        "mode": mode,
        "P": P,
        "G": G,
        "Lp": Lp,
        "N": N,
        "tokens_per_s": P * G * N / med,
        "median_s": med,
        "min_s": r["min_s"] * scale,
        "max_s": r["max_s"] * scale,
        "spread": r["spread"],
        "compile_s": r["compile_s"],
        "peak_mem_mb": round(r["peak_mem_bytes"] / 2**20, 1)
        if r["peak_mem_bytes"] is not None
        else None,
        "matmul_gflop": round(flops / 1e9, 2),
        "achieved_gflops": flops / med / 1e9,
        "peak_gflops": peak / 1e9,
        "frac_of_peak": flops / med / peak,
        "runs": r["runs"],
        "warmup": r["warmup"],
        "peak_mem_how": r["peak_mem_how"],
        "xla_temp_mb": round(r.get("xla_temp_bytes", 0) / 2**20, 1),
        "peak_source": peak_source,
    }
    if n_run != N:
        rec["extrapolated_from_new_tokens"] = n_run
        rec["measured_median_s"] = r["median_s"]
        rec["note"] = (
            f"timed {n_run} new tokens, scaled to {N} by the weight-matmul FLOP ratio {scale:.1f} "
            f"(attention, quadratic in the buffer, grows a little faster: a lower bound)"
        )
    return rec


def main(args: Args) -> None:
    if args.single:
        case, mode = args.single.split(":")
        harness.emit(run_one(case, mode, args))
        return
    cases = [c for c in args.cases.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"unknown case {c!r}; valid: {sorted(CASES)}")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; valid: {MODES}")
    for c in cases:
        for m in modes:
            if c == "b" and m == "nocache" and not args.nocache_b:
                harness.emit(
                    {
                        "bench": "rollout",
                        "case": c,
                        "mode": m,
                        **CASES[c],
                        "skipped": "nocache on 1024-token prompts is quadratic; --nocache-b to run it",
                    },
                    TABLE,
                )
                continue
            argv = [
                "--single",
                f"{c}:{m}",
                "--runs",
                str(args.runs),
                "--nocache-tokens",
                str(args.nocache_tokens),
                "--lora-rank",
                str(args.lora_rank),
                "--budget-s",
                str(args.budget_s),
            ]
            harness.run_isolated(os.path.abspath(__file__), argv, table=TABLE)


if __name__ == "__main__":
    main(tyro.cli(Args))
