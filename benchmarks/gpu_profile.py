"""Where an accelerator's time goes: device kernel time of the 1B update and decode, by kernel.

Traces a few calls with ``jax.profiler`` and sums the device events of the trace by kernel name
(with the HLO op that launched each), so the table needs no TensorBoard::

    kernel busy / call = sum of kernel durations on the device's streams / calls

Busy time close to the wall time means the device never waits for the host (no launch gaps);
far below it means it does. Prints one JSON line per program (wall, busy, kernel count, time by
category: GEMM / cuDNN attention / other) and its top kernels.

    python benchmarks/gpu_profile.py [update] [decode] [--policy dots|nothing] [--small]
"""

from __future__ import annotations

import collections
import glob
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import LLAMA_1B, TINY, update_inputs  # noqa: E402
from harness import emit  # noqa: E402

from relax.models import cast, init  # noqa: E402
from relax.rollout.sampler import RolloutConfig, compiled_generate  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402
from relax.algorithms.grpo.config import GRPOConfig  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402
from relax.algorithms.grpo.loss import make_grpo_update  # noqa: E402
from relax.passes import choose_passes  # noqa: E402


def category(kernel: str) -> str:
    k = kernel.lower()
    if any(s in k for s in ("cudnn", "fmha", "flash", "sdpa")):  # before gemm: cuDNN's names contain sm90_
        return "cudnn_attention"
    if any(s in k for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
        return "gemm"
    return "other"


def device_kernels(trace_dir: str) -> tuple[collections.Counter, collections.Counter]:
    """Nanoseconds and launches per ``hlo_op | kernel`` over the device planes of the trace."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    ns, count = collections.Counter(), collections.Counter()
    for plane in data.planes:
        if not plane.name.startswith(("/device:GPU", "/device:TPU")):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower() and "xla ops" not in line.name.lower():
                continue
            for ev in line.events:
                stats = dict(ev.stats)
                key = f"{str(stats.get('hlo_op', '-'))[:50]} | {ev.name[:90]}"
                ns[key] += ev.duration_ns
                count[key] += 1
    return ns, count


def profile(name: str, fn, calls: int = 2, top: int = 25) -> dict:
    jax.block_until_ready(fn())  # compile + warm up outside the trace
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        wall = (time.perf_counter() - t) / calls
        ns, count = device_kernels(d)
    busy = sum(ns.values()) / calls
    cats = collections.Counter()
    for k, v in ns.items():
        cats[category(k.split(" | ", 1)[1])] += v / calls
    line = emit({"bench": "gpu_profile", "program": name, "wall_ms_traced": wall * 1e3, "kernel_busy_ms": busy / 1e6,
                 "kernels_per_call": sum(count.values()) // calls,
                 **{f"{c}_ms": round(v / 1e6, 2) for c, v in cats.items()}})
    for k, v in ns.most_common(top):
        print(f"  {v / calls / 1e6:9.2f} ms  {count[k] // calls:6d}x  {k}")
    return line


def main():
    args = sys.argv[1:]
    small = "--small" in args
    policy = args[args.index("--policy") + 1] if "--policy" in args else "dots"
    what = [a for a in args if a in ("update", "decode")] or ["update", "decode"]
    cfg = TINY if small else LLAMA_1B
    model = cast(init(cfg, jax.random.key(0), param_dtype=jnp.bfloat16), dtype=jnp.bfloat16)
    if "update" in what:
        p, g, lp, n = (2, 4, 32, 32) if small else (8, 8, 256, 512)
        gcfg = GRPOConfig(num_generations=g, max_new_tokens=n, remat=True, remat_policy=policy,
                          optimizer=OptimizerConfig(learning_rate=1e-6))
        opt = gcfg.optimizer.make()
        update, opt_state, data = jax.jit(make_grpo_update(gcfg, opt, choose_passes())), opt.init(model), update_inputs(cfg, p, g, lp, n)
        profile(f"update_remat_{policy}", lambda: update(model, opt_state, data, jax.random.key(0)))
    if "decode" in what:
        ids = jax.random.randint(jax.random.key(1), (8, 128), 0, cfg.vocab_size)
        gen = compiled_generate(RolloutConfig(num_generations=8, max_new_tokens=32 if small else 256,
                                              sampling=SamplingConfig(temperature=1.0)))
        profile("decode", lambda: gen(model, ids, jnp.ones_like(ids), jax.random.key(2)))


if __name__ == "__main__":
    main()
