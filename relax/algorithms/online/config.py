"""An online run's configuration (GRPO, PPO and the agent trainer share it): the model, data,
reward, evaluation and async flags (``ModelRunConfig``, ``OnlineRunConfig``), and what an
algorithm brings to the run (``OnlineAlgorithm``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Literal

import tyro

from relax.algorithms.online.step import StepParts
from relax.environments.verifiers_source import is_verifiers
from relax.eval.evaluate import EvalConfig
from relax.models.config.model import DTYPES
from relax.models.config.precision import Precision
from relax.models.forward.forward_pass import resolve_attention
from relax.models.layers.lora import LoRAConfig
from relax.objectives.off_policy import OffPolicyConfig
from relax.parallel import ParallelConfig
from relax.passes import Passes
from relax.rewards.generative_judge import JudgeConfig
from relax.rewards.sandbox import SandboxConfig
from relax.rollout.generation import GenerationConfig
from relax.tasks import code as code_task
from relax.tasks import math as math_task
from relax.tasks import reasoning_gym as reasoning_gym_task
from relax.tasks import reverse
from relax.tasks import visual as visual_task
from relax.train.pipeline import AsyncConfig
from relax.train.run import RunConfig
from relax.train.update import micro_batch_text

BAR_KEYS = (
    ("reward", "reward"),
    ("kl", "kl"),
    ("completion_length", "len"),
    ("tokens_per_s", "tok/s"),
)


@dataclasses.dataclass(frozen=True)
class ModelRunConfig(RunConfig):
    """What every run on a model and a dataset has (online, offline and the agent trainer): the
    model, its tokenizer, the data and its held-out part, dtypes, the batch size, LoRA and the
    meshes. Without ``model`` a run trains its built-in task."""

    model: str | None = None
    """Hugging Face model directory (config.json + safetensors; its tokenizer and chat template too)."""
    tokenizer: str | None = None
    """Another tokenizer than --model's: a directory, a tokenizer.json or a sentencepiece .model."""
    data: str | None = None
    """Training rows: .jsonl / .parquet file or directory (required with --model)."""
    eval_data: str | None = None
    """Held-out rows; without it ``eval_fraction`` of --data is held out."""
    eval_fraction: float = 0.0
    batch_size: int = 16
    """Rows per step: prompts (each gets G completions), examples, packed rows or pairs."""
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    """The dtype of every matmul's operands (weights and activations; products accumulate in float32)."""
    precision: Precision = Precision()
    """What stays float32 when --compute-dtype is lower (``relax.models.config.precision``): the residual
    stream, the products' results, the attention probabilities. One policy for the sampler and
    every training forward (it rides on the model)."""
    lora: LoRAConfig = LoRAConfig()
    """LoRA adapters (``--lora.rank 8``): only they train, the KL reference is the base model and
    checkpoints hold only the adapters; rank 0 (the default): the whole model trains."""
    parallel: ParallelConfig = ParallelConfig()
    """Meshes and multi-host setup (``relax.parallel``): e.g. ``--parallel.mesh fsdp=-1``."""

    def __post_init__(self):
        super().__post_init__()
        if self.model is not None and self.data is None and not self.makes_data:
            raise ValueError("--model needs --data")
        for name in (self.param_dtype, self.compute_dtype):
            if name not in DTYPES:
                raise ValueError(f"dtype {name!r} is not one of {', '.join(DTYPES)}")
        if self.batch_size < 1:
            raise ValueError("--batch-size >= 1 is required")

    @property
    def makes_data(self) -> bool:
        """Whether the run makes its own rows with --model (no --data needed): a subclass's say."""
        return False


BUILTIN_TASKS = ("reverse", "code", "math", "visual")  # the built-in tasks named by --task


