"""Image prompts: the group-shared image prefix against encoding and prefilling each completion's
image (issue 55), the sampler's tokens/s and the update's time at G completions per prompt.

The model: a small random Qwen2.5-VL built here with transformers' ``Qwen2_5_VLConfig`` and
``Qwen2_5_VLForConditionalGeneration`` (its own random init, seed 0), saved to a temporary
directory and read back with ``relax.models.vision.qwen2_5_vl_checkpoint.load_qwen2_5_vl``:
text hidden 256, 4 layers, 4 heads / 2 KV heads, MLP 512, vocab 1000; vision hidden 128, depth 4
(block 3 full attention, the others windows of 112 pixels), 2 heads, MLP 256, patch 14, merge 2;
float32. P prompts (default 2), each ``text(8) <|vision_start|> image <|vision_end|> text(8)``
with one image of ``--image-tokens`` merged tokens (default 256 and 1,024: grids (1, 32, 32) and
(1, 64, 64) patches), random pixel arrays in the processor's layout; G = 8 completions of
N = 32 new tokens (the stop ids are unreachable: every completion runs the whole budget).

Modes (the same model, prompts and pixels):

    shared    what relax does: ``prompt_inputs`` (``relax.models.vision.qwen2_5_vl``: the vision
              tower and the M-RoPE tables) once per prompt, P images, then
              ``generate_program(..., RolloutConfig(num_generations=G), prompt=inputs)``: each
              prompt prefilled once for its G completions. The update: the gradient of the sum of
              ``completion_logprobs(..., ForwardPass(attention="group"), prompt=inputs)`` over
              the ``[P, G, N]`` completions.
    repeated  a trainer without prefix sharing: every completion its own copy of the prompt and
              image, P*G prompts (rows and pixel arrays repeated G times: the vision tower runs
              P*G times), ``num_generations=1``; the update over ``[P*G, 1, N]``.

The image inputs are made one prompt at a time in both modes (a ``lax.map`` of ``prompt_inputs``
over the prompts), so the vision tower runs once per image on that image alone.
(``vision_forward`` on several images at once attends under one dense ``[N, N]`` mask over all
their patches, so its cost grows with the square of the batch's patches; ``vision_1_image_s`` and
``vision_batched_s`` time one image and the P images in one call.)

Timed (medians over ``--runs`` after one untimed warm-up call of each compiled program, the two
modes alternating within every run):

    sampler_s  the sampler program: image inputs + prefill + decode; tokens_per_s = P*G*N / it
    update_s   forward + backward: the image inputs (a peer re-encodes every step; forward only,
               the gradient is the language model's unless ``--train-vision``) and the gradient
               of the sum of the completions' log-probs (the shared mode's sampled tokens, in
               both modes)
    encode_s   the image inputs alone (the ``lax.map`` of ``prompt_inputs``)
    sampler_text_s / update_text_s   the sampler and the update on ready image inputs (prefill +
               decode; the language model's forward + backward): the text side alone

The summary line per image size gives the ratios repeated / shared of each. Each compiled
program's lower+compile seconds are reported (``compile_*_s``). Checks: the
repeated update's summed log-prob against the shared one's (the same tokens: equal up to float
summation order) and the fraction of sampled tokens that agree (the same key gives the same
per-row uniforms, so equal logits sample equal tokens). The load average is printed at the start
and the end (``/proc/loadavg``): the machine may be shared.

    .venv/bin/python benchmarks/vlm_prefix.py --runs 3
    .venv/bin/python benchmarks/vlm_prefix.py --image-tokens 256 --runs 1   # quick
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import statistics
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit, measure  # noqa: E402

from relax.models.forward.forward_pass import ForwardPass  # noqa: E402
from relax.models.forward.prefix_shared import completion_logprobs  # noqa: E402
from relax.models.vision.qwen2_5_vl import prepare_inputs, prompt_inputs  # noqa: E402
from relax.models.vision.qwen2_5_vl_checkpoint import load_qwen2_5_vl  # noqa: E402
from relax.models.vision.qwen_vit import vision_forward  # noqa: E402
from relax.rollout.config import RolloutConfig  # noqa: E402
from relax.rollout.sampler import generate_program  # noqa: E402

VOCAB = 1000
IMAGE, START, END = 997, 998, 999
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12]},  # head_dim 64
)
VISION = dict(
    depth=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=2,
    patch_size=14,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=112,
    out_hidden_size=256,
    fullatt_block_indexes=[3],
)
MODES = ("shared", "repeated")
TABLE = [
    "image_tokens",
    "mode",
    "prompts_run",
    "images_encoded",
    "sampler_s",
    "tokens_per_s",
    "update_s",
    "encode_s",
    "sampler_text_s",
    "update_text_s",
    "compile_sampler_s",
    "compile_update_s",
    "loadavg_1m",
]
SUMMARY_TABLE = [
    "image_tokens",
    "sampler_ratio",
    "update_ratio",
    "encode_ratio",
    "sampler_text_ratio",
    "update_text_ratio",
    "logprob_sum_rel_diff",
    "tokens_match_frac",
    "vision_1_image_s",
    "vision_batched_s",
]


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 3
    """timed runs per (image size, mode, program); the median is reported"""
    image_tokens: tuple[int, ...] = (256, 1024)
    """merged image tokens per image (each a square: a (1, 2 sqrt(t), 2 sqrt(t)) patch grid)"""
    prompts: int = 2
    """P: prompts, one image each"""
    generations: int = 8
    """G: completions per prompt"""
    new_tokens: int = 32
    """N: the completion budget (every completion runs all of it)"""
    text_tokens: int = 16
    """text tokens per prompt (half before the image, half after)"""
    train_vision: bool = False
    """the update's gradient covers the vision tower too (default: the language model only)"""
    seed: int = 0


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return f.read().strip()
    except OSError:
        return "unavailable"


