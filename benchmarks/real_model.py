"""GRPO on a real checkpoint, measured: relax (and, with ``--peer trl``, TRL's GRPOTrainer on the
same rows, prompts, reward and hyper-parameters), learning curves, held-out accuracy, seconds per step.

The task (``benchmarks/arithmetic_task.py``, deterministic by ``--seed``; not one of relax's built-in tasks):
short arithmetic word problems of five kinds (``data_source``: add_sub, multiply, change,
rate_plus, two_step), each answered with a number and rewarded by relax's built-in
``numeric_match`` (1 when the completion's final number equals the answer; how it reads the final
number is ``relax.rewards.builtin``'s). The train and held-out rows are
disjoint. They are written to ``OUT/train.jsonl`` and ``OUT/eval.jsonl`` and trained on the way a
user would: ``examples/train_grpo.py``'s ``main([...])`` with ``--model DIR --data train.jsonl
--eval-data eval.jsonl --reward numeric_match``. Every prompt is a plain string, so the model's
chat template renders it (SmolLM2's adds its default system prompt); all are well under 100 tokens.

Records, under ``--out``:

- ``relax-<dtype>/``: the run directory (``metrics.jsonl``, ``summary.json``, ``final_hf/``);
- ``curve-relax-<dtype>.jsonl``: per step: reward, KL, completion length, ``time/step`` and each
  ``time/<segment>`` (the step split by stage), and the wall seconds since the first step began;
- with ``--peer trl``: ``trl/`` (``steps.jsonl``: TRL's own log per step plus the step's wall
  time, ``final_hf/``, ``mapping.json``: each hyper-parameter on both sides), ``curve-trl.jsonl``
  and ``trl-eval/``: TRL's final model evaluated by relax's evaluator (``--eval-only``, same
  prompts, same sampling keys), so both sides' accuracies come from one function;
- ``curve.png`` (reward per step and per wall second), ``results.json``; the same JSON is
  printed as the last line of stdout.

Setup (dev-only; the checkpoint: ``benchmarks/make_smollm2.py``). TRL is kept out of relax's
environment (it would add datasets, pandas, ... to it): it runs in a separate interpreter
(``--trl-python``, running ``benchmarks/real_model_trl.py``) with the same torch / transformers
versions. That interpreter scores with
relax's own ``numeric_match``, loaded from a copy of ``relax/rewards`` taken when this script
starts (``OUT/reward_src``; no jax needed), so it needs ``math-verify`` at relax's version too::

    python3.11 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 transformers==5.23.0 accelerate==1.15.0 trl==1.16.0 \\
        math-verify==0.9.0

Runs::

    .venv/bin/python benchmarks/make_smollm2.py
    .venv/bin/python benchmarks/real_model.py --steps 10 --eval-every 5 --param-dtype float32,bfloat16:5 \\
        --peer trl --trl-steps 5 --num-eval 48 --lr 2e-5 --out runs/real-model-2026-11-27 \\
        --results benchmarks/results/real-model-2026-11-27
    # a TRL worker stopped early (or any partial set of runs): rebuild results.json / curve.png from --out
    .venv/bin/python benchmarks/real_model.py --collect --peer trl --out runs/real-model-2026-11-27 \\
        --num-eval 48 --lr 2e-5 --results benchmarks/results/real-model-2026-11-27
    # a bigger model on an accelerator, unchanged:
    python benchmarks/real_model.py --model models/qwen2.5-0.5b-instruct --steps 200 --batch-size 16 \\
        --num-generations 8 --max-new-tokens 256 --param-dtype bfloat16 --out runs/real-qwen

``--param-dtype bfloat16`` trains bfloat16 parameters with float32 master weights
(``--param-dtype bfloat16 --compute-dtype bfloat16 --grpo.optimizer.master-weights``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arithmetic_task import make_rows  # noqa: E402
from flop_floor import mean_prompt_tokens, steps_at_floor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "smollm2-135m-instruct"


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def read_jsonl(path: Path) -> list[dict]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if path.exists()
        else []
    )


# ----------------------------------------------------------------------------- hyper-parameters


def hparams(args) -> dict:
    """The run's hyper-parameters, named once; both sides are configured from this dict."""
    return {
        "learning_rate": args.lr,
        "num_generations": args.num_generations,
        "prompts_per_step": args.batch_size,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": None,
        "beta": args.beta,
        "kl_estimator": "k3",
        "epsilon_low": 0.2,
        "epsilon_high": 0.2,
        "loss_type": "grpo",
        "scale_rewards": "group",
        "num_iterations": 1,
        "optimizer_steps_per_batch": 1,
        "adam_b1": 0.9,
        "adam_b2": 0.99,
        "adam_eps": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "schedule": "constant",
        "warmup_steps": 0,
        "mask_truncated_completions": False,
        "remat": args.remat,
        "seed": args.seed,
        # TRL only: completions per forward/backward (None: all of a step's in one); relax's
        # micro-batches are its own pass layout's
        "trl_micro_batch": args.trl_micro_batch,
    }


