"""An online run's model and data: the built-in task or ``--model``/``--data``, LoRA, the prompts
prepared and held out, the text decoder, and the export of a policy as a Hugging Face directory."""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from relax.algorithms.online.config import ModelRunConfig, OnlineRunConfig, TaskRunConfig
from relax.algorithms.online.rewards import reward_columns
from relax.data.curriculum import RisingCurriculum
from relax.data.image_prompts import ImagePrompts, processor_for
from relax.data.images.pixels import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE
from relax.data.prompts import (
    DataConfig,
    PreparedPrompts,
    batch_of,
    eval_records,
    prepare_prompts,
    prompt_iterator,
    read_records,
    read_splits,
)
from relax.models.adapters.operations import add_lora, has_lora, merge_lora
from relax.models.adapters.peft import TEXT_PREFIX, fused_adapter_error, save_adapter
from relax.models.adapters.tower import ModuleLoRA, merged_module
from relax.models.config.model import DTYPES
from relax.models.decoder.prompt_inputs import PromptInputs, text_prompt_inputs
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.models.vision.families import (
    VISION_FAMILIES,
    Pixels,
    VisionLanguage,
    encode_images,
    load_vision_language,
    pixels_of,
    save_vision_language,
    trainable_vision,
    vision_family_of,
)
from relax.objectives.reference import ReferenceConfig
from relax.parallel import place_process_rows, place_rows, rows_shardings, shard_vision
from relax.parallel.distributed import barrier, multi_process, on_host_memory
from relax.parallel.local import local_mesh
from relax.parallel.pixels import global_pixels
from relax.tasks import TASK_REWARDS, TASKS, kind
from relax.tasks import reasoning_gym as reasoning_gym_task
from relax.tasks.base import prepare, write_jsonl
from relax.tasks.visual_base import prepare_visual
from relax.text import TextTokenizer, load_tokenizer
from relax.train.logs import is_main_process


