"""Shared benchmark harness: timing, memory, hardware peaks, environment and output.

Every benchmark script prints ONE JSON line per case to stdout (``emit``) and a readable
table row to stderr. Each line carries the environment (jax/jaxlib versions, device, git
commit) so results from different machines and releases can be told apart.

Timing (``measure``): compile time is reported separately - a jitted function is lowered and
compiled ahead of time (``fn.lower(*args).compile()``), any other function has its first call
timed - then ``warmup`` untimed calls and ``runs`` timed calls, each ended by
``jax.block_until_ready``. Other work on the machine adds noise: read the median, and the
spread ``(max - min) / median`` says how much to trust it.

Memory: on CPU the run-phase peak is the process's resident-set high-water mark above the
resident size after compiling. Linux lets a process reset that mark (``/proc/self/clear_refs``),
so each ``measure`` sees its own peak; where it cannot, the mark is process-wide and only grows,
so run the heavy case last or in a subprocess (``run_isolated``). On GPU/TPU the peak is the
device allocator's ``peak_bytes_in_use`` (process-wide). For a jitted function XLA's own
accounting of its scratch memory (``xla_temp_bytes``) is exact and noise-free.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

CHILD_ENV = "RELAX_BENCH_CHILD"  # set in subprocesses: print JSON only, the parent prints the table

# Datasheet peaks (dense, no sparsity) by device-kind substring, checked in order.
DATASHEET = {
    "H200": {"bf16_flops": 989e12, "hbm_bytes_per_s": 4.8e12},
    "H100": {"bf16_flops": 989e12, "hbm_bytes_per_s": 3.35e12},  # SXM
    "A100": {"bf16_flops": 312e12, "hbm_bytes_per_s": 2.0e12},
}


@functools.lru_cache(maxsize=1)
def env_info() -> dict:
    dev = jax.devices()[0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=root,
                timeout=10,
            ).stdout.strip()
            or None
        )
        # the library differs from the commit (benchmarks/ itself is not counted)
        dirty = (
            subprocess.run(
                ["git", "diff", "--quiet", "HEAD", "--", "relax"], cwd=root, timeout=10
            ).returncode
            == 1
            if commit
            else None
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    import jaxlib

    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "git_commit": commit,
        "git_dirty": dirty,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
        "thp": _thp_mode(),
    }


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``/``madvise``/``never``), None off Linux.

    Host figures depend on it: with ``madvise`` only ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
    (set by the Makefile) gets XLA's per-call scratch in 2 MiB pages."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def on_cpu() -> bool:
    return jax.devices()[0].platform == "cpu"


def datasheet() -> dict | None:
    kind = jax.devices()[0].device_kind
    return next((v for k, v in DATASHEET.items() if k.lower() in kind.lower()), None)


# ---------------------------------------------------------------------------- memory


def _hwm_bytes() -> int:
    """Process resident-set high-water mark (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _hwm_bytes()


def _reset_hwm() -> bool:
    """Reset the high-water mark to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _device_peak() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


# ---------------------------------------------------------------------------- timing


def measure(fn, *args, warmup: int = 1, runs: int = 5, budget_s: float | None = None) -> dict:
    """Compile seconds, then ``runs`` timed calls: median/min/max/spread seconds and peak memory.

    With ``budget_s``, no further timed run is started once the runs so far plus one more
    (at their median) would exceed it; at least one run is always made.
    """
    start_hwm = _hwm_bytes()
    t0 = time.perf_counter()
    xla_temp = None
    if hasattr(fn, "lower"):  # jitted: compile ahead of time, call the executable
        call = fn.lower(*args).compile()
        compile_s = time.perf_counter() - t0
        try:
            m = call.memory_analysis()
            xla_temp = int(m.temp_size_in_bytes) + int(m.output_size_in_bytes)
        except Exception:  # not every backend reports it
            pass
        compile_note = "lower+compile"
    else:  # first call = trace + compile + one run (it also serves as a warmup call)
        call = fn
        jax.block_until_ready(fn(*args))
        compile_s = time.perf_counter() - t0
        compile_note = "first call (includes one run)"
    reset = on_cpu() and _reset_hwm()  # before the first execution, which takes memory from the OS
    base = _rss_bytes() if reset else start_hwm
    for _ in range(warmup - (call is fn)):
        jax.block_until_ready(call(*args))
    times = []
    for _ in range(runs):
        if times and budget_s is not None and sum(times) + statistics.median(times) > budget_s:
            break
        t = time.perf_counter()
        jax.block_until_ready(call(*args))
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    out = {
        "compile_s": round(compile_s, 4),
        "compile_how": compile_note,
        "runs": len(times),
        "warmup": warmup,
        "median_s": med,
        "min_s": min(times),
        "max_s": max(times),
        "spread": (max(times) - min(times)) / med if med > 0 else 0.0,
    }
    if on_cpu():
        out["peak_mem_bytes"] = max(_hwm_bytes() - base, 0)
        out["peak_mem_how"] = (
            "rss high-water above the rss after compiling"
            if reset
            else "ru_maxrss delta (process-wide high-water; includes compile)"
        )
        out["process_peak_rss_bytes"] = _hwm_bytes()
    else:
        out["peak_mem_bytes"] = _device_peak()
        out["peak_mem_how"] = "device peak_bytes_in_use (process-wide)"
    if xla_temp is not None:
        out["xla_temp_bytes"] = xla_temp  # scratch + outputs, from XLA's buffer assignment
    return out


# ---------------------------------------------------------------------------- inputs


def alternate(variants: dict, runs: int) -> tuple[dict, dict]:
    """``(medians, first_call_s)`` of each of ``variants`` (name -> a call returning arrays): one
    warm-up call each (its seconds: the compile), then ``runs`` rounds, the variants alternating
    within each round (so drift on a shared host spreads over all of them)."""
    first = {}
    for name, fn in variants.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        first[name] = time.perf_counter() - t0
    times = {name: [] for name in variants}
    for _ in range(runs):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, first


def group_attention_inputs(
    P: int, G: int, H: int, R: int, Lp: int, N: int, D: int, *, dtype=jnp.float32, seed: int = 0
) -> tuple[tuple, tuple]:
    """Random ``(q, pk, pv, k, v)`` and the position tuple for ``prefix_group_attention``: P full
    prompts of Lp tokens, G completions of N tokens each, H KV heads with R query heads each."""
    k = jax.random.split(jax.random.key(seed), 5)
    f = lambda i, *s: jax.random.normal(k[i], s, dtype)
    q, ck, cv = f(0, P, H, G, R * N, D), f(1, P, H, G, N, D), f(2, P, H, G, N, D)
    pk, pv = f(3, P, H, Lp, D), f(4, P, H, Lp, D)
    c_pos = jnp.broadcast_to(Lp + jnp.arange(N), (P, G, N))
    pos = (
        jnp.tile(c_pos, (1, 1, R)),
        jnp.broadcast_to(jnp.arange(Lp), (P, Lp)),
        jnp.ones((P, Lp), bool),
        c_pos,
        jnp.ones((P, G, N), bool),
    )
    return (q, pk, pv, ck, cv), pos


# ---------------------------------------------------------------------------- hardware peaks

PEAK_ENV = "RELAX_BENCH_PEAK_FLOPS"  # a parent's measured peak, shared with its subprocesses


@functools.lru_cache(maxsize=8)
def matmul_peak_flops(n: int = 1024, dtype=jnp.float32, runs: int = 20) -> float:
    """Measured FLOP/s of an n x n x n matmul here and now (median of ``runs``).

    A subprocess started by ``run_isolated`` reuses its parent's figure, so every line of one
    script is compared with the same reference."""
    if os.environ.get(PEAK_ENV) and (n, dtype, runs) == (1024, jnp.float32, 20):
        return float(os.environ[PEAK_ENV])
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    r = measure(jax.jit(jnp.matmul), a, b, warmup=2, runs=runs)
    return 2 * n**3 / r["median_s"]


@functools.lru_cache(maxsize=1)
def read_bandwidth(mbytes: int = 256, runs: int = 10) -> float:
    """Measured bytes/s of a reduction over a large float32 array (a read-bound roofline)."""
    x = jnp.ones((mbytes * 2**20 // 4,), jnp.float32)
    r = measure(jax.jit(jnp.sum), x, warmup=2, runs=runs)
    return x.nbytes / r["median_s"]


def peak_flops() -> tuple[float, str]:
    """Reference FLOP/s and where it came from: measured on CPU, datasheet (bf16 dense) elsewhere."""
    sheet = None if on_cpu() else datasheet()
    if sheet is not None:
        return sheet["bf16_flops"], "datasheet bf16 dense"
    return matmul_peak_flops(), "measured f32 1024^3 matmul"


def peak_bandwidth() -> tuple[float, str]:
    """Reference memory bytes/s: measured on CPU, datasheet HBM elsewhere."""
    sheet = None if on_cpu() else datasheet()
    if sheet is not None:
        return sheet["hbm_bytes_per_s"], "datasheet HBM"
    return read_bandwidth(), "measured 256 MiB f32 sum"


# ---------------------------------------------------------------------------- output

_TABLE_KEYS: list[str] | None = None
_SKIP = {"compile_how", "peak_mem_how", "peak_source", "note"}


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _round(v, digits: int = 5):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v == v and v not in (float("inf"), float("-inf")) and v != 0:
        return float(f"{v:.{digits}g}")
    return v


def emit(record: dict, table: list[str] | None = None) -> dict:
    """Print one JSON line (record + environment) to stdout and a table row (``table`` keys,
    default every scalar field) to stderr."""
    global _TABLE_KEYS
    rec = {k: _round(v) for k, v in record.items()}
    rec.update({k: v for k, v in env_info().items() if k not in rec})
    print(json.dumps(rec, default=str), flush=True)
    if os.environ.get(CHILD_ENV):
        return rec
    keys = table or [
        k
        for k in record
        if k not in env_info() and k not in _SKIP and not isinstance(record[k], (list, dict))
    ]
    widths = [max(len(k), 8) for k in keys]
    if keys != _TABLE_KEYS:
        _TABLE_KEYS = keys
        print("  ".join(f"{k:>{w}}" for k, w in zip(keys, widths)), file=sys.stderr)
    print(
        "  ".join(f"{_fmt(rec.get(k, '')):>{w}}" for k, w in zip(keys, widths)),
        file=sys.stderr,
        flush=True,
    )
    return rec


def run_isolated(
    script: str, argv: list[str], timeout: float | None = None, table: list[str] | None = None
) -> list[dict]:
    """Run ``python script *argv`` in a fresh process (its own memory high-water mark) and
    re-emit its JSON lines here; the child's stderr passes through."""
    env = {**os.environ, CHILD_ENV: "1"}
    if on_cpu():
        env[PEAK_ENV] = repr(matmul_peak_flops())
    try:
        proc = subprocess.run(
            [sys.executable, script, *argv],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return [
            emit(
                {
                    "script": os.path.basename(script),
                    "args": " ".join(argv),
                    "error": f"timed out after {timeout} s",
                }
            )
        ]
    out = []
    for line in proc.stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            rec = json.loads(line)
            out.append(emit({k: v for k, v in rec.items() if k not in env_info()}, table))
    if proc.returncode:
        out.append(
            emit(
                {
                    "script": os.path.basename(script),
                    "args": " ".join(argv),
                    "error": f"subprocess exited {proc.returncode}",
                }
            )
        )
    return out


if __name__ == "__main__":  # quick self-check: environment and peaks
    (f, fs), (b, bs) = peak_flops(), peak_bandwidth()
    emit(
        {
            "bench": "peaks",
            "peak_gflops": f / 1e9,
            "flops_source": fs,
            "peak_gb_per_s": b / 1e9,
            "bw_source": bs,
        }
    )
