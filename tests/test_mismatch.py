"""Sampler-vs-trainer mismatch metrics (relax.objectives.mismatch) against numpy, their first-step
reductions through the update, and the ``mismatch/*`` names in GRPO's and PPO's steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import _decode, fives
from test_train import CFG, _update_data

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.loss import make_actor_loss
from relax.algorithms.ppo.step import make_ppo_step
from relax.metrics import reduce_micro, reduce_steps, values
from relax.models import init
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.heads.critic import init_critic, init_value_head
from relax.objectives.kl import kl_estimate
from relax.objectives.mismatch import mismatch_metrics
from relax.passes import choose_passes
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state
from relax.train.update import make_update

NAMES = (
    "mismatch/k3",
    "mismatch/abs_mean",
    "mismatch/abs_max",
    "mismatch/ratio_out_frac",
    "mismatch/seq_log_ratio",
    "mismatch/seq_log_ratio_abs_max",
)


def numpy_mismatch(logp, sampler, mask) -> dict[str, float]:
    """The metrics by hand in float64: d = logp - sampler on valid tokens, r = exp(d)."""
    logp, sampler, mask = (np.asarray(x, np.float64) for x in (logp, sampler, mask))
    mask = mask > 0
    d = np.where(mask, logp - np.where(mask, sampler, 0.0), 0.0)
    r = np.exp(d[mask])
    seq = d.sum(-1)[mask.any(-1)]
    return {
        "mismatch/k3": float(np.mean(r - np.log(r) - 1.0)) if mask.any() else 0.0,
        "mismatch/abs_mean": float(np.mean(np.abs(d[mask]))) if mask.any() else 0.0,
        "mismatch/abs_max": float(np.max(np.abs(d[mask]), initial=0.0)),
        "mismatch/ratio_out_frac": float(np.mean((r < 0.8) | (r > 1.25))) if mask.any() else 0.0,
        "mismatch/seq_log_ratio": float(np.mean(seq)) if seq.size else 0.0,
        "mismatch/seq_log_ratio_abs_max": float(np.max(np.abs(seq), initial=0.0)),
    }


def _random(n=6, t=7, seed=0):
    """Log-probs whose ratios straddle [0.8, 1.25]; row 2 has no valid token, padding holds -inf."""
    rng = np.random.default_rng(seed)
    sampler = rng.uniform(-4.0, -0.1, (n, t))
    logp = sampler + rng.normal(0.0, 0.3, (n, t))
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, (n, 1))
    mask[2] = False
    sampler = np.where(mask, sampler, -np.inf)
    return logp.astype(np.float32), sampler.astype(np.float32), mask


def test_mismatch_metrics_match_numpy():
    logp, sampler, mask = _random()
    got = mismatch_metrics(jnp.asarray(logp), jnp.asarray(sampler), jnp.asarray(mask))
    want = numpy_mismatch(logp, sampler, mask)
    assert sorted(got) == sorted(NAMES)
    assert 0.05 < want["mismatch/ratio_out_frac"] < 0.95  # tokens on both sides of the band
    for name in NAMES:
        np.testing.assert_allclose(float(got[name].value), want[name], rtol=1e-5, err_msg=name)
    # the KL's direction: k3 of KL(sampler || trainer), the sampler in kl_estimate's policy place
    kl = kl_estimate(jnp.asarray(sampler), jnp.asarray(logp), "k3", mask=jnp.asarray(mask))
    np.testing.assert_allclose(
        float(got["mismatch/k3"].value), float(kl.sum() / mask.sum()), rtol=1e-5
    )
    assert float(got["mismatch/k3"].weight) == mask.sum()
    assert float(got["mismatch/seq_log_ratio"].weight) == mask.any(-1).sum()


def test_hand_values_of_the_docstring_example():
    d = jnp.asarray([[np.log(2.0), 0.0]])
    got = values(mismatch_metrics(d - 1.0, jnp.full((1, 2), -1.0), jnp.ones((1, 2), bool)))
    want = {"k3": (1 - np.log(2)) / 2, "abs_mean": np.log(2) / 2, "abs_max": np.log(2)}
    want |= {"ratio_out_frac": 0.5, "seq_log_ratio": np.log(2), "seq_log_ratio_abs_max": np.log(2)}
    for k, v in want.items():
        np.testing.assert_allclose(float(got[f"mismatch/{k}"]), v, rtol=1e-6, err_msg=k)


def test_no_valid_token_gives_zeros_and_no_gradient():
    logp, sampler, _ = _random()
    empty = jnp.zeros(logp.shape, bool)
    got = mismatch_metrics(jnp.asarray(logp), jnp.full(logp.shape, -jnp.inf), empty)
    for name, m in got.items():
        assert float(m.value) == 0.0, name
    assert float(got["mismatch/k3"].weight) == 0.0

    def total(x):
        return sum(
            m.value
            for m in mismatch_metrics(x, jnp.asarray(sampler), jnp.ones_like(empty)).values()
        )

    grad = jax.grad(total)(jnp.asarray(logp))
    np.testing.assert_array_equal(grad, 0.0)  # detached


def test_first_step_reductions_are_the_exact_means_of_the_first_step():
    """Three micro-batches of unequal tokens and sequences (one empty), two optimizer steps: the
    token and sequence means of the first step exactly, its maxima, never the second step's."""
    logp, sampler, mask = _random(n=9)
    mask[3:6] = False  # micro-batch 2 has no valid token
    steps = []
    for shift in (0.0, 5.0):  # the second step's log-probs moved far
        per_micro = [
            mismatch_metrics(
                jnp.asarray(logp[i : i + 3] + shift), sampler[i : i + 3], mask[i : i + 3]
            )
            for i in (0, 3, 6)
        ]
        stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_micro)
        token_weights = jnp.asarray([9.0, 1.0, 1.0])  # what the update passes: not used by these
        steps.append(reduce_micro(stacked, token_weights))
    got = values(reduce_steps(jax.tree.map(lambda *x: jnp.stack(x), *steps)))
    want = numpy_mismatch(logp, sampler, mask)
    for name in NAMES:
        np.testing.assert_allclose(float(got[name]), want[name], rtol=1e-5, err_msg=name)