def relax_flags(h: dict) -> list[str]:
    return [
        "--preset",
        "grpo",
        "--grpo.num-generations",
        str(h["num_generations"]),
        "--grpo.max-new-tokens",
        str(h["max_new_tokens"]),
        "--grpo.temperature",
        str(h["temperature"]),
        "--grpo.beta",
        str(h["beta"]),
        "--grpo.kl-estimator",
        h["kl_estimator"],
        "--grpo.policy-loss.epsilon-low",
        str(h["epsilon_low"]),
        "--grpo.policy-loss.epsilon-high",
        str(h["epsilon_high"]),
        "--grpo.loss-type",
        h["loss_type"],
        "--grpo.scale-rewards",
        h["scale_rewards"],
        "--grpo.num-iterations",
        str(h["num_iterations"]),
        "--grpo.num-minibatches",
        "1",
        "--grpo.optimizer.learning-rate",
        str(h["learning_rate"]),
        "--grpo.optimizer.b1",
        str(h["adam_b1"]),
        "--grpo.optimizer.b2",
        str(h["adam_b2"]),
        "--grpo.optimizer.eps",
        str(h["adam_eps"]),
        "--grpo.optimizer.weight-decay",
        str(h["weight_decay"]),
        "--grpo.optimizer.max-grad-norm",
        str(h["max_grad_norm"]),
        "--grpo.optimizer.schedule",
        h["schedule"],
        "--grpo.optimizer.warmup-steps",
        str(h["warmup_steps"]),
        "--batch-size",
        str(h["prompts_per_step"]),
        "--seed",
        str(h["seed"]),
        "--grpo.remat" if h.get("remat") else "--grpo.no-remat",
    ]


def trl_kwargs(h: dict) -> dict:
    """GRPOConfig keyword arguments for the same hyper-parameters (TRL 1.16 names)."""
    g, p = h["num_generations"], h["prompts_per_step"]
    m = h.get("trl_micro_batch") or g * p  # completions per forward/backward
    if (g * p) % m:
        raise ValueError(f"--trl-micro-batch {m} must divide the step's {g * p} completions")
    return dict(
        learning_rate=h["learning_rate"],
        num_generations=g,
        per_device_train_batch_size=m,  # TRL counts completions per device batch
        gradient_accumulation_steps=g * p // m,  # one optimizer step per generated batch
        steps_per_generation=g * p // m,
        num_iterations=h["num_iterations"],
        max_completion_length=h["max_new_tokens"],
        temperature=h["temperature"],
        top_p=h["top_p"],
        top_k=0,
        beta=h["beta"],
        epsilon=h["epsilon_low"],
        epsilon_high=h["epsilon_high"],
        loss_type=h["loss_type"],
        scale_rewards=h["scale_rewards"],
        mask_truncated_completions=h["mask_truncated_completions"],
        adam_beta1=h["adam_b1"],
        adam_beta2=h["adam_b2"],
        adam_epsilon=h["adam_eps"],
        weight_decay=h["weight_decay"],
        max_grad_norm=h["max_grad_norm"],
        lr_scheduler_type=h["schedule"],
        warmup_steps=h["warmup_steps"],
        seed=h["seed"],
    )


