"""A trained vision tower in a GRPO step (``--train-vision``, ``relax.algorithms.online.vision``)
on the tiny Qwen2.5-VL and the counting task's rows, built as a run builds them: the sampler
reads the state's tower, the reference the initial one, the tower runs once per image in the
sampler and in each optimizer step of the update, and at the first optimizer step the language
model's update is the frozen-tower step's exactly while the tower moves."""

from __future__ import annotations

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.run import GRPORunConfig, algorithm
from relax.algorithms.online.config import run_parts
from relax.algorithms.online.run import _make_batch
from relax.algorithms.online.setup import (
    load_run_data,
    text_decoder,
    training_batches,
)
from relax.algorithms.online.step import StepParts
from relax.models.adapters.operations import split_trainable
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.layers.lora import LoRAConfig
from relax.models.vision import families
from relax.models.vision.families import trainable_vision
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits

TASK = VisualTask(num_train=8, num_eval=2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run's data, its first batch (made anew: a step donates it) and a step factory:
    ``(data, batch, make)``."""
    root = tmp_path_factory.mktemp("train-vision")
    write_tiny_qwen2_5_vl(root / "model", TASK, key=jax.random.key(0))
    train, _ = make_splits(TASK)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    cfg = GRPORunConfig(
        model=str(root / "model"),
        data=str(root / "train.jsonl"),
        image_field="image",
        batch_size=2,
        max_prompt_tokens=64,
        eval_fraction=0.0,
        train_vision=True,
        run_dir=str(root / "run"),
    )
    cfg = dataclasses.replace(
        cfg, grpo=configure(GRPOConfig, num_generations=2, max_new_tokens=3, beta=0.04)
    )
    data = load_run_data(cfg, root / "run", False, lambda *a: None)
    first = next(iter(training_batches(cfg, data)))

    def batch(features: bool = True):  # made anew: a step donates its batch
        return _make_batch(cfg, data, features=features)(first)

    algo = algorithm(cfg)
    tok = data.tokenizer

    def make(vision):
        parts = StepParts(
            reward_fns=[lambda prompts, completions, **kw: [float(len(c)) for c in completions]],
            decode=text_decoder(tok),
            eos_ids=tuple(tok.eos_token_ids),
            pad_id=tok.pad_token_id,
        )
        state = algo.make_state(
            jax.tree.map(lambda x: x.copy(), data.model), jax.random.key(1), vision=vision
        )
        return state, algo.make_step(run_parts(cfg, parts, algo.generation))

    return data, batch, make


def _tower(data):
    """The tower a ``--train-vision`` run trains: a copy of the run's."""
    return trainable_vision(data.vision, LoRAConfig(), jax.random.key(0))


def _logprobs(model, b, prompt):
    return completion_logprobs(
        model, b.prompt_ids, b.prompt_mask, b.tokens, b.mask, ForwardPass(), prompt=prompt
    )


def _nudged(vision):
    """The tower with its patch merger's last layer moved: other features than the initial's."""
    return eqx.tree_at(lambda v: v.visual.merger.fc2, vision, vision.visual.merger.fc2 * 1.5)


@pytest.mark.slow
def test_the_sampler_reads_the_state_s_tower_and_the_reference_the_initial_one(run):
    data, batch, make = run
    tower = _nudged(_tower(data))
    state, step = make(jax.tree.map(lambda x: x.copy(), tower))  # a step donates its state
    state = state.replace(step=state.step + 1)  # a tower already trained: not the initial one
    _, out = step(state, batch())
    b = out.device.batch
    m = np.asarray(b.mask, bool)
    own = families.with_image_features(b.images, tower, batch().device.pixels)
    want = _logprobs(data.model, b, own)
    np.testing.assert_allclose(np.asarray(b.old_logprobs)[m], np.asarray(want)[m], atol=2e-5)
    initial = _logprobs(data.model, b, b.images)  # the reference: the initial model and tower
    np.testing.assert_allclose(np.asarray(b.ref_logprobs)[m], np.asarray(initial)[m], atol=2e-5)
    assert np.abs(np.asarray(want - initial)[m]).max() > 1e-3  # the two towers differ


@pytest.mark.slow
def test_the_tower_runs_once_per_image_in_the_sampler_and_the_update(run, monkeypatch):
    data, batch, make = run
    calls = []
    family = families.VISION_FAMILIES["qwen2_5_vl"]

    def counting(vision, pixels):
        calls.append(len(pixels.grid))
        return family.features(vision, pixels)

    monkeypatch.setitem(
        families.VISION_FAMILIES, "qwen2_5_vl", dataclasses.replace(family, features=counting)
    )
    state, step = make(_tower(data))
    step(state, batch())
    # 2 prompts of one image each, G = 2: the sampler once, the update's one optimizer step once
    assert calls == [2, 2], calls


@pytest.mark.parametrize("features", [True, False], ids=["data-encoded", "not-encoded"])
@pytest.mark.slow
def test_first_step_trains_the_language_model_as_the_frozen_tower_does_and_moves_the_tower(
    run, features
):
    """``features=False``: the data leaves the features at zero (no reference reads them at
    step 0): the sampler and the update compute their own, so nothing changes."""
    data, batch, make = run
    frozen_state, frozen_step = make(None)
    frozen, _ = frozen_step(frozen_state, batch())
    state, step = make(_tower(data))
    new, out = step(state, batch(features))
    if not features:
        assert not np.asarray(batch(False).device.images.features).any()
    for a, b in zip(jax.tree.leaves(new.policy), jax.tree.leaves(frozen.policy)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(new.vision), jax.tree.leaves(_tower(data)))
    ]
    assert sum(moved) >= len(moved) - 1, moved  # every trained weight (but perhaps one) moved
    assert np.isfinite(float(out.device.metrics["grad_norm"]))


@pytest.mark.slow
def test_lora_vision_trains_the_tower_s_adapters_alone(run):
    """``--lora.vision``: the state's tower is a ``ModuleLoRA``; a step moves its adapters (``B``
    from 0) and leaves its base bitwise, and the sampler reads the merged tower."""
    from relax.models.adapters.tower import ModuleLoRA

    data, batch, make = run
    cfg = LoRAConfig(rank=4, alpha=8.0, vision=True)
    tower = trainable_vision(data.vision, cfg, jax.random.key(5))
    assert isinstance(tower, ModuleLoRA) and len(tower.a) == len(data.vision.family.lora_modules)
    base = jax.tree.map(np.asarray, tower.base)
    trained = split_trainable(tower)[0]  # what the optimizer sees of it: the factors alone
    assert len(jax.tree.leaves(trained)) == 2 * len(tower.a)
    assert not jax.tree.leaves(trained.base)
    state, step = make(tower)
    new, out = step(state, batch())
    for a, b in zip(jax.tree.leaves(new.vision.base), jax.tree.leaves(base)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert all(float(jnp.abs(b).max()) > 0 for b in new.vision.b.values())  # every B moved
    assert np.isfinite(float(out.device.metrics["grad_norm"]))
