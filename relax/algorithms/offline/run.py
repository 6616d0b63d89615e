"""Offline runs (SFT, DPO, ORPO, KTO, reward models, distillation): a fixed dataset instead of
rollouts. Model, tokenizer and data (the built-in task or ``--model``/``--data``), the batch
pipeline, held-out evaluation and export; the loop itself is ``relax.train.run.run_loop``, the
one GRPO and PPO use (checkpoints, exact resume, logs, health guards, SIGTERM).

An algorithm supplies an ``OfflineAlgorithm``: how to build its state and step, how to turn data
rows into examples (errors name the file, row and field) and a batch of examples into
fixed-shape arrays (one compile), how to evaluate on held-out examples, and the synthetic data
of its built-in task.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import grain
import jax
import jax.numpy as jnp

from relax.algorithms.cli.report import first_row_lines, run_report
from relax.algorithms.offline.ahead import prepare_offline
from relax.algorithms.offline.images import Encoder, ImageTrainer
from relax.algorithms.online.config import TaskRunConfig, tower_line
from relax.algorithms.online.run import run_meshes, start_run
from relax.algorithms.online.setup import (
    base_path,
    builtin_setup,
    exporter,
    image_prompts,
    load_model,
    trained_tower,
    with_lora,
)
from relax.data.files import Record, read_records
from relax.data.image_prompts import ImagePrompts
from relax.data.prompts import DataConfig, prompt_batch, train_eval_split
from relax.eval.evaluate import EvalConfig, evaluate
from relax.models.adapters.tower import merged_module
from relax.models.vision.families import (
    VisionLanguage,
    encode_images,
    pixels_of,
)
from relax.parallel import ShardedStep, ShardingError, batch_shards
from relax.parallel.distributed import on_host_memory
from relax.passes import Passes, choose_passes
from relax.rewards.builtin import make_exact_match
from relax.rewards.functions import RewardFunction
from relax.tasks import reverse
from relax.text import TextTokenizer, load_tokenizer
from relax.train.logs import MetricsLogger
from relax.train.run import Trainer, run_loop
from relax.train.vision_tower import initial_features_read, with_trained_vision

MAX_EVAL_PROMPT = 512


@dataclasses.dataclass(frozen=True)
class OfflineRunConfig(TaskRunConfig):
    """An offline run on a dataset (every ``TaskRunConfig`` flag, plus how many held-out rows
    are evaluated)."""

    eval_fraction: float = 0.05
    eval_max_examples: int | None = 200
    image_field: str | None = None
    """A vision-language --model (Gemma 3, Qwen2.5-VL; SFT and the DPO family): the column of
    each row's image or list of images (a path relative to the data file, bytes or base64),
    placed by the model's chat template; each prompt's images are encoded once (frozen tower)."""
    bad_images: Literal["reject", "drop"] = "reject"
    """A row whose image is missing, unreadable or over the limits: an error naming the file, row
    and field, or the row dropped (counted and named at start-up)."""
    compile_ahead: bool = True
    """Compile the step's programs before the first step (every batch has one shape), listed with
    their compile seconds and what each allocates per device in the start-up report, and stop
    there if one cannot fit the devices' free memory; off: each compiles when first called."""

    def __post_init__(self):
        super().__post_init__()
        if self.model is None and self.task != "reverse":
            raise ValueError(
                f"--task {self.task}: the offline trainers' built-in task is reverse "
                "(code and math are for GRPO and PPO)"
            )
        if self.image_field is not None and self.model is None:
            raise ValueError(
                f"--image-field {self.image_field!r} needs a vision-language --model "
                "(the built-in task is text)"
            )
        if self.tower_trains and self.image_field is None:
            raise ValueError(
                "--train-vision / --lora.vision train a vision-language model's tower: give --image-field"
            )


