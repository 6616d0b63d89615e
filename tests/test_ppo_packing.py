"""PPO's padding-free update (relax.models.forward.completion_packing): a critic's values and the policy's
log-probs, entropies and values of one joint forward over packed bins against the plain
full-sequence forward (``hidden_states``, ``token_logprobs``: the independent reference), with
their gradients; the composed PPO step (values, GAE, actor and critic updates) with packing on
equal to it off, for a separate critic and a value head, every loss aggregation mode, with
gradient accumulation."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_completion_packing import _pack, _ragged, assert_same_steps
from test_parallel import _decode, fives
from test_train import CFG, _prompts

from relax.algorithms.cli.configure import configure
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.step import make_ppo_step
from relax.data.completion_layout import PackingConfig
from relax.models import hidden_states, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.forward_pass import ForwardPass
from relax.models.heads.critic import (
    completion_logprobs_and_values,
    completion_values,
    init_critic,
    init_value_head,
)
from relax.objectives.aggregation import AGGREGATION_MODES
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state


def _setup(p=3, g=5, n=6, lp=8):
    ids, pm = _prompts(p, lp, [8, 3, 5])
    tokens, mask = _ragged(p, g, n, seed=1)
    packed = _pack(ids, pm, tokens, mask)
    assert int(jnp.sum(packed.num_pairs > 0)) < p * g / 2  # several completions share a bin
    full = jnp.concatenate([jnp.repeat(ids, g, 0), jnp.asarray(tokens).reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), jnp.asarray(mask).reshape(p * g, n)], 1)
    return ids, pm, jnp.asarray(tokens), jnp.asarray(mask), packed, full, fmask


def _full_values(backbone, head, bias, full, fmask, shape):
    """``V[p, g, t] = h . head + b`` with ``h`` the plain forward's hidden state at the position
    before completion token ``t`` (the last prompt position for ``t = 0``)."""
    p, g, n = shape
    h = hidden_states(backbone, full, fmask)[:, -n - 1 : -1]
    return (jnp.sum(h * head, -1) + bias).reshape(p, g, n)


@pytest.mark.slow
def test_packed_critic_values_and_gradients_equal_the_full_sequence_forward():
    ids, pm, tokens, mask, packed, full, fmask = _setup()
    critic = init_critic(init(CFG, jax.random.key(0), std=0.3))
    critic = critic.__class__(
        critic.backbone,
        0.5 * jax.random.normal(jax.random.key(4), critic.head.shape),
        jnp.float32(0.25),
    )
    got = completion_values(critic, ids, pm, tokens, mask, packed=packed)
    chex.assert_shape(got, tokens.shape)

    def direct(c):
        return _full_values(c.backbone, c.head, c.bias, full, fmask, tokens.shape)

    np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, direct(critic), 0), atol=1e-5)
    w = jax.random.normal(jax.random.key(2), tokens.shape) * mask
    want = jax.grad(lambda c: jnp.sum(w * direct(c)))(critic)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    # the CPU update's options too
    for how in (ForwardPass(), ForwardPass(unroll=True, save_attention=True)):
        grad = jax.grad(
            lambda c: jnp.sum(w * completion_values(c, ids, pm, tokens, mask, how, packed=packed))
        )(critic)
        chex.assert_trees_all_close(grad, want, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.slow
def test_packed_joint_forward_equals_the_full_sequence_forward():
    """Log-probs, entropies and values of one packed forward of the policy with a value head,
    and the gradient of a weighted sum of log-probs and values."""
    ids, pm, tokens, mask, packed, full, fmask = _setup()
    p, g, n = tokens.shape
    policy = init(CFG, jax.random.key(0), std=0.3)
    head = init_value_head(CFG, 0.5, key=jax.random.key(4))
    lp, ent, values = completion_logprobs_and_values(
        policy, head, ids, pm, tokens, mask, temperature=0.7, packed=packed
    )
    chex.assert_shape([lp, ent, values], (p, g, n))
    lp_padded, ent_padded, _ = completion_logprobs_and_values(
        policy, head, ids, pm, tokens, mask, temperature=0.7
    )
    lp_full = token_logprobs(policy, full, fmask, temperature=0.7)[:, -n:].reshape(p, g, n)
    v_full = _full_values(policy, head.head, head.bias, full, fmask, (p, g, n))
    for got, want in ((lp, lp_full), (ent, ent_padded), (values, v_full)):
        np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), atol=1e-5)
    w1, w2 = (jax.random.normal(jax.random.key(k), (p, g, n)) * mask for k in (2, 3))

    def direct(params):
        m, h = params
        lp = token_logprobs(m, full, fmask, temperature=0.7)[:, -n:].reshape(p, g, n)
        return jnp.sum(w1 * lp + w2 * _full_values(m, h.head, h.bias, full, fmask, (p, g, n)))

    def packed_sum(params):
        lp, _, v = completion_logprobs_and_values(
            *params, ids, pm, tokens, mask, temperature=0.7, packed=packed
        )
        return jnp.sum(w1 * lp + w2 * v)

    want = jax.grad(direct)((policy, head))
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(want))
    chex.assert_trees_all_close(
        jax.grad(packed_sum)((policy, head)), want, atol=1e-5 * scale, rtol=1e-4
    )


# the rest in make test-all; the value head's packed joint forward has a fast test above
FAST = (("separate", "token-mean"),)


@pytest.mark.parametrize(
    "critic,loss_type",
    [
        (c, m) if (c, m) in FAST else pytest.param(c, m, marks=pytest.mark.slow)
        for c in ("separate", "shared")
        for m in AGGREGATION_MODES
    ],
)
@pytest.mark.slow
def test_ppo_step_with_packing_equals_it_without(critic, loss_type):
    """Two iterations of the composed PPO step (rollout, pack, reference, values and GAE, actor and
    critic updates) on completions that stop early: the same samples, metrics, policy and critic
    with packing on (one bin per micro-batch, accumulated) and off (one micro-batch). One
    minibatch: a packed update's minibatches are sets of bins, a padded one's sets of groups."""
    ids, pm = _prompts(4, 6, [6, 2, 4, 5])
    batch = step_input(ids, pm, ["a", "b", "c", "d"], {"weight": [1.0] * 4})
    runs = {}
    for mode in ("on", "off"):
        cfg = configure(
            PPOConfig,
            num_generations=4,
            max_new_tokens=8,
            kl_coef=0.05,
            critic=critic,
            loss_type=loss_type,
            entropy_coef=0.01,
            num_iterations=2,
            packing=PackingConfig(mode=mode, bin_tokens=24),
            optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-2, max_grad_norm=None),
            critic_optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-2, max_grad_norm=None),
        )
        policy = init(CFG, jax.random.key(0), std=0.3)
        value = (
            init_value_head(CFG, 0.5, key=jax.random.key(5))
            if critic == "shared"
            else init_critic(policy)
        )
        state = init_state(
            policy,
            cfg.optimizer.make(),
            key=jax.random.key(1),
            with_reference=True,
            critic=value,
            critic_optimizer=cfg.critic_optimizer.make(),
        )
        step = make_ppo_step(
            cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(3,), pad_id=0)
        )  # token 3 ends a completion
        out = []
        for _ in range(2):
            state, b = step(state, batch)
            out.append(
                (
                    np.asarray(b.device.batch.tokens),
                    {k: float(v) for k, v in b.device.metrics.items()},
                )
            )
        runs[mode] = (out, state.policy, state.critic)
    (on, policy_on, critic_on), (off, policy_off, critic_off) = runs["on"], runs["off"]
    assert (
        on[0][1]["pack_bins"] < 4 and "pack_bins" not in off[0][1]
    )  # packed, several groups to a bin
    assert on[1][1]["critic/vf_mse"] > 0 and on[1][1]["kl"] > 0  # values and the KL are not trivial
    assert_same_steps(on, off)
    # Adam's round-off on gradient components within float noise of 0 (tests/test_parallel.py's WEIGHT_ATOL)
    chex.assert_trees_all_close(policy_on, policy_off, atol=5e-3 * 1e-2)
    chex.assert_trees_all_close(critic_on, critic_off, atol=5e-3 * 1e-2)