def builtin_setup(cfg: TaskRunConfig, run_dir: Path, log):
    """Task files, tokenizer and base model of the built-in task ``cfg.task`` (reused when present):
    ``(tokenizer, model, train path, held-out path)``."""
    tokenizer, model, _, _ = prepare(
        TASKS[kind(cfg.task)],
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


def reasoning_gym_setup(cfg: OnlineRunConfig, run_dir: Path, log) -> OnlineRunConfig:
    """``cfg`` itself, or for a ``--model`` run on ``--task reasoning_gym:<names>`` (the task's own
    tiny base model without ``--model`` is ``builtin_setup``'s) ``cfg`` as a ``--model/--data`` run on
    the task's rows, written by the main process to ``run_dir/task/{train,eval}.jsonl``
    (``relax.tasks.reasoning_gym.make_splits``), rewarded by ``reasoning_gym`` (when ``--reward``
    is left at its default) with reasoning-gym's system prompt (``--reasoning-gym.prompt-style``,
    unless ``--system-prompt`` is given or the model has no chat template: then the prompts are
    the bare questions), per-task metrics by the rows' ``data_source``."""
    if cfg.model is None or not cfg.task.startswith(reasoning_gym_task.PREFIX):
        return cfg
    if cfg.data is not None or cfg.eval_data is not None:
        raise ValueError(f"--task {cfg.task} makes its own rows: drop --data / --eval-data")
    task, task_dir = cfg.task_config, run_dir / "task"
    if is_main_process():
        train, held_out = reasoning_gym_task.make_splits(task)
        write_jsonl(train, task_dir / "train.jsonl")
        write_jsonl(held_out, task_dir / "eval.jsonl")
        log(
            f"reasoning-gym {', '.join(task.names)}: {len(train)} training rows (seed {task.seed}), "
            f"{len(held_out)} held out (seed {task.eval_seed}) in {task_dir}"
        )
    barrier("reasoning-gym task")
    default_reward = cfg.reward == ("exact_match",) and not cfg.reward_weights
    tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
    chat = cfg.chat_template == "always" or (
        cfg.chat_template == "auto" and tokenizer.has_chat_template
    )
    system_prompt = cfg.system_prompt
    if system_prompt is None and chat:
        system_prompt = reasoning_gym_task.system_prompt(task)
    elif system_prompt is None:
        log(f"{cfg.model} has no chat template: the prompts are the bare questions")
    return dataclasses.replace(
        cfg,
        data=str(task_dir / "train.jsonl"),
        eval_data=str(task_dir / "eval.jsonl"),
        reward=TASK_REWARDS[kind(cfg.task)] if default_reward else cfg.reward,
        system_prompt=system_prompt,
    )


def visual_setup(cfg: OnlineRunConfig, run_dir: Path, log) -> OnlineRunConfig:
    """``cfg`` itself, or for the built-in visual task (``--task visual``, no ``--model``) ``cfg``
    as a ``--model`` run on the task's base model and rows (``relax.tasks.visual_base``: made by
    the main process, or reused from ``run_dir``)."""
    if cfg.model is not None or cfg.task != "visual":
        return cfg
    if cfg.image_field is None:
        raise ValueError(
            "--task visual trains on image prompts (--image-field image): GRPO's "
            "(examples/train_grpo.py --task visual)"
        )
    if is_main_process():
        prepare_visual(cfg.visual, run_dir, seed=cfg.seed, log=log)
    barrier("visual task")
    task_dir = run_dir / "task"
    return dataclasses.replace(
        cfg,
        model=str(run_dir / "base_model"),
        data=str(task_dir / "train.jsonl"),
        eval_data=str(task_dir / "eval.jsonl"),
    )


def text_decoder(tokenizer: TextTokenizer):
    """``decode(tokens, mask) -> texts``: the completions as text, special tokens skipped, stripped."""

    def decode(tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        return [
            text.strip() for text in tokenizer.decode_batch(tokens, mask, skip_special_tokens=True)
        ]

    return decode


PROCESSOR_FILES = (
    IMAGE_PROCESSOR_FILE,
    PROCESSOR_FILE,
    "chat_template.json",
    "video_preprocessor_config.json",
)  # a vision-language model's processor files, copied as they are


def exporter(
    tokenizer: TextTokenizer, base: str | None = None, vision: VisionLanguage | None = None
):
    """``export(policy, directory) -> directory``: weights, config, generation config, tokenizer
    files and chat template, a directory ``transformers`` loads (collective: every process calls it).
    A LoRA policy is exported merged (``W + s A B``), and its adapters alone in PEFT's format under
    ``directory/adapter`` (``base``: the base model's path, recorded in the adapter config) where
    that format can hold them: adapters on a family's fused tensors (Phi-3's ``qkv_proj``) have no
    PEFT form, and then only the merged model is written, with a warning saying why.

    A vision-language model's run (``vision``: its family and frozen vision part) exports the
    whole model as its family's architecture (``save_vision_language``: the trained language
    model with the vision part, the VLM's ``config.json``) and the processor files of ``base``
    (``PROCESSOR_FILES``, those there); its adapters are named as PEFT names them on that class
    (``prefix=vision.family.peft_prefix``). ``export(..., vision=part)``: with that trained
    vision part in place of the run's (``--train-vision``)."""
    run_vision = vision
    if run_vision is not None and base is None:
        raise ValueError("a vision-language model's export copies its processor files from base")
    prefix = TEXT_PREFIX if run_vision is None else run_vision.family.peft_prefix

    def export(policy, directory: Path, vision=None) -> Path:
        policy = host_policy(policy)
        if run_vision is None:
            save = save_pretrained
        else:
            part = run_vision.vision if vision is None else host_policy(merged_module(vision))
            save = whole_model(run_vision._replace(vision=part))
        tower = host_policy(vision) if isinstance(vision, ModuleLoRA) else None  # its adapters
        if is_main_process():
            save(merge_lora(policy), directory)
            tokenizer.save_pretrained(directory)
            if run_vision is not None:
                copy_processor_files(base, directory)
            if has_lora(policy):
                why = fused_adapter_error(policy.config.family, policy.layers.lora.weights())
                if why is None:
                    save_adapter(
                        policy,
                        Path(directory) / "adapter",
                        base_model_name_or_path=base,
                        prefix=prefix,
                        tower=tower,
                        tower_modules=None
                        if run_vision is None
                        else run_vision.family.lora_modules,
                    )
                else:
                    warnings.warn(
                        f"{directory}: the merged model is written, the adapters alone are not: {why}",
                        stacklevel=2,
                    )
        return directory

    return export


def whole_model(vision: VisionLanguage):
    """``save(language_model, directory)``: the vision-language model of ``vision``'s family and
    vision part with ``language_model`` in it (``save_vision_language``). Only the family and
    the vision part are kept (not the language model ``vision`` was loaded with)."""
    family, part = vision.family, vision.vision

    def save(language_model, directory) -> None:
        save_vision_language(VisionLanguage(family, language_model, part), directory)

    return save


def copy_processor_files(source: str | Path, directory: str | Path) -> list[str]:
    """Copy ``source``'s ``PROCESSOR_FILES`` (those it has) into ``directory``; their names."""
    copied = []
    for name in PROCESSOR_FILES:
        if (Path(source) / name).is_file():
            shutil.copyfile(Path(source) / name, Path(directory) / name)
            copied.append(name)
    return copied


LORA_STREAM = 7  # the adapters' init key: fold_in(key(seed), LORA_STREAM)
VISION_LORA_STREAM = 8  # the tower's adapters' (--lora.vision)


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


def host_policy(policy):
    """The policy as host arrays on every process (gathered from all processes' shards)."""
    if jax.process_count() == 1:
        return policy
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(policy, tiled=True)


@dataclasses.dataclass(frozen=True)
class RunData:
    """An online run's tokenizer, model and prompts: the training rows prepared (formatted,
    tokenized, budget-checked) and the held-out ones as one batch (None: nothing held out).
    A vision-language model's run: ``vision`` (its family and frozen vision part; ``model`` is
    its language model) and ``images`` (how rows become image prompts; None: text prompts);
    ``mesh``: the trainer mesh (``on_mesh``; None: one device). On several processes each one
    encodes its own rows on its own devices (``relax.parallel.local.local_mesh``), which hold the
    vision part, and the inputs are assembled into global arrays (``place_process_rows``)."""

    tokenizer: TextTokenizer
    model: Any
    data_cfg: DataConfig
    train: PreparedPrompts
    held_out: PreparedPrompts | None
    vision: VisionLanguage | None = None
    images: ImagePrompts | None = None
    mesh: Mesh | None = None

    def on_mesh(self, mesh: Mesh) -> RunData:
        """This run's data with its frozen vision part laid out on ``mesh`` once, by the
        language model's sharding rules (``relax.parallel.shard_vision``), so that ``encode``
        runs on the mesh; as it is for text prompts. On several processes: on this process's
        devices of the mesh (``local_mesh``)."""
        if self.images is None:
            return self
        where = local_mesh(mesh) if multi_process() else mesh
        vision = self.vision._replace(vision=shard_vision(self.vision.vision, where))
        return dataclasses.replace(self, vision=vision, mesh=mesh)

    @property
    def eval_batch(self):
        return (
            None
            if self.held_out is None or not self.held_out.examples
            else batch_of(self.held_out, self.data_cfg, self.tokenizer.pad_token_id, self.images)
        )

    def encoded_shape(self, rows: int, length: int) -> PromptInputs:
        """The ``PromptInputs`` that ``encode`` gives a step's ``rows`` prompts of ``length``
        tokens, as ``ShapeDtypeStruct`` s laid out as ``encode`` lays them out: those of text
        prompts' inputs (``text_prompt_inputs``: the families' encodes give the same leaves,
        shapes and dtypes whatever the images), for compiling the step ahead."""
        ids = jax.ShapeDtypeStruct((rows, length), np.int32)
        shapes = jax.eval_shape(lambda i: text_prompt_inputs(self.model, i, i), ids)
        if self.mesh is None:
            return shapes
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            rows_shardings(shapes, self.mesh, rows),
        )

    def encode(
        self, policy, batch, *, shared: bool = False, vision=None, features: bool = True
    ) -> PromptInputs | None:
        """A ``PromptBatch``'s image prompts' inputs for ``policy`` (None: text prompts); on a
        mesh, computed there and laid out as the step takes them: rows over the batch axes.
        ``shared``: every process holds the whole ``batch`` (the held-out one), not its rows of
        it; on several processes its inputs are replicated. ``vision``: a trained vision part to
        encode with (default: the run's frozen one); ``features=False``: the features left at
        zero (the step computes them from its trained tower)."""
        if batch.images is None:
            return None
        if vision is not None and multi_process():  # the state's tower, whole on this process
            vision = host_policy(vision)
        part = self.vision if vision is None else self.vision._replace(vision=merged_module(vision))
        args = (part, policy, batch.prompt_ids, batch.prompt_mask, batch.images)
        inputs = encode_images(*args, features=features)
        if self.mesh is None:
            return inputs
        if multi_process():
            return place_process_rows(inputs, self.mesh, shared=shared)
        return place_rows(inputs, self.mesh, batch.prompt_ids.shape[0])  # the step's layout


def trained_tower(cfg: ModelRunConfig, vision: VisionLanguage):
    """The vision part a ``--train-vision`` / ``--lora.vision`` run trains
    (``trainable_vision``: a copy of ``vision``'s, which stays the initial tower, the reference's
    features), its adapters drawn from ``fold_in(key(seed), VISION_LORA_STREAM)``."""
    key = jax.random.fold_in(jax.random.key(cfg.seed), VISION_LORA_STREAM)
    return trainable_vision(vision, cfg.lora, key)


def batch_pixels(data: RunData, batch) -> Pixels | None:
    """A ``PromptBatch``'s images for a trained tower: its own, or on several processes every
    process's, in the global rows' order (``relax.parallel.pixels.global_pixels``)."""
    if batch.images is None:
        return None
    if multi_process():
        return global_pixels(batch.images.pixel_values, batch.images.grid, data.mesh)
    return pixels_of(batch.images)


def training_batches(cfg: OnlineRunConfig, data: RunData):
    """The training batches: the rows' ``prompt_iterator``, or on a reasoning-gym curriculum
    (``--reasoning-gym.max-level``) a ``RisingCurriculum`` over each level's rows, every level
    padded as the whole data is (one compiled step)."""
    task = cfg.task_config if kind(cfg.task) == "reasoning_gym" else None
    if task is None or task.max_level is None:
        return prompt_iterator(
            data.data_cfg, data.tokenizer, prepared=data.train, images=data.images
        )
    parts = []
    for level in reasoning_gym_task.levels(task):
        examples = [e for e in data.train.examples if e.extras.get("level") == level]
        if not examples:
            raise ValueError(
                f"--reasoning-gym.max-level: no training prompt of level {level} is within "
                f"--max-prompt-tokens {cfg.max_prompt_tokens}"
            )
        level_rows = dataclasses.replace(data.train, examples=examples)
        parts.append(
            prompt_iterator(
                data.data_cfg,
                data.tokenizer,
                prepared=level_rows,
                images=data.images,
                padded_as=data.train,
            )
        )
    return RisingCurriculum(
        reasoning_gym_task.levels(task),
        parts,
        threshold=task.level_up_at,
        window=task.level_window,
    )


def load_run_data(cfg: OnlineRunConfig, run_dir: Path, on_host: bool, log) -> RunData:
    """The built-in task or --model/--data, loaded and prepared."""
    vision = None
    if cfg.model is None:
        tokenizer, model, data_path, eval_path = builtin_setup(cfg, run_dir, log)
    else:
        tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
        with on_host_memory(on_host):
            model, vision = load_model(cfg)
        data_path, eval_path = cfg.data, cfg.eval_data
    images = image_prompts(cfg, vision)
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
    train = prepare_prompts(splits.train, data_cfg, tokenizer, images)
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
        prepare_prompts(held_out, data_cfg, tokenizer, images) if held_out else None,
        vision,
        images,
    )


