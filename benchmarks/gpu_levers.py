"""The decode levers, one at a time (run where a GPU is present): each variant runs
``benchmarks/gpu.py --only decode,long_prompt`` in its own process (XLA flags are read once per
process), so a single command measures every lever against the same baseline.

Variants (name: gpu.py flags, XLA_FLAGS added to the environment's):

    baseline          the defaults (XLA decode attention, 64-slot cache blocks, XLA's own command buffers)
    pallas            --decode-attention pallas (relax.models.attention.decode's Triton kernel)
    one_block         --cache-chunk 256: one cache block for the 256-token budget (one decode loop)
    no_cmd_buffers    --xla_gpu_enable_command_buffer= (every kernel launched on its own)
    while_cmd_buffer  command buffers that also capture the while loop (FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE)

Prints each gpu.py JSON line with ``"variant"`` added, or ``{"variant": ..., "error": ...}``.

    python benchmarks/gpu_levers.py [--small] [--variants baseline,pallas]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = {
    "baseline": ([], ""),
    "pallas": (["--decode-attention", "pallas"], ""),
    "one_block": (["--cache-chunk", "256"], ""),
    "no_cmd_buffers": ([], "--xla_gpu_enable_command_buffer="),
    "while_cmd_buffer": (
        [],
        "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE",
    ),
}


def run(name: str, small: bool) -> None:
    args, xla = VARIANTS[name]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {xla}".strip()}
    cmd = [sys.executable, os.path.join(HERE, "gpu.py"), "--only", "decode,long_prompt", *args]
    proc = subprocess.run(
        cmd + (["--small"] if small else []), env=env, capture_output=True, text=True
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        print(
            json.dumps({"variant": name, "error": (proc.stderr or proc.stdout)[-1500:]}), flush=True
        )
    for line in lines:
        print(json.dumps({"variant": name, **json.loads(line)}), flush=True)


def main():
    argv = sys.argv[1:]
    names = (
        argv[argv.index("--variants") + 1].split(",") if "--variants" in argv else list(VARIANTS)
    )
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {','.join(VARIANTS)}")
    for name in names:
        run(name, "--small" in argv)


if __name__ == "__main__":
    main()