MAPPING_NOTES = {
    "learning_rate": "--grpo.optimizer.learning-rate <-> learning_rate",
    "num_generations": "--grpo.num-generations <-> num_generations",
    "prompts_per_step": "--batch-size (prompts) <-> per_device_train_batch_size = prompts x G (completions), "
    "gradient_accumulation_steps=1, steps_per_generation=1 (--trl-micro-batch m: per_device_train_batch_size=m, "
    "gradient_accumulation_steps = steps_per_generation = prompts x G / m)",
    "max_new_tokens": "--grpo.max-new-tokens <-> max_completion_length",
    "temperature": "--grpo.temperature <-> temperature (both also divide the trained log-probs' logits by it)",
    "top_p/top_k": "none <-> top_p=1.0, top_k=0",
    "beta": "--grpo.beta <-> beta (both keep a frozen reference model)",
    "kl_estimator": "--grpo.kl-estimator k3 <-> TRL's only per-token KL (k3)",
    "epsilon": "--grpo.policy-loss.epsilon-low/high <-> epsilon / epsilon_high",
    "loss_type": "--grpo.loss-type grpo <-> loss_type='grpo' (mean over each completion's tokens, then over completions)",  # noqa: E501
    "scale_rewards": "--grpo.scale-rewards group <-> scale_rewards='group' (std eps 1e-4 on both)",
    "num_iterations": "--grpo.num-iterations 1, one minibatch <-> num_iterations=1: one optimizer step per batch",
    "optimizer": "AdamW b1/b2/eps, weight decay, clip by global norm <-> adam_beta1/2, adam_epsilon, weight_decay, "
    "max_grad_norm",
    "schedule": "--grpo.optimizer.schedule constant, no warm-up <-> lr_scheduler_type='constant', warmup_steps=0",
    "reward": "relax numeric_match on both (TRL: a wrapper calling relax.rewards.builtin.numeric_match on the "
    "assistant message's text)",
    "prompts": "the same rows as chat messages [{'role': 'user', 'content': prompt}] through the checkpoint's chat "
    "template, generation prompt added (token ids compared, see prompt_ids_equal)",
    "dtype": "float32 parameters and compute on both for the side-by-side (relax also bfloat16)",
    "remat": "--remat: relax --grpo.remat <-> gradient_checkpointing=True (both on by default in the trainers); "
    "without it --grpo.no-remat <-> gradient_checkpointing=False, as every recorded comparison ran",
    "generation": "relax's prefix-shared sampler (one prompt prefill per group) <-> transformers generate on the "
    "prompts repeated G times, sdpa attention, no vLLM",
}


# ----------------------------------------------------------------------------- relax


def _train_grpo_main():
    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "examples" / "train_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def run_relax(args, h: dict, dtype: str, out: Path, data: dict[str, Path]) -> dict:
    run_dir = out / f"relax-{dtype}"
    flags = [
        "--model",
        args.model,
        "--data",
        str(data["train"]),
        "--eval-data",
        str(data["eval"]),
        "--reward",
        "numeric_match",
        "--steps",
        str(args.steps),
        "--run-dir",
        str(run_dir),
        "--eval-max-prompts",
        str(args.num_eval),
        "--eval.num-samples",
        str(args.eval_samples),
        "--eval-every",
        str(args.eval_every),
        "--checkpoint-every",
        "1000000",
        "--reward-workers",
        "0",
        "--max-prompt-tokens",
        "256",
        *relax_flags(h),
    ]
    if dtype == "bfloat16":
        flags += [
            "--param-dtype",
            "bfloat16",
            "--compute-dtype",
            "bfloat16",
            "--grpo.optimizer.master-weights",
        ]
    else:
        flags += ["--param-dtype", dtype, "--compute-dtype", dtype]
    flags += args.relax_extra
    print("relax:", "examples/train_grpo.py " + " ".join(flags), flush=True)
    t0, load0 = time.time(), os.getloadavg()
    summary = _train_grpo_main()(flags)
    wall = time.time() - t0
    curve = relax_curve(run_dir / "metrics.jsonl")
    write_jsonl(out / f"curve-relax-{dtype}.jsonl", curve)
    times = [r["time/step"] for r in curve if "time/step" in r]
    seg_keys = sorted({k for r in curve for k in r if k.startswith("time/") and k != "time/step"})
    floor = relax_floor(args, h, data, curve) if dtype == "float32" else None
    return {
        "side": "relax",
        "dtype": dtype,
        "flags": flags,
        "run_dir": str(run_dir),
        "wall_s": wall,
        "loadavg_begin": load0,
        "loadavg_end": os.getloadavg(),
        "relax_commit": _git_commit(),
        "steps": len(times),
        "median_step_s": _median(times[1:]),
        "first_step_s": times[0] if times else None,
        "median_segment_s": {k: _median([r[k] for r in curve[1:] if k in r]) for k in seg_keys},
        "before": summary.get("before"),
        "after": summary.get("after"),
        "evals": relax_evals(run_dir / "metrics.jsonl"),
        "reward_first5": _mean([r["reward"] for r in curve[:5] if r.get("reward") is not None]),
        "reward_last5": _mean([r["reward"] for r in curve[-5:] if r.get("reward") is not None]),
        "floor": floor,
    }


