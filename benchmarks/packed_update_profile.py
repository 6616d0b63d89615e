"""Where the packed update's time goes: ``packed_update.py``'s variants traced by JAX's profiler,
XLA's ops ranked by their summed time.

Each variant (default ``update_packed`` and ``update_no_padding``) is compiled, run ``--runs``
times (median seconds), then run once more under ``jax.profiler.trace``; the trace's complete
events are summed by name (an op inside a loop is counted once per iteration, and a loop's own
event includes its body's ops). Prints one JSON line per variant: the median, the top ``--top``
ops with their milliseconds and calls.

    python benchmarks/packed_update_profile.py [--runs 3] [--top 25]
    python benchmarks/packed_update_profile.py --variants update_packed --model-shape smollm-135m
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

import jax
import tyro

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import emit  # noqa: E402
from packed_update import Args, build  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ProfileArgs(Args):
    variants: tuple[str, ...] = ("update_packed", "update_no_padding")
    top: int = 25


def trace_ops(fn, top: int) -> list[dict]:
    """``fn()`` once under the profiler: the ``top`` event names by summed duration."""
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        (path,) = glob.glob(f"{d}/**/*.trace.json.gz", recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return [
        {"op": name, "ms": us / 1e3, "calls": calls[name]} for name, us in total.most_common(top)
    ]


def main(args: ProfileArgs) -> list[dict]:
    variants, _ = build(args)
    out = []
    for name in args.variants:
        fn = variants[name]
        jax.block_until_ready(fn())  # compile
        times = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        record = {
            "bench": "packed_update_profile",
            "variant": name,
            "model_shape": args.model_shape,
            "N": args.new_tokens,
            "median_s": statistics.median(times),
            "ops": trace_ops(fn, args.top),
        }
        out.append(emit(record, table=["bench", "variant", "N", "median_s"]))
    return out


if __name__ == "__main__":
    main(tyro.cli(ProfileArgs))
