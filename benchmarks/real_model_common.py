"""What both sides of ``benchmarks/real_model.py`` share: the hyper-parameters named once, relax's
flags for them, relax's evaluator (which scores TRL's final model too), the JSON-lines files and
the summary statistics."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
from pathlib import Path

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


# relax's flag for each hyper-parameter of ``hparams`` it reads, in the order given
RELAX_FLAGS = (
    ("--grpo.num-generations", "num_generations"),
    ("--grpo.max-new-tokens", "max_new_tokens"),
    ("--grpo.temperature", "temperature"),
    ("--grpo.beta", "beta"),
    ("--grpo.kl-estimator", "kl_estimator"),
    ("--grpo.policy-loss.epsilon-low", "epsilon_low"),
    ("--grpo.policy-loss.epsilon-high", "epsilon_high"),
    ("--grpo.loss-type", "loss_type"),
    ("--grpo.scale-rewards", "scale_rewards"),
    ("--grpo.num-iterations", "num_iterations"),
    ("--grpo.num-minibatches", None),  # one optimizer step per batch: "1"
    ("--grpo.optimizer.learning-rate", "learning_rate"),
    ("--grpo.optimizer.b1", "adam_b1"),
    ("--grpo.optimizer.b2", "adam_b2"),
    ("--grpo.optimizer.eps", "adam_eps"),
    ("--grpo.optimizer.weight-decay", "weight_decay"),
    ("--grpo.optimizer.max-grad-norm", "max_grad_norm"),
    ("--grpo.optimizer.schedule", "schedule"),
    ("--grpo.optimizer.warmup-steps", "warmup_steps"),
    ("--batch-size", "prompts_per_step"),
    ("--seed", "seed"),
)


def relax_flags(h: dict) -> list[str]:
    """relax's command-line flags for the hyper-parameters ``h`` (``hparams``)."""
    pairs = [(flag, "1" if key is None else str(h[key])) for flag, key in RELAX_FLAGS]
    remat = "--grpo.remat" if h.get("remat") else "--grpo.no-remat"
    return ["--preset", "grpo", *(x for pair in pairs for x in pair), remat]


def train_grpo_main():
    spec = importlib.util.spec_from_file_location("train_grpo", ROOT / "examples" / "train_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def run_flags(args, h: dict, data: dict[str, Path], run_dir: Path) -> list[str]:
    """The flags of every relax run here (training or evaluation only): the task's rows and
    reward, the run directory, the held-out evaluation, the hyper-parameters."""
    return [
        "--data",
        str(data["train"]),
        "--eval-data",
        str(data["eval"]),
        "--reward",
        "numeric_match",
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


def relax_eval_only(args, model_dir: Path, run_dir: Path, data: dict[str, Path], h: dict) -> dict:
    """relax's evaluator on ``model_dir`` (the same held-out prompts, sampling keys and settings as
    the training runs' before/after evaluations)."""
    flags = ["--model", str(model_dir), "--eval-only", *run_flags(args, h, data, run_dir)]
    print("relax eval:", "examples/train_grpo.py " + " ".join(flags), flush=True)
    return train_grpo_main()(flags).get("eval_only", {})


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def git_commit() -> str | None:
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