@dataclasses.dataclass(frozen=True)
class TaskRunConfig(ModelRunConfig):
    """A ``ModelRunConfig`` whose built-in task (without ``--model``) is one of the text tasks:
    ``task`` and its options."""

    task: str = "reverse"
    """The built-in task without --model: reverse, or (GRPO / PPO) code or math, or (GRPO) visual;
    or (GRPO / PPO, with or without --model) reasoning_gym:<name>[,<name>...], reasoning-gym's
    generated rows (``--reasoning-gym.*``, ``relax.tasks.reasoning_gym``)."""
    reverse: reverse.ReverseTask = reverse.ReverseTask()
    code: code_task.CodeTask = code_task.CodeTask()
    math: math_task.MathTask = math_task.MathTask()
    visual: visual_task.VisualTask = visual_task.VisualTask()
    reasoning_gym: reasoning_gym_task.ReasoningGymTask = reasoning_gym_task.ReasoningGymTask()
    train_vision: bool = False
    """A vision-language --model with --image-field (GRPO, PPO, SFT, the DPO family): train the
    vision tower and its projection with the language model, by the policy's optimizer (frozen
    by default): its features are recomputed from the trained tower inside the gradient, the KL
    reference keeps the initial tower; the export and checkpoints hold the trained tower."""

    @property
    def tower_trains(self) -> bool:
        """The vision tower trains: whole (``--train-vision``) or through adapters
        (``--lora.vision``)."""
        return self.train_vision or self.lora.vision

    def __post_init__(self):
        super().__post_init__()
        names = reasoning_gym_task.task_names(self.task)  # checked against reasoning-gym's registry
        if names is None and self.task not in BUILTIN_TASKS:
            raise ValueError(
                f"--task {self.task!r}: one of {', '.join(BUILTIN_TASKS)} or "
                f"{reasoning_gym_task.PREFIX}<name>[,<name>...]"
            )
        if names is not None:
            reasoning_gym_task.with_names(self.reasoning_gym, names)  # weights, options, seeds

    @property
    def task_config(self):
        """The options of the built-in task ``task`` (a reasoning-gym task's with its names)."""
        names = reasoning_gym_task.task_names(self.task)
        if names is not None:
            return reasoning_gym_task.with_names(self.reasoning_gym, names)
        tasks = {"reverse": self.reverse, "code": self.code, "math": self.math}
        return {**tasks, "visual": self.visual}[self.task]


@dataclasses.dataclass(frozen=True)
class OnlineRunConfig(TaskRunConfig):
    """An online RL run on prompts (every ``TaskRunConfig`` flag, plus prompts, rewards and
    evaluation sampling)."""

    chat_template: Literal["auto", "always", "never"] = "auto"
    """auto: string prompts go through the model's chat template when it has one (a chat model);
    always / never. A prompt that is a list of chat messages always goes through it."""
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
    image_field: str | None = None
    """A vision-language --model (Gemma 3, Qwen2.5-VL): the column of each row's image or list of
    images (a path relative to the data file, bytes or base64), rendered into the prompt by the
    model's chat template; each prompt's images are encoded once and shared by its group."""
    bad_images: Literal["reject", "drop"] = "reject"
    """A row whose image is missing, unreadable or over the limits: an error naming the file, row
    and field, or the row dropped (counted and named at start-up)."""
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
    judge: JudgeConfig = JudgeConfig()
    """A generative judge as the reward ``judge`` (``relax.rewards.generative_judge``): a judge
    model on the run's devices (``--judge.model DIR``) or an OpenAI-compatible endpoint
    (``--judge.url``) reads each completion and states a score or verdict."""
    eval: EvalConfig = EvalConfig()
    eval_max_prompts: int | None = None
    env: str | None = None
    """A single-turn ``verifiers`` environment, ``verifiers:<id>[?key=value&...]``
    (``relax.environments.verifiers_source``): its tasks are the rows (``--eval-fraction`` of them
    held out) and its rewards the reward functions (with ``--reward``'s unless left at its
    default). Multi-turn and tool environments train with ``relax agent``."""
    compile_ahead: bool = True
    """Compile every program of the step (for each prompt bucket a batch can be padded to) and of
    the held-out evaluation before the first step (a compile thread per two CPU cores), listed
    with their compile seconds in the start-up report; off: each compiles when first called."""
    async_: Annotated[AsyncConfig, tyro.conf.arg(name="async")] = AsyncConfig()
    """Asynchronous RL (``relax.train.pipeline``): ``--async.staleness 1`` samples the next batch
    while the update runs, with an off-policy correction (``--async.correction.kind``)."""

    @property
    def makes_data(self) -> bool:
        """A reasoning-gym task (``setup.reasoning_gym_setup``) or a verifiers environment
        (``verifiers_setup``) writes the rows of a --model run."""
        return self.task.startswith(reasoning_gym_task.PREFIX) or is_verifiers(self.env)

    def __post_init__(self):
        super().__post_init__()
        if self.reward_workers < 0:
            raise ValueError(f"--reward-workers must be >= 0, got {self.reward_workers}")
        if self.env is not None and (not is_verifiers(self.env) or self.data is not None):
            raise ValueError(
                f"--env {self.env!r}: GRPO / PPO take verifiers:<id>, whose tasks are the rows "
                "(no --data); module:factory environments are multi-turn (relax agent)"
            )
        if self.image_field is not None and self.model is None and self.task != "visual":
            raise ValueError(
                f"--image-field {self.image_field!r} needs a vision-language --model or "
                f"--task visual (the built-in task {self.task!r} is text)"
            )
        if self.tower_trains and self.image_field is None:
            raise ValueError(
                "--train-vision / --lora.vision train a vision-language model's tower: give "
                "--image-field"
            )
        if self.reward_weights and len(self.reward_weights) != len(self.reward):
            raise ValueError(
                f"{len(self.reward_weights)} --reward-weights for {len(self.reward)} --reward"
            )
        rising = self.reasoning_gym.max_level is not None
        if rising and self.task.startswith(reasoning_gym_task.PREFIX) and self.async_.staleness:
            raise ValueError(
                "--reasoning-gym.max-level: the rising curriculum picks each batch's level from "
                "the updates before it, so it runs synchronously (drop --async.staleness)"
            )


