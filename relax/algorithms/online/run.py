"""Online RL runs on prompts, shared by GRPO and PPO: model, tokenizer and data (the built-in
task or ``--model``/``--data``), reward functions, held-out evaluation, HF export, meshes; the
loop itself is ``relax.train.run.run_loop``.

An algorithm supplies an ``OnlineAlgorithm``: its name, how to build its state from the loaded
model, how to build its step, and the sampling sizes evaluation needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import tyro

from relax.algorithms.cli.report import (
    StartupReport,
    first_prompt_lines,
    prompt_lines,
    run_report,
    token_lines,
)
from relax.algorithms.online.batch import HostRecord, step_input
from relax.algorithms.online.step import StepParts
from relax.compose import WithHost
from relax.data.prompts import (
    DataConfig,
    PreparedPrompts,
    batch_of,
    eval_records,
    padded_length,
    prepare_prompts,
    prompt_iterator,
    read_records,
    read_splits,
)
from relax.eval.evaluate import EvalConfig, evaluate
from relax.models.adapters.operations import add_lora, has_lora, merge_lora
from relax.models.adapters.peft import fused_adapter_error, save_adapter
from relax.models.config.model import DTYPES
from relax.models.heads.reward_model import load_reward_model
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.models.layers.lora import LoRAConfig
from relax.objectives.reference import ReferenceConfig
from relax.parallel import ParallelConfig, ShardedStep, batch_shards, check_batch
from relax.passes import choose_passes
from relax.rewards.builtin import get_reward, make_exact_match, make_numeric_match
from relax.rewards.code_exec import CodeExec
from relax.rewards.functions import RewardFunction
from relax.rewards.math_answers import MathVerify
from relax.rewards.model import TextRewardModel
from relax.rewards.pool import PoolConfig, RewardPool
from relax.rewards.sandbox import SandboxConfig
from relax.rollout.generation import GenerationConfig
from relax.rollout.partial import PartialRollouts
from relax.tasks import TASKS, reverse
from relax.tasks import code as code_task
from relax.tasks import math as math_task
from relax.tasks.base import prepare
from relax.text import TextTokenizer, load_tokenizer
from relax.train.logs import MetricsLogger, is_main_process
from relax.train.pipeline import AsyncConfig
from relax.train.run import RunConfig, Trainer, run_loop

BAR_KEYS = (
    ("reward", "reward"),
    ("kl", "kl"),
    ("completion_length", "len"),
    ("tokens_per_s", "tok/s"),
)


@dataclasses.dataclass(frozen=True)
class ModelRunConfig(RunConfig):
    """What every run on a model and a dataset has (online and offline): the model, its tokenizer,
    the data and its held-out part, dtypes, the batch size. Without ``model`` the built-in offline
    task (``task``) is used."""

    model: str | None = None
    """Hugging Face model directory (config.json + safetensors; its tokenizer and chat template too)."""
    tokenizer: str | None = None
    """Another tokenizer than --model's: a directory, a tokenizer.json or a sentencepiece .model."""
    data: str | None = None
    """Training rows: .jsonl / .parquet file or directory (required with --model)."""
    eval_data: str | None = None
    """Held-out rows; without it ``eval_fraction`` of --data is held out."""
    eval_fraction: float = 0.0
    chat_template: Literal["auto", "always", "never"] = "auto"
    """auto: string prompts go through the model's chat template when it has one (a chat model);
    always / never. A prompt that is a list of chat messages always goes through it."""
    batch_size: int = 16
    """Rows per step: prompts (each gets G completions), examples, packed rows or pairs."""
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (``--lora.rank 8``): only they train, the KL reference is the base model and
    checkpoints hold only the adapters; rank 0 (the default): the whole model trains."""
    task: Literal["reverse", "code", "math"] = "reverse"
    """The built-in task without --model: reverse, or (GRPO / PPO) code or math."""
    reverse: reverse.ReverseTask = reverse.ReverseTask()
    code: code_task.CodeTask = code_task.CodeTask()
    math: math_task.MathTask = math_task.MathTask()

    @property
    def task_config(self):
        """The options of the built-in task ``task``."""
        return {"reverse": self.reverse, "code": self.code, "math": self.math}[self.task]

    def __post_init__(self):
        super().__post_init__()
        if self.model is not None and self.data is None:
            raise ValueError("--model needs --data")
        for name in (self.param_dtype, self.compute_dtype):
            if name not in DTYPES:
                raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if self.batch_size < 1:
            raise ValueError("--batch-size >= 1 is required")


@dataclasses.dataclass(frozen=True)
class OnlineRunConfig(ModelRunConfig):
    """An online RL run on prompts (every ``ModelRunConfig`` flag, plus prompts, rewards,
    evaluation sampling and meshes)."""

    prompt_field: str = "prompt"
    answer_field: str = "answer"
    data_source_field: str = "data_source"
    max_prompt_tokens: int = 512
    overlong: Literal["drop", "reject", "truncate"] = "drop"
    """A prompt over --max-prompt-tokens (counted, and named at start-up) is dropped, refused with an
    error naming its row, or cut to fit (a chat prompt keeps its header and system prompt whole)."""
    pad_to: Literal["data", "batch"] = "data"
    """Pad every batch to the bucket of the data's longest prompt (one compile), or each batch to
    its own (fewer pad tokens; one compile of the step per bucket met)."""
    system_prompt: str | None = None
    reward: tuple[str, ...] = ("exact_match",)
    """Built-in reward functions by name (exact_match, numeric_match, format_reward, math_verify, code_exec)."""
    reward_weights: tuple[float, ...] = ()
    """One weight per --reward (empty: all 1)."""
    reward_timeout_s: float | None = 60.0
    reward_on_error: str = "raise"
    """raise: stop naming the function and sample; missing: log, count, treat as missing."""
    reward_workers: int = 4
    """Host reward functions run in this many worker processes (``relax.rewards.pool``: a
    timeout per chunk, a crashed worker replaced, its samples missing or an error per
    --reward-on-error), overlapping the reference forward; 0: in the trainer process."""
    reward_chunk_size: int = 8
    """Samples per task sent to a reward worker."""
    tests_field: str = "tests"
    """code_exec: the column of each row's tests (asserts, or stdin/stdout pairs)."""
    sandbox: SandboxConfig = SandboxConfig()
    """code_exec: isolation and limits of each sandboxed run (``relax.rewards.sandbox``)."""
    reward_model: str | None = None
    """A reward-model directory (``<Family>ForSequenceClassification``): its score of each
    completion, with its own tokenizer, is the reward ``reward_model``."""
    reward_model_weight: float = 1.0
    eval: EvalConfig = EvalConfig()
    eval_max_prompts: int | None = None
    parallel: ParallelConfig = ParallelConfig()
    """Meshes and multi-host setup (``relax.parallel``): e.g. ``--parallel.mesh fsdp=-1``."""
    async_: Annotated[AsyncConfig, tyro.conf.arg(name="async")] = AsyncConfig()
    """Asynchronous RL (``relax.train.pipeline``): ``--async.staleness 1`` samples the next batch
    while the update runs, with an off-policy correction (``--async.correction.kind``)."""

    def __post_init__(self):
        super().__post_init__()
        if self.reward_workers < 0:
            raise ValueError(f"--reward-workers must be >= 0, got {self.reward_workers}")
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ValueError(
                f"{len(self.reward_weights)} --reward-weights for {len(self.reward)} --reward"
            )


