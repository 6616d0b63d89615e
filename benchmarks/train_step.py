"""One GRPO iteration, split into rollout / score / update, on a model shape (random weights).

``--model-shape small`` (default): the rollout issue's small config: Llama architecture, vocab
4096, hidden 256, intermediate 688, 4 layers, 8 heads, 4 KV heads. ``--model-shape small-moe``: the
same attention with every MLP a Mixtral-style mixture of 8 experts of width 344, top-2 (the
same active parameters as ``small``: 2 x 344 = 688 MLP units per token). ``--model-shape smollm-135m``:
SmolLM2-135M's shape (Llama architecture, vocab 49,152, hidden 576, intermediate 1536, 30 layers,
9 heads, 3 KV heads, tied embeddings). float32. By default 8 prompts x 8 completions, 64-token
prompts, 128 new tokens (stop tokens unreachable, so every completion is full length), KL beta
0.04 with a reference model, one epoch, one minibatch.

    python benchmarks/train_step.py [--runs 5] [--preset grpo]
    python benchmarks/train_step.py --model-shape smollm-135m --prompts 4 --generations 4 --new-tokens 64

Prints one JSON line: median seconds per iteration and per stage, generated tokens/s, compile
seconds per stage, and the update's achieved FLOP/s against the matmul peak measured here.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit, peak_flops  # noqa: E402

from relax.algorithms.grpo.config import preset  # noqa: E402
from relax.algorithms.grpo.step import make_grpo_step  # noqa: E402
from relax.algorithms.online.batch import step_input  # noqa: E402
from relax.algorithms.online.step import StepParts  # noqa: E402
from relax.models import ModelConfig, init, small_config  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.train.run import CompileCounter  # noqa: E402
from relax.train.state import init_state  # noqa: E402

SHAPES = {
    "small": small_config,
    "small-moe": lambda: small_config(
        family="mixtral",
        intermediate_size=344,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=344,
        norm_topk_prob=True,
    ),
    "smollm-135m": lambda: ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 5
    model_shape: str = "small"
    """small | small-moe | smollm-135m"""
    preset: str = "grpo"
    prompts: int = 8
    generations: int = 8
    prompt_len: int = 64
    new_tokens: int = 128
    beta: float = 0.04
    grad_accum: int | None = None
    """micro-batches (of whole prompt groups) per optimizer step; None: relax's default"""


def reward(prompts, completions, **fields):
    """Cheap deterministic reward: parity of the completion's first token id."""
    return [float(int(c.split(" ", 1)[0]) % 2) if c else 0.0 for c in completions]


def decode(tokens, mask):
    return [" ".join(map(str, row[m > 0])) for row, m in zip(tokens, mask)]


def main(args: Args) -> dict:
    if args.model_shape not in SHAPES:
        raise SystemExit(f"--model-shape {args.model_shape!r}: one of {', '.join(SHAPES)}")
    mcfg = SHAPES[args.model_shape]()
    model = init(mcfg, jax.random.key(0))
    cfg = preset(
        args.preset,
        num_generations=args.generations,
        max_new_tokens=args.new_tokens,
        beta=args.beta,
        grad_accum=args.grad_accum,
        remat=False,  # as every recorded figure ran (the trainers' default is on)
        optimizer=OptimizerConfig(learning_rate=1e-6),
    )
    opt = cfg.optimizer.make()
    state = init_state(model, opt, key=jax.random.key(1), with_reference=cfg.needs_reference)
    step = make_grpo_step(cfg, StepParts(reward_fns=[reward], decode=decode, eos_ids=(), pad_id=0))
    p = args.prompts
    ids = jax.random.randint(jax.random.key(2), (p, args.prompt_len), 0, mcfg.vocab_size)

    def batch():
        return step_input(ids, jnp.ones_like(ids), ["x"] * p, {})

    def iteration(state):
        b, times = batch(), {}
        for seg in step.segments:
            t0 = time.perf_counter()
            state, b = seg.run(state, b)
            jax.block_until_ready((state, b.device))  # the host record holds no device work
            times["+".join(seg.names)] = time.perf_counter() - t0
        return state, times

    state, first = iteration(state)  # compiles
    runs = []
    with CompileCounter() as recompiles:
        for _ in range(args.runs):
            state, times = iteration(state)
            runs.append(times)
    stages = list(first)
    med = {s: statistics.median(r[s] for r in runs) for s in stages}
    total = statistics.median(sum(r.values()) for r in runs)
    tokens = p * args.generations * args.new_tokens
    # update FLOPs: forward + backward ~ 6 * params * tokens, the prompt counted once per group
    # (the reference forward, 2 * params * tokens, is a program of its own since the score was
    # split around it: not counted)
    # embedding lookups are free (a tied head's matmul is counted: num_params counts it once); a
    # mixture of experts counts the experts a token uses (num_active_params)
    n_params = mcfg.num_active_params() - (
        0 if mcfg.tie_word_embeddings else mcfg.vocab_size * mcfg.hidden_size
    )
    update_tokens = p * args.prompt_len + tokens
    update_flops = 6 * n_params * update_tokens
    peak, peak_source = peak_flops()
    upd_name = next(s for s in stages if s.endswith("update"))  # advantage+update, fused
    upd = med[upd_name]
    return emit(
        {
            "bench": "train_step",
            "model_shape": args.model_shape,
            "params": mcfg.num_params(),
            "active_params": mcfg.num_active_params(),
            "preset": args.preset,
            "P": p,
            "G": args.generations,
            "Lp": args.prompt_len,
            "N": args.new_tokens,
            "beta": args.beta,
            "grad_accum": args.grad_accum,
            "runs": args.runs,
            "iteration_s": total,
            "rollout_s": med["rollout"],
            "score_s": med["score_start"] + med["score_finish"],
            "reference_s": med.get("reference", 0.0),
            "update_s": upd,
            "update_stages": upd_name,
            "min_iteration_s": min(sum(r.values()) for r in runs),
            "max_iteration_s": max(sum(r.values()) for r in runs),
            "tokens_per_s": tokens / total,
            "rollout_tokens_per_s": tokens / med["rollout"],
            "compile_s": {s: round(first[s] - med[s], 3) for s in stages},
            "compiles_after_first": recompiles.count,
            "update_gflops": update_flops / upd / 1e9,
            "peak_gflops": peak / 1e9,
            "peak_source": peak_source,
            "update_frac_of_peak": update_flops / upd / peak,
        },
        table=[
            "bench",
            "iteration_s",
            "rollout_s",
            "score_s",
            "update_s",
            "tokens_per_s",
            "update_frac_of_peak",
        ],
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