def relax_floor(args, h: dict, data: dict[str, Path], curve: list[dict]) -> dict:
    """Each step against the FLOP floor of its real tokens (``flop_floor``) at the float32 matmul
    peak measured right after the run; ``median_of_peak`` over the steps after the first."""
    import harness

    peak = harness.matmul_peak_flops()
    prompt_len = mean_prompt_tokens(args.model, [r["prompt"] for r in read_jsonl(data["train"])])
    steps = steps_at_floor(args.model, h, prompt_len, curve, peak)
    return {
        "mean_prompt_tokens": prompt_len,
        "peak_gflops": peak / 1e9,
        "steps": steps,
        "median_of_peak": _median([s["of_peak"] for s in steps[1:]]),
    }


TRAIN_KEYS = (
    "reward",
    "kl",
    "completion_length",
    "truncated_frac",
    "frac_reward_zero_std",
    "loss",
    "grad_norm",
    "clip_frac_low",
    "clip_frac_high",
    "entropy",
    "compiles",
    "tokens_per_s",
    "mismatch/k3",
    "mismatch/abs_mean",
    "mismatch/abs_max",
    "mismatch/ratio_out_frac",
    "mismatch/seq_log_ratio",
    "mismatch/seq_log_ratio_abs_max",
)


def relax_curve(metrics: Path) -> list[dict]:
    """Training records of ``metrics.jsonl`` -> ``{step, wall_s, reward, ..., time/*}`` lines;
    ``wall_s``: the summed step times up to and including the step (evaluations excluded)."""
    out, wall = [], 0.0
    for r in read_jsonl(metrics):
        if "time/step" not in r:
            continue
        wall += r["time/step"]
        line = {"step": r["step"], "wall_s": round(wall, 3)}
        line.update({k: r[k] for k in TRAIN_KEYS if k in r})
        line.update({k: v for k, v in r.items() if k.startswith("time/")})
        out.append(line)
    return out


def relax_evals(metrics: Path) -> list[dict]:
    """Evaluation records (``eval/*`` keys) of ``metrics.jsonl`` by step."""
    out = []
    for r in read_jsonl(metrics):
        ev = {k: v for k, v in r.items() if k.startswith("eval/")}
        if ev:
            out.append({"step": r["step"], **ev})
    return out


def relax_eval_only(args, model_dir: Path, run_dir: Path, data: dict[str, Path], h: dict) -> dict:
    """relax's evaluator on ``model_dir`` (the same held-out prompts, sampling keys and settings as
    the training runs' before/after evaluations)."""
    flags = [
        "--model",
        str(model_dir),
        "--data",
        str(data["train"]),
        "--eval-data",
        str(data["eval"]),
        "--reward",
        "numeric_match",
        "--eval-only",
        "--run-dir",
        str(run_dir),
        "--eval-max-prompts",
        str(args.num_eval),
        "--eval.num-samples",
        str(args.eval_samples),
        "--reward-workers",
        "0",
        "--max-prompt-tokens",
        "256",
        *relax_flags(h),
    ]
    print("relax eval:", "examples/train_grpo.py " + " ".join(flags), flush=True)
    return _train_grpo_main()(flags).get("eval_only", {})


# ----------------------------------------------------------------------------- TRL (separate interpreter)