def run_parts(cfg: OnlineRunConfig, parts: StepParts) -> StepParts:
    """``parts`` scored and scheduled as the run's flags say: ``--reward-on-error``,
    ``--reward-timeout-s``, and ``--async.*``'s off-policy correction (pipelined when the
    staleness is above 0)."""
    return dataclasses.replace(
        parts,
        on_error=cfg.reward_on_error,
        timeout_s=cfg.reward_timeout_s,
        off_policy=cfg.async_.off_policy,
        pipelined=cfg.async_.staleness > 0,
    )


@dataclasses.dataclass(frozen=True)
class OnlineAlgorithm:
    """``make_state(model, key)`` -> the algorithm's ``TrainState``; ``make_step(parts)`` -> its
    composed step; ``generation``, what it samples (G, the completion budget and stop strings for
    evaluation and tokens/s)."""

    name: str
    make_state: Callable[[Any, jax.Array], Any]
    make_step: Callable[[StepParts], Any]
    generation: GenerationConfig
    describe_update: Callable[[Any], str] | None = (
        None  # model -> a start-up report line (its layout)
    )


def builtin_setup(cfg: ModelRunConfig, run_dir: Path, log):
    """Task files, tokenizer and base model of the built-in task ``cfg.task`` (reused when present):
    ``(tokenizer, model, train path, held-out path)``."""
    tokenizer, model, _, _ = prepare(
        TASKS[cfg.task],
        cfg.task_config,
        run_dir,
        seed=cfg.seed,
        teacher=f"a noisy teacher of the {cfg.task} task",
        log=log,
    )
    return (
        tokenizer,
        model,
        str(run_dir / "task" / "train.jsonl"),
        str(run_dir / "task" / "eval.jsonl"),
    )


