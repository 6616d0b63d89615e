"""Where an accelerator's time goes: device kernel time of the 1B update and decode, by kernel.

Traces calls with ``jax.profiler`` and sums the device events by ``hlo_op | kernel`` (no
TensorBoard): busy / call = sum of kernel durations on the device's streams / calls. ``update``:
one JSON line (wall, busy, kernels, time by category) and its top kernels.

``decode``: ONE decode step (batch P*G = 64, Lp 128, N 256, 1B). The sampler for N new tokens
and for 1 (prefill only) are traced on the same shapes; x / step = (x of the N-token call - x of
the 1-token call) / (N - 1) for launches, kernel busy, device idle (gaps between consecutive
kernels over the union of the stream lines, positive part) and wall. Under a profiler XLA runs
command buffers (CUDA graphs) op by op unless XLA_FLAGS has
``--xla_enable_command_buffers_during_profiling=true``: traced idle and wall are an upper bound;
the untraced wall per step is printed too. Per kernel, the decode loops' kernels (trace
``hlo_op`` = HLO instruction name) are summed over the N-token call / (N - 1); their bytes come
from the same executable's optimized HLO (``relax.parallel.hlo.kernel_bytes``)::

    bytes / execution = operand sizes + result size   (slices: what they read; in place: the update)
    bytes / step      = sum over the loops' kernels of bytes / execution * executions / (N - 1)
    achieved GB/s     = bytes / step / kernel time per step

against the ideal step = all weights once + the K/V the step reads (``gpu.decode_ideal_bytes``).
The HLO part (bytes, categories, ``copy`` instructions and whole-buffer dynamic-update-slices in
the loop bodies: either on a cache means it is not updated in place) needs no device, so on CPU
(``--small``: TINY config) it is printed alone and the trace part says it needs a GPU/TPU.

    python benchmarks/gpu_profile.py [update] [decode] [--policy dots|nothing] [--small]
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import DECODE_LEVERS, LLAMA_1B, TINY, decode_ideal_bytes, flag, update_inputs  # noqa: E402
from harness import emit  # noqa: E402

from relax.algorithms.cli.configure import configure  # noqa: E402
from relax.algorithms.grpo.config import GRPOConfig  # noqa: E402
from relax.algorithms.grpo.loss import make_grpo_update  # noqa: E402
from relax.models import cast, init  # noqa: E402
from relax.parallel.hlo import CONTROL, FREE, Instr, arrays, kernel_bytes, launching, parse_hlo  # noqa: E402
from relax.parallel.hlo import loops as while_loops  # noqa: E402
from relax.passes import choose_passes  # noqa: E402
from relax.rollout.sampler import RolloutConfig, block_size, compiled_generate  # noqa: E402
from relax.rollout.sampling import SamplingConfig  # noqa: E402
from relax.train.optimizer import OptimizerConfig  # noqa: E402


def category(kernel: str) -> str:
    k = kernel.lower()
    if any(
        s in k for s in ("cudnn", "fmha", "flash", "sdpa")
    ):  # before gemm: cuDNN's names contain sm90_
        return "cudnn_attention"
    if any(s in k for s in ("gemm", "cutlass", "xmma", "nvjet", "cublas")):
        return "gemm"
    return "other"


def device_events(trace_dir: str) -> list[tuple]:
    """``(line, start_ns, duration_ns, hlo_op, kernel)`` of every kernel on the device planes: the
    stream lines (GPU), else the "XLA Ops" lines (TPU), never both (that would count twice)."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    out = []
    for plane in data.planes:
        if not plane.name.startswith(("/device:GPU", "/device:TPU")):
            continue
        lines = [ln for ln in plane.lines if "stream" in ln.name.lower()] or [
            ln for ln in plane.lines if "xla ops" in ln.name.lower()
        ]
        for line in lines:
            for ev in line.events:
                op = str(dict(ev.stats).get("hlo_op", "-")).lstrip("%")
                out.append((f"{plane.name}/{line.name}", ev.start_ns, ev.duration_ns, op, ev.name))
    return out


def by_kernel(events) -> tuple[collections.Counter, collections.Counter]:
    """Nanoseconds and launches per ``hlo_op | kernel``."""
    ns, count = collections.Counter(), collections.Counter()
    for _, _, dur, op, name in events:
        key = f"{op[:50]} | {name[:90]}"
        ns[key] += dur
        count[key] += 1
    return ns, count


def idle_ns(events) -> int:
    """Device idle inside the trace: the gaps between consecutive kernels over the union of all
    stream lines (start of the next minus the latest end so far, positive part), summed."""
    idle, end = 0, None
    for _, start, dur, *_ in sorted(events, key=lambda e: e[1]):
        if end is not None and start > end:
            idle += start - end
        end = start + dur if end is None else max(end, start + dur)
    return idle