def snapshot_rewards(dest: Path) -> dict[str, str]:
    """Copy relax's reward code (``relax/*.py``, ``relax/rewards/*.py``) to ``dest`` and import
    ``relax.rewards.builtin`` right after, so that the TRL interpreter scores with the code this
    process scores with even while the tree is being edited; sha256 of each file."""
    import hashlib
    import shutil

    hashes = {}
    for sub in ("relax", "relax/rewards"):
        (dest / sub).mkdir(parents=True, exist_ok=True)
        for f in sorted((ROOT / sub).glob("*.py")):
            shutil.copyfile(f, dest / sub / f.name)
            hashes[f"{sub}/{f.name}"] = hashlib.sha256(
                (dest / sub / f.name).read_bytes()
            ).hexdigest()[:16]
    import relax.rewards.builtin  # noqa: F401  (imported now, next to the copy)

    return hashes


def run_trl(args, h: dict, out: Path, data: dict[str, Path]) -> dict:
    trl_dir = out / "trl"
    trl_dir.mkdir(parents=True, exist_ok=True)
    (trl_dir / "hparams.json").write_text(json.dumps(h))
    import relax

    tok = relax.load_tokenizer(args.model)
    rows = read_jsonl(data["train"])[:16]
    (trl_dir / "relax_prompt_ids.json").write_text(
        json.dumps(
            [
                list(
                    tok.apply_chat_template(
                        [{"role": "user", "content": r["prompt"]}],
                        add_generation_prompt=True,
                        tokenize=True,
                    )
                )
                for r in rows
            ]
        )
    )
    mapping = {
        "hparams": h,
        "trl_GRPOConfig": trl_kwargs(h),
        "relax_flags": relax_flags(h),
        "notes": MAPPING_NOTES,
    }
    (trl_dir / "mapping.json").write_text(json.dumps(mapping, indent=1))
    print("hyper-parameter mapping (relax <-> TRL GRPOConfig):")
    for k, v in MAPPING_NOTES.items():
        print(f"  {k:<18} {v}")
    cmd = [
        args.trl_python,
        str(Path(__file__).resolve().with_name("real_model_trl.py")),
        "--model",
        args.model,
        "--steps",
        str(args.trl_steps or args.steps),
        "--seed",
        str(args.seed),
        "--out",
        str(trl_dir),
        "--train-jsonl",
        str(data["train"]),
    ]
    print("trl:", " ".join(cmd), flush=True)
    t0, load0 = time.time(), os.getloadavg()
    rc = subprocess.run(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}).returncode
    run = {
        "wall_s": time.time() - t0,
        "loadavg_begin": load0,
        "loadavg_end": os.getloadavg(),
        "returncode": rc,
    }
    return trl_result(args, out, data, h, run)


def trl_result(args, out: Path, data: dict[str, Path], h: dict, run: dict | None = None) -> dict:
    """TRL's run from its files: the steps it logged, and relax's evaluation of its final model
    when the worker got to save one (a worker stopped early leaves its steps, no final model)."""
    trl_dir = out / "trl"
    info_file = trl_dir / "trl_info.json"
    info = (
        json.loads(info_file.read_text())
        if info_file.exists()
        else {"versions": trl_versions(args.trl_python)}
    )
    steps = read_jsonl(trl_dir / "steps.jsonl")
    curve = [
        {
            "step": s["step"],
            "wall_s": s["wall_s"],
            "reward": s.get("reward"),
            "kl": s.get("kl"),
            "completion_length": s.get("completions/mean_length"),
            "step_s": s["step_s"],
            "process_cpu_s": s["process_cpu_s"],
            "loadavg1": s.get("loadavg1"),
        }
        for s in steps
    ]
    write_jsonl(out / "curve-trl.jsonl", curve)
    finished = (trl_dir / "final_hf" / "config.json").exists()
    after = (
        relax_eval_only(args, trl_dir / "final_hf", out / "trl-eval", data, h) if finished else None
    )
    times = [s["step_s"] for s in steps]
    return {
        "side": "trl",
        "dtype": "float32",
        **(run or {}),
        "steps": len(steps),
        "finished": finished,
        "median_step_s": _median(times[1:]),
        "first_step_s": times[0] if times else None,
        "step_s": times,
        "after": after,
        **info,
        "reward_first5": _mean([c["reward"] for c in curve[:5] if c["reward"] is not None]),
        "reward_last5": _mean([c["reward"] for c in curve[-5:] if c["reward"] is not None]),
    }