def reward_function(cfg: OnlineRunConfig, name: str):
    """The built-in reward ``name`` configured by the run's flags (answer / tests columns, sandbox)."""
    if name == "code_exec":
        return CodeExec(tests_field=cfg.tests_field, sandbox=cfg.sandbox)
    if name == "math_verify":
        return MathVerify(answer_field=cfg.answer_field)
    if name == "exact_match":
        return make_exact_match(cfg.answer_field)
    if name == "numeric_match":
        return make_numeric_match(cfg.answer_field)
    return get_reward(name)


def reward_columns(cfg: OnlineRunConfig) -> tuple[str, ...]:
    """The columns the built-in rewards read besides the prompt and the answer (which the data
    checks): ``code_exec``'s tests. Every row must have them, checked before any compute."""
    return (cfg.tests_field,) if "code_exec" in cfg.reward else ()


def reward_pool(cfg: OnlineRunConfig, reward_fns: list[RewardFunction]) -> RewardPool | None:
    """The worker pool of the run's host reward functions (``--reward-workers``; None for 0). A
    reward model scoring texts stays in the trainer process: it holds device arrays."""
    pooled = [f for f in reward_fns if not isinstance(f.fn, TextRewardModel)]
    if cfg.reward_workers == 0 or not pooled:
        return None
    return RewardPool(
        pooled,
        PoolConfig(
            num_workers=cfg.reward_workers,
            timeout_s=cfg.reward_timeout_s,
            chunk_size=cfg.reward_chunk_size,
        ),
    )


def reward_functions(cfg: OnlineRunConfig) -> list[RewardFunction]:
    """``--reward`` (with ``--reward-weights``) and ``--reward-model`` as weighted reward functions."""
    weights = cfg.reward_weights or (1.0,) * len(cfg.reward)
    fns = [
        RewardFunction(reward_function(cfg, n), name=n, weight=w)
        for n, w in zip(cfg.reward, weights)
    ]
    if cfg.reward_model is not None:
        rm = TextRewardModel(load_reward_model(cfg.reward_model), load_tokenizer(cfg.reward_model))
        fns.append(RewardFunction(rm, name="reward_model", weight=cfg.reward_model_weight))
    return fns


