"""Plans for the models people post-train (``relax plan``; no weights, no accelerator): one JSON
line per case with each program's need per chip, the peak and whether the run fits.

    JAX_PLATFORMS=cpu python benchmarks/plans.py                 # every case (long: see RESULTS.md)
    JAX_PLATFORMS=cpu python benchmarks/plans.py qwen0.5b-v5e-full llama8b-v5p
    JAX_PLATFORMS=cpu python benchmarks/plans.py llama70b-v5p-smallest   # a chip kind: its smallest slice that fits

The configs in ``benchmarks/configs`` are written from the published model shapes. GPU targets
need the CUDA plugin (``relax.plan.gpu_target``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from relax.models.hf.checkpoint import read_config
from relax.plan import plan
from relax.plan.plan import compile_once, parse_run
from relax.plan.search import SLICES, smallest

CONFIGS = Path(__file__).parent / "configs"
BF16 = [
    "--param-dtype",
    "bfloat16",
    "--compute-dtype",
    "bfloat16",
    "--grpo.optimizer.master-weights",
]
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
CASES: dict[str, tuple[str, str, list[str]]] = {
    "qwen0.5b-v5e-full": (
        "qwen2.5-0.5b",
        "v5e:2x2",
        [*GRPO, *BF16, "--batch-size", "8", "--parallel.mesh", "fsdp=4"],
    ),
    "qwen0.5b-v5e-full-remat": (
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
}


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        model, target, flags = CASES[name]
        t0 = time.perf_counter()
        argv = ["--model", str(CONFIGS / f"{model}.json"), *flags]
        line = {"case": name, "model": model, "target": target, "flags": " ".join(flags)}
        if target in SLICES:
            run = parse_run("grpo", argv)
            p, tried = smallest(
                "grpo",
                run,
                read_config(run.model),
                target,
                compile_fn=compile_once(),
                log=lambda text: print(text, file=sys.stderr, flush=True),
            )
            line["tried"] = [
                {
                    "target": str(t.target),
                    "fits": t.fits,
                    "reason": t.reason,
                    "peak_gib": None if t.peak_bytes is None else round(t.peak_bytes / 2**30, 2),
                }
                for t in tried
            ]
            if p is None:
                print(
                    json.dumps({**line, "fits": False, "seconds": round(time.perf_counter() - t0)}),
                    flush=True,
                )
                continue
        else:
            p = plan("grpo", argv, target)
        print(p.table(), file=sys.stderr, flush=True)
        print(
            json.dumps(
                {
                    **line,
                    "slice": str(p.target),
                    "fits": p.fits,
                    "peak": p.peak.name,
                    "peak_gib": round(p.peak.total / 2**30, 2),
                    "limit_gib": round(p.peak.limit / 2**30, 2),
                    "seconds": round(time.perf_counter() - t0),
                    "programs": {m.name: round(m.total / 2**30, 2) for m in p.programs},
                    "decode_step_ms": [
                        round(t.decode_step_seconds * 1e3, 2)
                        for t in p.traffic
                        if t is not None and t.decode_step_seconds
                    ],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
