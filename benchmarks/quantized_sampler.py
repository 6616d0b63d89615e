"""An 8-bit sampler (``RolloutConfig.sampler_precision``, ``relax.models.layers.quantized``) against
the model's own: its speed, the bytes of its weights and how far its log-probs are from the
trainer's.

On the real checkpoint ``models/smollm2-135m-instruct`` when present (``benchmarks/make_smollm2.py``;
bfloat16 params and compute, the arithmetic task's chat prompts), else a random 16-layer model:
``--prompts`` prompts x ``--gens`` completions x ``--tokens`` tokens (no stop ids, so every
completion runs to the budget), for each ``--precisions``:

``tokens_per_s``   sampled tokens / seconds of one rollout (prefill and decode, one jitted
                   program), the median of ``--runs`` runs alternating the precisions
``layer_bytes``    the decode loop's fused layer matrices (``FUSED_WEIGHTS``: codes + scales when
                   8-bit), ``head_bytes`` the LM head it reads per step
``mismatch``       ``d = log p_trainer - log p_sampler`` per valid token, the trainer the model
                   itself in bfloat16 (prefix-shared forward): max / p99.9 / mean |d| and the
                   ratio ``exp(d)``'s range (the model's own sampler: the bfloat16 gap of the precision
                   policy, ``benchmarks/precision.py``)

    .venv/bin/python benchmarks/quantized_sampler.py                 # JSON lines, then a summary
    .venv/bin/python benchmarks/quantized_sampler.py --random --precisions model int8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from precision import left_pad, load, stats  # noqa: E402

from relax.models.decoder.transformer import fuse_layers  # noqa: E402
from relax.models.forward.prefix_shared import completion_logprobs  # noqa: E402
from relax.models.layers.quantized import FUSED_WEIGHTS, quantize, quantize_fields  # noqa: E402
from relax.rollout import sampler as rollout  # noqa: E402
from relax.rollout.config import RolloutConfig  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def weight_bytes(model, precision: str) -> dict:
    """The decode loop's fused matrices and head as the sampler of ``precision`` holds them."""
    layers = fuse_layers(model)
    head = model.head.astype(model.dtype)
    if precision != "model":
        layers = [quantize_fields(p, FUSED_WEIGHTS, precision, model.dtype) for p in layers]
        head = quantize(model.head, precision, model.dtype, contract=-1)
    fields = [getattr(p, f) for p in layers for f in FUSED_WEIGHTS if getattr(p, f) is not None]
    return {"layer_bytes": nbytes(fields), "head_bytes": nbytes(head)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", nargs="+", default=["model", "int8", "fp8"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gens", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--random", action="store_true", help="a random model even with the checkpoint")
    args = ap.parse_args(argv)
    model, prompts, _, name = load(random=args.random)  # bfloat16 params and compute
    ids, mask = left_pad(prompts[: args.prompts], 128)
    gen = jax.jit(rollout.generate_program, static_argnums=4)
    train = jax.jit(completion_logprobs)
    cfgs = {
        p: RolloutConfig(
            num_generations=args.gens,
            max_new_tokens=args.tokens,
            sampling=SamplingConfig(temperature=1.0),
            compactions=0,
            sampler_precision=p,
        )
        for p in args.precisions
    }
    rows = {}
    for p, cfg in cfgs.items():  # compile, and the mismatch of one rollout
        t0 = time.perf_counter()
        r = jax.block_until_ready(gen(model, ids, mask, jax.random.key(0), cfg))
        compile_s = time.perf_counter() - t0
        lp = train(model, ids, mask, r.tokens, r.mask)
        rows[p] = {"model": name, "precision": p, "compile_and_first_s": round(compile_s, 1)}
        rows[p] |= weight_bytes(model, p) | {"mismatch": stats(r.logprobs, lp, r.mask)}
    seconds = {p: [] for p in cfgs}
    for i in range(args.runs):  # alternating: a drift of the machine's load hits every precision
        for p, cfg in cfgs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(gen(model, ids, mask, jax.random.key(i + 1), cfg))
            seconds[p].append(time.perf_counter() - t0)
    tokens = args.prompts * args.gens * args.tokens
    out = []
    for p, row in rows.items():
        median = float(np.median(seconds[p]))
        row |= {
            "tokens": tokens,
            "seconds": [round(s, 3) for s in seconds[p]],
            "tokens_per_s": round(tokens / median, 1),
            "backend": jax.default_backend(),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    main()