def load_model(cfg: ModelRunConfig) -> tuple[Any, VisionLanguage | None]:
    """``--model``'s language model, and its vision part when it is a vision-language model."""
    dtype, param_dtype = DTYPES[cfg.compute_dtype], DTYPES[cfg.param_dtype]
    if vision_family_of(cfg.model) is None:
        model = load_pretrained(
            cfg.model, dtype=dtype, param_dtype=param_dtype, precision=cfg.precision
        )
        return model, None
    vision = load_vision_language(cfg.model, dtype=dtype, param_dtype=param_dtype)
    model = vision.language_model
    if cfg.precision is not None:
        model = dataclasses.replace(model, precision=cfg.precision)
    return model, vision


def image_prompts(cfg: OnlineRunConfig, vision: VisionLanguage | None) -> ImagePrompts | None:
    """How the rows become image prompts (``--image-field``), or None for text prompts."""
    if cfg.image_field is None:
        return None
    if vision is None:
        raise ValueError(
            f"--image-field {cfg.image_field!r} needs a vision-language --model "
            f"(model_type {sorted(VISION_FAMILIES)}); {cfg.model or 'the built-in task'} is not one"
        )
    processor = processor_for(vision.family.model_type, cfg.model)
    return ImagePrompts(cfg.image_field, processor, bad_images=cfg.bad_images)