def run_parts(cfg: OnlineRunConfig, parts: StepParts, generation: GenerationConfig) -> StepParts:
    """``parts`` scored and scheduled as the run's flags say: ``--reward-on-error``,
    ``--reward-timeout-s``, and ``--async.*``'s off-policy correction (``off_policy``; pipelined
    when the staleness is above 0)."""
    return dataclasses.replace(
        parts,
        on_error=cfg.reward_on_error,
        timeout_s=cfg.reward_timeout_s,
        off_policy=off_policy(cfg, generation),
        pipelined=cfg.async_.staleness > 0,
    )


def off_policy(cfg: OnlineRunConfig, generation: GenerationConfig) -> OffPolicyConfig | None:
    """The loss's behaviour correction (``relax.objectives.off_policy``): ``--async.correction`` on
    stale batches (``--async.staleness`` > 0), and on every batch of an 8-bit sampler
    (``generation.sampler_precision`` int8 / fp8: its policy is not the trainer's even when
    synchronous; the proximal policy is then the trainer's own log-probs of the batch)."""
    if not generation.quantized:
        return cfg.async_.off_policy
    if cfg.async_.correction.kind == "none":
        raise ValueError(
            f"sampler_precision {generation.sampler_precision}: the sampler's weights are not the "
            "trainer's, so every batch is off-policy and needs a behaviour correction; "
            "--async.correction.kind none applies none (choose tis, mis or decoupled)"
        )
    return cfg.async_.correction


def tower_line(train_vision: bool, lora: LoRAConfig) -> str:
    """The start-up report's line on a vision-language run's tower: frozen, trained whole
    (``--train-vision``) or through its adapters (``--lora.vision``)."""
    if lora.vision:
        return f"vision tower: trained through rank-{lora.rank} adapters (--lora.vision)"
    if train_vision:
        return "vision tower: trained with the language model (--train-vision)"
    return "vision tower: frozen (--train-vision or --lora.vision trains it)"


@dataclasses.dataclass(frozen=True)
class OnlineAlgorithm:
    """``make_state(model, key)`` -> the algorithm's ``TrainState`` (GRPO's also takes ``vision=``:
    a vision part to train, ``--train-vision``); ``make_step(parts)`` -> its
    composed step; ``generation``, what it samples (G, the completion budget and stop strings for
    evaluation and tokens/s)."""

    name: str
    make_state: Callable[..., Any]
    make_step: Callable[[StepParts], Any]
    generation: GenerationConfig
    describe_update: Callable[[Any, Any], str] | None = (
        None  # (model, passes) -> a start-up report line (its layout)
    )


def describe_update(cfg: Any, batch_size: int, flags: str, model: Any, passes: Passes) -> str:
    """The start-up report's line on an online update: its completions packed or padded and a
    padded one's micro-batches (``micro_batch_text``). ``cfg``: GRPO's or PPO's config (its
    ``packing``, ``forward``, ``generation``, ``num_minibatches``, ``grad_accum``); ``flags``: its
    flag group."""
    attention = resolve_attention(cfg.forward.train_attention, model)
    gen = cfg.generation
    line = cfg.packing.describe(attention, gen.max_new_tokens, passes.auto_packs)
    if cfg.packing.applies(attention, passes.auto_packs):
        return line
    slots = gen.num_generations * gen.max_new_tokens  # a prompt group's completion slots
    micro = micro_batch_text(
        batch_size, cfg.num_minibatches, cfg.grad_accum, passes, slots, f"--{flags}.grad-accum"
    )
    return f"{line}; {micro}"
