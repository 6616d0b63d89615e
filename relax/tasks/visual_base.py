"""The visual task's base model: a tiny Qwen2.5-VL whose vision tower and language model learn
together, in a short supervised phase, to imitate a noisy teacher of the counting task.

The teacher (``teacher_answers``) gives the right count with probability
``VisualTask.teacher_accuracy`` and otherwise over-counts by one, so the base model reads the
picture but prefers the wrong answer, as the reverse task's base model prefers copying: GRPO
with the exact-match reward must find and reinforce the right count. The phase minimises the
token-mean NLL of the teacher's answer given the image prompt (``image_nll``), the gradient
reaching the vision tower; the model is written (``prepare_visual``) as a directory both relax and
transformers load, tokenizer and image processor included. Nothing is downloaded.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

from relax.data.files import Record
from relax.data.image_prompts import ImagePrompts, processor_for
from relax.data.prompts import DataConfig, PreparedPrompts, batch_of, prepare_prompts
from relax.masked import masked_mean
from relax.models.decoder.logprobs import logprobs_from_hidden
from relax.models.decoder.prompt_inputs import prompt_hidden_states
from relax.models.vision.mrope import Grid
from relax.models.vision.qwen2_5_vl import Qwen2_5_VL, prepare_inputs, prompt_inputs
from relax.models.vision.qwen2_5_vl_checkpoint import load_qwen2_5_vl, save_qwen2_5_vl
from relax.tasks.base import write_jsonl
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits
from relax.text import TextTokenizer, load_tokenizer
from relax.train.primitives import forward_backward, optim_step
from relax.train.state import init_state

__all__ = [
    "VisualRows",
    "batch_rows",
    "image_nll",
    "prepare_visual",
    "teacher_answers",
    "train_base_model",
]

IMAGE_FIELD = "image"
PROMPT_BUCKETS = tuple(2**k for k in range(4, 13))  # each batch padded to its bucket: 16 .. 4096


class VisualRows(NamedTuple):
    """A supervised batch: prompt + answer ``ids`` / ``mask`` / ``loss_mask`` ``[b, t]`` (prompts
    left-padded, answers right-padded), the M-RoPE ``positions`` ``[3, b, t]`` and the images'
    patch rows ``pixels`` (their ``grid`` travels beside, static)."""

    ids: Int[Array, "b t"]
    mask: Int[Array, "b t"]
    loss_mask: Int[Array, "b t"]
    positions: Int[Array, "3 b t"]
    pixels: Float[Array, "N P"]


def teacher_answers(task: VisualTask, counts: Sequence[int], rng: np.random.Generator) -> list[str]:
    """The noisy teacher: ``count`` with probability ``teacher_accuracy``, else ``count + 1``."""
    right = rng.random(len(counts)) < task.teacher_accuracy
    return [task.answer(c if r else c + 1) for c, r in zip(counts, right)]


def image_nll(model: Qwen2_5_VL, rows: VisualRows, grid: Grid) -> Float[Array, ""]:
    """Token-mean NLL of the answer tokens, the vision tower inside the gradient::

    loss = - sum_t m_t log p(x_{t+1} | x_{<=t}, images) / sum_t m_t     (m: loss mask, shifted)
    """
    lm = model.language_model
    inputs = prompt_inputs(model, rows.ids, rows.mask, rows.positions, rows.pixels, grid)
    h = prompt_hidden_states(lm, rows.ids, rows.mask, inputs)
    lp = logprobs_from_hidden(lm, h[:, :-1], rows.ids[:, 1:])
    return -masked_mean(lp, rows.loss_mask[:, 1:])


@eqx.filter_jit(donate="all")
def _step(state, rows: VisualRows, grid: Grid):
    loss_fn = lambda model, r: (image_nll(model, r, grid), {})  # noqa: E731
    grads, metrics = forward_backward(state, rows, loss_fn)
    return optim_step(state, grads), metrics


def batch_rows(
    model: Qwen2_5_VL,
    prepared: PreparedPrompts,
    idx: np.ndarray,
    answers: list[str],
    data_cfg: DataConfig,
    tokenizer: TextTokenizer,
    images: ImagePrompts,
) -> tuple[VisualRows, Grid]:
    """The examples ``idx`` of ``prepared`` with ``answers`` (and the end of turn) after them."""
    batch = batch_of(
        PreparedPrompts([prepared.examples[i] for i in idx], False, prepared.stats),
        data_cfg,
        tokenizer.pad_token_id,
        images,
    )
    targets = [
        tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in answers
    ]
    width = max(map(len, targets))
    answer_ids = np.full((len(idx), width), tokenizer.pad_token_id, np.int32)
    answer_mask = np.zeros((len(idx), width), np.int32)
    for i, t in enumerate(targets):
        answer_ids[i, : len(t)], answer_mask[i, : len(t)] = t, 1
    ids = np.concatenate([batch.prompt_ids, answer_ids], 1)
    mask = np.concatenate([batch.prompt_mask, answer_mask], 1)
    loss_mask = np.concatenate([np.zeros_like(batch.prompt_mask), answer_mask], 1)
    x = prepare_inputs(model, ids, mask, batch.images.grid)
    rows = VisualRows(ids, mask, loss_mask, x.positions.astype(np.int32), batch.images.pixel_values)
    return jax.tree.map(jnp.asarray, rows), x.grid


def train_base_model(
    task: VisualTask,
    model: Qwen2_5_VL,
    tokenizer: TextTokenizer,
    images: ImagePrompts,
    train: list[dict],
    *,
    key: jax.Array,
    log=print,
) -> Qwen2_5_VL:
    """``model`` (tower and language model) after ``task.sft_steps`` AdamW steps (warm-up, cosine
    decay to 0) on ``image_nll`` of the teacher's answers to ``task.sft_batch`` random training
    prompts a step."""
    data_cfg = DataConfig(
        path="<visual task>",
        batch_size=task.sft_batch,
        max_prompt_tokens=PROMPT_BUCKETS[-1],
        prompt_buckets=PROMPT_BUCKETS,
        pad_to="batch",
    )
    rows = [Record("<visual task>", i + 1, r) for i, r in enumerate(train)]
    prepared = prepare_prompts(rows, data_cfg, tokenizer, images)
    counts = [int(r["answer"]) for r in train]
    rng = np.random.default_rng(task.seed)
    warmup = min(20, task.sft_steps // 2)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, task.sft_learning_rate, warmup, task.sft_steps
    )
    state = init_state(model, optax.adamw(schedule, weight_decay=0.0), key=key)
    t0 = time.perf_counter()
    for i in range(task.sft_steps):
        idx = rng.choice(len(train), task.sft_batch, replace=False)
        answers = teacher_answers(task, [counts[j] for j in idx], rng)
        batch, grid = batch_rows(state.policy, prepared, idx, answers, data_cfg, tokenizer, images)
        state, metrics = _step(state, batch, grid)
        if (i + 1) % 100 == 0 or i + 1 == task.sft_steps:
            log(
                f"  supervised step {i + 1}/{task.sft_steps}: loss {float(metrics['loss']):.3f} "
                f"({time.perf_counter() - t0:.0f}s)"
            )
    return state.policy


def prepare_visual(task: VisualTask, run_dir: Path, *, seed: int, log=print) -> Path:
    """The visual task in ``run_dir``: its rows in ``task/train.jsonl`` and ``task/eval.jsonl``
    (an ``image`` column of base64 PNGs) and its base model in ``base_model`` (reused when
    present), else a tiny random Qwen2.5-VL (``write_tiny_qwen2_5_vl``) trained by
    ``train_base_model``, written whole to ``base_model`` (through a temporary directory: an
    interrupted phase leaves no half-made base model). One process writes; the base model's path."""
    train, held_out = make_splits(task)
    write_jsonl(train, run_dir / "task" / "train.jsonl")
    write_jsonl(held_out, run_dir / "task" / "eval.jsonl")
    base = run_dir / "base_model"
    if (base / "config.json").exists():
        log(f"base model: {base} (reused)")
        return base
    log("base model: a supervised phase on a noisy teacher of the visual task ...")
    scratch = run_dir / "base_model.partial"
    shutil.rmtree(scratch, ignore_errors=True)
    k_init, k_train = jax.random.split(jax.random.key(seed))
    write_tiny_qwen2_5_vl(
        scratch,
        task,
        key=k_init,
        hidden_size=task.hidden_size,
        num_layers=task.num_layers,
        vision_hidden=task.vision_hidden,
        vision_depth=task.vision_depth,
        std=task.init_std,
    )
    tokenizer = load_tokenizer(scratch)
    images = ImagePrompts(IMAGE_FIELD, processor_for("qwen2_5_vl", scratch))
    model = train_base_model(
        task, load_qwen2_5_vl(scratch), tokenizer, images, train, key=k_train, log=log
    )
    save_qwen2_5_vl(model, scratch)
    scratch.rename(base)
    return base
