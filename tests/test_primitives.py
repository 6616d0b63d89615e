"""The research primitives (relax.train.primitives): the README's own loop runs and learns, and
forward_backward / optim_step / logprobs / sample agree with independent computations."""

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from relax.masked import masked_mean
from relax.models import ModelConfig, init
from relax.objectives.registry import policy_loss
from relax.rollout.sampler import RolloutConfig
from relax.train.primitives import forward_backward, logprobs, optim_step, policy_logprobs, sample
from relax.train.state import init_state

README = Path(__file__).resolve().parents[1] / "docs" / "research.md"
MARK = "<!-- primitives-loop -->"

# grouped-query attention (2 query heads per KV head), left-padded prompts of two lengths
CFG = ModelConfig(
    vocab_size=16,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)
P, G, N, LP, EOS = 2, 4, 6, 8, 3
ROLLOUT = RolloutConfig(num_generations=G, max_new_tokens=N, eos_ids=(EOS,), prompt_buckets=(LP,))


def readme_loop() -> str:
    text = README.read_text()
    assert text.count(MARK) == 1, f"README.md must mark the loop once with {MARK}"
    block = text.split(MARK, 1)[1].lstrip("\n")
    assert block.startswith("```python\n"), "the marker must sit right before a ```python fence"
    return block[len("```python\n") :].split("\n```", 1)[0]


@pytest.mark.slow
def test_readme_loop_learns():
    src = readme_loop()
    assert len(src.splitlines()) <= 30
    ns = {"__name__": "readme_primitives_loop"}
    exec(compile(src, f"{README}:primitives-loop", "exec"), ns)
    history = np.asarray(ns["history"], np.float64)
    assert history.shape == (20,)
    # reward = share of tokens equal to TARGET: ~1/16 for the random model, ~1 once learnt
    assert history[:2].mean() < 0.2 and history[-5:].mean() > 0.8, history
    assert int(ns["state"].step) == 20 and np.isfinite(float(ns["metrics"]["loss"]))


@pytest.fixture(scope="module")
def setup():
    state = init_state(
        init(CFG, jax.random.key(0), std=0.3), optax.adam(1e-2), key=jax.random.key(1)
    )
    lengths = [LP, 5]
    ids = np.zeros((P, LP), np.int32)
    pm = np.zeros((P, LP), np.int32)
    rng = np.random.default_rng(0)
    for i, n in enumerate(lengths):
        ids[i, LP - n :] = rng.integers(4, CFG.vocab_size, n)
        pm[i, LP - n :] = 1
    ids, pm = jnp.asarray(ids), jnp.asarray(pm)
    rollout = sample(state, ids, pm, ROLLOUT)
    batch = {"prompt_ids": ids, "prompt_mask": pm, "tokens": rollout.tokens, "mask": rollout.mask}
    return state, rollout, batch


@pytest.mark.slow
def test_sample(setup):
    state, rollout, batch = setup
    chex.assert_shape([rollout.tokens, rollout.mask, rollout.logprobs], (P, G, N))
    chex.assert_shape([rollout.lengths, rollout.finished], (P, G))
    chex.assert_type([rollout.tokens, rollout.mask], jnp.int32)
    tokens, mask = np.asarray(rollout.tokens), np.asarray(rollout.mask)
    assert 0 < mask.sum() < mask.size, "the fixture should have completions cut short by EOS"
    for t, m in zip(tokens.reshape(-1, N), mask.reshape(-1, N)):
        stop = np.flatnonzero(t == EOS)
        n = stop[0] + 1 if stop.size else N  # 1 up to and including the first stop token
        np.testing.assert_array_equal(m, np.arange(N) < n)
        assert np.all(t[n:] == ROLLOUT.pad_id)
    np.testing.assert_array_equal(rollout.lengths, mask.sum(-1))
    np.testing.assert_array_equal(rollout.finished, (tokens == EOS).any(-1))
    assert np.all(np.asarray(rollout.logprobs)[mask == 0] == 0.0) and np.all(
        np.asarray(rollout.logprobs) <= 0.0
    )
    # the default key is derived from the state's key and step
    again = sample(
        state,
        batch["prompt_ids"],
        batch["prompt_mask"],
        ROLLOUT,
        key=jax.random.fold_in(state.key, state.step),
    )
    np.testing.assert_array_equal(again.tokens, rollout.tokens)


