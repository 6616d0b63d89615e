"""The run loop every trainer shares (docs/architecture.md, "Run directory and trust").

An algorithm supplies a ``Trainer``: its step (a composed stage, or a ``ShardedStep``), its
batches (an iterator with ``get_state``/``set_state``, checkpointed with the state), how an
iterator item becomes a step batch, its host-side metrics, an evaluation and an HF export.
``run_loop`` does the rest, the same for every algorithm: set aside an earlier run or resume
exactly (state, data position, logs cut back), evaluate before, train with logging, a progress
bar, health checks, periodic evaluation, checkpoints and exports, save on SIGTERM, evaluate
after, export, and write ``summary.json``.

The step must leave ``metrics`` (scalars) and ``health`` (``relax.train.health``'s integers) in
the batch it returns.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax

from relax.compose import SegmentRunner, split_host
from relax.models.adapters.operations import split_trainable
from relax.train.checkpoint import Checkpointer
from relax.train.health import HealthConfig, HealthMonitor, check_finite_weights, leaf_names
from relax.train.logs import MetricsLogger, ProgressBar, is_main_process, write_summary
from relax.train.optimizer import skip_counts
from relax.train.pipeline import AsyncConfig, Pipeline, producer_part
from relax.train.preemption import Preempted, PreemptionGuard
from relax.train.run_dir import load_summary, restore_latest, set_aside_earlier_run
from relax.train.update import Updated


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What every run has: its length, seed, run directory, checkpoints, evaluation schedule,
    exports and guards (algorithms extend it with their own fields)."""

    steps: int = 200
    seed: int = 0
    run_dir: str = "runs/relax"
    eval_every: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    checkpoint_every: int = 50
    keep_checkpoints: int = 3
    resume: bool = False
    """Continue from the latest checkpoint in --run-dir (verified; a damaged one stops the run).
    Without it, an earlier run's outputs in --run-dir are moved to <run-dir>/previous/<time>/."""
    resume_fallback: bool = False
    """With --resume: if the newest checkpoint is damaged, restore the newest intact one instead
    (the damaged ones are moved to <run-dir>/damaged_checkpoints/)."""
    eval_only: bool = False
    """Evaluate the model (or the latest checkpoint with --resume) and exit."""
    export_hf: bool = True
    """Export the final policy as a Hugging Face directory (run_dir/final_hf)."""
    export_every: int = 0
    """Also export the policy every N steps to run_dir/hf/step-N (0: never)."""
    health: HealthConfig = HealthConfig()
    """When to stop on non-finite values and warn of a collapse (``relax.train.health``)."""

    def __post_init__(self):
        if self.resume_fallback and not self.resume:
            raise ValueError("--resume-fallback needs --resume")
        if self.export_every < 0:
            raise ValueError(f"--export-every must be >= 0, got {self.export_every}")
        if self.steps < 0 or self.checkpoint_every < 1:
            raise ValueError("--steps >= 0 and --checkpoint-every >= 1 are required")
        if self.steps == 0 and not self.eval_only:
            raise ValueError(
                "--steps 0 trains nothing: pass --eval-only to evaluate the model, or --steps N >= 1"
            )


