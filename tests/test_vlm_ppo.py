"""Image prompts through a composed PPO step: ``Prompts.images`` (``PromptInputs``) reaches the
sampler, the critic's values of the sampled states and both updates (a separate critic's and a
value head's on the policy). Checked against the prefix-shared forward and the critic called
directly with the same ``PromptInputs``; text-only ``PromptInputs`` give the step without images
exactly; a critic that cannot read the policy's image features is refused at start, and so is
VinePPO (its branches are text prefixes)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from test_batch import CFG, G, N, _decode, _fives, _input
from test_image_prompts_step import _images

from relax.algorithms.cli.configure import configure
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.run import PPORunConfig, make_state
from relax.algorithms.ppo.step import make_ppo_step
from relax.compose import WithHost
from relax.data.completion_layout import PackingConfig
from relax.models import init
from relax.models.decoder.prompt_inputs import text_prompt_inputs
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.heads.critic import (
    completion_head_values,
    completion_values,
    init_critic,
    init_value_head,
    save_critic,
)
from relax.train.state import init_state

HOW = ForwardPass(attention="group")


def _model():
    return init(CFG, jax.random.key(0), std=0.3)


def _value_model(critic: str, model):
    """A critic with a nonzero head (a zero head's values are 0 whatever it reads): a copy of
    ``model`` (``separate``) or a value head on it (``shared``)."""
    if critic == "shared":
        return init_value_head(CFG, 0.5, key=jax.random.key(3))
    return init_critic(model, key=jax.random.key(3), head_std=0.5)


def _values(critic: str, images, b):
    """The critic's values of the batch's completions, computed directly (fresh models: the
    step donated its state's buffers)."""
    args = (b.prompt_ids, b.prompt_mask, b.tokens, b.mask, HOW)
    model = _model()
    if critic == "shared":
        return completion_head_values(model, _value_model("shared", model), *args, prompt=images)
    return completion_values(_value_model("separate", model), *args, prompt=images)


def _cfg(critic: str) -> PPOConfig:
    return configure(
        PPOConfig,
        num_generations=G,
        max_new_tokens=N,
        kl_coef=0.05,
        critic=critic,
        grad_accum=1,
        packing=PackingConfig(mode="off"),
    )


def _run(images=None, critic="separate"):
    """One PPO step on ``_input()``'s prompts with ``images(model, prompts)`` as their inputs."""
    cfg = _cfg(critic)
    model = _model()
    state = init_state(
        model,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
        critic=_value_model(critic, model),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    step = make_ppo_step(
        cfg, StepParts(reward_fns=[_fives], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    batch = _input()
    inputs = None if images is None else images(model, batch.device)
    new, out = step(state, WithHost(batch.device.replace(images=inputs), batch.host))
    return inputs, new, out


def _masked_mean(x, m):
    return float(np.sum(np.where(m, x, 0.0)) / np.sum(m))


@pytest.mark.parametrize(
    "critic", [pytest.param("separate", marks=pytest.mark.slow), "shared"]
)  # the separate critic's step: make test-all
@pytest.mark.slow
def test_log_probs_and_values_read_the_images(critic):
    images, _, out = _run(_images, critic)
    b, metrics = out.device.batch, out.device.metrics
    m = np.asarray(b.mask, bool)
    want = completion_logprobs(
        _model(), b.prompt_ids, b.prompt_mask, b.tokens, b.mask, HOW, prompt=images
    )
    np.testing.assert_allclose(np.asarray(b.old_logprobs)[m], np.asarray(want)[m], atol=2e-5)
    values = np.asarray(_values(critic, images, b))
    np.testing.assert_allclose(np.asarray(b.old_values)[m], values[m], atol=2e-5)
    # the update's forwards read them too: the actor's log-probs are the sampler's, and the
    # value loss's values at its first (only) optimizer step are the direct ones
    assert float(metrics["mismatch/abs_max"]) < 1e-4
    loss_m = np.asarray(b.loss_mask) > 0
    np.testing.assert_allclose(
        float(metrics["critic/vpred"]), _masked_mean(values, loss_m), rtol=1e-5, atol=1e-6
    )
    # and the images matter: the same completions' values without them differ
    plain = np.asarray(_values(critic, None, b))
    assert not np.allclose(values[m], plain[m], atol=1e-3)


@pytest.mark.slow  # two more PPO steps per critic: make test-all
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_text_prompt_inputs_are_the_step_without_images(critic):
    _, a, out_a = _run(lambda m, b: text_prompt_inputs(m, b.prompt_ids, b.prompt_mask), critic)
    _, b, out_b = _run(None, critic)
    ba, bb = out_a.device.batch, out_b.device.batch
    np.testing.assert_array_equal(np.asarray(ba.tokens), np.asarray(bb.tokens))
    m = np.asarray(ba.mask, bool)
    np.testing.assert_allclose(
        np.asarray(ba.old_values)[m], np.asarray(bb.old_values)[m], atol=1e-6, rtol=0
    )
    for x, y in zip(jax.tree.leaves((a.policy, a.critic)), jax.tree.leaves((b.policy, b.critic))):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "change, named",
    [(dict(hidden_size=48), "hidden_size 48"), (dict(rope_theta=500.0), "rope_theta 500.0")],
)
def test_a_critic_that_cannot_read_the_features_is_refused_at_start(tmp_path, change, named):
    other = init(dataclasses.replace(CFG, **change), jax.random.key(5), std=0.3)
    save_critic(init_critic(other), tmp_path / "critic")
    cfg = dataclasses.replace(_cfg("separate"), critic_model=str(tmp_path / "critic"))
    make_state(cfg, _model(), jax.random.key(1))  # text prompts: any critic
    with pytest.raises(ValueError, match=f"image prompts: the critic .*{named}"):
        make_state(cfg, _model(), jax.random.key(1), images=True)
    make_state(_cfg("separate"), _model(), jax.random.key(1), images=True)  # the policy's copy


@pytest.mark.slow
def test_a_step_refuses_a_critic_of_another_width():
    cfg = _cfg("separate")
    model = _model()
    other = init(dataclasses.replace(CFG, hidden_size=48), jax.random.key(5), std=0.3)
    state = init_state(
        model,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
        critic=init_critic(other),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    step = make_ppo_step(
        cfg, StepParts(reward_fns=[_fives], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    batch = _input()
    inputs = _images(model, batch.device)
    with pytest.raises(ValueError, match="hidden_size 48 \\(the policy's: 32\\)"):
        step(state, WithHost(batch.device.replace(images=inputs), batch.host))


def test_vineppo_refuses_image_prompts():
    ppo = configure(PPOConfig, advantage="vineppo")
    with pytest.raises(ValueError, match="vineppo branches from text prefixes"):
        PPORunConfig(model="vlm", data="rows.jsonl", image_field="image", ppo=ppo)
    PPORunConfig(model="vlm", data="rows.jsonl", ppo=ppo)  # text prompts: fine
