"""The GRPO trainer: prefix-shared training forward, update invariances, NaN guard, learning."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_parallel import _decode, fives

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig, preset
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import LossRows, step_input
from relax.algorithms.online.step import StepParts
from relax.models import ModelConfig, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.forward_pass import ForwardPass
from relax.models.forward.prefix_shared import completion_logprobs, completion_rope
from relax.objectives.reference import ReferenceConfig
from relax.passes import choose_passes
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state

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


def _prompts(p, lp, lengths, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.zeros((p, lp), np.int32)
    mask = np.zeros((p, lp), np.int32)
    for i, n in enumerate(lengths):
        ids[i, lp - n :] = rng.integers(1, CFG.vocab_size, n)
        mask[i, lp - n :] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.slow
def test_prefix_shared_forward_equals_full_sequence(window):
    cfg = ModelConfig(**{**CFG.__dict__, "sliding_window": window})
    model = init(cfg, jax.random.key(0), std=0.3)
    p, g, n, lp = 3, 4, 6, 8
    ids, pm = _prompts(p, lp, [8, 3, 5])
    comp = jax.random.randint(jax.random.key(1), (p, g, n), 0, cfg.vocab_size)
    cm = np.ones((p, g, n), np.int32)
    cm[0, 1, 4:] = 0
    cm[2, 3, 1:] = 0
    cm = jnp.asarray(cm)
    full = jnp.concatenate([jnp.repeat(ids, g, 0), comp.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), cm.reshape(p * g, n)], 1)

    def shared(m):
        return completion_logprobs(m, ids, pm, comp, cm, temperature=0.7)

    def direct(m):
        return token_logprobs(m, full, fmask, temperature=0.7)[:, lp - 1 :].reshape(p, g, n)

    got, want = shared(model), direct(model)
    chex.assert_shape(got, (p, g, n))
    np.testing.assert_allclose(np.where(cm, got, 0), np.where(cm, want, 0), atol=1e-5)
    # one prompt group per pass (the CPU reference forward): the same log-probs and entropies
    per_group = completion_logprobs(
        model, ids, pm, comp, cm, ForwardPass(with_entropy=True, groups_per_pass=1), temperature=0.7
    )
    whole = completion_logprobs(
        model, ids, pm, comp, cm, ForwardPass(with_entropy=True), temperature=0.7
    )
    # the same arithmetic in another reduction order (float32 on a GPU differs by ~2e-6)
    chex.assert_trees_all_close(per_group, whole, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="groups_per_pass=2 does not divide the 3 prompt groups"):
        completion_logprobs(model, ids, pm, comp, cm, ForwardPass(groups_per_pass=2))
    w = jax.random.normal(jax.random.key(2), (p, g, n)) * cm
    g1 = jax.grad(lambda m: jnp.sum(w * shared(m)))(model)
    g2 = jax.grad(lambda m: jnp.sum(w * direct(m)))(model)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g2))
    chex.assert_trees_all_close(g1, g2, atol=1e-5 * scale, rtol=1e-4)
    # the CPU update's options (unrolled layers, attention probabilities kept for the backward)
    fast = lambda m: completion_logprobs(
        m, ids, pm, comp, cm, ForwardPass(unroll=True, save_attention=True), temperature=0.7
    )
    np.testing.assert_allclose(np.where(cm, fast(model), 0), np.where(cm, want, 0), atol=1e-5)
    g3 = jax.grad(lambda m: jnp.sum(w * fast(m)))(model)
    chex.assert_trees_all_close(g3, g2, atol=1e-5 * scale, rtol=1e-4)
    # the rotary tables computed once outside (as the update does): the same values
    rope = completion_rope(cfg, pm, g, n)
    outside = completion_logprobs(
        model, ids, pm, comp, cm, ForwardPass(unroll=True), temperature=0.7, rope=rope
    )
    np.testing.assert_allclose(np.where(cm, outside, 0), np.where(cm, want, 0), atol=1e-5)


def test_completion_rope_tables_match_numpy():
    """Left-padded prompt token j of a length-l prompt sits at position j - (Lp - l) (padding at 0);
    completion token t at l + t; the tables are cos/sin of position * theta^(-2i/d), halves repeated."""
    p, g, n, lp = 3, 2, 4, 6
    lengths = [6, 2, 4]
    _, pm = _prompts(p, lp, lengths)
    rope = completion_rope(CFG, pm, g, n)
    d = CFG.head_dim
    inv = 1.0 / CFG.rope_theta ** (np.arange(0, d, 2) / d)
    table = lambda pos: (
        np.cos(np.concatenate([np.outer(pos, inv)] * 2, 1)),
        np.sin(np.concatenate([np.outer(pos, inv)] * 2, 1)),
    )
    chex.assert_shape(rope.prompt, ((p, lp, d),) * 2)
    chex.assert_shape(rope.completion, ((p, g, n, d),) * 2)
    for i, length in enumerate(lengths):
        pos = np.maximum(np.arange(lp) - (lp - length), 0)
        for got, want in zip(rope.prompt, table(pos)):
            np.testing.assert_allclose(got[i], want, atol=2e-6)
        for got, want in zip(rope.completion, table(length + np.arange(n))):
            for j in range(g):
                np.testing.assert_allclose(got[i, j], want, atol=2e-6)


def _update_data(p=4, g=4, n=5, seed=0, adv_scale=1.0):
    key = jax.random.key(seed)
    ids, pm = _prompts(p, 6, [6, 2, 4, 5][:p], seed)
    k1, k2, k3 = jax.random.split(key, 3)
    tokens = jax.random.randint(k1, (p, g, n), 0, CFG.vocab_size)
    mask = (jnp.arange(n)[None, None, :] < jax.random.randint(k2, (p, g, 1), 1, n + 1)).astype(
        jnp.int32
    )
    return LossRows(
        prompt_ids=ids,
        prompt_mask=pm,
        tokens=tokens,
        mask=mask,
        loss_mask=mask,
        old_logprobs=-2.0 + 0.1 * jax.random.normal(k3, (p, g, n)),
        advantages=adv_scale * jax.random.normal(jax.random.fold_in(key, 7), (p, g)),
    )


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])  # token-mean: test_aggregation
@pytest.mark.slow
def test_gradient_accumulation_does_not_change_the_update(loss_type):
    """Same loss normalisers whatever the micro-batching: the updated params and every metric
    (extremes such as ratio_max included) agree."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _update_data()
    results = []
    # 4: one prompt group per micro-batch, the finest split; None: the default (4 on one CPU device)
    for accum in (1, 4, None):
        cfg = configure(
            GRPOConfig,
            num_generations=4,
            max_new_tokens=5,
            loss_type=loss_type,
            grad_accum=accum,
            # a large Adam eps keeps the first step smooth in g (no sign(g) amplification)
            optimizer=OptimizerConfig(learning_rate=1e-2, eps=1e-2, max_grad_norm=None),
        )
        opt = cfg.optimizer.make()
        policy, _, metrics = jax.jit(make_grpo_update(cfg, opt, choose_passes()))(
            model, opt.init(model), data, jax.random.key(0)
        )
        results.append((policy, metrics))
    assert (
        float(results[0][1]["ratio_max"]) > float(results[0][1]["ratio_mean"]) + 0.05
    )  # a real spread
    for policy, metrics in results[1:]:
        chex.assert_trees_all_close(policy, results[0][0], atol=1e-6)
        assert metrics.keys() == results[0][1].keys()
        for name, value in metrics.items():
            np.testing.assert_allclose(
                value, results[0][1][name], rtol=1e-5, atol=1e-6, err_msg=name
            )