@dataclasses.dataclass(frozen=True)
class Trainer:
    """What an algorithm brings to ``run_loop``.

    ``name``: for the progress bar. ``step``: ``(state, batch) -> (state, batch)`` with
    ``segments`` (timed one by one). ``batches``: the data iterator. ``make_batch(item)``: the
    step's input. ``host_metrics(batch, metrics)``: extra host-side metrics of an iteration
    (e.g. tokens/s). ``evaluate(state, step, logger) -> metrics`` (the whole state: a
    distillation evaluation reads its teacher) and ``export(policy, directory) -> directory``
    (collective: every process calls them; a state with a trained vision part calls
    ``export(policy, directory, vision=state.vision)``). ``bar_keys``: metrics shown
    on the progress bar as ``(name, label)``. ``on_start(run_dir)``: called on the main process
    once the run directory is ready (an earlier run set aside), e.g. to write the start-up report.
    ``prepare(state, run_dir)``: called on every process with the state the loop trains from (the
    restored one with --resume) before the first evaluation and step, e.g. to compile every
    program ahead (``relax.algorithms.online.ahead``). ``info``: what ``summary.json`` records of
    the run besides its evaluations (its data, say)."""

    name: str
    step: SegmentRunner
    batches: Iterator
    make_batch: Callable[[Any], dict]
    host_metrics: Callable[[dict, dict], dict]
    evaluate: Callable[[Any, int, MetricsLogger], dict]
    export: Callable[[Any, Path], Path]
    bar_keys: Sequence[tuple[str, str]] = ()
    asynchronous: AsyncConfig = AsyncConfig()
    on_start: Callable[[Path], None] = lambda run_dir: None
    prepare: Callable[[Any, Path], None] = lambda state, run_dir: None
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class CompileCounter:
    """Counts XLA compilations while active (``jax.monitoring``'s backend-compile events): the run
    logs ``compiles`` per iteration, which must be 0 after the first one (static shapes)."""

    EVENT = "backend_compile_duration"

    def __init__(self):
        self.count = 0

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event.endswith(self.EVENT):
            self.count += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)


def iteration(trainer: Trainer, state, batch) -> tuple[Any, dict, dict]:
    """One iteration, timed per segment: ``(state, metrics, health)`` as host values;
    ``compiles`` counts the XLA programs it compiled."""
    timings = {}
    with CompileCounter() as compiles:
        for seg in trainer.step.segments:
            t0 = time.perf_counter()
            state, batch = seg.run(state, batch)
            jax.block_until_ready((state, _samples(batch)))
            timings["time/" + "+".join(seg.names)] = time.perf_counter() - t0
    timings["time/step"] = sum(timings.values())
    return (state, *_host_values(trainer, batch, timings, compiles.count))


def _host_values(trainer: Trainer, batch, timings: dict, compiles: int) -> tuple[dict, dict]:
    out = updated(batch)
    metrics = {k: float(v) for k, v in jax.device_get(out.metrics).items()}
    metrics.update(timings, compiles=float(compiles))
    metrics.update(trainer.host_metrics(batch, metrics))
    return metrics, {k: int(v) for k, v in jax.device_get(out.health).items()}


def _samples(batch) -> tuple:
    """What a segment's timing waits for besides the state: the batch's ``tokens`` and ``rewards``
    (not, e.g., the reference log-probs, which the device computes while the host scores)."""
    dev = split_host(batch)[1]
    dev = dev.batch if isinstance(dev, Updated) else dev
    if isinstance(dev, Mapping):
        return tuple(dev[k] for k in ("tokens", "rewards") if k in dev)
    return tuple(getattr(dev, k, None) for k in ("tokens", "rewards"))


def updated(batch) -> Updated:
    """The ``Updated`` (metrics, health) a step returned: its device part (``relax.compose.split_host``)."""
    return split_host(batch)[1]