def build_model(seed: int):
    """The small random Qwen2.5-VL: transformers' init, saved, loaded into relax."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT),
        vision_config=dict(VISION),
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=996,
    )
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return load_qwen2_5_vl(d)


def grid_of(tokens: int, merge: int) -> tuple[int, int, int]:
    side = math.isqrt(tokens)
    if side * side != tokens:
        raise SystemExit(f"--image-tokens {tokens}: must be a square number of merged tokens")
    return (1, side * merge, side * merge)


def make_prompts(args: Args, tokens: int, patch_dim: int, grid):
    """``[P, Lp]`` ids and mask (every prompt the same length) and ``[P, t*h*w, patch_dim]``
    pixels."""
    rng = np.random.default_rng(args.seed + tokens)
    a, b = args.text_tokens // 2, args.text_tokens - args.text_tokens // 2
    rows = [
        rng.integers(3, IMAGE, a).tolist()
        + [START]
        + [IMAGE] * tokens
        + [END]
        + rng.integers(3, IMAGE, b).tolist()
        for _ in range(args.prompts)
    ]
    ids = np.asarray(rows, np.int32)
    n_patch = grid[0] * grid[1] * grid[2]
    px = rng.standard_normal((args.prompts, n_patch, patch_dim)).astype(np.float32)
    return ids, np.ones_like(ids), px


def per_prompt_inputs(model, grid, ids, mask, positions, pixels):
    """``prompt_inputs`` one prompt at a time (a ``lax.map``), each prompt's image encoded alone;
    ``positions`` ``[3, B, Lp]``, ``pixels`` ``[B, t*h*w, patch_dim]``. The ``PromptInputs`` of
    all B prompts."""

    def one(x):
        i, m, pos, px = x
        return prompt_inputs(model, i[None], m[None], pos[:, None], px, (grid,))

    out = jax.lax.map(one, (ids, mask, jnp.moveaxis(positions, 1, 0), pixels))
    return jax.tree.map(lambda x: x[:, 0], out)


def programs(model, grid, g: int, n: int, train_vision: bool) -> dict:
    """The jitted programs of one mode (``g`` completions per prompt row): ``sampler`` and
    ``update`` (each with the image inputs made inside), ``encode`` (the image inputs alone), and
    ``sampler_text`` / ``update_text`` (the same on ready image inputs: prefill + decode, and the
    language model's forward + backward)."""
    cfg = RolloutConfig(num_generations=g, max_new_tokens=n, eos_ids=())
    how = ForwardPass(attention="group")

    def encode(model, ids, mask, positions, pixels):
        return per_prompt_inputs(model, grid, ids, mask, positions, pixels)

    def sampler_text(model, ids, mask, inputs, key):
        return generate_program(model.language_model, ids, mask, key, cfg, prompt=inputs)

    def sampler(model, ids, mask, positions, pixels, key):
        return sampler_text(model, ids, mask, encode(model, ids, mask, positions, pixels), key)

    def loss_of(lm, ids, mask, inputs, tokens, cmask):
        lp = completion_logprobs(lm, ids, mask, tokens, cmask, how, prompt=inputs)
        return jnp.sum(lp * cmask)

    def update_text(model, ids, mask, inputs, tokens, cmask):
        trained, frozen = eqx.partition(model.language_model, eqx.is_inexact_array)
        loss = lambda t: loss_of(eqx.combine(t, frozen), ids, mask, inputs, tokens, cmask)  # noqa: E731
        return jax.value_and_grad(loss)(trained)

    def update(model, ids, mask, positions, pixels, tokens, cmask):
        if not train_vision:  # the image inputs: forward only
            inputs = encode(model, ids, mask, positions, pixels)
            return update_text(model, ids, mask, inputs, tokens, cmask)
        trained, frozen = eqx.partition(model, eqx.is_inexact_array)

        def loss(t):
            m = eqx.combine(t, frozen)
            inputs = encode(m, ids, mask, positions, pixels)
            return loss_of(m.language_model, ids, mask, inputs, tokens, cmask)

        return jax.value_and_grad(loss)(trained)

    fns = dict(
        sampler=sampler,
        update=update,
        encode=encode,
        sampler_text=sampler_text,
        update_text=update_text,
    )
    return {k: jax.jit(f) for k, f in fns.items()}


PROGRAMS = ("sampler", "update", "encode", "sampler_text", "update_text")


def timed(fn) -> float:
    t = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t


def run_size(model, args: Args, tokens: int) -> None:
    m = model.visual.config.spatial_merge_size
    grid = grid_of(tokens, m)
    p, g, n = args.prompts, args.generations, args.new_tokens
    ids, mask, px = make_prompts(args, tokens, model.visual.config.patch_dim, grid)
    key = jax.random.key(args.seed + 1)

    data = {}
    for mode in MODES:
        rep = g if mode == "repeated" else 1
        mids, mmask, mpx = (np.repeat(x, rep, axis=0) for x in (ids, mask, px))
        x = prepare_inputs(model, mids, mmask, (grid,) * mids.shape[0])
        data[mode] = dict(
            ids=jnp.asarray(mids),
            mask=jnp.asarray(mmask),
            positions=jnp.asarray(x.positions, jnp.int32),
            pixels=jnp.asarray(mpx),
            fns=programs(model, grid, g // rep, n, args.train_vision),
            rows=mids.shape[0],
        )

    def call_args(mode: str, name: str) -> tuple:
        d = data[mode]
        head = (model, d["ids"], d["mask"])
        images = (
            (d["positions"], d["pixels"])
            if name in ("sampler", "update", "encode")
            else (d["inputs"],)
        )
        if name in ("sampler", "sampler_text"):
            tail = (key,)
        else:
            tail = () if name == "encode" else (d["tokens"], d["cmask"])
        return (*head, *images, *tail)

    # compile (lower + compile), then one untimed warm-up call each; the encode's output feeds
    # the *_text programs and the shared sampler's tokens feed every update
    compile_s, first_s, results = {}, {}, {}

    def prepare(mode: str, name: str):
        d = data[mode]
        a = call_args(mode, name)
        t0 = time.perf_counter()
        d[name] = d["fns"][name].lower(*a).compile()
        compile_s[(mode, name)] = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = jax.block_until_ready(d[name](*a))
        first_s[(mode, name)] = time.perf_counter() - t0
        return out

    for mode in MODES:
        results[mode] = prepare(mode, "sampler")
        data[mode]["inputs"] = prepare(mode, "encode")
        prepare(mode, "sampler_text")
    tok, cm = results["shared"].tokens, results["shared"].mask  # [P, G, N]
    for mode in MODES:
        d = data[mode]
        shape = (p, g, n) if mode == "shared" else (p * g, 1, n)
        d["tokens"], d["cmask"] = tok.reshape(shape), cm.reshape(shape)
        d["loss"] = float(prepare(mode, "update")[0])
        d["loss_text"] = float(prepare(mode, "update_text")[0])
    same_tokens = float(
        np.mean(
            np.asarray(results["shared"].tokens).reshape(p * g, n)
            == np.asarray(results["repeated"].tokens).reshape(p * g, n)
        )
    )

    times = {(mode, k): [] for mode in MODES for k in PROGRAMS}
    for _ in range(args.runs):
        for mode in MODES:
            for name in PROGRAMS:
                fn, a = data[mode][name], call_args(mode, name)
                times[(mode, name)].append(timed(lambda: fn(*a)))  # noqa: B023

    med = {k: statistics.median(v) for k, v in times.items()}
    lp = len(ids[0])
    for mode in MODES:
        d = data[mode]
        emit(
            {
                "bench": "vlm_prefix",
                "image_tokens": tokens,
                "grid": list(grid),
                "mode": mode,
                "P": p,
                "G": g,
                "N": n,
                "prompt_len": lp,
                "prompts_run": d["rows"],
                "images_encoded": d["rows"],
                "train_vision": args.train_vision,
                "runs": args.runs,
                "sampler_s": med[(mode, "sampler")],
                "tokens_per_s": p * g * n / med[(mode, "sampler")],
                "update_s": med[(mode, "update")],
                "encode_s": med[(mode, "encode")],
                "sampler_text_s": med[(mode, "sampler_text")],
                "tokens_per_s_text": p * g * n / med[(mode, "sampler_text")],
                "update_text_s": med[(mode, "update_text")],
                "times": {k: [round(t, 4) for t in times[(mode, k)]] for k in PROGRAMS},
                **{f"compile_{k}_s": compile_s[(mode, k)] for k in PROGRAMS},
                "first_call_s": {k: round(v, 3) for (md, k), v in first_s.items() if md == mode},
                "logprob_sum": d["loss"],
                "logprob_sum_text": d["loss_text"],
                "loadavg_1m": float(loadavg().split()[0]) if loadavg()[0].isdigit() else None,
            },
            TABLE,
        )

    # the vision tower alone: one image, and the P images in one call (one dense mask over all)
    vf = lambda k: jax.jit(lambda v, x: vision_forward(v, x, (grid,) * k))  # noqa: E731
    one = measure(vf(1), model.visual, jnp.asarray(px[0]), runs=args.runs)
    batched = measure(
        vf(p), model.visual, jnp.asarray(px.reshape(-1, px.shape[-1])), runs=args.runs
    )
    s, r = data["shared"]["loss"], data["repeated"]["loss"]
    emit(
        {
            "bench": "vlm_prefix_summary",
            "image_tokens": tokens,
            "P": p,
            "G": g,
            "N": n,
            "train_vision": args.train_vision,
            "sampler_ratio": med[("repeated", "sampler")] / med[("shared", "sampler")],
            "update_ratio": med[("repeated", "update")] / med[("shared", "update")],
            "encode_ratio": med[("repeated", "encode")] / med[("shared", "encode")],
            "sampler_text_ratio": med[("repeated", "sampler_text")]
            / med[("shared", "sampler_text")],
            "update_text_ratio": med[("repeated", "update_text")] / med[("shared", "update_text")],
            "logprob_sum_rel_diff": abs(r - s) / max(abs(s), 1e-30),
            "tokens_match_frac": same_tokens,
            "vision_1_image_s": one["median_s"],
            "vision_batched_s": batched["median_s"],
            "vision_batched_images": p,
            "process_peak_rss_mb": round(
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1
            ),
            "note": "ratios are repeated / shared (sampler and update seconds; tokens/s is the "
            "inverse ratio's gain)",
        },
        SUMMARY_TABLE,
    )


def main(args: Args) -> None:
    emit({"bench": "vlm_prefix_start", "loadavg": loadavg(), "args": dataclasses.asdict(args)})
    t0 = time.perf_counter()
    model = build_model(args.seed)
    build_s = time.perf_counter() - t0
    for tokens in args.image_tokens:
        run_size(model, args, tokens)
    emit(
        {
            "bench": "vlm_prefix_end",
            "loadavg": loadavg(),
            "model_build_s": build_s,
            "wall_s": time.perf_counter() - t0,
        }
    )


if __name__ == "__main__":
    main(tyro.cli(Args))
