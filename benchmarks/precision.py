"""Where the sampler and the trainer part in low precision, and how far apart they end.

Two measurements on one model (the real checkpoint ``models/smollm2-135m-instruct`` when present,
``benchmarks/make_smollm2.py``; else a random 16-layer model), in bfloat16 params and compute:

``mismatch``  the sampler's log-probs of its own completions (prefix-shared decode, cache blocks,
              compaction) against the trainer's prefix-shared forward of the same tokens with the
              same weights, per valid token ``d = log p_train - log p_sampler``: max / p99.9 / p99 /
              mean |d|, the ratio ``exp(d)``'s range and the share of tokens inside [0.95, 1.05],
              for each precision policy asked (``relax.models.config.precision``).
``diagnose``  op by op: every tapped value of the layer body (``relax.models.decoder.taps``: the
              residual stream in / mid / out, the norms' outputs, q / k / v after RoPE, attention,
              its projection, the MLP's activation and output, the final norm) recorded in both
              paths for the same completion tokens (stop ids off, so no compaction reorders rows)
              and compared: the relative RMS difference ``||a - b|| / ||b||`` per value and layer.
              Where it first departs from float32-rounding size is where the paths part.
``cost``      seconds of the sampler and of a training forward + backward per policy (alternated).
``mesh``      a GRPO step (``examples/train_grpo.py``) of a random 8-layer bfloat16 model on one
              device and on an 8-device mesh: its ``mismatch/*`` metrics per policy.

    .venv/bin/python benchmarks/precision.py mismatch --policies lowest default
    .venv/bin/python benchmarks/precision.py cost --policies lowest default --runs 3
    .venv/bin/python benchmarks/precision.py mesh --policies lowest default
    .venv/bin/python benchmarks/precision.py diagnose --policy lowest --prompts 2 --gens 4 --tokens 64
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arithmetic_task import make_rows  # noqa: E402

from relax.models import family_config, init  # noqa: E402
from relax.models.config.precision import Precision  # noqa: E402
from relax.models.decoder import taps  # noqa: E402
from relax.models.forward.prefix_shared import completion_logprobs  # noqa: E402
from relax.rollout import sampler as rollout  # noqa: E402
from relax.rollout.config import RolloutConfig  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "models" / "smollm2-135m-instruct"
POLICIES = {
    "lowest": Precision.lowest(),
    "default": Precision(),
    "residual": Precision(residual="float32", activations="compute"),
    "activations": Precision(residual="compute", activations="float32"),
    "probs": Precision(residual="compute", activations="compute", attention_probs="float32"),
    "no-probs": Precision(attention_probs="compute"),
}


def load(dtype=jnp.bfloat16, param_dtype=None, random=False):
    """The real checkpoint and chat prompts of the arithmetic task, or (``random``, or without the
    checkpoint) a random model and random prompts: ``(model, prompt_lists, eos_ids, name)``."""
    param_dtype = dtype if param_dtype is None else param_dtype
    if CHECKPOINT.exists() and not random:
        import relax

        model = relax.load_pretrained(CHECKPOINT, dtype=dtype, param_dtype=param_dtype)
        tok = relax.load_tokenizer(CHECKPOINT)
        rows, _ = make_rows(64, 0, 0)
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True
            )
            for r in rows
        ]
        return model, prompts, (2,), "smollm2-135m-instruct"
    cfg = family_config(
        "llama",
        vocab_size=512,
        hidden_size=256,
        intermediate_size=688,
        num_layers=16,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
    )
    model = init(cfg, jax.random.key(0), param_dtype=param_dtype, dtype=dtype, std=0.05)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 512, rng.integers(20, 60))) for _ in range(64)]
    return model, prompts, (2,), "random-16-layer"


def left_pad(prompts, width):
    ids, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.int32)
    for i, x in enumerate(prompts):
        ids[i, width - len(x) :], mask[i, width - len(x) :] = x, 1
    return jnp.asarray(ids), jnp.asarray(mask)


def sample_and_score(model, ids, mask, gens, tokens, eos, seed=0):
    """The sampler's rollout and the trainer's log-probs of its tokens."""
    cfg = RolloutConfig(
        num_generations=gens,
        max_new_tokens=tokens,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=eos,
    )
    r = jax.jit(rollout.generate_program, static_argnums=4)(
        model, ids, mask, jax.random.key(seed), cfg
    )
    train = jax.jit(completion_logprobs)(model, ids, mask, r.tokens, r.mask)
    return r, train


def stats(sampler, train, mask) -> dict:
    m = np.asarray(mask).astype(bool)
    d = (np.asarray(train, np.float64) - np.asarray(sampler, np.float64))[m]
    a, ratio = np.abs(d), np.exp(d)
    return {
        "tokens": int(m.sum()),
        "max": float(a.max()),
        "p999": float(np.quantile(a, 0.999)),
        "p99": float(np.quantile(a, 0.99)),
        "mean": float(a.mean()),
        "ratio_min": float(ratio.min()),
        "ratio_max": float(ratio.max()),
        "ratio_in_0.95_1.05": float(np.mean((ratio >= 0.95) & (ratio <= 1.05))),
    }


def _load(args):
    dt = lambda name: None if name is None else jnp.dtype(name)  # noqa: E731
    return load(dt(args.dtype), dt(args.param_dtype), args.random)


def mismatch(args) -> list[dict]:
    model, prompts, eos, name = _load(args)
    ids, mask = left_pad(prompts[: args.prompts], 128)
    out = []
    for policy in args.policies:
        m = dataclasses.replace(model, precision=POLICIES[policy])
        t0 = time.perf_counter()
        r, train = sample_and_score(m, ids, mask, args.gens, args.tokens, eos)
        row = {"model": name, "compute": args.dtype, "params": args.param_dtype or args.dtype}
        row |= {"policy": policy, **dataclasses.asdict(POLICIES[policy])}
        row |= stats(r.logprobs, train, r.mask) | {"seconds": round(time.perf_counter() - t0, 1)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def cost(args) -> list[dict]:
    """Seconds of the sampler's rollout and of a training forward + backward of its tokens under
    each policy, alternating the policies run by run; medians of ``--runs``."""
    model, prompts, eos, name = _load(args)
    ids, mask = left_pad(prompts[: args.prompts], 128)
    cfg = RolloutConfig(
        num_generations=args.gens, max_new_tokens=args.tokens, eos_ids=(), compactions=0
    )
    gen = jax.jit(rollout.generate_program, static_argnums=4)

    def loss(m, tokens, cmask):
        return jnp.sum(completion_logprobs(m, ids, mask, tokens, cmask) * cmask)

    grad = jax.jit(jax.grad(loss))
    models = {p: dataclasses.replace(model, precision=POLICIES[p]) for p in args.policies}
    r = gen(models[args.policies[0]], ids, mask, jax.random.key(0), cfg)
    for m in models.values():  # compile everything first
        jax.block_until_ready(
            (gen(m, ids, mask, jax.random.key(0), cfg), grad(m, r.tokens, r.mask))
        )
    times = {p: {"sample": [], "train": []} for p in args.policies}
    for _ in range(args.runs):
        for p, m in models.items():
            t0 = time.perf_counter()
            jax.block_until_ready(gen(m, ids, mask, jax.random.key(1), cfg))
            t1 = time.perf_counter()
            jax.block_until_ready(grad(m, r.tokens, r.mask))
            times[p]["sample"].append(t1 - t0)
            times[p]["train"].append(time.perf_counter() - t1)
    out = []
    for p, t in times.items():
        row = {"model": name, "compute": args.dtype, "policy": p, "runs": args.runs}
        row |= {f"{k}_s_median": round(float(np.median(v)), 3) for k, v in t.items()}
        row |= {f"{k}_s": [round(x, 3) for x in v] for k, v in t.items()}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


MESH_FLAGS = ["--parallel.mesh", "fsdp=4,tensor=2"]


def mesh(args) -> list[dict]:
    """``examples/train_grpo.py`` for one step on a random 8-layer model in bfloat16 (a character
    tokenizer, reversed words), on one device and on an 8-device ``fsdp=4,tensor=2`` mesh (8 host
    CPU devices; the character vocabulary, 14, splits over tensor=2), each policy: the step's
    ``mismatch/*`` metrics, the sampler's log-probs against the trainer's where the program runs
    sharded."""
    import subprocess
    import tempfile

    from relax.models import ModelConfig
    from relax.models.hf.checkpoint import save_pretrained
    from relax.text.sentencepiece_model import Tokenizer, train_sentencepiece

    d = Path(tempfile.mkdtemp(prefix="relax-precision-"))
    rng = np.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefgh"), rng.integers(3, 7))) for _ in range(64)]
    tok = Tokenizer(
        train_sentencepiece([w + "=" for w in words], d / "tok", vocab_size=16, model_type="char")
    )
    cfg = ModelConfig(
        vocab_size=tok.vocab_size,
        hidden_size=128,
        intermediate_size=320,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
        pad_token_id=tok.pad_id,
    )
    save_pretrained(init(cfg, jax.random.key(0), std=0.1), d / "model", dtype=jnp.bfloat16)
    rows = [{"prompt": w + "=", "answer": w[::-1]} for w in words]
    (d / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = []
    for where, extra in (("one device", []), ("fsdp=4,tensor=2", MESH_FLAGS)):
        for policy in args.policies:
            p = POLICIES[policy]
            run = d / f"run-{len(out)}"
            cmd = [
                sys.executable,
                str(ROOT / "examples" / "train_grpo.py"),
                "--model",
                str(d / "model"),
            ]
            cmd += ["--tokenizer", str(d / "tok.model"), "--data", str(d / "train.jsonl")]
            cmd += ["--run-dir", str(run), "--steps", "1", "--batch-size", "8"]
            cmd += ["--max-prompt-tokens", "16", "--reward", "exact_match", "--preset", "grpo"]
            cmd += ["--grpo.num-generations", "8", "--grpo.max-new-tokens", str(args.tokens)]
            cmd += ["--param-dtype", "bfloat16", "--compute-dtype", "bfloat16"]
            cmd += ["--grpo.optimizer.master-weights", *extra]
            for field in ("residual", "activations", "attention_probs"):
                cmd += [f"--precision.{field.replace('_', '-')}", getattr(p, field)]
            env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
            env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
            subprocess.run(cmd, env=env, check=True, capture_output=True)
            step = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
            row = {"where": where, "policy": policy}
            row |= {k: v for k, v in step.items() if k.startswith("mismatch/")}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def record(fn):
    """``fn()`` with every tapped value copied out as it runs: ``(result, {(name, shape): [arrays
    in execution order]})``."""
    store = collections.defaultdict(list)

    def recorder(name, x):
        key = (name, tuple(x.shape))
        jax.debug.callback(
            lambda v, key=key: store[key].append(np.asarray(v, np.float32)), x, ordered=True
        )
        return x

    jax.clear_caches()
    with taps.recording(recorder):
        result = jax.block_until_ready(fn())
    return result, store


def per_layer(values: list, layers: int) -> np.ndarray:
    """Calls in execution order (steps x layers) -> ``[layers, steps, ...]``."""
    steps = len(values) // layers
    return (
        np.stack(values[: steps * layers]).reshape(steps, layers, *values[0].shape).swapaxes(0, 1)
    )


def diagnose(args) -> dict:
    model, prompts, _, name = _load(args)
    model = dataclasses.replace(model, precision=POLICIES[args.policy])
    L, p, g, n = model.config.num_layers, args.prompts, args.gens, args.tokens
    ids, mask = left_pad(prompts[:p], 128)
    cfg = RolloutConfig(num_generations=g, max_new_tokens=n, eos_ids=(), compactions=0)
    gen = jax.jit(rollout.generate_program, static_argnums=4)
    r, sampled = record(lambda: gen(model, ids, mask, jax.random.key(0), cfg))
    train_fn = jax.jit(completion_logprobs)
    lp, trained = record(lambda: train_fn(model, ids, mask, r.tokens, r.mask))
    b = p * g
    rows = {}
    for (tap_name, shape), values in sampled.items():
        if shape[:2] != (b, 1):  # decode steps only (the prefill is the prompt's)
            continue
        want = [v for (k, s), v in trained.items() if k == tap_name and s[0] == b and s[1] == n]
        if not want:
            want = [v for (k, s), v in trained.items() if k == tap_name and s[:2] == (p, g * n)]
        if not want:
            continue
        dec = per_layer(values, L if tap_name != "final_norm" and tap_name != "residual_out" else 1)
        tr = np.stack(want[0])  # [layers, B, N, ...] (one call per layer)
        tr = tr.reshape(tr.shape[0], b, n, *shape[2:])
        steps = dec.shape[1]  # decode step t feeds completion token t
        dec = np.moveaxis(dec[:, :, :, 0], 1, 2)  # [layers, B, steps, ...]
        tr = tr[:, :, :steps]
        err = np.sqrt(
            np.sum((dec - tr) ** 2, axis=tuple(range(1, dec.ndim)))
            / np.maximum(np.sum(tr**2, axis=tuple(range(1, tr.ndim))), 1e-30)
        )
        rows[tap_name] = [float(f"{e:.3g}") for e in err]
    result = {
        "model": name,
        "policy": args.policy,
        "shape": [p, g, n],
        "relative_rms_difference_by_layer": rows,
        "logprobs": stats(r.logprobs, lp, r.mask),
    }
    print(json.dumps(result))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mm = sub.add_parser("mismatch")
    mm.add_argument("--policies", nargs="+", default=["lowest", "default"], choices=list(POLICIES))
    mm.add_argument("--prompts", type=int, default=8)
    mm.add_argument("--gens", type=int, default=8)
    mm.add_argument("--tokens", type=int, default=128)
    co = sub.add_parser("cost")
    co.add_argument("--policies", nargs="+", default=["lowest", "default"], choices=list(POLICIES))
    co.add_argument("--prompts", type=int, default=4)
    co.add_argument("--gens", type=int, default=8)
    co.add_argument("--tokens", type=int, default=64)
    co.add_argument("--runs", type=int, default=3)
    ms = sub.add_parser("mesh")
    ms.add_argument("--policies", nargs="+", default=["lowest", "default"], choices=list(POLICIES))
    ms.add_argument("--tokens", type=int, default=64)
    dg = sub.add_parser("diagnose")
    dg.add_argument("--policy", default="lowest", choices=list(POLICIES))
    dg.add_argument("--prompts", type=int, default=2)
    dg.add_argument("--gens", type=int, default=4)
    dg.add_argument("--tokens", type=int, default=64)
    for p in (mm, co, dg):
        p.add_argument("--dtype", default="bfloat16", help="compute dtype")
        p.add_argument("--param-dtype", default=None, help="parameter dtype (default: --dtype)")
        p.add_argument(
            "--random", action="store_true", help="a random model even with the checkpoint"
        )
    args = ap.parse_args(argv)
    return {"mismatch": mismatch, "cost": cost, "mesh": mesh, "diagnose": diagnose}[args.cmd](args)


if __name__ == "__main__":
    main()
