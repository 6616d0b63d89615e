"""Block-sparse attention over a packed stream of prompts and completions: forward+backward.

One stream of S slots holds prompts (uniform lengths in ``prompt_len``), each followed by
``completions`` completions of log-normal lengths (mean ``S / completion_div``), until full;
the rest is padding. Every completion sees its prompt and its own earlier tokens. Two
implementations, same math:

    stream  ``relax.models.attention.stream.stream_attention``: a loop over the (query block,
            key block) pairs that hold an allowed entry (``block_pairs``, host), custom backward
    dense   ``relax.models.attention.blocks.attention`` over the full ``S x S`` allowed mask,
            differentiated by autodiff

``pairs`` is the number of block pairs visited of the ``nb (nb + 1) / 2`` causal ones,
``density`` the share of allowed entries in ``S x S``, ``host_ms`` the time of ``block_pairs``,
``speedup`` dense / stream (forward+backward, medians). ``--dense-max-s``: the longest stream
the dense form is run on (its ``[Hq, S, S]`` float32 scores are 2 GiB at S = 8192, Hq = 8).

    .venv/bin/python benchmarks/stream_attention.py
    .venv/bin/python benchmarks/stream_attention.py --lengths 2048 --blocks 64 --runs 3
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import tyro  # noqa: E402

TABLE = ["impl", "S", "block", "pairs", "density", "host_ms", "median_ms", "spread", "speedup"]


@dataclasses.dataclass
class Args:
    lengths: str = "2048,8192"
    """comma-separated stream lengths S"""
    blocks: str = "32,64,128"
    """comma-separated block sizes of the stream kernel"""
    q_heads: int = 8
    """Hq (benchmarks/train_step.py's small shape)"""
    kv_heads: int = 4
    """Hkv"""
    head_dim: int = 64
    """D"""
    completions: int = 4
    """completions per prompt"""
    completion_div: int = 16
    """mean completion length = S / completion_div (log-normal)"""
    prompt_len: str = "32,256"
    """min,max prompt length (uniform)"""
    dense_max_s: int = 8192
    """run the dense reference only up to this S"""
    runs: int = 3
    """timed runs per case (median reported)"""
    dtype: str = "float32"
    """q, k, v dtype: float32 | bfloat16"""
    cudnn: bool = True
    """on a GPU, also time ``jax.nn.dot_product_attention(implementation="cudnn")`` (16-bit only):
    ``cudnn_masked`` with the same allowed mask (same math), ``cudnn_causal`` causal over the whole
    stream (a bound: what a fused kernel costs for S x S / 2, not the same math)"""
    seed: int = 0


def make_stream(s: int, args: Args, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """``(positions, docs, prefix_of, is_prefix)`` of one stream filled with prompts and their
    completions, then padding."""
    pos, docs, pre = (np.zeros(s, np.int32) for _ in range(3))
    isp = np.zeros(s, bool)
    lo, hi = (int(x) for x in args.prompt_len.split(","))
    mean = s / args.completion_div
    at, doc = 0, 1
    while True:
        lp = int(rng.integers(lo, hi + 1))
        lens = np.maximum(1, rng.lognormal(np.log(mean) - 0.5, 1.0, args.completions).astype(int))
        if at + lp + int(lens.sum()) > s:
            break
        prompt = doc
        for n, start, is_prompt in [(lp, 0, True)] + [(int(n), lp, False) for n in lens]:
            pos[at : at + n] = start + np.arange(n)
            docs[at : at + n], pre[at : at + n], isp[at : at + n] = doc, prompt, is_prompt
            at, doc = at + n, doc + 1
    return pos, docs, pre, isp


def allowed_matrix(pos, docs, pre, isp) -> np.ndarray:
    """The full ``[S, S]`` allowed mask (no window)."""
    q, k = (lambda x: x[:, None]), (lambda x: x[None, :])
    ok = (q(docs) > 0) & (k(docs) > 0) & (k(pos) <= q(pos))
    return ok & ((k(docs) == q(docs)) | (k(isp) & (k(pre) == q(pre))))


def _grad(f, w):
    return jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * f(q, k, v)), argnums=(0, 1, 2)))