@dataclasses.dataclass(frozen=True)
class OfflineAlgorithm:
    """What an offline trainer brings to ``run_offline``.

    ``make_state(model, key)``: its ``TrainState``. ``make_step(passes, tokenizer)``: its step (a stage
    whose output is a ``relax.train.update.Updated``: the batch, ``metrics`` and ``health``).
    ``encode(records, tokenizer)``: the training examples (errors name file, row and field);
    ``encode_eval(records, tokenizer)``: what ``evaluate`` reads, once (default: ``encode``).
    ``collate(examples, pad_id)``: a batch of fixed-shape numpy arrays, the algorithm's batch type
    (an ``equinox.Module``, e.g. ``relax.data.pairs.PairBatch``). ``evaluate(state, examples,
    tokenizer)``: held-out metrics (of ``state.policy``; a distillation reads its teacher,
    ``state.ref``). ``builtin_data(task, directory, tokenizer)``: the built-in task's ``(train,
    eval)`` jsonl paths. ``host_metrics(out, metrics)``: extra host-side metrics (e.g. tokens/s) from
    the step's output. ``export(policy, directory, tokenizer)``: an HF directory (default: the
    policy as a causal LM). ``longest(n)``: a collated batch of ``n`` items of the largest shape the
    config admits (what ``relax.plan`` compiles the step with, no data or tokenizer needed; None:
    not plannable yet). ``images(image_prompts)``: the trainer on rows with images
    (``relax.algorithms.offline.images.ImageTrainer``; None: it refuses ``--image-field``)."""

    name: str
    make_state: Callable[[Any, jax.Array], Any]
    make_step: Callable[[Passes, TextTokenizer], Any]
    encode: Callable[[Sequence[Record], TextTokenizer], list]
    collate: Callable[[list, int], Any]
    evaluate: Callable[[Any, Any, TextTokenizer], dict]
    builtin_data: Callable[[reverse.ReverseTask, Path, TextTokenizer], tuple[str, str]]
    encode_eval: Callable[[Sequence[Record], TextTokenizer], Any] | None = None
    prepare: Callable[[Any, list, Any, list[str], TextTokenizer], tuple[list, Any]] | None = None
    host_metrics: Callable[[Any, dict], dict] = lambda out, metrics: {}
    export: Callable[[Any, Path, TextTokenizer], Path] | None = None
    bar_keys: Sequence[tuple[str, str]] = (("loss", "loss"),)
    longest: Callable[[int], Any] | None = None
    images: Callable[[ImagePrompts], ImageTrainer] | None = None


def batch_iterator(
    examples: list,
    batch_size: int,
    seed: int,
    collate: Callable[[list], Any],
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """Shuffled (by ``seed``), repeated batches of ``collate``d examples; ``get_state()`` /
    ``set_state()`` resume exactly (checkpointed with the train state). Of several processes
    each collates its own ``batch_size / process_count`` of a step's examples (every process
    shuffles alike), which ``relax.parallel`` assembles into the global batch."""
    if len(examples) < batch_size:
        raise ValueError(f"{len(examples)} training examples make no full batch of {batch_size}")
    if batch_size % process_count:
        raise ValueError(f"--batch-size={batch_size} does not split over {process_count} processes")
    local = batch_size // process_count

    def mine(batch: list) -> Any:
        return collate(batch[process_index * local : (process_index + 1) * local])

    ds = grain.MapDataset.source(examples).shuffle(seed=seed).repeat()
    ds = ds.batch(batch_size, drop_remainder=True, batch_fn=mine)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=1)))


def _model_and_rows(cfg: OfflineRunConfig, algo: OfflineAlgorithm, run_dir: Path, log):
    """``(tokenizer, model, vision, train rows, held-out rows, data paths)``: the built-in task or
    --model/--data (``vision``: a vision-language model's, None for a text model)."""
    vision = None
    if cfg.model is None:
        tokenizer, model, _, _ = builtin_setup(cfg, run_dir, log)
        data, eval_data = algo.builtin_data(cfg.reverse, run_dir / "task", tokenizer)
    else:
        tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
        model, vision = load_model(cfg)
        data, eval_data = cfg.data, cfg.eval_data
    model = with_lora(cfg, model)
    rows = read_records(data)
    if eval_data is None:
        train, held_out = train_eval_split(rows, cfg.eval_fraction, cfg.seed)
    else:
        train, held_out = rows, read_records(eval_data)
    if cfg.eval_max_examples is not None:
        held_out = held_out[: cfg.eval_max_examples]
    paths = [str(d) for d in (data, eval_data) if d is not None]
    return tokenizer, model, vision, train, held_out, paths


def _check_images(cfg: OfflineRunConfig, algo: OfflineAlgorithm, mesh) -> None:
    """Rows with images train where they are built: SFT and the DPO family, on one device."""
    if cfg.image_field is None:
        return
    if algo.images is None:
        raise ValueError(
            f"--image-field: {algo.name} trains on text only (SFT and the DPO family take images)"
        )
    if mesh is not None:
        raise ValueError("--image-field: rows with images train on one device (no --parallel.*)")
    if cfg.tower_trains and algo.images is None:  # SFT and the DPO family have image trainers
        raise ValueError(f"--train-vision / --lora.vision: {algo.name} trains on text only")


