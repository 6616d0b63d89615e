"""Plans for the models people post-train (``relax plan``; no weights, no accelerator): one JSON
line per case with each program's need per chip, the peak and whether the run fits. Each case
names its trainer (GRPO, PPO with a reward model, SFT, DPO, ...).

    JAX_PLATFORMS=cpu python benchmarks/plans.py                 # every case (long: see RESULTS.md)
    JAX_PLATFORMS=cpu python benchmarks/plans.py qwen0.5b-v5e-full llama8b-v5p
    JAX_PLATFORMS=cpu python benchmarks/plans.py llama70b-v5p-smallest   # a chip kind: its smallest slice that fits
    JAX_PLATFORMS=cpu python benchmarks/plans.py llama8b-sft-v5p-smallest qwen7b-ppo-rm-v5p

The configs in ``benchmarks/configs`` are written from the published model shapes
(``qwen2.5-7b-rm.json``: Qwen2.5-7B as a ``Qwen2ForSequenceClassification`` reward model). GPU targets
need the CUDA plugin (``relax.plan.gpu_target``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from relax.models.hf.checkpoint import read_config
from relax.plan import plan
from relax.plan.plan import compile_once, parse_run
from relax.plan.search import SLICES, smallest

CONFIGS = Path(__file__).parent / "configs"


def bf16(group: str) -> list[str]:
    """bfloat16 weights and compute, float32 master weights in the optimizer of ``--<group>.*``."""
    return [
        "--param-dtype",
        "bfloat16",
        "--compute-dtype",
        "bfloat16",
        f"--{group}.optimizer.master-weights",
    ]


BF16 = bf16("grpo")
GRPO = [
    "--grpo.num-generations",
    "8",
    "--grpo.max-new-tokens",
    "1024",
    "--max-prompt-tokens",
    "512",
]

# On GPU targets the plan uses the group attention kernel: the fused cuDNN attention ("auto" in
# 16 bits on GPU) needs cuDNN itself to compile, which a GPU-less host does not have.
CASES: dict[str, tuple[str, str, str, list[str]]] = {
    "qwen0.5b-v5e-full": (
        "grpo",
        "qwen2.5-0.5b",
        "v5e:2x2",
        [*GRPO, *BF16, "--batch-size", "8", "--parallel.mesh", "fsdp=4"],
    ),
    "qwen0.5b-v5e-full-remat": (
        "grpo",
        "qwen2.5-0.5b",
        "v5e:2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "8",
            "--parallel.mesh",
            "fsdp=4",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen0.5b-v5e-lora": (
        "grpo",
        "qwen2.5-0.5b",
        "v5e:2x2",
        [
            *GRPO,
            "--param-dtype",
            "bfloat16",
            "--compute-dtype",
            "bfloat16",
            "--lora.rank",
            "16",
            "--batch-size",
            "8",
            "--parallel.mesh",
            "fsdp=4",
            "--grpo.remat",
        ],
    ),
    "llama8b-v5p": (
        "grpo",
        "llama-3.1-8b",
        "v5p:2x2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=8",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen7b-h100x8": (
        "grpo",
        "qwen2.5-7b",
        "h100x8",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=8",
            "--grpo.train-attention",
            "group",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "llama8b-v5p-4chips": (
        "grpo",
        "llama-3.1-8b",
        "v5p:2x2x1",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "8",
            "--parallel.mesh",
            "fsdp=4",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen7b-v5e-16chips": (
        "grpo",
        "qwen2.5-7b",
        "v5e:4x4",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "32",
            "--parallel.mesh",
            "fsdp=16",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen1.5b-v6e": (
        "grpo",
        "qwen2.5-1.5b",
        "v6e:2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "8",
            "--parallel.mesh",
            "fsdp=4",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen32b-v5p": (
        "grpo",
        "qwen2.5-32b",
        "v5p:2x2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=8",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "llama8b-h100x8-lora": (
        "grpo",
        "llama-3.1-8b",
        "h100x8",
        [
            *GRPO,
            "--param-dtype",
            "bfloat16",
            "--compute-dtype",
            "bfloat16",
            "--lora.rank",
            "16",
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=8",
            "--grpo.train-attention",
            "group",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen1.5b-h100x1": (
        "grpo",
        "qwen2.5-1.5b",
        "h100x1",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "4",
            "--parallel.mesh",
            "fsdp=1",
            "--grpo.train-attention",
            "group",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    # mixture of experts: Qwen3-30B-A3B (128 experts, top-8, 3B active), all weights trained
    "qwen3moe30b-v5p": (
        "grpo",
        "qwen3-30b-a3b",
        "v5p:2x2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=8",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen3moe30b-v5p-ep": (
        "grpo",
        "qwen3-30b-a3b",
        "v5p:2x2x2",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "expert=8",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "qwen3moe30b-h100x8": (
        "grpo",
        "qwen3-30b-a3b",
        "h100x8",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "expert=8",
            "--grpo.train-attention",
            "group",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    # a chip kind instead of a slice: the smallest slice of it that fits (relax.plan.search)
    "qwen32b-v5p-smallest": (
        "grpo",
        "qwen2.5-32b",
        "v5p",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=-1,tensor=4",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "llama70b-v5p-smallest": (
        "grpo",
        "llama-3.1-70b",
        "v5p",
        [
            *GRPO,
            *BF16,
            "--batch-size",
            "16",
            "--parallel.mesh",
            "fsdp=-1,tensor=8",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    "llama70b-h100-lora-smallest": (
        "grpo",
        "llama-3.1-70b",
        "h100",
        [
            *GRPO,
            "--param-dtype",
            "bfloat16",
            "--compute-dtype",
            "bfloat16",
            "--lora.rank",
            "16",
            "--batch-size",
            "8",
            "--parallel.mesh",
            "fsdp=-1,tensor=8",
            "--grpo.train-attention",
            "group",
            "--grpo.remat",
            "--grpo.grad-accum",
            "4",
        ],
    ),
    # every trainer (issue 51): offline runs on every chip (fsdp=-1), a reward model beside PPO
    "llama8b-sft-v5p-smallest": (
        "sft",
        "llama-3.1-8b",
        "v5p",
        [*bf16("sft"), "--sft.max-length", "4096", "--sft.remat", "--sft.grad-accum", "4"]
        + ["--batch-size", "16"],
    ),
    "llama8b-dpo-v5p-smallest": (
        "dpo",
        "llama-3.1-8b",
        "v5p",
        [*bf16("dpo"), "--dpo.max-prompt-tokens", "1024", "--dpo.max-completion-tokens", "1024"]
        + ["--dpo.remat", "--dpo.grad-accum", "4", "--batch-size", "16"],
    ),
    "qwen7b-ppo-rm-v5p": (
        "ppo",
        "qwen2.5-7b",
        "v5p:2x2x2",
        [*bf16("ppo"), "--ppo.critic-optimizer.master-weights", "--reward-model"]
        + [str(CONFIGS / "qwen2.5-7b-rm.json"), "--ppo.num-generations", "8"]
        + ["--ppo.max-new-tokens", "1024", "--max-prompt-tokens", "512", "--batch-size", "16"]
        + ["--parallel.mesh", "fsdp=8", "--ppo.remat", "--ppo.grad-accum", "4"],
    ),
    "llama70b-sft-lora-h100x8": (
        "sft",
        "llama-3.1-70b",
        "h100x8",
        ["--param-dtype", "bfloat16", "--compute-dtype", "bfloat16", "--lora.rank", "16"]
        + ["--sft.max-length", "4096", "--sft.remat", "--sft.grad-accum", "4", "--batch-size", "8"]
        + ["--parallel.mesh", "fsdp=8"],
    ),
    "qwen3moe30b-sft-v5p-ep": (
        "sft",
        "qwen3-30b-a3b",
        "v5p:2x2x2",
        [*bf16("sft"), "--sft.max-length", "4096", "--sft.remat", "--sft.grad-accum", "4"]
        + ["--batch-size", "16", "--parallel.mesh", "expert=8"],
    ),
    "qwen3moe30b-sft-v5p16-ep": (
        "sft",
        "qwen3-30b-a3b",
        "v5p:2x2x4",
        [*bf16("sft"), "--sft.max-length", "4096", "--sft.remat", "--sft.grad-accum", "4"]
        + ["--batch-size", "16", "--parallel.mesh", "expert=8,fsdp=2"],
    ),
}


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        algorithm, model, target, flags = CASES[name]
        t0 = time.perf_counter()
        argv = ["--model", str(CONFIGS / f"{model}.json"), *flags]
        line = {
            "case": name,
            "algorithm": algorithm,
            "model": model,
            "target": target,
            "flags": " ".join(flags),
        }
        if target in SLICES:
            p, line["tried"] = search(algorithm, argv, target)
            if p is None:
                print(
                    json.dumps({**line, "fits": False, "seconds": round(time.perf_counter() - t0)}),
                    flush=True,
                )
                continue
        else:
            p = plan(algorithm, argv, target)
        print(p.table(), file=sys.stderr, flush=True)
        seconds = round(time.perf_counter() - t0)
        print(json.dumps({**line, **figures(p), "seconds": seconds}), flush=True)


def search(algorithm: str, argv: list[str], kind: str) -> tuple[Any, list[dict]]:
    """The plan on the smallest slice of ``kind`` that fits (None if none), and the slices tried."""
    run = parse_run(algorithm, argv)
    p, tried = smallest(
        algorithm,
        run,
        read_config(run.model),
        kind,
        compile_fn=compile_once(),
        log=lambda text: print(text, file=sys.stderr, flush=True),
    )
    return p, [
        {
            "target": str(t.target),
            "fits": t.fits,
            "reason": t.reason,
            "peak_gib": None if t.peak_bytes is None else round(t.peak_bytes / 2**30, 2),
        }
        for t in tried
    ]


def figures(p) -> dict:
    """A plan's figures for the JSON line: the slice, the peak per chip and each program's."""
    return {
        "slice": str(p.target),
        "fits": p.fits,
        "peak": p.peak.name,
        "peak_gib": round(p.peak.total / 2**30, 2),
        "limit_gib": round(p.peak.limit / 2**30, 2),
        "programs": {m.name: round(m.total / 2**30, 2) for m in p.programs},
        "reward_model_gib": round(max(m.reward_model for m in p.programs) / 2**30, 2),
        "decode_step_ms": [
            round(t.decode_step_seconds * 1e3, 2)
            for t in p.traffic
            if t is not None and t.decode_step_seconds
        ],
    }


if __name__ == "__main__":
    main(sys.argv[1:])