def _decoder(tokenizer: TextTokenizer):
    def decode(tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        return [
            text.strip() for text in tokenizer.decode_batch(tokens, mask, skip_special_tokens=True)
        ]

    return decode


def _on_host(enabled: bool):
    """Load / initialise the model in host memory when it is going to be sharded anyway (so a
    model larger than one accelerator never lands whole on device 0)."""
    if enabled and jax.devices()[0].platform != "cpu":
        try:
            return jax.default_device(jax.devices("cpu")[0])
        except RuntimeError:  # no CPU backend (JAX_PLATFORMS without cpu)
            pass
    return contextlib.nullcontext()


def exporter(tokenizer: TextTokenizer, base: str | None = None):
    """``export(policy, directory) -> directory``: weights, config, generation config, tokenizer
    files and chat template, a directory ``transformers`` loads (collective: every process calls it).
    A LoRA policy is exported merged (``W + s A B``), and its adapters alone in PEFT's format under
    ``directory/adapter`` (``base``: the base model's path, recorded in the adapter config) where
    that format can hold them: adapters on a family's fused tensors (Phi-3's ``qkv_proj``) have no
    PEFT form, and then only the merged model is written, with a warning saying why."""

    def export(policy, directory: Path) -> Path:
        policy = _host_policy(policy)
        if is_main_process():
            save_pretrained(merge_lora(policy), directory)
            tokenizer.save_pretrained(directory)
            if has_lora(policy):
                why = fused_adapter_error(policy.config.family, policy.layers.lora.weights())
                if why is None:
                    save_adapter(policy, Path(directory) / "adapter", base_model_name_or_path=base)
                else:
                    warnings.warn(
                        f"{directory}: the merged model is written, the adapters alone are not: {why}",
                        stacklevel=2,
                    )
        return directory

    return export


LORA_STREAM = 7  # the adapters' init key: fold_in(key(seed), LORA_STREAM)


def with_lora(cfg: ModelRunConfig, model):
    """``model`` with fresh adapters when ``cfg.lora.rank > 0``, else as is."""
    if not cfg.lora.enabled:
        return model
    return add_lora(model, cfg.lora, jax.random.fold_in(jax.random.key(cfg.seed), LORA_STREAM))


def check_lora_reference(model, reference: ReferenceConfig, needs_reference: bool) -> None:
    """With LoRA the KL reference is the base model, the policy with its adapters off: a static
    reference that costs nothing. The rules that move the reference (ema, periodic, mixup, prorl)
    would need a second set of adapters, and ema / mixup of the factors A and B are not the ema of
    the weights ``s A B`` (a product): they are refused."""
    if needs_reference and has_lora(model) and reference.kind != "static":
        raise ValueError(
            f"with LoRA the KL reference is the base model (kind 'static'); reference kind "
            f"{reference.kind!r} is not supported with adapters"
        )


def base_path(cfg: ModelRunConfig, run_dir: Path) -> str:
    """Where the run's base model lives: ``--model`` or the built-in task's ``run_dir/base_model``."""
    return str(run_dir / "base_model") if cfg.model is None else cfg.model


def _host_policy(policy):
    """The policy as host arrays on every process (gathered from all processes' shards)."""
    if jax.process_count() == 1:
        return policy
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(policy, tiled=True)


@dataclasses.dataclass(frozen=True)
class RunData:
    """An online run's tokenizer, model and prompts: the training rows prepared (formatted,
    tokenized, budget-checked) and the held-out ones as one batch (None: nothing held out)."""

    tokenizer: TextTokenizer
    model: Any
    data_cfg: DataConfig
    train: PreparedPrompts
    held_out: PreparedPrompts | None

    @property
    def eval_batch(self):
        return (
            None
            if self.held_out is None or not self.held_out.examples
            else batch_of(self.held_out, self.data_cfg, self.tokenizer.pad_token_id)
        )


def _model_and_data(cfg: OnlineRunConfig, run_dir: Path, on_host: bool, log) -> RunData:
    """The built-in task or --model/--data, loaded and prepared."""
    if cfg.model is None:
        tokenizer, model, data_path, eval_path = builtin_setup(cfg, run_dir, log)
    else:
        tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
        with _on_host(on_host):
            model = load_pretrained(
                cfg.model, dtype=DTYPES[cfg.compute_dtype], param_dtype=DTYPES[cfg.param_dtype]
            )
        data_path, eval_path = cfg.data, cfg.eval_data
    model = with_lora(cfg, model)
    buckets = tuple(
        b for b in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if b < cfg.max_prompt_tokens
    )
    data_cfg = DataConfig(
        path=data_path,
        batch_size=cfg.batch_size,
        max_prompt_tokens=cfg.max_prompt_tokens,
        prompt_field=cfg.prompt_field,
        answer_field=cfg.answer_field,
        data_source_field=cfg.data_source_field,
        seed=cfg.seed,
        overlong=cfg.overlong,
        chat_template=cfg.chat_template,
        system_prompt=cfg.system_prompt,
        prompt_buckets=buckets + (cfg.max_prompt_tokens,),
        pad_to=cfg.pad_to,
        required_fields=reward_columns(cfg),
        eval_fraction=cfg.eval_fraction if eval_path is None else 0.0,
    )
    splits = read_splits(data_cfg)  # the training data is read once, for both splits
    if eval_path is not None:
        held_out = read_records(eval_path, fields=(cfg.prompt_field,))
    else:
        held_out = eval_records(data_cfg, splits)
    if cfg.eval_max_prompts is not None:
        held_out = held_out[: cfg.eval_max_prompts]
    train = prepare_prompts(splits.train, data_cfg, tokenizer)
    if not train.examples:
        raise ValueError(
            f"no training prompt is within --max-prompt-tokens {cfg.max_prompt_tokens}: "
            + (train.stats.over_budget_message("training") or "the data has no rows")
        )
    return RunData(
        tokenizer,
        model,
        data_cfg,
        train,
        prepare_prompts(held_out, data_cfg, tokenizer) if held_out else None,
    )


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
        else "each batch padded to its own bucket (--pad-to batch): one compile per bucket met"
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
    if algo.describe_update is not None:
        lines.append(algo.describe_update(data.model))
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


def _evaluator(cfg: OnlineRunConfig, algo: OnlineAlgorithm, eval_batch, parts: StepParts, log):
    """``run_eval(state, step, logger) -> metrics``: the policy's held-out evaluation, logged at ``step``."""

    def run_eval(state, step: int, logger: MetricsLogger) -> dict:
        if eval_batch is None:
            return {}
        t0 = time.perf_counter()
        metrics = evaluate(
            state.policy,
            eval_batch,
            reward_fns=parts.reward_fns,
            decode=parts.decode,
            eos_ids=parts.eos_ids,
            pad_id=parts.pad_id,
            max_new_tokens=algo.generation.max_new_tokens,
            key=jax.random.fold_in(jax.random.key(cfg.seed), 1_000_003),
            cfg=cfg.eval,
            answer_field=cfg.answer_field,
            timeout_s=cfg.reward_timeout_s,
            stop_strings=algo.generation.stop_strings,
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


def _host_metrics(cfg: OnlineRunConfig, algo: OnlineAlgorithm, over_budget: int):
    def host_metrics(out: WithHost, metrics: dict) -> dict:
        # from the global mean: on several processes ``lengths`` is not addressable whole
        num_tokens = metrics["completion_length"] * cfg.batch_size * algo.generation.num_generations
        return {
            "tokens_per_s": num_tokens / metrics["time/step"],
            "prompts_over_budget": float(over_budget),
            "reward_errors": float(
                sum(out.host.reward_info.get(k, 0) for k in ("errors", "timeouts", "crashes"))
            ),
            **(out.host.partial or {}),
        }

    return host_metrics


def _partial_rollouts(
    cfg: OnlineRunConfig, algo: OnlineAlgorithm, batches, eos_ids, pad_id: int, mesh
):
    """``--async.partial K``: the data iterator wrapped by the batches in progress
    (``relax.rollout.partial``), or None (K = 1)."""
    if cfg.async_.partial == 1:
        return None
    if mesh is not None:
        raise ValueError(
            "--async.partial runs on one device for now; drop --parallel.* or use --async.partial 1"
        )

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


def _make_batch(cfg: OnlineRunConfig):
    def make_batch(pb) -> WithHost:
        return step_input(
            jnp.asarray(pb.prompt_ids),
            jnp.asarray(pb.prompt_mask),
            pb.prompts,
            {cfg.answer_field: pb.answers, **pb.fields},
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


def run_online(cfg: OnlineRunConfig, algo: OnlineAlgorithm) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    cfg.parallel.initialize()  # multi-host: before anything touches a device
    run_dir, log = start_run(cfg, algo.name)
    t_start = time.perf_counter()
    mesh, sampler_mesh = cfg.parallel.meshes()
    check_batch(cfg.batch_size, mesh)
    check_batch(cfg.batch_size, sampler_mesh)
    if mesh is not None:
        log(
            f"mesh {dict(mesh.shape)}"
            + (f", sampler mesh {dict(sampler_mesh.shape)}" if sampler_mesh else "")
            + f" | {jax.process_count()} process(es)"
        )
    data = _model_and_data(cfg, run_dir, mesh is not None, log)
    tokenizer, model = data.tokenizer, data.model
    reward_fns = reward_functions(cfg)
    pool = reward_pool(cfg, reward_fns)
    with pool if pool is not None else contextlib.nullcontext():  # the workers end with the run
        eos_ids = tuple(sorted({*model.config.eos_ids, *tokenizer.eos_token_ids}))
        batches = prompt_iterator(data.data_cfg, tokenizer, prepared=data.train)
        partial = _partial_rollouts(cfg, algo, batches, eos_ids, tokenizer.pad_token_id, mesh)
        parts = StepParts(
            reward_fns=reward_fns,
            decode=_decoder(tokenizer),
            eos_ids=eos_ids,
            pad_id=tokenizer.pad_token_id,
            passes=choose_passes(batch_shards=1 if mesh is None else batch_shards(mesh)),
            pool=pool,
            partial=partial,
        )
        parts = run_parts(cfg, parts)
        report = _report(cfg, algo, data, parts, mesh)
        log(report.text())
        with _on_host(mesh is not None):
            state = algo.make_state(model, jax.random.key(cfg.seed))
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
            make_batch=_make_batch(cfg) if partial is None else (lambda request: request),
            host_metrics=_host_metrics(cfg, algo, over_budget),
            evaluate=_evaluator(cfg, algo, data.eval_batch, parts, log),
            export=exporter(tokenizer, base_path(cfg, run_dir)),
            bar_keys=BAR_KEYS,
            asynchronous=cfg.async_,
            on_start=report.write,
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
