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
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from arithmetic_task import make_rows  # noqa: E402
from flop_floor import mean_prompt_tokens, steps_at_floor  # noqa: E402
from real_model_common import (  # noqa: E402
    DEFAULT_MODEL,
    git_commit,
    hparams,
    mean,
    median,
    read_jsonl,
    run_flags,
    train_grpo_main,
    write_jsonl,
)
from real_model_peer import run_trl, snapshot_rewards, trl_result  # noqa: E402

# ----------------------------------------------------------------------------- relax


def run_relax(args, h: dict, dtype: str, out: Path, data: dict[str, Path]) -> dict:
    run_dir = out / f"relax-{dtype}"
    flags = [
        "--model",
        args.model,
        *run_flags(args, h, data, run_dir),
        "--steps",
        str(args.steps),
        "--eval-every",
        str(args.eval_every),
        "--checkpoint-every",
        "1000000",
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
    summary = train_grpo_main()(flags)
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
        "relax_commit": git_commit(),
        "steps": len(times),
        "median_step_s": median(times[1:]),
        "first_step_s": times[0] if times else None,
        "median_segment_s": {k: median([r[k] for r in curve[1:] if k in r]) for k in seg_keys},
        "before": summary.get("before"),
        "after": summary.get("after"),
        "evals": relax_evals(run_dir / "metrics.jsonl"),
        "reward_first5": mean([r["reward"] for r in curve[:5] if r.get("reward") is not None]),
        "reward_last5": mean([r["reward"] for r in curve[-5:] if r.get("reward") is not None]),
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
        "median_of_peak": median([s["of_peak"] for s in steps[1:]]),
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
    for pattern in SMALL:
        for f in out.glob(pattern):
            target = dest / f.relative_to(out)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
    print("copied the small outputs to", dest)


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


def run_sides(args, h: dict, out: Path, data: dict[str, Path]) -> None:
    """Run each side asked for (relax once per ``--param-dtype``, TRL after the first relax run)
    and write its ``run-<side>-<dtype>.json``; with ``--collect``, only a TRL worker that stopped
    early is read back from its files."""
    plan = (
        []
        if args.skip_relax or args.collect
        else [("relax", d) for d in args.param_dtype.split(",")]
    )
    if args.peer == "trl" and not args.collect:  # after the first relax run, before the others
        plan.insert(min(1, len(plan)), ("trl", "float32"))
    for side, spec in plan:
        if side == "trl":
            run = run_trl(args, h, out, data)
        else:  # "bfloat16:5": that dtype for 5 steps
            dtype, _, steps = spec.strip().partition(":")
            steps_args = argparse.Namespace(**{**vars(args), "steps": int(steps or args.steps)})
            run = run_relax(steps_args, h, dtype, out, data)
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


def recorded_runs(out: Path, model: str) -> list[dict]:
    """Every run recorded in ``out`` so far (earlier invocations included): relax float32, TRL,
    the rest."""
    order = {"relax-float32": 0, "trl-float32": 1}
    files = sorted(out.glob("run-*.json"), key=lambda f: (order.get(f.stem[4:], 2), f.name))
    runs = [json.loads(f.read_text()) for f in files]
    for r in runs:
        r["model"] = model
    return runs


def versions() -> dict:
    import jax
    import jaxlib

    out = {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "relax_commit": git_commit(),
        "python": sys.version.split()[0],
        "devices": [str(d) for d in jax.devices()],
    }
    try:
        import torch
        import transformers

        out.update(transformers=transformers.__version__, torch=torch.__version__)
    except ImportError:
        pass
    return out


PASS_AT = ("pass@1", "pass@2", "pass@4")


def table_row(r: dict, runs: list[dict]) -> dict:
    """A run's line of the summary table: its step time, floor and accuracies."""
    before = r.get("before") or (runs[0].get("before") if runs else None) or {}
    after = r.get("after") or {}
    return {
        "side": r["side"],
        "dtype": r["dtype"],
        "steps": r["steps"],
        "median_step_s": r["median_step_s"],
        "of_peak": (r.get("floor") or {}).get("median_of_peak"),
        "greedy_before": before.get("greedy/accuracy"),
        "greedy_after": after.get("greedy/accuracy"),
        **{f"{k}_before": before.get(k) for k in PASS_AT if k in before},
        **{f"{k}_after": after.get(k) for k in PASS_AT if k in after},
        "greedy_by_step": {e["step"]: e.get("eval/greedy/accuracy") for e in r.get("evals", [])},
        "reward_first5": r.get("reward_first5"),
        "reward_last5": r.get("reward_last5"),
    }


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
    run_sides(args, h, out, data)
    runs = recorded_runs(out, args.model)
    png = plot(out, runs) if runs else None
    table = [table_row(r, runs) for r in runs]
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
        "versions": versions(),
        "loadavg": os.getloadavg(),
        "cpu_count": os.cpu_count(),
    }
    (out / "results.json").write_text(json.dumps(result, indent=1, default=str))
    if args.results:
        copy_small(out, Path(args.results))
    summary = {"table": table, "versions": result["versions"], "png": result["png"]}
    print(json.dumps(summary, default=str))
    return result


if __name__ == "__main__":
    main()
