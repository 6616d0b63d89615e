"""Online RL runs on prompts, shared by GRPO and PPO: model, tokenizer and data (the built-in
task or ``--model``/``--data``), reward functions, held-out evaluation, HF export, meshes; the
loop itself is ``relax.train.run.run_loop``.

An algorithm supplies an ``OnlineAlgorithm``: its name, how to build its state from the loaded
model, how to build its step, and the sampling sizes evaluation needs.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import jax
from jax.sharding import Mesh

from relax.algorithms.cli.report import (
    StartupReport,
    first_prompt_lines,
    prompt_lines,
    run_report,
    token_lines,
)
from relax.algorithms.online.ahead import (
    CompiledAhead,
    compile_ahead,
    eval_lowerings,
    publish,
    shrink_hint,
    stand_in,
    step_lowerings,
)
from relax.algorithms.online.batch import HostRecord, step_input
from relax.algorithms.online.config import (
    BAR_KEYS,
    ModelRunConfig,
    OnlineAlgorithm,
    OnlineRunConfig,
    run_parts,
    tower_line,
)
from relax.algorithms.online.rewards import reward_functions, reward_pool
from relax.algorithms.online.setup import (
    RunData,
    base_path,
    batch_pixels,
    exporter,
    load_run_data,
    reasoning_gym_setup,
    text_decoder,
    trained_tower,
    training_batches,
    visual_setup,
)
from relax.algorithms.online.step import StepParts
from relax.algorithms.online.verifiers_setup import verifiers_setup
from relax.compose import WithHost
from relax.data.curriculum import RisingCurriculum
from relax.data.prompts import (
    batch_lengths,
    padded_length,
)
from relax.eval.evaluate import evaluate, sampler_calls
from relax.objectives.off_policy import OffPolicyConfig
from relax.parallel import ShardedStep, batch_shards, check_batch
from relax.parallel.distributed import on_host_memory
from relax.passes import choose_passes
from relax.rewards.generative_judge import judge_metrics
from relax.rewards.sandbox import describe as describe_sandbox
from relax.rollout.generation import GenerationConfig
from relax.rollout.partial import PartialRollouts
from relax.train.ahead import default_workers
from relax.train.logs import MetricsLogger, is_main_process
from relax.train.run import RunConfig, Trainer, run_loop
from relax.train.vision_tower import initial_features_read

EVAL_STREAM = 1_000_003  # the held-out evaluation's key: fold_in(key(seed), EVAL_STREAM)


def _report(
    cfg: OnlineRunConfig, algo: OnlineAlgorithm, data: RunData, parts: StepParts, mesh
) -> StartupReport:
    """The start-up report of an online run (``relax.algorithms.cli.report``)."""
    train = data.train.stats
    pad = padded_length(data.train, data.data_cfg)
    longest = max((len(e.ids) for e in data.train.examples), default=0)
    padding = (
        f"every batch padded to {pad} prompt tokens (the bucket of the longest kept prompt, {longest}): "
        "one compiled step"
        if pad is not None
        else "each batch padded to its own bucket (--pad-to batch): "
        + ", ".join(map(str, batch_lengths(data.train, data.data_cfg)))
        + " tokens (the kept prompts' buckets), one compiled step each"
    )
    held_out = (
        prompt_lines(data.held_out.stats, "held-out")
        if data.held_out is not None
        else ("nothing held out",)
    )
    lines = [
        *prompt_lines(train, "training"),
        *held_out,
        padding,
        f"{cfg.batch_size} prompts x {algo.generation.num_generations} completions per step",
    ]
    if data.images is not None:  # make_packing leaves image batches padded
        lines.append("image prompts: the update's forwards run on padded rows (not packed)")
        lines.append(tower_line(cfg.train_vision, cfg.lora))
    elif algo.describe_update is not None:
        lines.append(algo.describe_update(data.model, parts.passes))
    lines += _sampler_lines(algo.generation, parts.off_policy)
    if "code_exec" in cfg.reward:
        lines.append(describe_sandbox(cfg.sandbox))
    return run_report(
        cfg,
        data.model,
        lines,
        mesh=mesh,
        extra=[
            (
                "tokens",
                token_lines(
                    data.tokenizer,
                    parts.eos_ids,
                    algo.generation.stop_strings,
                    algo.generation.max_new_tokens,
                ),
            ),
            ("first prompt", first_prompt_lines(train.first_prompt)),
        ],
    )


def _sampler_lines(generation: GenerationConfig, correction: OffPolicyConfig | None) -> list[str]:
    """The start-up report's lines on the sampler's precision and the behaviour correction."""
    lines = []
    if generation.quantized:
        lines.append(
            f"sampler weights: {generation.sampler_precision}, weight-only per output channel "
            "(qwix), prefill and decode; the trainer keeps the model's: every batch off-policy"
        )
    if correction is not None:
        lines.append(
            f"behaviour correction: {correction.kind}, {correction.level} level"
            + (f", cap {correction.cap:g}" if correction.kind in ("tis", "mis") else "")
            + (f", lower {correction.lower_bound:g}" if correction.kind == "mis" else "")
            + " (relax.objectives.off_policy; proximal policy: the trainer's log-probs)"
        )
    return lines


def _evaluator(cfg: OnlineRunConfig, algo: OnlineAlgorithm, data: RunData, parts: StepParts, log):
    """``run_eval(state, step, logger) -> metrics``: the policy's held-out evaluation, logged at
    ``step`` (image prompts' inputs computed once when the vision tower is frozen, at each
    evaluation by the state's tower when it trains)."""
    eval_batch = data.eval_batch
    frozen = (
        None
        if eval_batch is None or cfg.tower_trains
        else data.encode(data.model, eval_batch, shared=True)
    )

    def run_eval(state, step: int, logger: MetricsLogger) -> dict:
        if eval_batch is None:
            return {}
        t0 = time.perf_counter()
        images = frozen
        if state.vision is not None and eval_batch.images is not None:
            images = data.encode(data.model, eval_batch, shared=True, vision=state.vision)
        metrics = evaluate(
            state.policy,
            eval_batch,
            reward_fns=parts.reward_fns,
            decode=parts.decode,
            eos_ids=parts.eos_ids,
            pad_id=parts.pad_id,
            max_new_tokens=algo.generation.max_new_tokens,
            key=jax.random.fold_in(jax.random.key(cfg.seed), EVAL_STREAM),
            cfg=cfg.eval,
            answer_field=cfg.answer_field,
            timeout_s=cfg.reward_timeout_s,
            stop_strings=algo.generation.stop_strings,
            images=images,
        )
        logger.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        log(
            f"eval @ step {step} ({time.perf_counter() - t0:.1f}s): "
            + ", ".join(
                f"{k} {v:.3f}" for k, v in metrics.items() if "/" not in k or k.startswith("greedy")
            )
        )
        return metrics

    return run_eval


def _compiled_ahead(
    cfg: OnlineRunConfig, algo: OnlineAlgorithm, data: RunData, parts: StepParts, step, state
) -> CompiledAhead:
    """Every program of the run's ``step`` (for each length a batch can be padded to) and of its
    held-out evaluation, compiled for ``state`` (``relax.algorithms.online.ahead``)."""
    t0 = time.perf_counter()
    lowerings, not_ahead = [], []
    if parts.partial is None:
        lowerings += step_lowerings(
            step,
            algo.make_step(stand_in(parts)),
            state,
            batch_lengths(data.train, data.data_cfg),
            batch_size=cfg.batch_size,
            answer_field=cfg.answer_field,
            pipelined=parts.pipelined,
            images=None if data.images is None else data.encoded_shape,
        )
    else:
        not_ahead.append(
            "the step's programs compile when first called: partial rollouts (--async.partial "
            f"{cfg.async_.partial}) sample in a host stage"
        )
    if data.images is not None:
        not_ahead.append(
            "image prompts' encode (its shapes follow each batch's images) and the held-out "
            "evaluation's samplers compile when first called"
        )
    elif data.eval_batch is not None:
        calls = sampler_calls(
            data.eval_batch,
            cfg.eval,
            eos_ids=parts.eos_ids,
            pad_id=parts.pad_id,
            max_new_tokens=algo.generation.max_new_tokens,
        )
        key = jax.random.fold_in(jax.random.key(cfg.seed), EVAL_STREAM)
        lowerings += eval_lowerings(state.policy, calls, key)
    return compile_ahead(lowerings, workers=default_workers(), not_ahead=not_ahead, t_start=t0)


def _prepare(
    cfg: OnlineRunConfig,
    algo: OnlineAlgorithm,
    data: RunData,
    parts: StepParts,
    step,
    report: StartupReport,
    log,
):
    """The run's ``Trainer.prepare``: its programs compiled ahead (``--compile-ahead``), the
    start-up report's last section, "compiled ahead", printed and written, then the run stopped
    if a program cannot fit its devices' free memory (``CompiledAhead.check_fit``)."""

    def prepare(state, run_dir: Path) -> None:
        ahead = None
        if cfg.compile_ahead and cfg.tower_trains:
            lines = (
                "off with a trained tower: the step's programs take each batch's images and "
                "compile when first called, once per image shape",
            )
        elif cfg.compile_ahead:
            ahead = _compiled_ahead(cfg, algo, data, parts, step, state)
            lines = ahead.lines()
        else:
            lines = (
                "off (--no-compile-ahead): each program compiles when the step first calls it",
            )
        publish(lines, ahead, report, run_dir, log, shrink_hint(algo.name))

    return prepare


def _host_metrics(
    cfg: OnlineRunConfig, algo: OnlineAlgorithm, over_budget: int, reward_fns=(), batches=None
):
    """The host's metrics of an update; a curriculum (``RisingCurriculum`` batches) reports the
    level the update trained on and observes its mean reward."""
    curriculum = batches if isinstance(batches, RisingCurriculum) else None

    def host_metrics(out: WithHost, metrics: dict) -> dict:
        level = {}
        if curriculum is not None:
            level = {"curriculum/level": float(curriculum.level)}
            curriculum.observe(metrics["reward"])
        # from the global mean: on several processes ``lengths`` is not addressable whole
        num_tokens = metrics["completion_length"] * cfg.batch_size * algo.generation.num_generations
        return {
            "tokens_per_s": num_tokens / metrics["time/step"],
            "prompts_over_budget": float(over_budget),
            "reward_errors": float(
                sum(out.host.reward_info.get(k, 0) for k in ("errors", "timeouts", "crashes"))
            ),
            **judge_metrics(reward_fns),  # a generative judge's last call
            **(out.host.partial or {}),
            **level,
        }

    return host_metrics


def _partial_rollouts(cfg: OnlineRunConfig, algo: OnlineAlgorithm, batches, eos_ids, pad_id: int):
    """``--async.partial K``: the data iterator wrapped by the batches in progress
    (``relax.rollout.partial``; they sample where the sampler's weights are, on one device, a
    mesh or several processes), or None (K = 1)."""
    if cfg.async_.partial == 1:
        return None

    def to_prompts(pb):
        return (
            pb.prompt_ids,
            pb.prompt_mask,
            HostRecord(
                prompts=list(pb.prompts), fields={cfg.answer_field: list(pb.answers), **pb.fields}
            ),
        )

    return PartialRollouts(
        batches,
        to_prompts,
        algo.generation.rollout(eos_ids=eos_ids, pad_id=pad_id),
        cfg.async_.partial,
        encode=lambda r: {"prompts": r.prompts, "fields": r.fields},
        decode=lambda d: HostRecord(prompts=d["prompts"], fields=d["fields"]),
    )


def _make_batch(cfg: OnlineRunConfig, data: RunData, *, features: bool = True):
    """``make_batch(prompt_batch) -> WithHost``: the step's input, its prompts the numpy arrays
    the data gives (the step's first program, or a runner on a mesh, puts them on the devices:
    ``jnp.asarray`` would compile a program for each new shape); image prompts' inputs computed
    here, the frozen vision tower run once per image (``RunData.encode``); with a trained tower
    they are the reference's (``features=False``: none reads them, they stay zero), and the
    images ride along for the state's tower (``relax.algorithms.online.vision``)."""

    def make_batch(pb) -> WithHost:
        return step_input(
            pb.prompt_ids,
            pb.prompt_mask,
            pb.prompts,
            {cfg.answer_field: pb.answers, **pb.fields},
            images=data.encode(data.model, pb, features=features),
            pixels=batch_pixels(data, pb) if cfg.tower_trains else None,
        )

    return make_batch


def start_run(cfg: RunConfig, name: str):
    """``(run_dir, log)``: the run directory (created) and a logger that prints on process 0 only;
    the run's first line names the algorithm, jax and the devices."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log = print if is_main_process() else (lambda *a, **k: None)
    log(
        f"relax {name.upper()} | jax {jax.__version__} | {jax.device_count()} {jax.devices()[0].platform} device(s) "
        f"| run dir {run_dir}"
    )
    return run_dir, log


def run_meshes(cfg: ModelRunConfig, log) -> tuple[Mesh | None, Mesh | None]:
    """The run's ``(trainer, sampler)`` meshes (``--parallel.*``; None: one device), checked
    against ``--batch-size`` (its rows split over the batch axes) and logged."""
    mesh, sampler_mesh = cfg.parallel.meshes()
    check_batch(cfg.batch_size, mesh)
    check_batch(cfg.batch_size, sampler_mesh)
    if mesh is not None:
        log(
            f"mesh {dict(mesh.shape)}"
            + (f", sampler mesh {dict(sampler_mesh.shape)}" if sampler_mesh else "")
            + f" | {jax.process_count()} process(es)"
        )
    return mesh, sampler_mesh


def _check_images(cfg: OnlineRunConfig, algo: OnlineAlgorithm) -> None:
    """Image prompts train where they are built: GRPO and PPO, whole rollouts, on one device or
    the trainer mesh (no separate sampler devices)."""
    if cfg.image_field is None:
        return
    if algo.name not in ("grpo", "ppo"):
        raise ValueError(
            f"--image-field: {algo.name} trains on text prompts only (GRPO and PPO take images)"
        )
    if cfg.parallel.sampler_devices:
        raise ValueError(
            "--image-field: image prompts sample on the trainer's devices (--parallel.mesh), not "
            "on separate ones (drop --parallel.sampler-devices)"
        )
    if cfg.async_.partial > 1:
        raise ValueError("--image-field: partial rollouts (--async.partial) take text prompts only")
    if cfg.tower_trains:
        _check_train_vision(cfg, algo)


def _check_train_vision(cfg: OnlineRunConfig, algo: OnlineAlgorithm) -> None:
    """A trained tower (``relax.algorithms.online.vision``): GRPO and PPO, synchronous."""
    if algo.name not in ("grpo", "ppo"):
        raise ValueError(
            f"--train-vision / --lora.vision: GRPO and PPO train the vision tower; {algo.name} "
            "keeps it frozen"
        )
    if cfg.async_.staleness:
        raise ValueError(
            "--train-vision / --lora.vision: the sampler reads the trained tower of the same "
            "step; drop --async.staleness"
        )


def run_online(cfg: OnlineRunConfig, algo: OnlineAlgorithm) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    _check_images(cfg, algo)
    cfg.parallel.initialize()  # multi-host: before anything touches a device
    run_dir, log = start_run(cfg, algo.name)
    t_start = time.perf_counter()
    cfg, env_rewards = verifiers_setup(cfg, run_dir, log)  # --env verifiers:<id>
    cfg = reasoning_gym_setup(cfg, run_dir, log)  # --model with --task reasoning_gym:<names>
    cfg = visual_setup(cfg, run_dir, log)
    mesh, sampler_mesh = run_meshes(cfg, log)
    data = load_run_data(cfg, run_dir, mesh is not None, log)
    if mesh is not None:  # the frozen vision part, laid out once by the sharding rules
        data = data.on_mesh(mesh)
    tokenizer, model = data.tokenizer, data.model
    reward_fns = reward_functions(cfg, mesh) + env_rewards
    pool = reward_pool(cfg, reward_fns)
    with pool if pool is not None else contextlib.nullcontext():  # the workers end with the run
        eos_ids = tuple(sorted({*model.config.eos_ids, *tokenizer.eos_token_ids}))
        batches = training_batches(cfg, data)  # a RisingCurriculum on a curriculum
        partial = _partial_rollouts(cfg, algo, batches, eos_ids, tokenizer.pad_token_id)
        parts = StepParts(
            reward_fns=reward_fns,
            decode=text_decoder(tokenizer),
            eos_ids=eos_ids,
            pad_id=tokenizer.pad_token_id,
            passes=choose_passes(batch_shards=1 if mesh is None else batch_shards(mesh)),
            pool=pool,
            partial=partial,
        )
        parts = run_parts(cfg, parts, algo.generation)
        report = _report(cfg, algo, data, parts, mesh)
        log(report.text())
        with on_host_memory(mesh is not None):
            trained = {"vision": trained_tower(cfg, data.vision)} if cfg.tower_trains else {}
            state = algo.make_state(model, jax.random.key(cfg.seed), **trained)
        frozen_read = not cfg.tower_trains or initial_features_read(state)
        step_fn = algo.make_step(parts)
        if mesh is not None:  # every process: the same state, laid out on the (global) mesh
            step_fn = ShardedStep(
                step_fn,
                state,
                mesh,
                sampler_mesh=sampler_mesh,
                offload_reference=cfg.parallel.offload_reference,
            )
            state = step_fn.place(state)
            del model
        over_budget = len(data.train.stats.over_budget)
        trainer = Trainer(
            name=algo.name,
            step=step_fn,
            batches=batches if partial is None else partial,
            make_batch=(
                _make_batch(cfg, data, features=frozen_read)
                if partial is None
                else (lambda request: request)
            ),
            host_metrics=_host_metrics(cfg, algo, over_budget, reward_fns, batches),
            evaluate=_evaluator(cfg, algo, data, parts, log),
            export=exporter(tokenizer, base_path(cfg, run_dir), data.vision),
            bar_keys=BAR_KEYS,
            asynchronous=cfg.async_,
            on_start=report.write,
            prepare=_prepare(cfg, algo, data, parts, step_fn, report, log),
            info={
                "data": {
                    "train": data.train.stats.summary(),
                    "held_out": None if data.held_out is None else data.held_out.stats.summary(),
                },
                "prompts_over_budget": over_budget,
            },
        )
        _, summary = run_loop(cfg, trainer, state, log, t_start=t_start)
    return summary