def trl_versions(python: str) -> dict:
    code = (
        "import json, trl, transformers, torch; print(json.dumps({'trl': trl.__version__, "
        "'transformers': transformers.__version__, 'torch': torch.__version__}))"
    )
    try:
        return json.loads(
            subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout
        )
    except (OSError, subprocess.CalledProcessError, ValueError):
        return {}


# ----------------------------------------------------------------------------- plot, main


def plot(out: Path, runs: list[dict]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        name = f"{run['side']} {run['dtype']}"
        curve = read_jsonl(
            out
            / (f"curve-relax-{run['dtype']}.jsonl" if run["side"] == "relax" else "curve-trl.jsonl")
        )
        pts = [(c["step"], c["wall_s"], c["reward"]) for c in curve if c.get("reward") is not None]
        if not pts:
            continue
        s, w, r = zip(*pts)
        axes[0].plot(s, r, marker=".", label=name)
        axes[1].plot(w, r, marker=".", label=name)
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall seconds (evaluations excluded)")
    for ax in axes:
        ax.set_ylabel("mean reward of the step's completions")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"GRPO on {Path(runs[0].get('model', '')).name or 'the checkpoint'}: word-problem arithmetic"
    )
    fig.tight_layout()
    path = out / "curve.png"
    fig.savefig(path, dpi=110)
    return path


SMALL = (
    "results.json",
    "hparams.json",
    "eval.jsonl",
    "curve.png",
    "curve-*.jsonl",
    "relax-*/summary.json",
    "relax-*/metrics.jsonl",
    "relax-*/startup.txt",
    "relax-*/text.jsonl",
    "trl/mapping.json",
    "trl/steps.jsonl",
    "trl/trl_info.json",
    "trl-eval/summary.json",
    "trl-eval/startup.txt",
    "run-*.json",
)