@pytest.mark.slow
def test_minibatch_losses_average_to_the_full_batch_loss():
    """Normalisers come from the whole batch (divided by M), so each minibatch loss is on the
    full-batch scale and their mean is exactly the full-batch loss (lr=0: nothing moves)."""
    model = init(CFG, jax.random.key(4), std=0.2)
    data = _update_data()
    losses = {}
    for m in (1, 4):
        cfg = configure(
            GRPOConfig, num_generations=4, max_new_tokens=5, loss_type="dapo", num_minibatches=m
        )
        opt = (
            optax.set_to_zero()
        )  # nothing moves (a zero learning rate is refused by OptimizerConfig)
        _, _, metrics = jax.jit(make_grpo_update(cfg, opt, choose_passes()))(
            model, opt.init(model), data, jax.random.key(0)
        )
        losses[m] = float(metrics["loss"])  # mean over the M minibatch steps
    np.testing.assert_allclose(losses[4], losses[1], rtol=1e-5)


@pytest.mark.slow
def test_non_finite_gradients_skip_the_update():
    model = init(CFG, jax.random.key(5), std=0.2)
    cfg = configure(
        GRPOConfig,
        num_generations=4,
        max_new_tokens=5,
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    opt = cfg.optimizer.make()
    update = jax.jit(make_grpo_update(cfg, opt, choose_passes()))
    bad = _update_data()
    bad = bad.replace(advantages=bad.advantages.at[0, 0].set(jnp.nan))
    policy, opt_state, metrics = update(model, opt.init(model), bad, jax.random.key(0))
    assert not np.isfinite(float(metrics["loss"]))
    assert int(opt_state.total_notfinite) == 1
    chex.assert_trees_all_equal(policy, model)  # nothing reached the weights
    policy, opt_state, _ = update(policy, opt_state, _update_data(), jax.random.key(0))
    assert int(opt_state.total_notfinite) == 1
    assert not np.allclose(np.asarray(policy.layers.wq), np.asarray(model.layers.wq))


@pytest.mark.slow
def test_grpo_learns_and_compiles_once():
    policy = init(CFG, jax.random.key(0), std=0.02)
    cfg = preset(
        "grpo",
        num_generations=8,
        max_new_tokens=6,
        beta=0.04,
        num_minibatches=2,
        optimizer=OptimizerConfig(learning_rate=3e-2),
    )
    opt = cfg.optimizer.make()
    state = init_state(policy, opt, key=jax.random.key(1), with_reference=True)
    step = make_grpo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0))
    ids, pm = _prompts(4, 8, [8, 5, 3, 7])
    rewards = []
    for _ in range(25):
        state, out = step(state, step_input(ids, pm, ["p"] * 4, {"weight": [1.0] * 4}))
        rewards.append(float(out.device.metrics["reward"]))
        assert np.isfinite(float(out.device.metrics["loss"]))
    assert np.mean(rewards[-5:]) > np.mean(rewards[:3]) + 0.3, rewards
    assert int(state.step) == 25
    assert step.cache_sizes() == (
        1,
        1,
        1,
    )  # rollout, reference and advantage+update compiled once each
    assert float(out.device.metrics["mismatch/abs_max"]) < 1e-4  # sampler == trainer