def test_logprobs_equal_the_samplers(setup):
    state, rollout, batch = setup
    lp = jax.jit(logprobs)(state, batch)
    chex.assert_shape(lp, (P, G, N))
    chex.assert_type(lp, jnp.float32)
    mask = np.asarray(rollout.mask) > 0
    np.testing.assert_allclose(
        np.where(mask, lp, 0.0), np.where(mask, rollout.logprobs, 0.0), atol=1e-4
    )


def direct_logprobs(policy, batch):
    """The completions' log-probs from the plain full-sequence forward: each completion after its
    own copy of the prompt, ``log_softmax`` of the model's logits at the previous position."""
    ids = jnp.concatenate(
        [jnp.repeat(batch["prompt_ids"], G, 0), batch["tokens"].reshape(P * G, N)], 1
    )
    attn = jnp.concatenate(
        [jnp.repeat(batch["prompt_mask"], G, 0), batch["mask"].reshape(P * G, N)], 1
    )
    logits = policy(ids, attn)  # [B, LP + N, V]
    logp = jax.nn.log_softmax(logits[:, LP - 1 : -1], axis=-1)
    return jnp.take_along_axis(logp, batch["tokens"].reshape(P * G, N, 1), axis=-1)[..., 0]


@pytest.mark.slow
def test_forward_backward_equals_grad_of_the_composed_loss(setup):
    state, rollout, batch = setup
    rng = np.random.default_rng(1)
    mask = np.asarray(rollout.mask).reshape(P * G, N) > 0
    # old log-probs off the policy's so that tokens fall on both sides of the clip range
    old = jnp.asarray(
        np.asarray(rollout.logprobs).reshape(P * G, N) + rng.normal(0, 0.3, (P * G, N)), jnp.float32
    )
    adv = jnp.asarray(rng.normal(size=P * G), jnp.float32)
    batch = {**batch, "old_logp": old, "advantages": adv}
    ppo = policy_loss("ppo")

    def loss_fn(policy, batch):
        logp = policy_logprobs(policy, batch).reshape(P * G, N)
        per_token, metrics = ppo(logp, batch["old_logp"], batch["advantages"], mask)
        return masked_mean(per_token, mask), metrics

    def direct(
        policy,
    ):  # the same loss written out: token-mean of PPO's pessimistic clipped surrogate
        r = jnp.exp(direct_logprobs(policy, batch) - old)
        a = adv[:, None]
        per_token = jnp.maximum(-a * r, -a * jnp.clip(r, 0.8, 1.2))
        return jnp.sum(jnp.where(mask, per_token, 0.0)) / mask.sum()

    grads, metrics = jax.jit(lambda s, b: forward_backward(s, b, loss_fn))(state, batch)
    loss, want = jax.jit(jax.value_and_grad(direct))(state.policy)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, state.policy)
    np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
    clipped = float(metrics["clip_frac_low"]) + float(metrics["clip_frac_high"])
    assert 0.0 < clipped < 1.0, clipped  # both branches of the surrogate are exercised
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        assert scale > 0, path
        np.testing.assert_allclose(
            g, w, rtol=1e-4, atol=2e-5 * scale, err_msg=jax.tree_util.keystr(path)
        )


@pytest.mark.slow
def test_optim_step_equals_optax_by_hand(setup):
    state, _, _ = setup
    # clipping and decoupled weight decay: the update reads the gradients' norm and the params
    opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
    state = init_state(state.policy, opt, key=jax.random.key(3))
    leaves, treedef = jax.tree.flatten(state.policy)
    keys = jax.random.split(jax.random.key(4), 2 * len(leaves))
    params, opt_state = state.policy, opt.init(state.policy)
    step = jax.jit(optim_step)
    for k in range(2):
        grads = jax.tree.unflatten(
            treedef,
            [jax.random.normal(key, x.shape, x.dtype) for key, x in zip(keys[k::2], leaves)],
        )
        state = step(state, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        chex.assert_trees_all_close(state.policy, params, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(state.opt_state, opt_state, rtol=1e-6, atol=1e-7)
        assert int(state.step) == k + 1
    chex.assert_trees_all_equal_shapes_and_dtypes(state.policy, setup[0].policy)
    assert not jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state.policy, setup[0].policy)
    )
    np.testing.assert_array_equal(
        jax.random.key_data(state.key), jax.random.key_data(jax.random.key(3))
    )
