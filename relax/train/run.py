"""The GRPO run: data -> grpo_step loop -> evaluation, checkpoints, logs, HF export.

``run(cfg)`` is what ``examples/train_grpo.py`` calls after parsing flags into ``RunConfig``.
With no ``model`` it trains on the built-in offline task (``relax.tasks.reverse``): the base
model is produced by a short supervised phase and saved as an HF directory in the run dir.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from relax.checkpoint import Checkpointer
from relax.choices import check_choice
from relax.data import DataConfig, eval_records, prompt_batch, prompt_iterator, read_records, read_splits
from relax.logging import MetricsLogger, ProgressBar, is_main_process, write_summary
from relax.models.config import DTYPES
from relax.models.hf import load_pretrained, save_pretrained
from relax.parallel_step import ParallelConfig, ShardedStep, check_batch
from relax.rewards.builtin import get_reward
from relax.rewards.functions import RewardFunction
from relax.tasks import reverse
from relax.text import TextTokenizer, load_tokenizer
from relax.train.config import PRESETS, GRPOConfig, preset
from relax.train.evaluate import EvalConfig, evaluate
from relax.train.grpo import make_grpo_step
from relax.train.health import HealthConfig, HealthMonitor, leaf_names
from relax.train.preemption import Preempted, PreemptionGuard
from relax.train.run_dir import load_summary, restore_latest, set_aside_earlier_run
from relax.train.state import init_state
from relax.train.update import skipped_updates

BAR_KEYS = (("reward", "reward"), ("kl", "kl"), ("completion_length", "len"), ("tokens_per_s", "tok/s"))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A GRPO run. Without ``model`` the built-in offline task (``task``) is used."""

    model: str | None = None
    """Hugging Face model directory (config.json + safetensors; its tokenizer and chat template too)."""
    tokenizer: str | None = None
    """Another tokenizer than --model's: a directory, a tokenizer.json or a sentencepiece .model."""
    data: str | None = None
    """Training prompts: .jsonl / .parquet file or directory (required with --model)."""
    eval_data: str | None = None
    """Held-out prompts; without it ``eval_fraction`` of --data is held out."""
    eval_fraction: float = 0.0
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    data_source_field: str = "data_source"
    max_prompt_tokens: int = 512
    overlong: str = "truncate"
    chat_template: Literal["auto", "always", "never"] = "auto"
    """auto: string prompts go through the model's chat template when it has one (a chat model);
    always / never. A prompt that is a list of chat messages always goes through it."""
    system_prompt: str | None = None
    reward: tuple[str, ...] = ("exact_match",)
    """Built-in reward functions by name (exact_match, numeric_match, format_reward)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per --reward (empty: all 1)."""
    reward_timeout_s: float | None = 60.0
    reward_on_error: str = "raise"
    """raise: stop naming the function and sample; missing: log, count, treat as missing."""
    preset: str = "grpo"
    """Algorithm preset (grpo, dr_grpo, dapo, gspo, rloo): the defaults of --grpo.*"""
    grpo: GRPOConfig = GRPOConfig()
    steps: int = 200
    batch_size: int = 16
    """Prompts per step (P); each gets --grpo.num-generations completions."""
    seed: int = 0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    eval: EvalConfig = EvalConfig()
    eval_every: int = 0
    """Evaluate every N steps (0: only before and after training)."""
    eval_max_prompts: int | None = None
    run_dir: str = "runs/grpo"
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
    task: reverse.ReverseTask = reverse.ReverseTask()
    health: HealthConfig = HealthConfig()
    """When to stop on non-finite values and warn of a collapse (``relax.train.health``)."""
    parallel: ParallelConfig = ParallelConfig()
    """Meshes and multi-host setup (``relax.parallel``): e.g. ``--parallel.mesh fsdp=-1``."""

    def __post_init__(self):
        check_choice("preset", self.preset, tuple(PRESETS))
        if self.model is not None and self.data is None:
            raise ValueError("--model needs --data")
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ValueError(f"{len(self.reward_weights)} --reward-weights for {len(self.reward)} --reward")
        for name in (self.param_dtype, self.compute_dtype):
            if name not in DTYPES:
                raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if self.resume_fallback and not self.resume:
            raise ValueError("--resume-fallback needs --resume")
        if self.export_every < 0:
            raise ValueError(f"--export-every must be >= 0, got {self.export_every}")
        if self.steps < 0 or self.batch_size < 1 or self.checkpoint_every < 1:
            raise ValueError("--steps >= 0, --batch-size >= 1 and --checkpoint-every >= 1 are required")