def main(args: Args) -> None:
    from relax.models.attention.blocks import attention
    from relax.models.attention.stream import (
        StreamMask,
        block_pairs,
        num_block_pairs,
        stream_attention,
    )

    rng = np.random.default_rng(args.seed)
    hq, hk, d = args.q_heads, args.kv_heads, args.head_dim
    for s in (int(x) for x in args.lengths.split(",") if x):
        meta = make_stream(s, args, rng)
        keys = jax.random.split(jax.random.key(args.seed), 4)
        dt = jnp.dtype(args.dtype)
        q = jax.random.normal(keys[0], (s, hq, d), dt)
        k, v = (jax.random.normal(kk, (s, hk, d), dt) for kk in keys[1:3])
        w = jax.random.normal(keys[3], (s, hq, d), dt)
        allowed = allowed_matrix(*meta)
        base = {
            "bench": "stream_attention",
            "S": s,
            "Hq": hq,
            "Hkv": hk,
            "D": d,
            "dtype": args.dtype,
        }
        base["density"] = float(allowed.mean())
        base["docs"] = int(meta[1].max())
        dense_ms = None
        if s <= args.dense_max_s:
            mask = jnp.asarray(allowed)[None]
            dense = lambda q, k, v: attention(
                q[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], mask
            )[0]
            r = harness.measure(_grad(dense, w), q, k, v, warmup=1, runs=args.runs)
            dense_ms = r["median_s"] * 1e3
            harness.emit({**base, "impl": "dense", "median_ms": dense_ms, **_extra(r)}, TABLE)
            del mask
        if args.cudnn and jax.default_backend() == "gpu" and dt.itemsize == 2:
            _cudnn(base, allowed, q, k, v, w, args.runs)
        for block in (int(x) for x in args.blocks.split(",") if x):
            t = time.perf_counter()
            pairs, n = block_pairs(*meta[1:], block)
            host_ms = (time.perf_counter() - t) * 1e3
            sm = StreamMask(*map(jnp.asarray, meta))
            f = lambda q, k, v, pairs=pairs, n=n, block=block: stream_attention(
                q, k, v, sm, pairs, n, block=block
            )
            r = harness.measure(_grad(f, w), q, k, v, warmup=1, runs=args.runs)
            ms = r["median_s"] * 1e3
            record = {
                **base,
                "impl": "stream",
                "block": block,
                "pairs": f"{n}/{num_block_pairs(s, block)}",
                "host_ms": host_ms,
                "median_ms": ms,
                "speedup": dense_ms / ms if dense_ms else None,
                **_extra(r),
            }
            harness.emit(record, TABLE)


def _cudnn(base: dict, allowed: np.ndarray, q, k, v, w, runs: int) -> None:
    """cuDNN's fused attention on the same stream, with the allowed mask and causal alone."""
    mask = jnp.asarray(allowed)[None, None]
    for name, kw in (("cudnn_masked", {"mask": mask}), ("cudnn_causal", {"is_causal": True})):

        def f(q, k, v, kw=kw):
            out = jax.nn.dot_product_attention(
                q[None], k[None], v[None], implementation="cudnn", **kw
            )
            return out[0]

        try:
            r = harness.measure(_grad(f, w), q, k, v, warmup=1, runs=runs)
        except Exception as e:  # noqa: BLE001 - a kernel cuDNN refuses is a result, not a crash
            harness.emit({**base, "impl": name, "error": str(e)[:300]}, TABLE)
            continue
        harness.emit({**base, "impl": name, "median_ms": r["median_s"] * 1e3, **_extra(r)}, TABLE)


def _extra(r: dict) -> dict:
    return {
        "pass": "forward+backward",
        "min_ms": r["min_s"] * 1e3,
        "spread": r["spread"],
        "compile_s": r["compile_s"],
        "runs": r["runs"],
        "xla_temp_mb": round(r.get("xla_temp_bytes", 0) / 2**20, 1),
    }


if __name__ == "__main__":
    main(tyro.cli(Args))
