"""Wall-clock per step of the multi-turn agent trainer, synchronous (staleness 0) against pipelined.

The run is ``examples/train_agent.py``'s own (its ``main(argv)``: ``relax.algorithms.agent.run``)
on the built-in calculator task with its built-in model (a 2-layer, width-64 Llama trained by the
task's supervised phase, done once and copied into every run's directory) and its defaults: 8 rows
x 8 trajectories per step, at most 3 turns of 16 tokens, 64 trajectory slots, GRPO. Pipelined is
``--async.staleness 1`` (``relax.train.pipeline``): the rollout of batch k + 1, decoding and the
environments' tool calls on the host, runs while the update of batch k runs on the device.

The calculator has no latency of its own; ``--tool-ms`` wraps its ``multiply`` in a sleep (a remote
tool, a sandbox), set from here by replacing ``relax.tasks.agent.tools`` for the run (nothing in
relax/ changes). The environments step in ``asyncio.to_thread`` workers (``relax.environments``),
so a turn's calls overlap up to the default executor's size, ``min(32, cores + 4)``.

Per step, from the run's ``metrics.jsonl``: the wall-clock between consecutive training lines
(``step_s``: what a user waits for), the trainer's ``time/*`` fields (synchronous: ``time/rollout``
and the update's segments; pipelined: ``time/produce``, batch k + 1's rollout, started once update
k is dispatched, so it includes whatever of the update its device calls queue behind, and
``time/wait_update``, the update's part still running after it), the rollout's ``time/env_s`` and
``time/device_s`` (decode and observation prefill; its first prefill is in neither), and sampled
(policy) tokens per second. The first ``--warmup`` steps (compiles, the pipeline's prologue) are
left out, and the last (pipelined: the epilogue, an update with no rollout beside it); the median
of the rest is a run's figure; the median of ``--runs`` runs, alternating synchronous and
pipelined, is the configuration's. ``--frozen``: the same runs with a policy that does not move
(the same workload in both modes; by default the pipelined run learns one step late).

    python benchmarks/agent_pipeline.py --tool-ms 0 50 --out cpu-2026-11-28-agent-pipeline.jsonl
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import tyro

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
import train_agent  # noqa: E402
from harness import emit  # noqa: E402

from relax.algorithms.agent.run import AgentRunConfig, builtin_defaults  # noqa: E402
from relax.algorithms.cli.flags import cli  # noqa: E402
from relax.tasks import agent as agent_task  # noqa: E402
from relax.tasks.base import prepare  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Args:
    runs: int = 2
    """Runs per configuration, synchronous and pipelined alternating."""
    steps: int = 12
    warmup: int = 2
    """Steps left out at the start of each run (>= 1: a step's wall-clock needs the line before)."""
    staleness: int = 1
    correction: str = "tis"
    """``--async.correction.kind`` of the pipelined runs (tis: as tests/test_agent_async.py)."""
    tool_ms: tuple[float, ...] = (0.0, 50.0)
    """Latency added to every calculator call (ms), one configuration each."""
    num_eval: int = 16
    """Held-out rows of the before/after evaluations (outside the timed steps; the run's default 200)."""
    frozen: bool = False
    """Learning rate 1e-12 (the optimizer wants > 0): the policy stays the base model, so both
    modes sample the same workload. By default it learns (5e-4): tool calls, turns and environment
    time grow over a run, and the pipelined run, one version behind, lags (``tool_calls``)."""
    extra: tuple[str, ...] = ()
    """More ``train_agent.py`` flags for every run, e.g. ``--extra=--batch-size=4``."""
    work_dir: str | None = None
    """Runs and the base model go here (default: a temporary directory); a base model already
    there is reused."""
    compile_cache: bool = True
    """A persistent XLA compilation cache in the work directory: later runs compile faster (the
    compiles are outside the measured steps either way)."""
    out: str | None = None
    """Append the JSON lines to benchmarks/results/OUT."""


@contextlib.contextmanager
def tool_latency(ms: float):
    """The calculator's ``fn`` behind a ``ms`` sleep while active (``relax.tasks.agent.tools`` replaced:
    the run's schemas and every environment read it)."""
    real = agent_task.tools

    def slow(fn):
        def call(**arguments):
            time.sleep(ms / 1000.0)
            return fn(**arguments)

        return call

    agent_task.tools = lambda task: (
        [dataclasses.replace(t, fn=slow(t.fn)) for t in real(task)] if ms else real(task)
    )
    try:
        yield
    finally:
        agent_task.tools = real


def base_model(work: Path) -> Path:
    """The built-in task's base model (its supervised phase), trained once into ``work/base``."""
    root = work / "base"
    if not (root / "base_model" / "config.json").exists():
        print(
            f"[agent_pipeline] training the built-in base model into {root} ...",
            file=sys.stderr,
            flush=True,
        )
        prepare(
            agent_task,
            builtin_defaults().task,
            root,
            seed=0,
            teacher="the calculator teacher",
            log=lambda *a, **k: None,
        )
    return root / "base_model"


def train_lines(run_dir: Path) -> list[dict]:
    lines = [
        json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()
    ]
    return sorted((x for x in lines if "loss" in x), key=lambda x: x["step"])


def run_once(a: Args, staleness: int, tool_ms: float, work: Path, base: Path, tag: str) -> dict:
    """One run: per-step figures of the measured steps (lists) and the run's medians."""
    run_dir = work / tag
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    shutil.copytree(base, run_dir / "base_model")
    argv = [
        "--steps",
        str(a.steps),
        "--run-dir",
        str(run_dir),
        "--eval-every",
        "0",
        "--no-export-hf",
        "--checkpoint-every",
        str(10 * a.steps),
        "--task.num-eval",
        str(a.num_eval),
        "--async.staleness",
        str(staleness),
        *(["--grpo.optimizer.learning-rate", "1e-12"] if a.frozen else []),
        *a.extra,
    ]
    if staleness:
        argv += ["--async.correction.kind", a.correction]
    t0 = time.perf_counter()
    with (
        open(run_dir / "output.log", "w") as log,
        contextlib.redirect_stdout(log),
        contextlib.redirect_stderr(log),
        tool_latency(tool_ms),
    ):
        train_agent.main(argv)
    wall = time.perf_counter() - t0
    lines = train_lines(run_dir)
    if [x["step"] for x in lines] != list(range(1, a.steps + 1)):
        raise RuntimeError(f"{run_dir}: training lines for steps {[x['step'] for x in lines]}")
    cfg = cli(
        AgentRunConfig, default=builtin_defaults(), args=argv
    )  # as train_agent.main parses it
    per_step = (
        cfg.batch_size * cfg.algorithm_config.generation.num_generations
    )  # trajectories per step
    measured = [
        (prev, x) for prev, x in zip(lines, lines[1:]) if a.warmup < x["step"] < a.steps
    ]  # no epilogue
    step_s = [x["time"] - prev["time"] for prev, x in measured]
    rows = [x for _, x in measured]
    timing_keys = sorted({k for x in rows for k in x if k.startswith("time/")})
    med = lambda k: statistics.median(x.get(k, float("nan")) for x in rows)  # noqa: E731
    out = {
        "step_s": step_s,
        "median_s": statistics.median(step_s),
        "run_wall_s": wall,
        "timings": {k: med(k) for k in timing_keys},
        "compiles_measured": int(sum(x.get("compiles", 0) for x in rows)),
        "compiles_warmup": int(sum(x.get("compiles", 0) for x in lines[: a.warmup])),
        "tokens_per_s": statistics.median(
            x["sampled_tokens"] * per_step / s for x, s in zip(rows, step_s)
        ),
        "turns": med("turns"),
        "tool_calls": med("tool_calls"),
        "sampled_tokens": med("sampled_tokens"),
        "staleness_seen": sorted({int(x.get("staleness", 0)) for x in rows}),
        "reward_last": lines[-1]["reward"],
    }
    print(
        f"[agent_pipeline] {tag}: median {out['median_s']:.3f} s/step over steps {a.warmup + 1}..{a.steps - 1} "
        f"(run {wall:.0f} s)",
        file=sys.stderr,
        flush=True,
    )
    return out


def summarize(
    a: Args, tool_ms: float, staleness: int, runs: list[dict], sync_s: float | None, load: list
) -> dict:
    med = lambda f: statistics.median(f(r) for r in runs)  # noqa: E731
    t = lambda k: med(lambda r: r["timings"].get(k, float("nan")))  # noqa: E731
    mode = "sync" if staleness == 0 else f"pipelined_s{staleness}"
    rec = {
        "bench": "agent_pipeline",
        "mode": mode,
        "tool_ms": tool_ms,
        "staleness": staleness,
        "correction": a.correction if staleness else None,
        "steps": a.steps,
        "warmup": a.warmup,
        "runs": a.runs,
        "load_avg_start": load,
        "median_s": med(lambda r: r["median_s"]),
        "runs_s": [r["median_s"] for r in runs],
        "time_step_s": t("time/step"),
        "env_s": t("time/env_s"),
        "device_s": t("time/device_s"),
    }
    if staleness == 0:
        rec["rollout_s"] = t("time/rollout")
        rec["update_s"] = med(
            lambda r: r["timings"]["time/step"] - r["timings"].get("time/rollout", 0.0)
        )
    else:
        rec["rollout_s"] = t("time/produce")  # batch k+1's rollout, on the host while update k runs
        rec["wait_update_s"] = t("time/wait_update")  # the update's part the rollout did not hide
        rec["speedup"] = sync_s / rec["median_s"] if sync_s else None
    rec.update(
        tokens_per_s=med(lambda r: r["tokens_per_s"]),
        turns=med(lambda r: r["turns"]),
        tool_calls=med(lambda r: r["tool_calls"]),
        compiles_measured=[r["compiles_measured"] for r in runs],
        staleness_seen=runs[0]["staleness_seen"],
        reward_last=[r["reward_last"] for r in runs],
        run_wall_s=[round(r["run_wall_s"], 1) for r in runs],
        step_s_per_run=[[round(s, 4) for s in r["step_s"]] for r in runs],
        timings=runs[0]["timings"]
        if len(runs) == 1
        else {
            k: statistics.median(r["timings"].get(k, float("nan")) for r in runs)
            for k in runs[0]["timings"]
        },
        load_avg_end=list(os.getloadavg()),
        frozen=a.frozen,
        extra=list(a.extra),
    )
    return rec


TABLE = [
    "mode",
    "tool_ms",
    "median_s",
    "rollout_s",
    "update_s",
    "wait_update_s",
    "env_s",
    "device_s",
    "tokens_per_s",
    "tool_calls",
    "speedup",
]


def main(a: Args):
    if a.warmup < 1 or a.steps < a.warmup + 4:
        raise SystemExit(
            "--warmup >= 1 and --steps >= warmup + 4 (three measured steps) are required"
        )
    with contextlib.ExitStack() as stack:
        work = (
            Path(a.work_dir)
            if a.work_dir
            else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        work.mkdir(parents=True, exist_ok=True)
        if a.compile_cache:
            jax.config.update("jax_compilation_cache_dir", str(work / "jax-cache"))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        base = base_model(work)
        records, load = [], list(os.getloadavg())
        for tool_ms in a.tool_ms:
            results: dict[int, list[dict]] = {0: [], a.staleness: []}
            for k in range(a.runs):
                for s in (0, a.staleness):  # alternating: the machine's noise hits both alike
                    tag = f"{'frozen-' if a.frozen else ''}tool{tool_ms:g}ms-s{s}-run{k}"
                    results[s].append(run_once(a, s, tool_ms, work, base, tag))
            sync = summarize(a, tool_ms, 0, results[0], None, load)
            records += [
                emit(sync, TABLE),
                emit(
                    summarize(
                        a, tool_ms, a.staleness, results[a.staleness], sync["median_s"], load
                    ),
                    TABLE,
                ),
            ]
    if a.out:
        path = HERE / "results" / a.out
        with open(path, "a") as f:
            for rec in records:
                f.write(json.dumps(rec, default=str) + "\n")
        print(f"[agent_pipeline] appended {len(records)} lines to {path}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
