"""The visual task's base model and its command line (``relax.tasks.visual_base``, ``--task
visual``): the noisy teacher's answers, the supervised loss against the NLL computed in numpy
from the full forward's logits (``vl_forward``, checked against transformers elsewhere), the
gradient reaching the vision tower, and a GRPO run that makes its base model, trains, and
reuses it."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import load_example

from relax.algorithms.grpo.run import GRPORunConfig
from relax.algorithms.online.setup import visual_setup
from relax.data.files import Record
from relax.data.image_prompts import ImagePrompts, processor_for
from relax.data.prompts import DataConfig, prepare_prompts
from relax.models.vision.qwen2_5_vl import vl_forward
from relax.models.vision.qwen2_5_vl_checkpoint import load_qwen2_5_vl
from relax.tasks import visual_base
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=16, num_eval=4, sft_steps=2, sft_batch=4)


def test_the_teacher_is_right_as_often_as_told():
    task = VisualTask(teacher_accuracy=0.3)
    counts = np.random.default_rng(0).integers(1, 5, 20_000)
    answers = np.asarray(
        [int(a) for a in visual_base.teacher_answers(task, counts, np.random.default_rng(1))]
    )
    right = answers == counts
    assert abs(right.mean() - 0.3) < 0.015
    assert np.all(answers[~right] == counts[~right] + 1)  # otherwise it over-counts by one


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = write_tiny_qwen2_5_vl(
        tmp_path_factory.mktemp("vb") / "m", TASK, key=jax.random.key(0), std=0.1
    )
    train, _ = make_splits(TASK)
    tokenizer = load_tokenizer(root)
    images = ImagePrompts("image", processor_for("qwen2_5_vl", root))
    cfg = DataConfig(
        path="x",
        batch_size=4,
        max_prompt_tokens=4096,
        prompt_buckets=visual_base.PROMPT_BUCKETS,
        pad_to="batch",
    )
    prepared = prepare_prompts(
        [Record("x", i + 1, r) for i, r in enumerate(train)], cfg, tokenizer, images
    )
    return load_qwen2_5_vl(root), tokenizer, images, cfg, prepared


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.slow
def test_image_nll_is_the_answer_tokens_nll(tiny):
    model, tokenizer, images, cfg, prepared = tiny
    idx, answers = np.arange(3), ["2", "13", "4"]  # a two-token answer: right padding is live
    rows, grid = visual_base.batch_rows(model, prepared, idx, answers, cfg, tokenizer, images)
    logits = np.asarray(vl_forward(model, rows.ids, rows.mask, rows.pixels, grid), np.float64)
    lp = np.take_along_axis(_log_softmax(logits[:, :-1]), np.asarray(rows.ids)[:, 1:, None], -1)[
        ..., 0
    ]
    total, count = 0.0, 0
    for i, a in enumerate(answers):  # the answer's tokens and the end of turn, after the prompt
        target = tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = np.asarray(rows.ids[i])
        start = int(np.flatnonzero(np.asarray(rows.loss_mask[i]))[0])
        assert ids[start : start + len(target)].tolist() == target
        total -= lp[i, start - 1 : start - 1 + len(target)].sum()
        count += len(target)
    got = float(visual_base.image_nll(model, rows, grid))
    np.testing.assert_allclose(got, total / count, rtol=1e-5)


@pytest.mark.slow
def test_the_gradient_reaches_the_vision_tower(tiny):
    model, tokenizer, images, cfg, prepared = tiny
    rows, grid = visual_base.batch_rows(
        model, prepared, np.arange(4), ["1", "2", "3", "4"], cfg, tokenizer, images
    )
    grads = jax.grad(visual_base.image_nll)(model, rows, grid)
    norm = lambda t: float(sum(np.sum(np.square(x)) for x in jax.tree.leaves(t)))  # noqa: E731
    assert norm(grads.visual.patch_embed) > 0 and norm(grads.visual.merger) > 0


def _args(run_dir, *extra):
    return [
        "--task", "visual",
        "--visual.num-train", "16",
        "--visual.num-eval", "4",
        "--visual.sft-steps", "2",
        "--visual.sft-batch", "4",
        "--run-dir", str(run_dir),
        "--steps", "1",
        "--batch-size", "2",
        "--grpo.num-generations", "2",
        "--eval-every", "1",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow  # a whole run: make test-all
def test_grpo_task_visual_makes_trains_and_reuses_its_base_model(tmp_path, capsys):
    grpo = load_example("grpo")
    summary = grpo.main(_args(tmp_path))
    out = capsys.readouterr().out
    assert "supervised step 2/2" in out and "training images: 16 in all" in out
    assert summary["data"]["train"]["images"] == 16
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/greedy/accuracy" in x for x in lines)
    assert not (tmp_path / "base_model.partial").exists()
    load_qwen2_5_vl(tmp_path / "base_model")  # a whole Qwen2.5-VL directory
    grpo.main(_args(tmp_path, "--steps", "2"))  # resumes: the base model is read, not made
    out = capsys.readouterr().out
    assert "(reused)" in out and "supervised step" not in out


def test_the_visual_task_needs_its_image_field(tmp_path):
    with pytest.raises(ValueError, match="--task visual trains on image prompts"):
        visual_setup(GRPORunConfig(task="visual"), tmp_path, print)
    assert not (tmp_path / "base_model").exists()
