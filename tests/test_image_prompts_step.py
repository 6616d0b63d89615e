"""Image prompts through a composed GRPO step: ``Prompts.images`` (``PromptInputs``) reaches the
sampler, the reference, the update's forwards and the mismatch metrics. Checked against the
prefix-shared forward called directly (sampler == trainer with the images), and end to end:
text-only ``PromptInputs`` give the step without images exactly, real image features change
it, and packing leaves image batches padded (``on`` refuses)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_batch import CFG, LP, G, N, P, _decode, _fives, _input

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.step import StepParts
from relax.compose import WithHost
from relax.data.completion_layout import PackingConfig
from relax.models import init
from relax.models.decoder.prompt_inputs import PromptInputs, text_prompt_inputs
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.layers.rope import rotary
from relax.train.state import init_state


def _images(model, batch) -> PromptInputs:
    """Prompt tokens 2..5 of every row (all valid) are one image: random features, one shared
    RoPE position per two tokens, one bidirectional block."""
    ids, mask = batch.prompt_ids, batch.prompt_mask
    is_image = jnp.zeros(ids.shape, bool).at[:, 3:7].set(True) & mask.astype(bool)
    pos = jnp.asarray([0, 1, 2, 3, 3, 4, 4, 5])[None].repeat(P, 0)
    pos = jnp.where(mask.astype(bool), pos - (LP - jnp.sum(mask, 1, keepdims=True)), 0)
    pos = jnp.maximum(pos, 0)
    features = jax.random.normal(jax.random.key(7), (*ids.shape, CFG.hidden_size))
    return PromptInputs(
        features=features,
        is_image=is_image,
        rope=rotary(CFG, pos),
        next_position=jnp.max(pos, axis=1) + 1,
        blocks=is_image.astype(jnp.int32),
    )


def _model():
    return init(CFG, jax.random.key(0), std=0.3)


def _run(images=None, packing=None):
    """One GRPO step (the state's buffers are donated: ``_model()`` builds the policy again)."""
    packing = PackingConfig(mode="off") if packing is None else packing
    cfg = configure(GRPOConfig, num_generations=G, max_new_tokens=N, beta=0.04, packing=packing)
    model = _model()
    state = init_state(model, cfg.optimizer.make(), key=jax.random.key(1), with_reference=True)
    step = make_grpo_step(
        cfg, StepParts(reward_fns=[_fives], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    batch = _input()
    inputs = None if images is None else images(model, batch.device)
    batch = WithHost(batch.device.replace(images=inputs), batch.host)
    new, out = step(state, batch)
    return model, inputs, new, out


@pytest.mark.slow
def test_the_sampler_and_every_forward_read_the_images():
    _, images, new, out = _run(_images)
    b = out.device.batch
    want = completion_logprobs(
        _model(),
        b.prompt_ids,
        b.prompt_mask,
        b.tokens,
        b.mask,
        ForwardPass(attention="group"),
        prompt=images,
    )
    m = np.asarray(b.mask, bool)
    np.testing.assert_allclose(np.asarray(b.old_logprobs)[m], np.asarray(want)[m], atol=2e-5)
    # the update's own forward read them too: the trainer's log-probs are the sampler's
    assert float(out.device.metrics["mismatch/abs_max"]) < 1e-4
    _, _, plain, plain_out = _run(None)
    assert not np.allclose(
        np.asarray(b.old_logprobs)[m], np.asarray(plain_out.device.batch.old_logprobs)[m], atol=1e-3
    )


@pytest.mark.slow
def test_text_prompt_inputs_are_the_step_without_images():
    _, _, a, out_a = _run(lambda m, b: text_prompt_inputs(m, b.prompt_ids, b.prompt_mask))
    _, _, b, out_b = _run(None)
    np.testing.assert_array_equal(
        np.asarray(out_a.device.batch.tokens), np.asarray(out_b.device.batch.tokens)
    )
    for x, y in zip(jax.tree.leaves(a.policy), jax.tree.leaves(b.policy)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)


@pytest.mark.slow
def test_packing_leaves_image_batches_padded():
    _, _, _, out = _run(_images, PackingConfig(mode="auto"))
    assert out.device.batch.packed is None
    with pytest.raises(ValueError, match="image prompts train on padded"):
        _run(_images, PackingConfig(mode="on"))