class Synchronous:
    """Each iteration samples, scores and updates on the live state (``iteration``); a
    checkpoint is the state and the data position."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def target(self, state):
        return state

    def restored(self, tree):
        return tree

    def saved(self, state, step: int, steps: int):
        return state, self.trainer.batches.get_state()

    def summary(self, steps: int) -> dict:
        return {}

    def updates(self, state, start: int, steps: int) -> Iterator[tuple[Any, dict, dict]]:
        for _ in range(start, steps):
            state, metrics, health = iteration(
                self.trainer, state, self.trainer.make_batch(next(self.trainer.batches))
            )
            yield state, metrics, health


class Pipelined(Synchronous):
    """``relax.train.pipeline``'s schedule; a checkpoint also holds the sampler's copies of the
    versions that batches in flight use, and the data position of the next batch to update on."""

    def __init__(self, trainer: Trainer, steps: int):
        super().__init__(trainer)
        self.cfg, self.steps, self.views = trainer.asynchronous, steps, {}
        self.pipeline: Pipeline | None = None

    def target(self, state):
        return {"train": state, "sampler": (producer_part(state),) * self.cfg.slots}

    def restored(self, tree):
        state = tree["train"]
        live = self.cfg.live_versions(int(state.step), self.steps)
        self.views = dict(zip(live, tree["sampler"]))
        for v, view in self.views.items():
            if int(view.step) != v:
                raise ValueError(
                    f"the checkpoint's sampler copy of version {v} holds version {int(view.step)}"
                )
        return state

    def summary(self, steps: int) -> dict:
        return {
            "staleness_histogram": {str(lag): n for lag, n in self.cfg.histogram(steps).items()}
        }

    def saved(self, state, step: int, steps: int):
        return (
            {"train": state, "sampler": self.pipeline.saved_views(state, step, steps)},
            self.pipeline.data_state(step),
        )

    def updates(self, state, start: int, steps: int) -> Iterator[tuple[Any, dict, dict]]:
        t = self.trainer
        self.pipeline = Pipeline(
            t.step.segments, self.cfg, t.batches, t.make_batch, views=self.views
        )
        run = self.pipeline.run(state, start, steps)
        while True:
            with CompileCounter() as compiles:
                item = next(run, None)
            if item is None:
                return
            state, batch, timings = item
            yield (state, *_host_values(t, batch, timings, compiles.count))


def _train(
    cfg: RunConfig,
    trainer: Trainer,
    schedule: Synchronous,
    state,
    start: int,
    ckpt: Checkpointer,
    logger: MetricsLogger,
    monitor: HealthMonitor,
):
    """Iterations ``start .. cfg.steps``: log, check health, evaluate, checkpoint, export (every
    ``cfg.export_every``); on SIGTERM save and raise ``Preempted``. Returns the final state (its
    last step checkpointed)."""
    last_saved = None

    def save(step: int, force: bool = False) -> bool:
        tree, data_state = schedule.saved(state, step, cfg.steps)
        return ckpt.save(step, tree, data_state=data_state, config=cfg, force=force)

    def saved_and_written(step: int) -> None:
        """``step`` checkpointed (forced unless it already is) and the save committed."""
        if last_saved != step and ckpt.latest_step() != step:
            save(step, force=True)
        ckpt.wait()

    bar = ProgressBar(total=cfg.steps, initial=start, keys=trainer.bar_keys, desc=trainer.name)
    with PreemptionGuard() as guard, bar:
        for step, (state, metrics, health) in enumerate(
            schedule.updates(state, start, cfg.steps), start
        ):
            logger.log(step + 1, metrics)
            bar.update(1, metrics)
            monitor.check(step + 1, metrics, health)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                trainer.evaluate(state, step + 1, logger)
            if save(step + 1):
                last_saved = step + 1
            if cfg.export_every and (step + 1) % cfg.export_every == 0:
                exported(trainer, state, Path(cfg.run_dir) / "hf" / f"step-{step + 1}")
            if guard.requested:
                saved_and_written(step + 1)
                raise Preempted(
                    f"SIGTERM: stopped after step {step + 1}, saved as checkpoint {step + 1} in "
                    f"{ckpt.directory}; continue with --resume"
                )
    saved_and_written(cfg.steps)
    return state


def _resume_and_train(cfg: RunConfig, trainer: Trainer, state, log) -> tuple[Any, dict]:
    """Restore (``--resume``), evaluate "before", train, evaluate "after": ``(state, summary)``.
    Pending checkpoint saves complete whatever happens (success, error, Ctrl-C, SIGTERM)."""
    run_dir = Path(cfg.run_dir)
    if not (cfg.resume or cfg.eval_only):
        set_aside_earlier_run(run_dir, log)
    if is_main_process():
        trainer.on_start(run_dir)
    ckpt = Checkpointer(
        run_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints, save_every=cfg.checkpoint_every
    )
    try:
        summary: dict = {**(load_summary(run_dir) if cfg.resume else {}), **trainer.info}
        schedule = (
            Synchronous(trainer)
            if trainer.asynchronous.staleness == 0
            else Pipelined(trainer, cfg.steps)
        )
        restored = (
            restore_latest(
                ckpt, schedule.target(state), run_dir, fallback=cfg.resume_fallback, log=log
            )
            if cfg.resume
            else None
        )
        if restored is not None:
            tree, data_state, _ = restored
            state = schedule.restored(tree)
            check_finite_weights(
                state.policy, f"the checkpoint of step {int(state.step)} in {ckpt.directory}"
            )
            trainer.batches.set_state(data_state)
            log(f"resumed from step {int(state.step)} ({ckpt.directory})")
        start = int(state.step)
        if not cfg.eval_only:
            trainer.prepare(state, run_dir)
        with MetricsLogger(run_dir, resume_step=None if cfg.eval_only else start) as logger:
            if cfg.eval_only:
                return state, {
                    **summary,
                    "eval_only": trainer.evaluate(state, start, logger),
                    "step": start,
                }
            if sum(logger.dropped.values()):
                log(
                    f"logs cut back to step {start}: {sum(logger.dropped.values())} later record(s) removed"
                )
            if "before" not in summary:
                if start == 0:
                    summary["before"] = trainer.evaluate(state, start, logger)
                    write_summary(run_dir, summary)
                else:
                    log(
                        "no 'before' evaluation was recorded for this run; summary.json will have none"
                    )
            monitor = HealthMonitor(
                cfg.health,
                grad_leaves=leaf_names(split_trainable(state.policy)[0]),
                vocab_size=state.policy.config.vocab_size,
                warn=log,
            )
            state = _train(cfg, trainer, schedule, state, start, ckpt, logger, monitor)
            summary.update(schedule.summary(cfg.steps))
            summary["after"] = trainer.evaluate(state, cfg.steps, logger)
            write_summary(run_dir, summary)
    finally:
        ckpt.close()
    return state, summary


def run_loop(
    cfg: RunConfig, trainer: Trainer, state, log=print, t_start: float | None = None
) -> tuple[Any, dict]:
    """Train ``state`` with ``trainer`` as ``cfg`` says (or only evaluate, ``eval_only``);
    ``(state, summary)``, the summary also written to ``run_dir/summary.json``. ``t_start``: when
    the run began (``time.perf_counter()``; default now), for ``run_time_s``."""
    t_start = time.perf_counter() if t_start is None else t_start
    run_dir = Path(cfg.run_dir)
    state, summary = _resume_and_train(cfg, trainer, state, log)
    if cfg.eval_only:
        write_summary(run_dir, summary)
        return state, summary
    if cfg.export_hf:
        summary["export"] = str(exported(trainer, state, run_dir / "final_hf"))
    summary.update(
        steps=cfg.steps,
        run_time_s=time.perf_counter() - t_start,
        skipped_updates=int(skip_counts(state.opt_state)[0]),
    )
    write_summary(run_dir, summary)
    if summary.get("before") and summary.get("after"):
        log("\n" + summary_table(summary["before"], summary["after"]))
    return state, summary


def summary_table(before: dict, after: dict) -> str:
    """Before / after / change of each metric; a missing one, or a NaN read back from JSON (None:
    e.g. the success rate of trajectories that called no tool when none did), shows as nan."""
    keys = [k for k in after if ("/" not in k or k.startswith("greedy/")) and k != "num_prompts"]
    lines = [f"{'metric':<22}{'before':>10}{'after':>10}{'change':>10}"]
    number = lambda x: float("nan") if x is None else x  # noqa: E731
    for k in keys:
        b, a = number(before.get(k)), number(after[k])
        lines.append(f"{k:<22}{b:>10.3f}{a:>10.3f}{a - b:>+10.3f}")
    return "\n".join(lines)


def exported(trainer: Trainer, state, directory: Path) -> Path:
    """The state's policy exported to ``directory`` by ``trainer.export``, with its trained vision
    part when it has one."""
    if getattr(state, "vision", None) is None:
        return trainer.export(state.policy, directory)
    return trainer.export(state.policy, directory, vision=state.vision)
