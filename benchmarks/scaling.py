"""How rollout time grows: prefix-shared vs repeated prompts, sweeping G, prompt length and N.

Small config (as in ``rollout.py``), P=4 prompts of random tokens, stop ids unreachable.
Three one-at-a-time sweeps around a base point (G=8, Lp=64, N=64):

    G   in 4, 8, 16          completions per prompt
    Lp  in 64, 256, 1024     prompt length
    N   in 32, 64, 128       new tokens

Each point runs ``prefix`` (``num_generations=G``) and ``repeat`` (prompts repeated G times,
``num_generations=1``). Prints one JSON line per (point, mode), a table, and draws
``benchmarks/scaling.png`` (matplotlib, from the ``dev`` extra) when it is installed.

    .venv/bin/python benchmarks/scaling.py
    .venv/bin/python benchmarks/scaling.py --runs 1 --sweeps G,N
"""

from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import tyro  # noqa: E402
from rollout import matmul_flops  # noqa: E402

BASE = dict(G=8, Lp=64, N=64)
SWEEPS = {"G": (4, 8, 16), "Lp": (64, 256, 1024), "N": (32, 64, 128)}
TABLE = [
    "sweep",
    "mode",
    "P",
    "G",
    "Lp",
    "N",
    "median_s",
    "spread",
    "tokens_per_s",
    "compile_s",
    "achieved_gflops",
    "prefix_speedup",
]


@dataclasses.dataclass
class Args:
    sweeps: str = "G,Lp,N"
    """comma-separated subset of: G, Lp, N"""
    prompts: int = 4
    """P"""
    runs: int = 3
    """timed runs per point (median reported)"""
    warmup: int = 1
    """untimed runs per point after compiling"""
    budget_s: float = 20.0
    """stop starting timed runs of one point once they would pass this many seconds"""
    plot: str = os.path.join(HERE, "scaling.png")
    """where to write the figure ('' for none)"""


def main(args: Args) -> None:
    from relax import models
    from relax.rollout import sampler as rollout

    cfg = models.small_config()
    model = models.init(cfg, jax.random.key(0))
    P = args.prompts
    peak, _ = harness.peak_flops()
    results: dict[str, dict[str, list]] = {}
    done: dict[tuple, dict] = {}  # the base point is in every sweep: measured once
    for sweep in [s for s in args.sweeps.split(",") if s]:
        if sweep not in SWEEPS:
            raise SystemExit(f"unknown sweep {sweep!r}; valid: {sorted(SWEEPS)}")
        results[sweep] = {"x": list(SWEEPS[sweep]), "prefix": [], "repeat": []}
        for x in SWEEPS[sweep]:
            pt = {**BASE, sweep: x}
            G, Lp, N = pt["G"], pt["Lp"], pt["N"]
            ids = jax.random.randint(jax.random.key(Lp), (P, Lp), 1, cfg.vocab_size, jnp.int32)
            mask = jnp.ones((P, Lp), jnp.int32)
            times = {}
            for mode in ("repeat", "prefix"):
                if (G, Lp, N, mode) in done:
                    rec = harness.emit(
                        {**done[G, Lp, N, mode], "sweep": sweep, "reused": True}, TABLE
                    )
                    times[mode] = rec["median_s"]
                    results[sweep][mode].append(rec["median_s"])
                    continue
                if mode == "prefix":
                    rc, i, m = (
                        rollout.RolloutConfig(num_generations=G, max_new_tokens=N, eos_ids=()),
                        ids,
                        mask,
                    )
                else:
                    rc = rollout.RolloutConfig(num_generations=1, max_new_tokens=N, eos_ids=())
                    i, m = jnp.repeat(ids, G, axis=0), jnp.repeat(mask, G, axis=0)
                r = harness.measure(
                    rollout.compiled_generate(rc),
                    model,
                    i,
                    m,
                    jax.random.key(2),
                    warmup=args.warmup,
                    runs=args.runs,
                    budget_s=args.budget_s,
                )
                times[mode] = r["median_s"]
                results[sweep][mode].append(r["median_s"])
                flops = matmul_flops(cfg, mode, P, G, Lp, N)
                done[G, Lp, N, mode] = harness.emit(
                    {
                        "bench": "scaling",
                        "sweep": sweep,
                        "mode": mode,
                        "P": P,
                        "G": G,
                        "Lp": Lp,
                        "N": N,
                        "median_s": r["median_s"],
                        "min_s": r["min_s"],
                        "max_s": r["max_s"],
                        "spread": r["spread"],
                        "runs": r["runs"],
                        "tokens_per_s": P * G * N / r["median_s"],
                        "compile_s": r["compile_s"],
                        "achieved_gflops": flops / r["median_s"] / 1e9,
                        "frac_of_peak": flops / r["median_s"] / peak,
                        "prefix_speedup": times["repeat"] / r["median_s"]
                        if mode == "prefix"
                        else None,
                    },
                    TABLE,
                )
    if args.plot:
        plot(results, P, args.plot)


def plot(results: dict, P: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): no figure", file=sys.stderr)
        return
    labels = {"G": "completions per prompt G", "Lp": "prompt length Lp", "N": "new tokens N"}
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.6), squeeze=False)
    for ax, (sweep, res) in zip(axes[0], results.items()):
        for mode, style in (("prefix", "o-"), ("repeat", "s--")):
            ax.plot(res["x"], res[mode], style, label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xticks(res["x"], [str(x) for x in res["x"]])
        ax.set_xlabel(labels[sweep])
        ax.set_ylabel("rollout seconds (median)")
        others = ", ".join(f"{k}={v}" for k, v in BASE.items() if k != sweep)
        ax.set_title(f"P={P}, {others}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
    env = harness.env_info()
    fig.suptitle(
        f"relax rollout, small config, {env['device_kind']} x{env['cpu_count']} cores, "
        f"jax {env['jax']}, {env['git_commit']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