def _with_images(
    cfg: OfflineRunConfig, algo: OfflineAlgorithm, vision: VisionLanguage | None, model
) -> tuple[OfflineAlgorithm, Callable[[Any], Any] | None, tuple[str, ...]]:
    """``(algo, make_batch_for, notes)``: for ``--image-field``, the algorithm's image trainer in
    place of its text one, ``make_batch_for(features)`` the step's batches made with the frozen
    vision tower run once per prompt image (a trained tower's run: also their images, and with
    ``features=False`` the tower not run, when none but the trained tower reads them; the
    held-out evaluation encodes with the state's tower), and its report notes; else
    ``(algo, None, ())``."""
    if cfg.image_field is None:
        return algo, None, ()
    trainer = algo.images(image_prompts(cfg, vision))

    def encoder_of(part, features: bool = True) -> Encoder:
        tower = vision if part is None else vision._replace(vision=merged_module(part))
        return lambda ids, mask, images: encode_images(
            tower, model, ids, mask, images, features=features
        )

    def make_batch_for(features: bool):
        """The step's batches: ``features=False`` when none but the trained tower reads them."""
        encoder = encoder_of(None, features)

        def make_batch(batch):
            rows = trainer.attach(batch, encoder)
            pixels = pixels_of(batch.images) if cfg.tower_trains else None
            return dataclasses.replace(rows, pixels=pixels) if cfg.tower_trains else rows

        return make_batch

    def evaluate(state, held, tokenizer):
        return trainer.evaluate(state, held, tokenizer, encoder_of(state.vision))

    algo = dataclasses.replace(
        algo,
        encode=lambda rows, tokenizer: trainer.encode(rows, tokenizer),
        encode_eval=lambda rows, tokenizer: (rows, trainer.encode(rows, tokenizer)),
        collate=trainer.collate,
        make_step=trainer.make_step,
        evaluate=evaluate,
        prepare=None,
    )
    notes = trainer.notes + (tower_line(cfg.train_vision, cfg.lora),)
    return algo, make_batch_for, notes