def traced(fn, calls: int) -> tuple[list, float, float]:
    """Device events of ``calls`` calls (after a warm-up call), wall seconds per call traced and
    per call untraced (the mean of as many calls before the trace)."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    for _ in range(calls):
        jax.block_until_ready(fn())
    untraced = (time.perf_counter() - t) / calls
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        with jax.profiler.trace(d):
            for _ in range(calls):
                jax.block_until_ready(fn())
        return device_events(d), (time.perf_counter() - t) / calls, untraced


def profile(name: str, fn, calls: int = 2, top: int = 25) -> dict:
    events, wall, _ = traced(fn, calls)
    ns, count = by_kernel(events)
    busy = sum(ns.values()) / calls
    cats = collections.Counter()
    for k, v in ns.items():
        cats[category(k.split(" | ", 1)[1])] += v / calls
    line = emit(
        {
            "bench": "gpu_profile",
            "program": name,
            "wall_ms_traced": wall * 1e3,
            "kernel_busy_ms": busy / 1e6,
            "kernels_per_call": sum(count.values()) // calls,
            **{f"{c}_ms": round(v / 1e6, 2) for c, v in cats.items()},
        }
    )
    for k, v in ns.most_common(top):
        print(f"  {v / calls / 1e6:9.2f} ms  {count[k] // calls:6d}x  {k}")
    return line


# ---------------------------------------------------------------------------- optimized HLO


def hlo_category(ins: Instr, comps, local, tags: dict) -> str:
    """attention: an operand or result has a K/V cache's or a score block's shape; gemm: a
    GEMM custom-call or a fusion with a dot; sampling: a [B, V] operand or result (any
    [B, ...] reshape of it); other."""
    dims = [
        d
        for s in [ins.shape] + [local[o].shape for o in ins.operands if o in local]
        for _, d in arrays(s)
    ]
    inner = {i.op for c in ins.called() for i in comps.get(c, [])}
    if any(d in tags["attention"] for d in dims):
        return "attention"
    if (
        "dot" in inner
        or "convolution" in inner
        or ins.op == "dot"
        or (ins.op == "custom-call" and re.search(r"gemm|matmul|cublas", ins.attrs, re.I))
    ):
        return "gemm"
    b, v = tags["bv"]
    return "sampling" if any(d and d[0] == b and math.prod(d) == b * v for d in dims) else "other"


# ---------------------------------------------------------------------------- one decode step


def segment_steps(cfg: RolloutConfig) -> list[int]:
    """Steps each decode while loop runs: one loop per cache block, as the sampler builds them."""
    n = cfg.max_new_tokens
    chunk = min(block_size(cfg), n)
    return [
        min((s + 1) * chunk, n - 1) - s * chunk for s in range(-(-n // chunk)) if s * chunk < n - 1
    ]


def shape_tags(c, p, g, lp, cfg) -> dict:
    """Dims that mark a decode-attention op: the caches (prompt ``[P,Hkv,D,Lp]``/``[P,Hkv,Lp,D]``,
    completion blocks ``[B,Hkv,D,S]``/``[B,Hkv,S,D]``) and score blocks; and (B, V) for sampling."""
    hk, d, r, b, n = c.num_kv_heads, c.head_dim, c.q_per_kv, p * g, cfg.max_new_tokens
    chunk = min(block_size(cfg), n)
    sizes = {min(chunk, n - i) for i in range(0, n, chunk)}
    cache = (
        {(p, hk, d, lp), (p, hk, lp, d)}
        | {(b, hk, d, s) for s in sizes}
        | {(b, hk, s, d) for s in sizes}
    )
    scores = {(p, hk, g * r, lp)} | {(b, hk, r, s) for s in sizes}
    return {"cache": cache, "attention": cache | scores, "bv": (b, c.vocab_size)}


def decode_ops(text: str, tags: dict, cfg: RolloutConfig, b: int) -> tuple[dict, dict]:
    """Each kernel of the decode while loops (bodies and conditions; a loop is a ``while`` whose
    state holds the ``s32[B, N]`` token buffer), with executions and bytes per step::

        executions / step = steps of its loop / (N - 1),  bytes / step = bytes / execution * that

    and the loops' summary: ``copy`` instructions and kernels with a dynamic-update-slice that is
    not in place (count, bytes per step, how many have a cache's shape)."""
    comps, entry = parse_hlo(text)
    n = cfg.max_new_tokens
    loops = [i for i in while_loops(comps, entry) if f"s32[{b},{n}]" in i.shape]
    steps = segment_steps(cfg)
    if len(steps) != len(loops):  # not the sampler's segment structure: share the steps evenly
        steps = [(n - 1) / max(len(loops), 1)] * len(loops)
    ops, copies = {}, collections.Counter()
    for loop, st in zip(loops, steps):
        for cn in [x for called in loop.called() for x in launching(comps, called)]:
            local = {i.name: i for i in comps[cn]}
            for ins in comps[cn]:
                if ins.op in FREE or ins.op in CONTROL:
                    continue
                by, inplace = kernel_bytes(ins, comps, local)
                w = st / (n - 1)
                ops[ins.name] = {
                    "op": ins.op,
                    "category": hlo_category(ins, comps, local, tags),
                    "execs": w,
                    "bytes": by * w,
                    "inplace": inplace,
                    "shape": ins.shape,
                }
                inner = {i.op for c in ins.called() for i in comps.get(c, [])} | {ins.op}
                for kind, hit in (
                    ("copies", ins.op in ("copy", "copy-start")),  # not in place: whole buffer
                    ("dus_not_inplace", "dynamic-update-slice" in inner and not inplace),
                ):
                    copies[f"loop_{kind}"] += hit
                    copies[f"loop_{kind}_mb_per_step"] += hit * by * w / 1e6
                    copies[f"loop_cache_{kind}"] += hit and any(
                        d in tags["cache"] for _, d in arrays(ins.shape)
                    )
    return ops, {"decode_loops": len(loops), "loop_steps": steps, **dict(sorted(copies.items()))}


def step_trace(call_n, make_call_1, n: int, ops: dict, calls: int = 2) -> tuple | None:
    """Per decode step from traces of the N-token and the 1-token call: launches, kernel busy,
    device idle and wall (traced and not) by difference / (N - 1); per loop kernel: its time and
    launches over the N-token call / calls / (N - 1); the kernels not matched to a loop op by
    ``hlo_op | kernel``, by difference. None without device events (CPU)."""
    ev_n, wall_n, free_n = traced(call_n, calls)
    if not ev_n:
        return None
    ev_1, wall_1, free_1 = traced(make_call_1(), calls)
    per = lambda a, b: (a - b) / calls / (n - 1)
    busy = per(sum(e[2] for e in ev_n), sum(e[2] for e in ev_1))
    summary = {
        "launches_per_step": per(len(ev_n), len(ev_1)),
        "busy_us_per_step": busy / 1e3,
        "idle_us_per_step": per(idle_ns(ev_n), idle_ns(ev_1)) / 1e3,
        "wall_us_per_step": (wall_n - wall_1) / (n - 1) * 1e6,
        "untraced_wall_us_per_step": (free_n - free_1) / (n - 1) * 1e6,
    }
    summary["busy_over_wall"] = summary["busy_us_per_step"] / summary["wall_us_per_step"]
    summary["busy_over_untraced_wall"] = (
        summary["busy_us_per_step"] / summary["untraced_wall_us_per_step"]
    )
    per_op = collections.defaultdict(
        lambda: {"ns": 0.0, "launches": 0.0, "kernels": collections.Counter()}
    )
    for _, _, dur, op, name in (e for e in ev_n if e[3] in ops):
        row = per_op[op]
        row["ns"], row["launches"] = row["ns"] + per(dur, 0), row["launches"] + per(1, 0)
        row["kernels"][name] += dur
    summary["matched_frac"] = sum(r["ns"] for r in per_op.values()) / busy if busy > 0 else None
    (ns_n, _), (ns_1, _) = (by_kernel(e for e in ev if e[3] not in ops) for ev in (ev_n, ev_1))
    unmatched = {k: per(v, ns_1.get(k, 0)) for k, v in ns_n.items()}
    return summary, per_op, unmatched


def decode_profile(model, p: int, g: int, lp: int, n: int, top: int = 25) -> dict:
    """One decode step: the HLO part (bytes, categories, copies) always, the trace part where
    the device has a profiler plane (GPU/TPU). One JSON line, then the top kernels."""
    c = model.config
    ids = jax.random.randint(jax.random.key(1), (p, lp), 0, c.vocab_size)
    mask, key = jnp.ones_like(ids), jax.random.key(2)

    def compiled(new):
        cfg = RolloutConfig(
            num_generations=g,
            max_new_tokens=new,
            sampling=SamplingConfig(temperature=1.0),
            **DECODE_LEVERS,
        )
        return cfg, compiled_generate(cfg).lower(model, ids, mask, key).compile()

    cfg, exe = compiled(n)  # the same executable is traced, so trace hlo_op names = HLO names
    tags = shape_tags(c, p, g, lp, cfg)
    ops, loops = decode_ops(exe.as_text(), tags, cfg, p * g)
    weight_b, kv_b = decode_ideal_bytes(c, model.dtype, p, g, lp, n)
    hlo_b = sum(o["bytes"] for o in ops.values())
    cat_b = collections.Counter()
    for o in ops.values():
        cat_b[o["category"]] += o["bytes"]
    rec = {
        "bench": "gpu_profile",
        "program": "decode_step",
        "batch": p * g,
        "P": p,
        "G": g,
        "Lp": lp,
        "N": n,
        **loops,
        "hlo_kernels_per_step": sum(o["execs"] for o in ops.values()),
        "inplace_updates_per_step": sum(o["execs"] for o in ops.values() if o["inplace"]),
        "hlo_mb_per_step": hlo_b / 1e6,
        "ideal_mb_per_step": (weight_b + kv_b) / 1e6,
        "weight_mb": weight_b / 1e6,
        "kv_mb_per_step": kv_b / 1e6,
        "hlo_over_ideal": hlo_b / (weight_b + kv_b),
        **{f"hlo_{k}_mb_per_step": v / 1e6 for k, v in sorted(cat_b.items())},
    }
    call = lambda e: lambda: e(model, ids, mask, key)
    got = step_trace(call(exe), lambda: call(compiled(1)[1]), n, ops)
    if got is None:
        rec["trace"] = "per-step kernel times need a GPU/TPU profiler plane (none on this device)"
        emit(rec)
        print_table(ops, None, top)
        return rec
    summary, per_op, unmatched = got
    cat_ns = collections.Counter()
    for op, r in per_op.items():
        cat_ns[ops[op]["category"]] += r["ns"]
    matched_ns = sum(r["ns"] for r in per_op.values())
    rec.update(
        summary,
        **{f"{k}_us_per_step": v / 1e3 for k, v in sorted(cat_ns.items())},
        loop_kernels_gb_per_s=hlo_b / matched_ns
        if matched_ns
        else None,  # HLO bytes / their kernels' time
        ideal_gb_per_s=(weight_b + kv_b) / (summary["untraced_wall_us_per_step"] * 1e3),
    )
    emit(rec)
    print_table(ops, per_op, top)
    frac = summary["matched_frac"]
    print(
        f"  not matched to a decode-loop op, by difference (us/step; matched: {frac and round(frac, 3)}):"
    )
    for k, v in sorted(unmatched.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {v / 1e3:10.2f}  {k}")
    return rec


def print_table(ops: dict, per_op: dict | None, top: int):
    """The top decode-loop kernels: by time per step with launches, KB and achieved GB/s =
    bytes / step / time / step (trace), else by HLO bytes per step (no trace)."""
    if per_op is None:
        print(
            f"  top {top} decode-loop kernels by HLO bytes per step:\n"
            "    KB/step  execs/step  category   in-place  op name shape"
        )
        for name, o in sorted(ops.items(), key=lambda kv: -kv[1]["bytes"])[:top]:
            print(
                f"  {o['bytes'] / 1e3:9.1f}  {o['execs']:10.3f}  {o['category']:10s} {str(o['inplace']):8s}  "
                f"{o['op']} {name} {o['shape'][:60]}"
            )
        return
    print(
        f"  top {top} decode-loop kernels by time per step:\n"
        "     us/step  launch/step    KB/step    GB/s  category    hlo_op | kernel"
    )
    for name, r in sorted(per_op.items(), key=lambda kv: -kv[1]["ns"])[:top]:
        o, kernel = ops[name], r["kernels"].most_common(1)[0][0]
        print(
            f"  {r['ns'] / 1e3:10.2f}  {r['launches']:11.2f}  {o['bytes'] / 1e3:9.1f}  "
            f"{o['bytes'] / r['ns'] if r['ns'] else 0.0:6.0f}  {o['category']:10s}  {name[:40]} | {kernel[:80]}"
        )


def main():
    args = sys.argv[1:]
    small = "--small" in args
    policy = flag("--policy", "dots")
    what = [a for a in args if a in ("update", "decode")] or ["update", "decode"]
    cfg = TINY if small else LLAMA_1B
    model = cast(init(cfg, jax.random.key(0), param_dtype=jnp.bfloat16), dtype=jnp.bfloat16)
    if "update" in what:
        p, g, lp, n = (2, 4, 32, 32) if small else (8, 8, 256, 512)
        gcfg = configure(
            GRPOConfig,
            num_generations=g,
            max_new_tokens=n,
            remat=True,
            remat_policy=policy,
            optimizer=OptimizerConfig(learning_rate=1e-6),
        )
        opt = gcfg.optimizer.make()
        update, opt_state, data = (
            jax.jit(make_grpo_update(gcfg, opt, choose_passes())),
            opt.init(model),
            update_inputs(cfg, p, g, lp, n),
        )
        profile(f"update_remat_{policy}", lambda: update(model, opt_state, data, jax.random.key(0)))
    if "decode" in what:  # small: N = 80, two cache blocks (two decode loops) on TINY
        decode_profile(model, 8, 8, 128, 80 if small else 256)


if __name__ == "__main__":
    main()