def _first_token_is_seven(prompt_ids, prompt_mask, completion_ids, completion_mask):
    return (completion_ids[..., 0] == 7).astype(jnp.float32)


@pytest.mark.parametrize(
    "name,overrides",
    [
        # DAPO + overlong penalty + length shaping + Signal's conservative KL + CISPO
        (
            "dapo",
            {
                "overlong_buffer": 2,
                "length_shaping": "punitive",
                "length_target": 3.0,
                "length_coef": 0.5,
                "beta": 0.04,
                "kl_threshold": 0.01,
                "policy_loss": "cispo",
                "epsilon_high": 4.0,
            },
        ),
        # RLOO preset + REINFORCE++ token advantages + GSPO sequence ratios + KL in the reward + EMA reference
        (
            "rloo",
            {
                "advantage": "reinforce_pp",
                "importance_sampling_level": "sequence",
                "beta": 0.04,
                "kl_in_reward": True,
                "reference": ReferenceConfig(kind="ema", alpha=0.5),
            },
        ),
    ],
)
@pytest.mark.slow
def test_every_preset_and_option_runs(name, overrides):
    from relax.rewards.token_rewards import TokenRewardFunction

    cfg = preset(name, num_generations=4, max_new_tokens=4, **overrides)
    policy = init(CFG, jax.random.key(0), std=0.3)
    opt = cfg.optimizer.make()
    state = init_state(policy, opt, key=jax.random.key(1), with_reference=cfg.needs_reference)
    token_reward = TokenRewardFunction(_first_token_is_seven, name="seven", weight=0.5)
    step = make_grpo_step(
        cfg, StepParts(reward_fns=[fives, token_reward], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    ids, pm = _prompts(2, 8, [8, 5])
    state, out = step(state, step_input(ids, pm, ["p"] * 2, {"weight": [1.0, 2.0]}))
    m, scored = out.device.metrics, out.device.batch
    assert set(scored.reward_parts) == {"fives", "seven"}
    np.testing.assert_allclose(
        scored.rewards, scored.reward_parts["fives"] + 0.5 * scored.reward_parts["seven"], rtol=1e-6
    )
    assert all(np.isfinite(float(v)) for v in m.values()), m
    assert int(state.step) == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("learning_rate", float("nan")),
        ("learning_rate", -1e-6),
        ("learning_rate", 0.0),
        ("learning_rate", float("inf")),
        ("weight_decay", -0.1),
        ("eps", 0.0),
        ("b2", 1.0),
        ("max_grad_norm", 0.0),
    ],
)
def test_optimizer_refuses_values_that_poison_or_reverse_training(field, value):
    with pytest.raises(ValueError, match=field):
        OptimizerConfig(**{field: value})


def test_nan_learning_rate_flag_is_refused_before_anything_runs(capsys):
    from conftest import load_example

    with pytest.raises(SystemExit):
        load_example("grpo").parse_args(["--grpo.optimizer.learning-rate", "nan"])
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())  # tyro's box, wrapped
    assert "learning_rate must be finite and > 0, got nan" in err