def _evaluator(algo: OfflineAlgorithm, held_out, rows: int, tokenizer: TextTokenizer, log):
    """``run_eval(state, step, logger)``: ``algo.evaluate`` on the encoded held-out data (nothing
    when there are no held-out ``rows``), logged at ``step``."""

    def run_eval(state, step: int, logger: MetricsLogger) -> dict:
        if not rows:
            return {}
        t0 = time.perf_counter()
        metrics = {k: float(v) for k, v in algo.evaluate(state, held_out, tokenizer).items()}
        logger.log(step, {f"eval/{k}": v for k, v in metrics.items()})
        log(
            f"eval @ step {step} ({time.perf_counter() - t0:.1f}s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        )
        return metrics

    return run_eval


def _sharded(cfg: OfflineRunConfig, step, state, mesh, sampler_mesh):
    """``(step, state)`` on the meshes (``relax.parallel.ShardedStep``); a sampler mesh only for a
    step that samples (its stages placed on the sampler: distillation's on-policy ``sample``)."""
    if sampler_mesh is not None and not any(s.placement == "sampler" for s in step.leaves):
        raise ShardingError(
            "--parallel.sampler-devices: this trainer samples nothing; drop it (every device "
            "trains on --parallel.mesh)"
        )
    step = ShardedStep(
        step,
        state,
        mesh,
        sampler_mesh=sampler_mesh,
        offload_reference=cfg.parallel.offload_reference,
    )
    return step, step.place(state)


def run_offline(cfg: OfflineRunConfig, algo: OfflineAlgorithm) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``. With
    ``--parallel.*`` the step runs on the meshes, its batch rows split over the batch axes and
    the state laid out by the sharding rules, as GRPO's (``relax.parallel``)."""
    cfg.parallel.initialize()  # multi-host: before anything touches a device
    run_dir, log = start_run(cfg, algo.name)
    t_start = time.perf_counter()
    mesh, sampler_mesh = run_meshes(cfg, log)
    _check_images(cfg, algo, mesh)
    with on_host_memory(mesh is not None):
        tokenizer, model, vision, train_rows, held_out_rows, paths = _model_and_rows(
            cfg, algo, run_dir, log
        )
    algo, image_batch_for, notes = _with_images(cfg, algo, vision, model)
    train = algo.encode(train_rows, tokenizer)
    encode_eval = algo.encode if algo.encode_eval is None else algo.encode_eval
    held_out = (
        encode_eval(held_out_rows, tokenizer) if held_out_rows else None
    )  # None: nothing held out
    if image_batch_for is not None:  # ImageRows: the examples, the rows dropped for a bad image
        notes = (
            (train.summary("training"),)
            + ((held_out[1].summary("held-out"),) if held_out is not None else ())
            + notes
        )
        train = train.examples
        held_out = None if held_out is None else (held_out[0], held_out[1].examples)
    if algo.prepare is not None:
        train, held_out = algo.prepare(model, train, held_out, paths, tokenizer)
    report = run_report(
        cfg,
        model,
        [
            f"{len(train_rows)} training rows ({len(train)} batch items) from "
            f"{paths[0]}, {len(held_out_rows)} held out",
            f"{cfg.batch_size} batch items per step",
            *notes,
        ],
        extra=[
            ("first training row", first_row_lines(train_rows[0].record if train_rows else None))
        ],
    )
    log(report.text())
    with on_host_memory(mesh is not None):
        state = algo.make_state(model, jax.random.key(cfg.seed))
    if cfg.tower_trains:  # a copy: the run's stays the initial tower
        state = with_trained_vision(state, trained_tower(cfg, vision))
    image_batch = None
    if image_batch_for is not None:  # the data runs the tower when another model reads it
        image_batch = image_batch_for(not cfg.tower_trains or initial_features_read(state))
    step = algo.make_step(
        choose_passes(batch_shards=1 if mesh is None else batch_shards(mesh)), tokenizer
    )
    if mesh is not None:
        step, state = _sharded(cfg, step, state, mesh, sampler_mesh)
        del model
    export = (
        exporter(tokenizer, base_path(cfg, run_dir), vision)
        if algo.export is None
        else (lambda policy, d: algo.export(policy, d, tokenizer))
    )
    batches = functools.partial(
        batch_iterator,
        train,
        cfg.batch_size,
        cfg.seed,
        functools.partial(algo.collate, pad_id=tokenizer.pad_token_id),
    )
    # on a mesh the step places this process's rows itself (relax.parallel.place_batch)
    make_batch = (
        image_batch
        if image_batch is not None
        else (lambda b: b)
        if mesh is not None
        else (lambda b: jax.tree.map(jnp.asarray, b))
    )
    trainer = Trainer(
        name=algo.name,
        step=step,
        batches=batches(process_index=jax.process_index(), process_count=jax.process_count()),
        make_batch=make_batch,
        host_metrics=algo.host_metrics,
        evaluate=_evaluator(algo, held_out, len(held_out_rows), tokenizer, log),
        export=export,
        bar_keys=algo.bar_keys,
        on_start=report.write,
        prepare=prepare_offline(
            algo.name,
            step,
            # the global batch's shapes (a step's programs take all processes' rows), from an
            # iterator of its own: the run's is not advanced
            lambda: make_batch(next(batches())),
            report,
            log,
            enabled=cfg.compile_ahead,
            images=image_batch is not None,
            held_out=held_out is not None,
        ),
        info={
            "data": {
                "train_rows": len(train_rows),
                "batch_items": len(train),
                "held_out_rows": len(held_out_rows),
            }
        },
    )
    _, summary = run_loop(cfg, trainer, state, log, t_start=t_start)
    return summary


def greedy_accuracy(
    policy,
    tokenizer: TextTokenizer,
    records: Sequence[Record],
    *,
    max_new_tokens: int,
    prompt_field: str = "prompt",
    answer_field: str = "answer",
    seed: int = 0,
) -> float:
    """Held-out greedy exact-match accuracy: the share of ``records`` whose greedy completion is
    their ``answer_field`` (the built-in tasks' figure; relax.eval.evaluate with exact_match)."""
    cfg = DataConfig(
        path=(),
        batch_size=1,
        max_prompt_tokens=MAX_EVAL_PROMPT,
        prompt_field=prompt_field,
        answer_field=answer_field,
        data_source_field=None,
        prompt_buckets=(16, MAX_EVAL_PROMPT),
    )
    batch = prompt_batch(list(records), cfg, tokenizer)
    eos_ids = tuple(sorted({*policy.config.eos_ids, *tokenizer.eos_token_ids}))
    decode = lambda t, m: [
        s.strip() for s in tokenizer.decode_batch(t, m, skip_special_tokens=True)
    ]  # noqa: E731
    metrics = evaluate(
        policy,
        batch,
        reward_fns=[RewardFunction(make_exact_match(answer_field), name="exact_match")],
        decode=decode,
        eos_ids=eos_ids,
        pad_id=tokenizer.pad_token_id,
        max_new_tokens=max_new_tokens,
        key=jax.random.key(seed),
        cfg=EvalConfig(num_samples=1),
        answer_field=answer_field,
    )
    return metrics["greedy/accuracy"]


@dataclasses.dataclass(frozen=True)
class PairRunConfig(OfflineRunConfig):
    """An offline run on prompt/completion pairs or unpaired completions: their token budgets."""

    max_prompt_tokens: int = 256
    max_completion_tokens: int = 256
    truncate_prompt: bool = False
    """Cut prompts longer than --max-prompt-tokens from the left (default: an error naming the row)."""
