"""Accelerator benchmarks against the hardware limit (run where a GPU/TPU is present).

1. Decode of a 1B-class Llama (Llama-3.2-1B shapes, random weights, bfloat16) as a fraction of
   the HBM roofline: bytes read per decode step (all weights once + the K/V read by the step)
   divided by the step time, against the datasheet bandwidth. The step time is the sampler's
   time for N new tokens minus its time for 1 new token (prefill), divided by N - 1.
2. The GRPO update step at 1B in bfloat16: model FLOPs (6 * params * trained tokens, prompt
   counted once per group) per second against the datasheet bf16 peak (MFU). Every layer is
   rematerialised (the batch does not fit otherwise), keeping nothing or the weight matmuls'
   outputs (``remat_policy``); the training attention is the trainer's default (cuDNN on GPU).
3. The training attention of one layer at 1B shapes, forward+backward: relax's prefix-group
   kernel (``relax.models.attention.group``, prompt keys shared by the G completions) against
   ``jax.nn.dot_product_attention`` with ``implementation="xla"`` and ``"cudnn"`` on the same
   work laid out as P*G causal sequences [prompt; completion] (the prompt repeated per
   completion, as a trainer without prefix sharing runs it). Tells where cuDNN wins.
4. Accuracy of the bfloat16 training log-probs and gradient through either attention path
   against float32 (``check_dense_accuracy``).
5. The long-prompt case (Lp = 1024, G = 16): the prefix-shared sampler against the repeated-prompt
   mode (each prompt repeated G times, ``num_generations=1``), tokens/s = P*G*N / time of the
   whole generate call (prefill included), and their ratio (acceptance: >= 5x).

    python benchmarks/gpu.py [--small] [--only decode,long_prompt,update,attention,accuracy]
                             [--decode-attention xla|pallas] [--cache-chunk N]

``--small``: a tiny config, to check the script on CPU. ``--only``: run just these parts (a
session with little device time); without it every part runs.

No flags library on purpose: the accelerator image may lack tyro; this script needs only
jax, equinox, optax and relax.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import datasheet, emit, group_attention_inputs, measure  # noqa: E402

from relax.algorithms.cli.configure import configure  # noqa: E402
from relax.algorithms.grpo.config import GRPOConfig  # noqa: E402
from relax.algorithms.grpo.loss import make_grpo_update  # noqa: E402
from relax.algorithms.online.batch import LossRows  # noqa: E402
from relax.models import ModelConfig, cast, init  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.rollout.sampler import RolloutConfig, compiled_generate  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402

SMALL = "--small" in sys.argv


def flag(name: str, default: str) -> str:
    """The value after ``--name`` on the command line, or ``default``."""
    argv = sys.argv[1:]
    return (
        argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default
    )


# The sampler's decode levers (benchmarks/gpu_levers.py sweeps them): the attention kernel and the
# completion-cache block size; every rollout config of this script and gpu_profile.py takes them.
DECODE_LEVERS = dict(
    decode_attention=flag("--decode-attention", "xla"),
    cache_chunk=int(flag("--cache-chunk", str(RolloutConfig.cache_chunk))),
)
PARTS = ("decode", "long_prompt", "update", "attention", "accuracy")
LLAMA_1B = ModelConfig(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = ModelConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def timed(fn, *args, runs=3):
    """Median seconds of ``runs`` calls after a compile + warm-up call."""
    return measure(fn, *args, warmup=1, runs=runs)["median_s"]


def decode_ideal_bytes(c: ModelConfig, dtype, p, g, lp, n) -> tuple[float, float]:
    """(weight bytes, K/V bytes) one decode step must read at least, on average over N steps::

        weights = params * itemsize                    (every weight once; tied head counted once)
        kv      = 2 * L * Hkv * D * itemsize * (P * Lp + P * G * N / 2)

    the shared prompt's keys/values once per prompt, each completion's own cache at its mean
    filled length N / 2.
    """
    bytes_el = jnp.dtype(dtype).itemsize
    kv_per_slot = 2 * c.num_layers * c.num_kv_heads * c.head_dim * bytes_el
    return c.num_params() * bytes_el, kv_per_slot * (p * lp + p * g * n / 2)


def bench_decode(model, p, g, lp, n, peak_bw):
    """Step = (time for N new tokens - time for 1) / (N - 1); achieved = ideal bytes / step."""
    c = model.config
    ids = jax.random.randint(jax.random.key(1), (p, lp), 0, c.vocab_size)
    mask = jnp.ones_like(ids)

    def gen(new):
        cfg = RolloutConfig(
            num_generations=g,
            max_new_tokens=new,
            sampling=SamplingConfig(temperature=1.0),
            **DECODE_LEVERS,
        )
        f = compiled_generate(cfg)
        return lambda: f(model, ids, mask, jax.random.key(2))

    t_full, t_prefill = timed(gen(n)), timed(gen(1))
    step = (t_full - t_prefill) / (n - 1)
    weight_bytes, kv_bytes = decode_ideal_bytes(c, model.dtype, p, g, lp, n)
    achieved = (weight_bytes + kv_bytes) / step
    return emit(
        {
            "bench": "gpu_decode",
            **DECODE_LEVERS,
            "params_b": c.num_params() / 1e9,
            "dtype": str(jnp.dtype(model.dtype)),
            "batch": p * g,
            "P": p,
            "G": g,
            "Lp": lp,
            "N": n,
            "step_ms": step * 1e3,
            "tokens_per_s": p * g / step,
            "bytes_per_step_gb": (weight_bytes + kv_bytes) / 1e9,
            "achieved_gb_per_s": achieved / 1e9,
            "hbm_roofline_frac": None if peak_bw is None else achieved / peak_bw,
            "generate_s": t_full,
            "prefill_s": t_prefill,
        }
    )


def bench_long_prompt(model, p, g, lp, n):
    """Long prompts: the prefix-shared sampler (P prompts, ``num_generations=G``) against the
    repeated-prompt mode (the P*G rows ``jnp.repeat(ids, G)``, ``num_generations=1``, as
    ``benchmarks/rollout.py``'s ``repeat`` mode), no stop ids::

        tokens/s = P * G * N / median seconds of the whole generate call (prefill included)
        speedup  = tokens/s shared / tokens/s repeated

    Memory at the 1B defaults (P=4, G=16, Lp=1024, N=256): K/V is 2 * 16 layers * 8 heads * 64
    * 2 B = 32 KiB a slot; the repeated mode caches P*G*(Lp+N) = 81,920 slots = 2.7 GB, its
    prefill runs 65,536 tokens whose per-layer float32 scores are 64 * 32 heads * 1024^2 * 4 B =
    8.6 GB, weights 2.5 GB. XLA's buffer assignment of the repeated program (compiled for CPU,
    which also keeps float32 copies of the weights): 29.4 GB of temporaries (shared: 10.8 GB),
    so it fits 80 GB.
    """
    c = model.config
    ids = jax.random.randint(jax.random.key(5), (p, lp), 0, c.vocab_size)
    mask = jnp.ones_like(ids)
    rep_ids, rep_mask = jnp.repeat(ids, g, axis=0), jnp.repeat(mask, g, axis=0)
    sampling = SamplingConfig(temperature=1.0)
    shared = compiled_generate(
        RolloutConfig(num_generations=g, max_new_tokens=n, sampling=sampling, **DECODE_LEVERS)
    )
    repeat = compiled_generate(
        RolloutConfig(num_generations=1, max_new_tokens=n, sampling=sampling, **DECODE_LEVERS)
    )
    t_shared = timed(lambda: shared(model, ids, mask, jax.random.key(2)))
    t_repeat = timed(lambda: repeat(model, rep_ids, rep_mask, jax.random.key(2)))
    tokens = p * g * n
    return emit(
        {
            "bench": "gpu_long_prompt",
            **DECODE_LEVERS,
            "params_b": c.num_params() / 1e9,
            "dtype": str(jnp.dtype(model.dtype)),
            "P": p,
            "G": g,
            "Lp": lp,
            "N": n,
            "shared_s": t_shared,
            "repeat_s": t_repeat,
            "shared_tokens_per_s": tokens / t_shared,
            "repeat_tokens_per_s": tokens / t_repeat,
            "speedup": t_repeat / t_shared,
            "target_speedup": 5.0,
        }
    )


def update_inputs(c: ModelConfig, p, g, lp, n) -> LossRows:
    """A random update batch: P full-length prompts, G full-length completions each."""
    k = jax.random.split(jax.random.key(3), 4)
    return LossRows(
        prompt_ids=jax.random.randint(k[0], (p, lp), 0, c.vocab_size),
        prompt_mask=jnp.ones((p, lp), jnp.int32),
        tokens=jax.random.randint(k[1], (p, g, n), 0, c.vocab_size),
        mask=jnp.ones((p, g, n), jnp.int32),
        loss_mask=jnp.ones((p, g, n), jnp.int32),
        old_logprobs=-jnp.abs(jax.random.normal(k[2], (p, g, n))),
        advantages=jax.random.normal(k[3], (p, g)),
    )


def bench_update(model, p, g, lp, n, peak_flops, remat_policy):
    c = model.config
    cfg = configure(
        GRPOConfig,
        num_generations=g,
        max_new_tokens=n,
        remat=True,
        remat_policy=remat_policy,
        optimizer=OptimizerConfig(learning_rate=1e-6),
    )
    opt = cfg.optimizer.make()
    data = update_inputs(c, p, g, lp, n)
    update = jax.jit(make_grpo_update(cfg, opt, choose_passes()))
    opt_state = opt.init(model)
    t = timed(lambda: update(model, opt_state, data, jax.random.key(0)), runs=3)
    tokens = p * lp + p * g * n
    flops = 6 * c.num_params() * tokens
    return emit(
        {
            "bench": "gpu_update",
            "params_b": c.num_params() / 1e9,
            "dtype": str(jnp.dtype(model.dtype)),
            "P": p,
            "G": g,
            "Lp": lp,
            "N": n,
            "remat_policy": remat_policy,
            "train_attention": cfg.forward.train_attention,
            "trained_tokens": tokens,
            "update_s": t,
            "tflops": flops / t / 1e12,
            "mfu": None if peak_flops is None else flops / t / peak_flops,
        }
    )


def bench_attention(p, g, lp, n, hk, r, d, dtype):
    from relax.models.attention.group import prefix_group_attention

    (q, pk, pv, ck, cv), pos = group_attention_inputs(p, g, hk, r, lp, n, d, dtype=dtype, seed=4)
    k = jax.random.split(jax.random.key(4), 5)
    f = lambda i, *shape: jax.random.normal(k[i], shape, dtype)
    # the same attention as P*G full sequences [prompt; completion], token-major [B, T, H, D]
    t = lp + n
    fq = f(0, p * g, t, hk * r, d)
    fk, fv = f(1, p * g, t, hk, d), f(2, p * g, t, hk, d)
    grad = lambda fn, n_args: jax.jit(
        jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=range(n_args))
    )
    cases = {
        "relax_group": (grad(lambda *a: prefix_group_attention(*a, *pos), 5), (q, pk, pv, ck, cv))
    }
    for impl in ("xla", "cudnn"):
        fn = lambda a, b_, c_, impl=impl: jax.nn.dot_product_attention(
            a, b_, c_, is_causal=True, implementation=impl
        )
        cases[f"dpa_{impl}_repeated"] = (grad(fn, 3), (fq, fk, fv))
    # useful attention FLOPs: completion rows only, 4 * rows * visible keys * D per head; forward 1x +
    # backward 2.5x (the backward recomputes the scores)
    flops = 3.5 * 4 * p * g * hk * r * n * (lp + n / 2) * d
    for name, (fn, args) in cases.items():
        try:
            sec, err = timed(fn, *args), None
        except Exception as e:  # cuDNN needs a GPU, a supported dtype/head size and a cuDNN build
            sec, err = None, f"{type(e).__name__}: {str(e)[:200]}"
        emit(
            {
                "bench": "gpu_train_attention",
                "impl": name,
                "P": p,
                "G": g,
                "Lp": lp,
                "N": n,
                "Hkv": hk,
                "R": r,
                "D": d,
                "dtype": str(jnp.dtype(dtype)),
                "fwd_bwd_ms": None if sec is None else sec * 1e3,
                "useful_tflops": None if sec is None else flops / sec / 1e12,
                "error": err,
            }
        )


def check_dense_accuracy():
    """The training log-probs and their gradient in bfloat16 through each attention path (on a GPU:
    "dense" is cuDNN), against float32 through the group path at the highest matmul precision::

        err = max |log p_bf16 - log p_f32|,   grad_err = |grad_bf16 - grad_f32| / |grad_f32|
    """
    import numpy as np

    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs

    cfg = ModelConfig(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    m32 = init(cfg, jax.random.key(0))
    p, g, lp, n = 4, 4, 64, 96
    ids = jax.random.randint(jax.random.key(1), (p, lp), 0, cfg.vocab_size)
    pm = (jnp.arange(lp)[None, :] >= jnp.array([0, 5, 17, 40])[:, None]).astype(
        jnp.int32
    )  # left padding
    comp = jax.random.randint(jax.random.key(2), (p, g, n), 0, cfg.vocab_size)
    cm = (jnp.arange(n) < jax.random.randint(jax.random.key(3), (p, g, 1), 1, n + 1)).astype(
        jnp.int32
    )  # ragged

    def run(model, attention):
        f = lambda m: jnp.where(
            cm > 0, completion_logprobs(m, ids, pm, comp, cm, ForwardPass(attention=attention)), 0.0
        )
        grads = jax.jit(jax.grad(lambda m: jnp.sum(f(m))))(model)
        return np.asarray(jax.jit(f)(model), np.float64), np.concatenate(
            [np.asarray(x, np.float32).ravel() for x in jax.tree.leaves(grads)]
        )

    with jax.default_matmul_precision("highest"):
        ref_lp, ref_g = run(m32, "group")
    for attention in ("dense", "group"):
        lp16, g16 = run(cast(m32, dtype=jnp.bfloat16), attention)
        emit(
            {
                "bench": "gpu_train_attention_accuracy",
                "path_bf16": attention,
                "max_abs_logprob_err": float(np.abs(lp16 - ref_lp).max()),
                "mean_abs_logprob_err": float(np.abs(lp16 - ref_lp).mean()),
                "grad_rel_err": float(np.linalg.norm(g16 - ref_g) / np.linalg.norm(ref_g)),
            }
        )


def parts() -> list[str]:
    """The parts ``--only a,b`` names (all of ``PARTS`` without it)."""
    names = [x for x in flag("--only", ",".join(PARTS)).split(",") if x]
    bad = [x for x in names if x not in PARTS] or ([] if names else ["(none)"])
    if bad:
        raise SystemExit(f"--only {','.join(names)}: unknown {bad}; choose from {','.join(PARTS)}")
    return names


def main():
    only = parts()
    sheet = datasheet() or {}
    peak_bw, peak_flops = sheet.get("hbm_bytes_per_s"), sheet.get("bf16_flops")
    cfg = TINY if SMALL else LLAMA_1B
    model = cast(init(cfg, jax.random.key(0), param_dtype=jnp.bfloat16), dtype=jnp.bfloat16)
    if "decode" in only:
        for p, g in ((8, 8), (16, 16)):
            bench_decode(model, p, g, 128, 32 if SMALL else 256, peak_bw)
    if "long_prompt" in only:
        bench_long_prompt(model, *((2, 4, 64, 16) if SMALL else (4, 16, 1024, 256)))
    if "update" in only:
        for policy in ("dots", "nothing"):
            bench_update(
                model,
                2 if SMALL else 8,
                4 if SMALL else 8,
                32 if SMALL else 256,
                32 if SMALL else 512,
                peak_flops,
                policy,
            )
    if "attention" in only:
        if SMALL:
            bench_attention(2, 4, 16, 32, 2, 2, 16, jnp.bfloat16)
        else:
            bench_attention(8, 8, 256, 512, 8, 4, 64, jnp.bfloat16)
    if "accuracy" in only:
        check_dense_accuracy()


if __name__ == "__main__":
    main()
