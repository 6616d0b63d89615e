"""The TRL side of ``benchmarks/real_model.py``: TRL's GRPOConfig for the same hyper-parameters,
the worker (``real_model_trl.py``) started in its own interpreter, and its results read back
from the files it writes (its steps; relax's evaluation of its final model)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from real_model_common import (
    ROOT,
    mean,
    median,
    read_jsonl,
    relax_eval_only,
    relax_flags,
    write_jsonl,
)


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
        "median_step_s": median(times[1:]),
        "first_step_s": times[0] if times else None,
        "step_s": times,
        "after": after,
        **info,
        "reward_first5": mean([c["reward"] for c in curve[:5] if c["reward"] is not None]),
        "reward_last5": mean([c["reward"] for c in curve[-5:] if c["reward"] is not None]),
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
