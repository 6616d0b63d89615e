"""Run the CPU benchmark set and collect every JSON line into benchmarks/results/cpu-<date>.jsonl.

Each script runs as a subprocess with run counts small enough that the whole set stays under
about 10 minutes on 2 cores; its table goes to stderr as it runs. After each script one line
``{"bench": "run_all", "script": ..., "wall_s": ..., "rc": ...}`` records how it went.
``train_step.py`` is included when it exists.

    .venv/bin/python benchmarks/run_all.py
    .venv/bin/python benchmarks/run_all.py --only rollout,attention --out /tmp/bench.jsonl
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import tyro  # noqa: E402

# (script, arguments for the quick CPU set); order: cheap first
# (script, arguments for the quick CPU set: fewer runs, a time budget per case; the rollout's
# no-cache mode on 1024-token prompts - a ~60 s extrapolation - is left to `rollout.py` alone)
SUITE = [
    ("attention", ["--runs", "10"]),
    ("train_attention", ["--runs", "3"]),
    ("rollout", ["--runs", "2", "--budget-s", "15", "--no-nocache-b"]),
    ("logprobs", ["--runs", "2", "--budget-s", "15"]),
    ("train_step", ["--runs", "2"]),
    ("scaling", ["--runs", "2", "--warmup", "0", "--budget-s", "5"]),
]


@dataclasses.dataclass
class Args:
    only: str = ""
    """comma-separated subset of scripts (default: all that exist)"""
    out: str = ""
    """output file (default benchmarks/results/cpu-<date>.jsonl; appended to)"""
    timeout_s: float = 300.0
    """wall-clock limit per script"""


def main(args: Args) -> None:
    only = {s for s in args.only.split(",") if s}
    out = args.out or os.path.join(
        HERE, "results", f"cpu-{datetime.date.today().isoformat()}.jsonl"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    start = time.perf_counter()
    with open(out, "a") as f:
        for name, argv in SUITE:
            script = os.path.join(HERE, f"{name}.py")
            if (only and name not in only) or not os.path.exists(script):
                continue
            print(f"== {name} {' '.join(argv)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            lines, rc = [], None
            try:
                proc = subprocess.run(
                    [sys.executable, script, *argv],
                    stdout=subprocess.PIPE,
                    text=True,
                    timeout=args.timeout_s,
                )
                rc, stdout = proc.returncode, proc.stdout
            except subprocess.TimeoutExpired as e:
                stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            for line in stdout.splitlines():
                if line.startswith("{"):
                    try:
                        lines.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
                    f.write(line.strip() + "\n")
            f.flush()
            summary = {
                "bench": "run_all",
                "script": name,
                "args": " ".join(argv),
                "records": len(lines),
                "wall_s": time.perf_counter() - t0,
                "rc": rc,
            }
            if rc is None:
                summary["error"] = f"timed out after {args.timeout_s} s"
            rec = harness.emit(summary)
            f.write(json.dumps(rec) + "\n")
    print(f"== {time.perf_counter() - start:.0f} s in all; results in {out}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