def _own_logprobs(model, data, temperature):
    return completion_logprobs(
        model,
        data.prompt_ids,
        data.prompt_mask,
        data.tokens,
        data.mask,
        temperature=temperature,
    )


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.slow
def test_update_reports_the_first_steps_mismatch(algorithm):
    """Sampler log-probs = the trainer's minus a known shift: the update (two micro-batches per
    step, two optimizer steps, the second after a large step) reports the shift's metrics."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _update_data()
    config = GRPOConfig if algorithm == "grpo" else PPOConfig
    cfg = configure(
        config,
        num_generations=4,
        max_new_tokens=5,
        grad_accum=2,
        num_minibatches=1,
        num_iterations=2,
        optimizer=OptimizerConfig(learning_rate=0.3),
    )
    shift = 0.4 * jax.random.normal(jax.random.key(11), data.tokens.shape)
    own = _own_logprobs(model, data, cfg.generation.temperature)
    sampler = jnp.where(data.mask > 0, own - shift, -jnp.inf)
    data = data.replace(old_logprobs=sampler)
    opt = cfg.optimizer.make()
    if algorithm == "grpo":
        update = make_grpo_update(cfg, opt, choose_passes())
    else:
        data = data.replace(
            advantages=jnp.broadcast_to(data.advantages[..., None], data.tokens.shape)
        )
        update = make_update(
            make_actor_loss(cfg, choose_passes()),
            opt,
            epochs=cfg.num_iterations,
            grad_accum=cfg.grad_accum,
        )
    _, _, metrics = jax.jit(update)(model, opt.init(model), data, jax.random.key(0))
    p, g, n = data.tokens.shape
    want = numpy_mismatch(
        np.asarray(own).reshape(p * g, n),
        np.asarray(sampler).reshape(p * g, n),
        np.asarray(data.mask).reshape(p * g, n),
    )
    assert 0.05 < want["mismatch/ratio_out_frac"] < 0.95
    for name in NAMES:
        np.testing.assert_allclose(
            float(metrics[name]), want[name], rtol=1e-4, atol=1e-5, err_msg=name
        )


def _assert_sampler_is_trainer(metrics):
    m = {k: float(metrics[k]) for k in NAMES}
    assert m["mismatch/abs_max"] < 1e-4, m  # float32: the sampler's log-probs are the trainer's
    assert m["mismatch/abs_mean"] <= m["mismatch/abs_max"]
    assert 0.0 <= m["mismatch/k3"] < 1e-8, m
    assert m["mismatch/ratio_out_frac"] == 0.0
    assert abs(m["mismatch/seq_log_ratio"]) <= m["mismatch/seq_log_ratio_abs_max"] < 1e-3


@pytest.mark.slow
def test_grpo_step_reports_mismatch():
    cfg = configure(
        GRPOConfig,
        num_generations=4,
        max_new_tokens=5,
        optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    state = init_state(
        init(CFG, jax.random.key(0), std=0.2), cfg.optimizer.make(), key=jax.random.key(1)
    )
    step = make_grpo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0))
    ids = jax.random.randint(jax.random.key(9), (4, 3), 1, CFG.vocab_size)
    _, out = step(state, step_input(ids, jnp.ones_like(ids), ["x"] * 4, {"weight": [1.0] * 4}))
    _assert_sampler_is_trainer(out.device.metrics)


@pytest.mark.slow
@pytest.mark.parametrize("critic", ["separate", "shared"])
def test_ppo_step_reports_mismatch(critic):
    """Actor-only policy terms (a separate critic) and the joint loss (a value head on the policy)."""
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=5,
        critic=critic,
        optimizer=OptimizerConfig(learning_rate=1e-2),
        critic_optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    policy = init(CFG, jax.random.key(0), std=0.2)
    head = init_value_head(CFG) if cfg.shared_critic else init_critic(policy)
    state = init_state(
        policy,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=cfg.needs_reference,
        critic=head,
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    step = make_ppo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(), pad_id=0))
    ids = jax.random.randint(jax.random.key(9), (4, 3), 1, CFG.vocab_size)
    _, out = step(state, step_input(ids, jnp.ones_like(ids), ["x"] * 4, {"weight": [1.0] * 4}))
    _assert_sampler_is_trainer(out.device.metrics)
