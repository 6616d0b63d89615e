"""The GRPO update and reference forward padded vs packed (``relax.models.forward.completion_packing``)
on completion lengths with a long tail, against the padding-free ideal.

A model shape with random weights (``--model-shape small`` default, or ``smollm-135m``: see
``train_step.py``), float32, P prompts (default 4) x G completions (default 8), 64-token prompts,
a completion budget N (default 1024). Completion lengths are log-normal (seeded numpy) with mean
about N/4 and ``--sigma`` (default 1.0), clipped to [1, N]; tokens are random, each mask a prefix.
Timed (medians over ``--runs`` after one warm-up call each, the variants alternating per run):

    update_padded      make_grpo_update on the [P, G, N] padded batch
    update_packed      the same with rows.packed: the batch packed across groups into bins (on the
                       host, untimed; pack_s apart), one bin per micro-batch, empty bins skipped
    update_no_padding  the padded update on [P, G, L], L = round(mean length), mask all ones:
                       the same real tokens with no padding, what packing should approach
                       (its attention has less work than the real lengths': ``attention_keys_*``)
    ref_padded / ref_packed   the reference forward (stages.forward_logprobs), padded / packed

    python benchmarks/packed_update.py [--runs 3] [--model-shape small]
    python benchmarks/packed_update.py --new-tokens 256 --prompts 2 --runs 1   # quick
    python benchmarks/packed_update.py --model-shape smollm-135m --sigma 1.5 --bin-tokens 4096
    python benchmarks/packed_update.py --model-shape smollm-135m --dtype bfloat16 --prompts 8  # GPU
    python benchmarks/packed_update.py --model-shape smollm-135m --dtype bfloat16 --prompts 8 \
        --train-attention dense    # GPU: cuDNN per completion (padded) and per bin (packed)

Prints one JSON line: length statistics, real / padded / packed token slots, the bins used and
their fill, the attention block pairs visited (and all causal pairs of those bins), each
variant's median seconds, packed_over_no_padding
(update_packed / update_no_padding) and packed_speedup (update_padded / update_packed).
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
from harness import alternate, emit  # noqa: E402
from train_step import SHAPES  # noqa: E402

from relax.algorithms.cli.configure import configure  # noqa: E402
from relax.algorithms.grpo.config import GRPOConfig  # noqa: E402
from relax.algorithms.grpo.loss import make_grpo_update  # noqa: E402
from relax.algorithms.online.batch import LossRows  # noqa: E402
from relax.algorithms.online.stages import forward_logprobs  # noqa: E402
from relax.data.completion_layout import PackingConfig, bin_fill, pack_bins  # noqa: E402
from relax.models import cast, init  # noqa: E402
from relax.models.forward.forward_pass import resolve_attention  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 3
    model_shape: str = "small"
    """small | smollm-135m"""
    prompts: int = 4
    generations: int = 8
    prompt_len: int = 64
    new_tokens: int = 1024
    """the completion budget N"""
    sigma: float = 1.0
    """log-normal sigma of the completion lengths (their mean stays about N/4)"""
    dtype: str = "float32"
    """the model's dtype: float32 | bfloat16 (bfloat16: as users run on GPU/TPU, where the padded
    update's attention is the backend's fused kernel)"""
    bin_tokens: int | None = None
    """slots per bin (None: the packing default, 2 x (prompt + budget))"""
    train_attention: str = "auto"
    """auto | group | dense: with dense the padded update's attention is one fused kernel per
    completion and the packed one's one fused kernel per bin over its mask (cuDNN's on a GPU in
    16 bits, XLA's elsewhere); auto: the trainer's choice (the packed update's group kernel)"""
    seed: int = 0


def lengths(args: Args) -> np.ndarray:
    """``[P, G]`` completion lengths: log-normal with mean N/4, clipped to [1, N]."""
    n = args.new_tokens
    mu = np.log(n / 4) - args.sigma**2 / 2  # E[exp(X)] = exp(mu + sigma^2 / 2) = N / 4
    x = np.random.default_rng(args.seed).lognormal(mu, args.sigma, (args.prompts, args.generations))
    return np.clip(np.rint(x), 1, n).astype(np.int64)


def attention_keys(lens: np.ndarray, prompt_len: int) -> int:
    """Query-key entries the update's attention must compute for completions of ``lens`` (each
    sees its prompt and its own earlier tokens) and each prompt once::

        sum_c (Lp len_c + len_c (len_c + 1) / 2) + P Lp (Lp + 1) / 2
    """
    lens = lens.astype(np.int64)
    completions = int(np.sum(prompt_len * lens + lens * (lens + 1) // 2))
    return completions + lens.shape[0] * prompt_len * (prompt_len + 1) // 2


def update_data(args: Args, vocab: int, lens: np.ndarray, n: int) -> LossRows:
    """The update's rows (tests/test_train.py ``_update_data``) with prefix masks of ``lens``."""
    p, g = lens.shape
    rng = np.random.default_rng(args.seed + 1)
    mask = (np.arange(n)[None, None, :] < lens[..., None]).astype(np.int32)
    ids = rng.integers(0, vocab, (p, args.prompt_len), dtype=np.int32)
    tokens = rng.integers(0, vocab, (p, g, n), dtype=np.int32)
    logp = lambda: (-2.0 + 0.1 * rng.standard_normal((p, g, n))).astype(np.float32)  # noqa: E731
    data = {
        "prompt_ids": ids,
        "prompt_mask": np.ones_like(ids),
        "tokens": tokens,
        "mask": mask,
        "loss_mask": mask,
        "old_logprobs": logp(),
        "ref_logprobs": logp(),
        "advantages": rng.standard_normal((p, g)).astype(np.float32),
    }
    return LossRows(**{k: jnp.asarray(v) for k, v in data.items()})


def model_of(args: Args):
    """``(config, model)``: ``--model-shape`` with random weights in ``--dtype``."""
    if args.model_shape not in SHAPES:
        raise SystemExit(f"--model-shape {args.model_shape!r}: one of {', '.join(SHAPES)}")
    mcfg = SHAPES[args.model_shape]()
    dtype = jnp.dtype(args.dtype)
    return mcfg, cast(init(mcfg, jax.random.key(0), param_dtype=dtype), dtype=dtype)


def build(args: Args):
    """``(variants, setup)``: each variant's call (module docstring) and what ``main`` reports
    of the setup (config, lengths, sizes, the packed batch, the pack timings)."""
    mcfg, model = model_of(args)
    p, g, n = args.prompts, args.generations, args.new_tokens
    passes = choose_passes()
    packing = PackingConfig(bin_tokens=args.bin_tokens)

    def config(budget):
        return configure(
            GRPOConfig,
            num_generations=g,
            max_new_tokens=budget,
            beta=0.04,
            packing=packing,
            train_attention=args.train_attention,
            remat=False,  # as every recorded figure ran (the trainers' default is on)
            optimizer=OptimizerConfig(learning_rate=1e-6),
        )

    cfg = config(n)
    opt = cfg.optimizer.make()
    opt_state = opt.init(model)
    key = jax.random.key(0)

    lens = lengths(args)
    padded = update_data(args, mcfg.vocab_size, lens, n)
    host = [
        np.asarray(x) for x in (padded.prompt_ids, padded.prompt_mask, padded.tokens, padded.mask)
    ]
    sizes = packing.sizes(p, g, args.prompt_len, n, block=passes.stream_block)
    pack_times = []
    for _ in range(max(args.runs, 3)):
        t0 = time.perf_counter()
        pk = pack_bins(*host, sizes)
        pack_times.append(time.perf_counter() - t0)
    packed = padded.replace(packed=jax.tree.map(jnp.asarray, pk))
    flat_len = max(1, int(round(float(lens.mean()))))
    full = update_data(args, mcfg.vocab_size, np.full((p, g), flat_len), flat_len)

    update = jax.jit(make_grpo_update(cfg, opt, passes))
    update_flat = jax.jit(make_grpo_update(config(flat_len), opt, passes))
    ref = jax.jit(lambda m, b: forward_logprobs(m, b, passes, cfg.forward, temperature=1.0))
    variants = {
        "update_padded": lambda: update(model, opt_state, padded, key),
        "update_packed": lambda: update(model, opt_state, packed, key),
        "update_no_padding": lambda: update_flat(model, opt_state, full, key),
        "ref_padded": lambda: ref(model, padded),
        "ref_packed": lambda: ref(model, packed),
    }
    setup = dict(mcfg=mcfg, cfg=cfg, model=model, lens=lens, sizes=sizes, pk=pk)
    return variants, dict(setup, pack_times=pack_times, flat_len=flat_len)


def batch_fields(args: Args, lens: np.ndarray, sizes, pk, flat_len: int) -> dict:
    """The JSON record's description of the batch and its bins (shared with
    ``ppo_packed_update.py``)."""
    used = pk.num_pairs > 0
    return {
        "P": args.prompts,
        "G": args.generations,
        "Lp": args.prompt_len,
        "N": args.new_tokens,
        "sigma": args.sigma,
        "seed": args.seed,
        "runs": args.runs,
        "bin_tokens": sizes.tokens,
        "bins": sizes.bins,
        "completions_per_bin": sizes.completions,
        "block": sizes.block,
        "mean_len": float(lens.mean()),
        "max_len": int(lens.max()),
        "p50_len": float(np.median(lens)),
        "no_padding_len": flat_len,
        "real_tokens": int(lens.sum()),
        "padded_slots": args.prompts * args.generations * args.new_tokens,
        "packed_slots": int(used.sum()) * sizes.tokens,
        "pack_bins": int(used.sum()),
        "pack_fill": bin_fill(pk),
    }


def main(args: Args) -> dict:
    variants, setup = build(args)
    mcfg, cfg, model, lens = setup["mcfg"], setup["cfg"], setup["model"], setup["lens"]
    sizes, pk, pack_times = setup["sizes"], setup["pk"], setup["pack_times"]
    flat_len = setup["flat_len"]
    p, g = args.prompts, args.generations
    med, first = alternate(variants, args.runs)

    used = pk.num_pairs > 0
    return emit(
        {
            "bench": "packed_update",
            "model_shape": args.model_shape,
            "dtype": args.dtype,
            "train_attention": resolve_attention(cfg.forward.train_attention, model),
            "params": mcfg.num_params(),
            **batch_fields(args, lens, sizes, pk, flat_len),
            "pairs_visited": int(pk.num_pairs.sum()),
            "pairs_dense": int(used.sum()) * pk.pairs.shape[1],
            # the attention's work: the real lengths', the no-padding batch's (uniform lengths:
            # less, sum len^2 >= n mean^2), and the packed kernel's (every visited block whole)
            "attention_keys_real": attention_keys(lens, args.prompt_len),
            "attention_keys_no_padding": attention_keys(np.full((p, g), flat_len), args.prompt_len),
            "attention_keys_visited": int(pk.num_pairs.sum()) * sizes.block**2,
            "pack_s": statistics.median(pack_times),
            **med,
            "first_call_s": {k: round(v, 3) for k, v in first.items()},
            "packed_over_no_padding": med["update_packed"] / med["update_no_padding"],
            "packed_speedup": med["update_padded"] / med["update_packed"],
            "ref_packed_speedup": med["ref_padded"] / med["ref_packed"],
            "passes_cache_sized": choose_passes().cache_sized,
        },
        table=[
            "bench",
            "N",
            "mean_len",
            "pack_bins",
            "pack_fill",
            "update_padded",
            "update_packed",
            "update_no_padding",
            "ref_padded",
            "ref_packed",
            "packed_speedup",
            "packed_over_no_padding",
        ],
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
