"""SFT update throughput with and without packing, on the same examples (random weights).

``--model-shape small`` (``relax.models.small_config()``: Llama architecture, vocab 4096, hidden
256, 4 layers), float32. ``--examples`` examples with lengths drawn log-uniformly from
``[min-len, max-len]`` (seeded; every token but the first a target), one batch per step:

- ``packed``: whole examples packed into rows of ``max-len`` tokens (first-fit-decreasing,
  ``relax.data.supervised.pack``), attention kept within each example (``relax.models.forward.packed``);
- ``unpacked``: one example per row, right-padded to ``max-len``.

Both run the same ``make_sft_step`` (one optimizer step, ``grad_accum`` micro-batches). Prints one
JSON line per case: median seconds per step, non-padding tokens per second of the update, the
rows and padding fraction, compile seconds; the packed line adds its speed-up over the unpacked one.

    python benchmarks/sft.py [--runs 5] [--examples 32] [--min-len 16] [--max-len 256] [--no-remat]
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

from relax.algorithms.sft import SFTConfig, init_sft_state, make_sft_step, sft_batch  # noqa: E402
from relax.data.supervised import SFTExample, padding_fraction  # noqa: E402
from relax.models import init, small_config  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.run import CompileCounter  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 5
    examples: int = 32
    min_len: int = 16
    max_len: int = 256
    """also the row length of both layouts"""
    grad_accum: int = 1
    remat: bool = True
    """per-layer remat (SFT's default)"""
    seed: int = 0
    cases: tuple[str, ...] = ("unpacked", "packed")


def make_examples(args: Args, vocab: int) -> list[SFTExample]:
    rng = np.random.default_rng(args.seed)
    lengths = np.exp(
        rng.uniform(np.log(args.min_len), np.log(args.max_len + 1), args.examples)
    ).astype(int)
    lengths = np.clip(lengths, args.min_len, args.max_len)
    return [
        SFTExample(rng.integers(1, vocab, n), np.r_[0, np.ones(n - 1, np.int32)]) for n in lengths
    ]


def run_case(args: Args, packing: bool, model, examples) -> dict:
    cfg = SFTConfig(
        max_length=args.max_len,
        packing=packing,
        grad_accum=args.grad_accum,
        remat=args.remat,
        optimizer=OptimizerConfig(learning_rate=1e-5),
    )
    batch = jax.tree.map(jnp.asarray, sft_batch(cfg, examples, pad_id=0))
    step = make_sft_step(cfg)
    state = init_sft_state(cfg, jax.tree.map(jnp.copy, model), key=jax.random.key(1))
    t0 = time.perf_counter()
    state, out = step(state, batch)
    jax.block_until_ready(state)
    first = time.perf_counter() - t0
    times = []
    with CompileCounter() as recompiles:
        for _ in range(args.runs):
            t = time.perf_counter()
            state, out = step(state, batch)
            jax.block_until_ready(state)
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    tokens = int(out.metrics["tokens"])
    rows = int(batch.ids.shape[0])
    return {
        "bench": "sft",
        "case": "packed" if packing else "unpacked",
        "examples": len(examples),
        "row_length": args.max_len,
        "rows": rows,
        "tokens": tokens,
        "padding_fraction": padding_fraction(batch),
        "grad_accum": args.grad_accum,
        "runs": len(times),
        "step_s": med,
        "min_step_s": min(times),
        "max_step_s": max(times),
        "spread": (max(times) - min(times)) / med,
        "tokens_per_s": tokens / med,
        "compile_s": round(first - med, 3),
        "compiles_after_first": recompiles.count,
        "loss": float(out.metrics["loss"]),
    }


def main(args: Args) -> list[dict]:
    mcfg = small_config()
    model = init(mcfg, jax.random.key(0))
    examples = make_examples(args, mcfg.vocab_size)
    lengths = [len(e) for e in examples]
    out, base = [], None
    for case in args.cases:
        if case not in ("packed", "unpacked"):
            raise SystemExit(f"--cases {case!r}: packed | unpacked")
        rec = run_case(args, case == "packed", model, examples)
        rec.update(
            model_shape="small",
            params=mcfg.num_params(),
            min_len=args.min_len,
            max_len=args.max_len,
            mean_len=float(np.mean(lengths)),
        )
        if case == "unpacked":
            base = rec["tokens_per_s"]
        elif base is not None:
            rec["speedup_vs_unpacked"] = rec["tokens_per_s"] / base
        out.append(
            emit(
                rec,
                table=[
                    "bench",
                    "case",
                    "rows",
                    "tokens",
                    "padding_fraction",
                    "step_s",
                    "tokens_per_s",
                    "compile_s",
                    "speedup_vs_unpacked",
                ],
            )
        )
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