def builtin_defaults(preset_name: str = "grpo") -> RunConfig:
    """The no-argument run: the reverse task, sized to finish in a few minutes on 2 CPU cores.

    Only the sizes and the learning rate are the task's; every algorithm value is the preset's."""
    grpo = preset(preset_name, num_generations=8, max_new_tokens=8,
                  optimizer=dataclasses.replace(GRPOConfig().optimizer, learning_rate=1e-3))
    return RunConfig(preset=preset_name, grpo=grpo, steps=60, batch_size=16, max_prompt_tokens=16, eval_every=20,
                     checkpoint_every=20, run_dir="runs/grpo-reverse")


def real_defaults(preset_name: str = "grpo") -> RunConfig:
    return RunConfig(preset=preset_name, grpo=preset(preset_name))


def _builtin_setup(cfg: RunConfig, run_dir: Path, log):
    """Task files, tokenizer and base model of the built-in task (reused when present)."""
    task = cfg.task
    task_dir = run_dir / "task"
    train, held_out = reverse.make_splits(task)
    reverse.write_jsonl(train, task_dir / "train.jsonl")
    reverse.write_jsonl(held_out, task_dir / "eval.jsonl")
    tokenizer = reverse.build_tokenizer(task, task_dir)
    base_dir = run_dir / "base_model"
    if (base_dir / "config.json").exists():
        model = load_pretrained(base_dir)
        log(f"base model: {base_dir} (reused)")
    else:
        log("base model: a supervised phase on a noisy teacher (reverses only "
            f"{task.reverse_prob:.0%} of the time) ...")
        model = reverse.train_base_model(task, tokenizer, train, key=jax.random.key(cfg.seed), log=log)
        if is_main_process():
            save_pretrained(model, base_dir)
            tokenizer.save_pretrained(base_dir)  # a complete HF directory: transformers loads it
    return tokenizer, model, str(task_dir / "train.jsonl"), str(task_dir / "eval.jsonl")