def copy_small(out: Path, dest: Path) -> None:
    import shutil

    for pattern in SMALL:
        for f in out.glob(pattern):
            target = dest / f.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    print("copied the small outputs to", dest)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _mean(xs):
    return sum(xs) / len(xs) if xs else None


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="a Hugging Face model directory")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-size", type=int, default=4, help="prompts per step")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument(
        "--param-dtype",
        default="float32",
        help="float32 and/or bfloat16, comma-separated: one relax run each (bfloat16: bf16 compute, "
        "float32 master weights); DTYPE:N runs that one for N steps instead of --steps",
    )
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument(
        "--remat",
        action="store_true",
        help="recompute layers in the backward on both sides (relax --grpo.remat, TRL "
        "gradient_checkpointing; both trainers' default); off: as the recorded comparisons ran",
    )
    ap.add_argument("--beta", type=float, default=0.04)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-train", type=int, default=1000)
    ap.add_argument("--num-eval", type=int, default=64)
    ap.add_argument(
        "--eval-samples", type=int, default=4, help="samples per held-out prompt for pass@k"
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="relax: also evaluate every N steps (0: before/after)",
    )
    ap.add_argument("--out", default="runs/real-model")
    ap.add_argument(
        "--results",
        default=None,
        help="also copy the small outputs (curves, summaries, metrics, PNG, results.json) here; "
        "the run directories (checkpoints, exported models) stay under --out",
    )
    ap.add_argument("--peer", choices=("none", "trl"), default="none")
    ap.add_argument("--trl-steps", type=int, default=0, help="TRL's steps (0: --steps)")
    ap.add_argument(
        "--trl-micro-batch",
        type=int,
        default=None,
        help="TRL's completions per forward/backward (default: a step's all; smaller fits less memory)",
    )
    ap.add_argument(
        "--trl-python",
        default=os.environ.get("TRL_PYTHON", "/work/trl-venv/bin/python"),
        help="an interpreter with trl installed",
    )
    ap.add_argument(
        "--skip-relax", action="store_true", help="only the peer (and the shared files)"
    )
    ap.add_argument(
        "--collect",
        action="store_true",
        help="run nothing: rebuild results.json, the curves and the PNG from the runs already in --out "
        "(with --peer trl: also a TRL worker that stopped early, from its logged steps)",
    )
    ap.add_argument(
        "--relax-extra",
        nargs=argparse.REMAINDER,
        default=[],
        help="further examples/train_grpo.py flags (last on the command line)",
    )
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = make_rows(args.num_train, args.num_eval, args.seed)
    data = {"train": out / "train.jsonl", "eval": out / "eval.jsonl"}
    write_jsonl(data["train"], train)
    write_jsonl(data["eval"], held_out)
    h = hparams(args)
    (out / "hparams.json").write_text(json.dumps(h, indent=1))
    # --collect keeps the copy an earlier invocation's TRL worker scored with
    reward_src_sha = {} if args.collect else snapshot_rewards(out / "reward_src")
    plan = (
        []
        if args.skip_relax or args.collect
        else [("relax", d) for d in args.param_dtype.split(",")]
    )
    if (
        args.peer == "trl" and not args.collect
    ):  # after the first relax run, before the other dtypes
        plan.insert(min(1, len(plan)), ("trl", "float32"))
    for side, spec in plan:
        if side == "trl":
            run = run_trl(args, h, out, data)
        else:  # "bfloat16:5": that dtype for 5 steps
            dtype, _, steps = spec.strip().partition(":")
            run = run_relax(
                argparse.Namespace(**{**vars(args), "steps": int(steps or args.steps)}),
                h,
                dtype,
                out,
                data,
            )
        (out / f"run-{run['side']}-{run['dtype']}.json").write_text(
            json.dumps(run, indent=1, default=str)
        )
    if (
        args.collect
        and args.peer == "trl"
        and not (out / "run-trl-float32.json").exists()
        and (out / "trl" / "steps.jsonl").exists()
    ):
        run = trl_result(args, out, data, h, {"note": "collected from the worker's files"})
        (out / "run-trl-float32.json").write_text(json.dumps(run, indent=1, default=str))
    # every run recorded in --out so far (earlier invocations included): relax float32, TRL, the rest
    order = {"relax-float32": 0, "trl-float32": 1}
    runs = [
        json.loads(f.read_text())
        for f in sorted(out.glob("run-*.json"), key=lambda f: (order.get(f.stem[4:], 2), f.name))
    ]
    for r in runs:
        r["model"] = args.model
    png = plot(out, runs) if runs else None
    import jax
    import jaxlib

    versions = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "relax_commit": _git_commit(),
        "python": sys.version.split()[0],
        "devices": [str(d) for d in jax.devices()],
    }
    try:
        import torch
        import transformers  # noqa: E401

        versions.update(transformers=transformers.__version__, torch=torch.__version__)
    except ImportError:
        pass
    table = []
    for r in runs:
        before = r.get("before") or (runs[0].get("before") if runs else None) or {}
        after = r.get("after") or {}
        table.append(
            {
                "side": r["side"],
                "dtype": r["dtype"],
                "steps": r["steps"],
                "median_step_s": r["median_step_s"],
                "of_peak": (r.get("floor") or {}).get("median_of_peak"),
                "greedy_before": before.get("greedy/accuracy"),
                "greedy_after": after.get("greedy/accuracy"),
                **{
                    f"{k}_before": before.get(k)
                    for k in ("pass@1", "pass@2", "pass@4")
                    if k in before
                },
                **{
                    f"{k}_after": after.get(k) for k in ("pass@1", "pass@2", "pass@4") if k in after
                },
                "greedy_by_step": {
                    e["step"]: e.get("eval/greedy/accuracy") for e in r.get("evals", [])
                },
                "reward_first5": r.get("reward_first5"),
                "reward_last5": r.get("reward_last5"),
            }
        )
    result = {
        "benchmark": "real_model",
        "model": args.model,
        "hparams": h,
        "num_train": len(train),
        "reward_src_sha256_16": {k: v for k, v in reward_src_sha.items() if "rewards/" in k},
        "num_eval": len(held_out),
        "table": table,
        "runs": runs,
        "png": str(png) if png else None,
        "versions": versions,
        "loadavg": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    if args.results:
        copy_small(out, Path(args.results))
    print(json.dumps({"table": table, "versions": versions, "png": result["png"]}, default=str))
    return result


if __name__ == "__main__":
    main()