def _decoder(tokenizer: TextTokenizer):
    def decode(tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        return [text.strip() for text in tokenizer.decode_batch(tokens, mask, skip_special_tokens=True)]
    return decode


def _table(before: dict, after: dict) -> str:
    keys = [k for k in after if "/" not in k or k.startswith("greedy/")]
    keys = [k for k in keys if k not in ("num_prompts",)]
    lines = [f"{'metric':<22}{'before':>10}{'after':>10}{'change':>10}"]
    for k in keys:
        b, a = before.get(k, float("nan")), after[k]
        lines.append(f"{k:<22}{b:>10.3f}{a:>10.3f}{a - b:>+10.3f}")
    return "\n".join(lines)


def _on_host(enabled: bool):
    """Load / initialise the model in host memory when it is going to be sharded anyway (so a
    model larger than one accelerator never lands whole on device 0)."""
    if enabled and jax.devices()[0].platform != "cpu":
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
            pass
    return contextlib.nullcontext()


def _exporter(tokenizer: TextTokenizer):
    """``export(policy, directory) -> directory``: weights, config, generation config, tokenizer
    files and chat template, a directory ``transformers`` loads (collective: every process calls it)."""

    def export(policy, directory: Path) -> Path:
        policy = _host_policy(policy)
        if is_main_process():
            save_pretrained(policy, directory)
            tokenizer.save_pretrained(directory)
        return directory

    return export


def _host_policy(policy):
    """The policy as host arrays on every process (gathered from all processes' shards)."""
    if jax.process_count() == 1:
        return policy
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(policy, tiled=True)


def _batch(cfg: RunConfig, pb) -> dict:
    return {"prompt_ids": jnp.asarray(pb.prompt_ids), "prompt_mask": jnp.asarray(pb.prompt_mask),
            "prompts": pb.prompts, "fields": {cfg.answer_field: pb.answers, **pb.fields}}


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


def _iteration(cfg: RunConfig, step_fn, state, batch) -> tuple[object, dict, dict]:
    """One GRPO iteration, timed per segment: ``(state, metrics, health)`` as host values;
    ``compiles`` counts the XLA programs it compiled."""
    timings = {}
    with CompileCounter() as compiles:
        for seg in step_fn.segments:
            t0 = time.perf_counter()
            state, batch = seg.run(state, batch)
            jax.block_until_ready((state, {k: v for k, v in batch.items() if k in ("tokens", "rewards")}))
            timings["time/" + "+".join(seg.names)] = time.perf_counter() - t0
    metrics = {k: float(v) for k, v in jax.device_get(batch["metrics"]).items()}
    metrics.update(timings, compiles=float(compiles.count))
    step_time = sum(timings.values())
    metrics["time/step"] = step_time
    # from the global mean: on several processes ``lengths`` is not addressable whole
    num_tokens = metrics["completion_length"] * cfg.batch_size * cfg.grpo.num_generations
    metrics["tokens_per_s"] = num_tokens / step_time
    metrics["reward_errors"] = float(batch["reward_info"]["errors"] + batch["reward_info"]["timeouts"])
    return state, metrics, {k: int(v) for k, v in jax.device_get(batch["health"]).items()}


def _train(cfg: RunConfig, step_fn, state, start: int, iterator, ckpt: Checkpointer, logger: MetricsLogger,
           monitor: HealthMonitor, run_eval, export):
    """Iterations ``start .. cfg.steps``: log, check health, evaluate, checkpoint, export (every
    ``cfg.export_every``); on SIGTERM save and raise ``Preempted``. Returns the final state (its
    last step checkpointed)."""
    last_saved = None

    def save(step: int, force: bool = False) -> bool:
        return ckpt.save(step, state, data_state=iterator.get_state(), config=cfg, force=force)

    def saved_and_written(step: int) -> None:
        """``step`` checkpointed (forced unless it already is) and the save committed."""
        if last_saved != step and ckpt.latest_step() != step:
            save(step, force=True)
        ckpt.wait()

    with PreemptionGuard() as guard, ProgressBar(total=cfg.steps, initial=start, keys=BAR_KEYS, desc="grpo") as bar:
        for step in range(start, cfg.steps):
            state, metrics, health = _iteration(cfg, step_fn, state, _batch(cfg, next(iterator)))
            logger.log(step + 1, metrics)
            bar.update(1, metrics)
            monitor.check(step + 1, metrics, health)
            if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
                run_eval(state.policy, step + 1)
            if save(step + 1):
                last_saved = step + 1
            if cfg.export_every and (step + 1) % cfg.export_every == 0:
                export(state.policy, Path(cfg.run_dir) / "hf" / f"step-{step + 1}")
            if guard.requested:
                saved_and_written(step + 1)
                raise Preempted(f"SIGTERM: stopped after step {step + 1}, saved as checkpoint {step + 1} in "
                                f"{ckpt.directory}; continue with --resume")
    saved_and_written(cfg.steps)
    return state


def _model_and_data(cfg: RunConfig, run_dir: Path, on_host: bool, log):
    """``(tokenizer, model, data_cfg, splits, eval_batch)``: the built-in task or --model/--data."""
    if cfg.model is None:
        tokenizer, model, data_path, eval_path = _builtin_setup(cfg, run_dir, log)
    else:
        tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
        with _on_host(on_host):
            model = load_pretrained(cfg.model, dtype=DTYPES[cfg.compute_dtype], param_dtype=DTYPES[cfg.param_dtype])
        data_path, eval_path = cfg.data, cfg.eval_data
    buckets = tuple(b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if b < cfg.max_prompt_tokens)
    data_cfg = DataConfig(
        path=data_path, batch_size=cfg.batch_size, max_prompt_tokens=cfg.max_prompt_tokens,
        prompt_field=cfg.prompt_field, answer_field=cfg.answer_field, data_source_field=cfg.data_source_field,
        seed=cfg.seed, overlong=cfg.overlong, chat_template=cfg.chat_template, system_prompt=cfg.system_prompt,
        prompt_buckets=buckets + (cfg.max_prompt_tokens,),
        eval_fraction=cfg.eval_fraction if eval_path is None else 0.0)
    splits = read_splits(data_cfg)  # the training data is read once, for both splits
    if eval_path is not None:
        held_out = read_records(eval_path, fields=(cfg.prompt_field,))
    else:
        held_out = eval_records(data_cfg, splits)
    if cfg.eval_max_prompts is not None:
        held_out = held_out[:cfg.eval_max_prompts]
    eval_batch = prompt_batch(held_out, data_cfg, tokenizer) if held_out else None
    return tokenizer, model, data_cfg, splits, eval_batch


def _evaluator(cfg: RunConfig, eval_batch, reward_fns, decode, eos_ids, pad_id: int, log):
    """``run_eval(policy, step, logger) -> metrics``: the held-out evaluation, logged at ``step``."""

    def run_eval(policy, step: int, logger: MetricsLogger) -> dict:
        if eval_batch is None:
            return {}
        t0 = time.perf_counter()
        metrics = evaluate(policy, eval_batch, reward_fns=reward_fns, decode=decode, eos_ids=eos_ids,
                           pad_id=pad_id, max_new_tokens=cfg.grpo.max_new_tokens,
                           key=jax.random.fold_in(jax.random.key(cfg.seed), 1_000_003), cfg=cfg.eval,
                           answer_field=cfg.answer_field, timeout_s=cfg.reward_timeout_s,
                           stop_strings=cfg.grpo.stop_strings)
        logger.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        log(f"eval @ step {step} ({time.perf_counter() - t0:.1f}s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if "/" not in k or k.startswith("greedy")))
        return metrics

    return run_eval


def _resume_and_train(cfg: RunConfig, run_dir: Path, step_fn, state, iterator, run_eval, export,
                      log) -> tuple[object, dict]:
    """Restore (``--resume``), evaluate "before", train, evaluate "after": ``(state, summary)``.
    Pending checkpoint saves complete whatever happens (success, error, Ctrl-C, SIGTERM)."""
    if not (cfg.resume or cfg.eval_only):
        set_aside_earlier_run(run_dir, log)
    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints, save_every=cfg.checkpoint_every)
    try:
        summary: dict = load_summary(run_dir) if cfg.resume else {}
        restored = restore_latest(ckpt, state, run_dir, fallback=cfg.resume_fallback, log=log) if cfg.resume else None
        if restored is not None:
            state, data_state, _ = restored
            iterator.set_state(data_state)
            log(f"resumed from step {int(state.step)} ({ckpt.directory})")
        start = int(state.step)
        with MetricsLogger(run_dir, resume_step=None if cfg.eval_only else start) as logger:
            if cfg.eval_only:
                return state, {**summary, "eval_only": run_eval(state.policy, start, logger), "step": start}
            if sum(logger.dropped.values()):
                log(f"logs cut back to step {start}: {sum(logger.dropped.values())} later record(s) removed")
            if "before" not in summary:
                if start == 0:
                    summary["before"] = run_eval(state.policy, start, logger)
                    write_summary(run_dir, summary)
                else:
                    log("no 'before' evaluation was recorded for this run; summary.json will have none")
            monitor = HealthMonitor(cfg.health, grad_leaves=leaf_names(state.policy),
                                    vocab_size=state.policy.config.vocab_size, warn=log)
            evaluate_at = lambda policy, step: run_eval(policy, step, logger)  # noqa: E731
            state = _train(cfg, step_fn, state, start, iterator, ckpt, logger, monitor, evaluate_at, export)
            summary["after"] = run_eval(state.policy, cfg.steps, logger)
            write_summary(run_dir, summary)
    finally:
        ckpt.close()
    return state, summary


def run(cfg: RunConfig) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    cfg.parallel.initialize()  # multi-host: before anything touches a device
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = print if is_main_process() else (lambda *a, **k: None)
    log(f"relax GRPO | jax {jax.__version__} | {jax.device_count()} {jax.devices()[0].platform} device(s) "
        f"| run dir {run_dir}")
    t_start = time.perf_counter()
    mesh, sampler_mesh = cfg.parallel.meshes()
    check_batch(cfg.batch_size, mesh)
    check_batch(cfg.batch_size, sampler_mesh)
    if mesh is not None:
        log(f"mesh {dict(mesh.shape)}" + (f", sampler mesh {dict(sampler_mesh.shape)}" if sampler_mesh else "")
            + f" | {jax.process_count()} process(es)")
    tokenizer, model, data_cfg, splits, eval_batch = _model_and_data(cfg, run_dir, mesh is not None, log)
    eos_ids = tuple(sorted({*model.config.eos_ids, *tokenizer.eos_token_ids}))
    weights = cfg.reward_weights or (1.0,) * len(cfg.reward)
    reward_fns = [RewardFunction(get_reward(n), name=n, weight=w) for n, w in zip(cfg.reward, weights)]
    decode = _decoder(tokenizer)
    optimizer = cfg.grpo.optimizer.make()
    with _on_host(mesh is not None):
        state = init_state(model, optimizer, key=jax.random.key(cfg.seed), with_reference=cfg.grpo.needs_reference)
    step_fn = make_grpo_step(cfg.grpo, optimizer, reward_fns, decode, eos_ids=eos_ids,
                             pad_id=tokenizer.pad_token_id, on_error=cfg.reward_on_error,
                             timeout_s=cfg.reward_timeout_s)
    if mesh is not None:  # every process: the same state, laid out on the (global) mesh
        step_fn = ShardedStep(step_fn, state, mesh, sampler_mesh=sampler_mesh,
                              offload_reference=cfg.parallel.offload_reference)
        state = step_fn.place(state)
        del model
    run_eval = _evaluator(cfg, eval_batch, reward_fns, decode, eos_ids, tokenizer.pad_token_id, log)
    iterator = prompt_iterator(data_cfg, tokenizer, splits=splits)
    export = _exporter(tokenizer)
    state, summary = _resume_and_train(cfg, run_dir, step_fn, state, iterator, run_eval, export, log)
    if cfg.eval_only:
        write_summary(run_dir, summary)
        return summary
    if cfg.export_hf:
        summary["export"] = str(export(state.policy, run_dir / "final_hf"))
    summary.update(steps=cfg.steps, run_time_s=time.perf_counter() - t_start,
                   skipped_updates=int(skipped_updates(state.opt_state)))
    write_summary(run_dir, summary)
    if summary.get("before") and summary.get("after"):
        log("\n" + _table(summary["before"], summary["after"]))
    return summary
