"""Every objective by name (relax.serve.objectives): each equals its trainer's update on the same
batch (metrics, and the weights after ``objective_optim_step`` against the trainer's one optimizer
step), a few against independent NumPy formulas over the plain full-sequence forward, and the
errors."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_completion_packing import _update_data
from test_parallel import _decode, fives
from test_sft import _examples
from test_train import CFG, _prompts

from relax.algorithms.cli.configure import configure
from relax.algorithms.dpo import DPOConfig, make_dpo_step
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.loss import make_grpo_update
from relax.algorithms.kto import KTOConfig, make_kto_step
from relax.algorithms.online.batch import LossRows, step_input
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.step import make_ppo_step
from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.step import make_reward_model_step
from relax.algorithms.sft import SFTConfig, make_sft_step, sft_batch
from relax.data.pairs import PairBatch, UnpairedBatch
from relax.models import hidden_states, init
from relax.models.decoder.logprobs import token_logprobs
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.heads.critic import init_value_head
from relax.models.heads.reward_model import init_reward_model
from relax.objectives.registry import POLICY_LOSSES
from relax.passes import Passes
from relax.serve.objectives import (
    OBJECTIVES,
    ValueRows,
    make_objective_forward_backward,
    objective_forward_backward,
    objective_optim_step,
)
from relax.train.optimizer import OptimizerConfig
from relax.train.state import init_state

# eps=1: Adam's first step ~ lr * g, so equal weights mean equal gradients, not equal signs
OPT = OptimizerConfig(learning_rate=0.05, eps=1.0, max_grad_norm=None)


def _copy(tree):
    return jax.tree.map(jnp.copy, tree)


def _state(model, **kw):
    return init_state(_copy(model), OPT.make(), key=jax.random.key(1), **kw)


def _same_metrics(
    got: dict, want: dict, *, skip=("grad_norm", "first_nonfinite_grad"), rtol=2e-5, atol=1e-6
):
    common = set(got) & set(want) - set(skip)
    assert "loss" in common and len(common) >= 3, (sorted(got), sorted(want))
    for k in sorted(common):
        np.testing.assert_allclose(
            np.asarray(got[k]), np.asarray(want[k]), rtol=rtol, atol=atol, err_msg=k
        )


def _rows(model):
    """``_update_data`` with sampler and reference log-probs near the model's own (as a rollout's
    are: the ratios near 1, some clipped, the KL small)."""
    data = _update_data()
    own = completion_logprobs(model, data.prompt_ids, data.prompt_mask, data.tokens, data.mask)
    noise = 0.2 * jax.random.normal(jax.random.key(8), own.shape)
    return data.replace(old_logprobs=own + noise, ref_logprobs=own - noise)


POLICY_NAMES = sorted(POLICY_LOSSES)
FAST_POLICY = ("importance_sampling",)  # the rest: make test-all


@pytest.mark.parametrize(
    "name",
    [n if n in FAST_POLICY else pytest.param(n, marks=pytest.mark.slow) for n in POLICY_NAMES],
)
@pytest.mark.slow
def test_policy_objectives_equal_grpos_update(name):
    """Each registry name over ``LossRows`` with a KL to the reference and an entropy bonus: the
    metrics and the updated weights of GRPO's update (one micro-batch, one optimizer step)."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _rows(model)
    kw = dict(loss_type="seq-mean-token-sum", beta=0.04, entropy_coef=0.01)
    cfg = configure(GRPOConfig, policy_loss=name, grad_accum=1, optimizer=OPT, **kw)
    opt = OPT.make()
    policy, _, want = jax.jit(make_grpo_update(cfg, opt, Passes()))(
        _copy(model), opt.init(model), data, jax.random.key(0)
    )
    state = _state(model)
    grads, got = make_objective_forward_backward(name, passes=Passes(), **kw)(
        state, data
    )  # the update's pass layout
    assert grads.critic is None
    _same_metrics(got, want)
    chex.assert_trees_all_close(objective_optim_step(state, grads).policy, policy, atol=1e-6)


@pytest.mark.slow
def test_importance_sampling_against_numpy():
    """Token-mean ``-min(r, cap) A`` with ``r = exp(logp - old)``, ``logp`` from the plain
    full-sequence forward of each [prompt; completion]."""
    model = init(CFG, jax.random.key(3), std=0.2)
    data = _update_data()
    p, g, n = data.tokens.shape
    full = jnp.concatenate([jnp.repeat(data.prompt_ids, g, 0), data.tokens.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(data.prompt_mask, g, 0), data.mask.reshape(p * g, n)], 1)
    logp = np.asarray(token_logprobs(model, full, fmask)[:, -n:], np.float64).reshape(p, g, n)
    ratio = np.exp(logp - np.asarray(data.old_logprobs, np.float64))
    m = np.asarray(data.loss_mask) > 0
    per_token = -np.minimum(ratio, 1.5) * np.asarray(data.advantages)[..., None]
    _, metrics = objective_forward_backward(
        _state(model), data, "importance_sampling", cap=1.5, loss_type="token-mean"
    )
    np.testing.assert_allclose(float(metrics["loss"]), per_token[m].mean(), rtol=1e-5)


@pytest.mark.slow
def test_causal_lm_equals_the_sft_step_and_numpy():
    model = init(CFG, jax.random.key(5), std=0.3)
    cfg = SFTConfig(max_length=12, optimizer=OPT)
    batch = sft_batch(cfg, _examples([9, 7, 5, 4, 3, 8], seed=7), pad_id=0)
    trained, out = make_sft_step(cfg, Passes())(_state(model), batch)
    state = _state(model)
    grads, got = make_objective_forward_backward("causal_lm")(
        state, jax.tree.map(jnp.asarray, batch)
    )
    _same_metrics(got, out.metrics)
    chex.assert_trees_all_close(
        objective_optim_step(state, grads).policy, trained.policy, atol=1e-6
    )
    # NLL: each example alone through the plain forward
    ids, seg, lm = (np.asarray(x) for x in (batch.ids, batch.segment_ids, batch.loss_mask))
    nll = []
    for r in range(ids.shape[0]):
        for k in set(seg[r][seg[r] > 0].tolist()):
            where = np.flatnonzero(seg[r] == k)
            x = jnp.asarray(ids[r, where])[None]
            lp = np.asarray(token_logprobs(model, x, jnp.ones_like(x)))[
                0
            ]  # lp[t] predicts x[t + 1]
            nll += [-lp[t - 1] for t in range(1, len(where)) if lm[r, where[t]]]
    np.testing.assert_allclose(float(got["nll"]), np.mean(nll), rtol=1e-5)


def _pairs(seed=0, p=4, lp=6, n=5, reference=True):
    rng = np.random.default_rng(seed)
    ids, pm = (np.asarray(x) for x in _prompts(p, lp, [6, 3, 4, 2][:p], seed))
    tokens = rng.integers(1, CFG.vocab_size, (p, 2, n)).astype(np.int32)
    mask = np.ones((p, 2, n), np.int32)
    mask[0, 1, 3:] = 0
    mask[2, 0, 2:] = 0
    ref = (-8.0 + rng.standard_normal((p, 2))).astype(np.float32)
    return PairBatch(
        prompt_ids=ids,
        prompt_mask=pm,
        tokens=tokens,
        mask=mask,
        loss_mask=np.ones(p, np.int32),
        ref_logps=ref if reference else None,
        margin=rng.random(p).astype(np.float32),
    )


@pytest.mark.parametrize(
    "name", ["dpo", *(pytest.param(n, marks=pytest.mark.slow) for n in ("ipo", "simpo", "orpo"))]
)
@pytest.mark.slow
def test_dpo_family_equals_the_dpo_step(name):
    model = init(CFG, jax.random.key(0), std=0.3)
    batch = _pairs()
    loss_type = "sigmoid" if name == "dpo" else name
    cfg = DPOConfig(
        loss_type=loss_type,
        beta=0.2,
        precompute_reference=loss_type not in ("simpo", "orpo"),
        grad_accum=1,
        optimizer=OPT,
    )
    trained, out = make_dpo_step(cfg)(_state(model), batch)
    state = _state(model)
    grads, got = make_objective_forward_backward(name, beta=0.2)(
        state, jax.tree.map(jnp.asarray, batch)
    )
    _same_metrics(got, out.metrics)
    chex.assert_trees_all_close(
        objective_optim_step(state, grads).policy, trained.policy, atol=1e-6
    )


@pytest.mark.slow  # make test-all; DPO's pair path is fast
def test_kto_equals_the_kto_step():
    """Unpaired examples with the reference's log-probs attached: z0 from the KL completions under
    the policy, the loss, metrics and update of the KTO step."""
    model = init(CFG, jax.random.key(0), std=0.3)
    b = _pairs()
    rng = np.random.default_rng(3)
    batch = UnpairedBatch(
        prompt_ids=b.prompt_ids,
        prompt_mask=b.prompt_mask,
        tokens=b.tokens,
        mask=b.mask,
        label=np.array([1, 0, 1, 0], np.int32),
        loss_mask=b.loss_mask,
        ref_logps=(-20.0 + rng.standard_normal((4, 2))).astype(np.float32),
    )
    cfg = KTOConfig(
        beta=0.5, desirable_weight=1.2, precompute_reference=True, grad_accum=1, optimizer=OPT
    )
    trained, out = make_kto_step(cfg)(_state(model), batch)
    assert float(out.metrics["kl"]) > 0  # z0 not clamped
    state = _state(model)
    grads, got = make_objective_forward_backward("kto", beta=0.5, desirable_weight=1.2)(
        state, jax.tree.map(jnp.asarray, batch)
    )
    _same_metrics(got, out.metrics)
    chex.assert_trees_all_close(
        objective_optim_step(state, grads).policy, trained.policy, atol=1e-6
    )


@pytest.mark.slow
def test_reward_modeling_equals_the_reward_model_step():
    rm = init_reward_model(init(CFG, jax.random.key(0), std=0.3), jax.random.key(2), head_std=0.5)
    batch = _pairs()
    cfg = RewardModelConfig(center_rewards_coefficient=0.01, grad_accum=1, optimizer=OPT)
    trained, out = make_reward_model_step(cfg, Passes())(_state(rm), batch)
    state = _state(rm)
    grads, got = make_objective_forward_backward(
        "reward_modeling", center_rewards_coefficient=0.01
    )(state, jax.tree.map(jnp.asarray, batch))
    _same_metrics(got, out.metrics)
    chex.assert_trees_all_close(
        objective_optim_step(state, grads).policy, trained.policy, atol=1e-6
    )


@pytest.mark.slow
def test_ppo_with_a_value_head_equals_the_ppo_step():
    """The second iteration of the PPO trainer (value head, KL to a static reference in the
    rewards): GAE inside ``objective_forward_backward`` from the batch's rewards gives the step's
    advantages, returns and values; its metrics and the updated policy and head are the step's;
    the returns against a NumPy GAE over the plain forward's values."""
    kw = dict(kl_coef=0.05, vf_coef=0.5, gamma=0.9, lam=0.8, entropy_coef=0.01)
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=6,
        critic="shared",
        grad_accum=1,
        optimizer=OPT,
        critic_optimizer=OPT,
        **kw,
    )
    policy = init(CFG, jax.random.key(0), std=0.3)
    state = init_state(
        policy,
        OPT.make(),
        key=jax.random.key(1),
        with_reference=True,
        critic=init_value_head(CFG, 0.5, key=jax.random.key(5)),
        critic_optimizer=OPT.make(),
    )
    step = make_ppo_step(cfg, StepParts(reward_fns=[fives], decode=_decode, eos_ids=(3,), pad_id=0))
    ids, pm = _prompts(4, 6, [6, 2, 4, 5])
    batch = step_input(ids, pm, ["a", "b", "c", "d"], {"weight": [1.0] * 4})
    state, _ = step(state, batch)
    before = _copy(state)
    after, out = step(state, batch)
    b = out.device.batch
    rows = ValueRows(
        prompt_ids=b.prompt_ids,
        prompt_mask=b.prompt_mask,
        tokens=b.tokens,
        mask=b.mask,
        old_logprobs=b.old_logprobs,
        loss_mask=b.loss_mask,
        rewards=b.rewards,
        ref_logprobs=b.ref_logprobs,
    )
    grads, got = make_objective_forward_backward("ppo", **kw)(before, rows)
    assert grads.critic is not None
    _same_metrics(got, out.device.metrics, rtol=1e-4, atol=1e-5)
    new = objective_optim_step(before, grads)
    chex.assert_trees_all_close((new.policy, new.critic), (after.policy, after.critic), atol=2e-6)
    # returns by hand: V from the plain forward, r_t = score at the last token - kl_coef KL_t
    p, g, n = b.tokens.shape
    full = jnp.concatenate([jnp.repeat(b.prompt_ids, g, 0), b.tokens.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(b.prompt_mask, g, 0), b.mask.reshape(p * g, n)], 1)
    h = np.asarray(hidden_states(before.policy, full, fmask)[:, -n - 1 : -1], np.float64)
    v = h @ np.asarray(before.critic.head, np.float64) + float(before.critic.bias)
    m = np.asarray(b.loss_mask).reshape(p * g, n) > 0
    kl = (np.asarray(b.old_logprobs) - np.asarray(b.ref_logprobs)).reshape(p * g, n)  # k1
    returns = np.zeros_like(v)
    for i in range(p * g):
        last = np.flatnonzero(m[i]).max()
        r = -kw["kl_coef"] * kl[i]
        r[last] += np.asarray(b.rewards).reshape(-1)[i]
        a = 0.0
        for t in range(last, -1, -1):
            nxt = v[i, t + 1] if t < last else 0.0
            a = r[t] + kw["gamma"] * nxt - v[i, t] + kw["gamma"] * kw["lam"] * a
            returns[i, t] = a + v[i, t]
    np.testing.assert_allclose(float(got["returns_mean"]), returns[m].mean(), rtol=1e-4, atol=1e-5)


def test_errors_name_what_is_wrong():
    model = init(CFG, jax.random.key(0), std=0.3)
    state, data = _state(model), _update_data()
    with pytest.raises(ValueError, match="unknown objective 'nope'.*causal_lm"):
        objective_forward_backward(state, data, "nope")
    with pytest.raises(TypeError, match="'dpo' takes a relax.data.pairs.PairBatch.*LossRows"):
        objective_forward_backward(state, data, "dpo")
    with pytest.raises(TypeError, match="no option.*'nope'"):
        objective_forward_backward(state, data, "grpo", nope=1)
    with pytest.raises(ValueError, match="need ref_logprobs"):
        objective_forward_backward(state, data.replace(ref_logprobs=None), "grpo", beta=0.1)
    with pytest.raises(ValueError, match="ref_logps"):
        objective_forward_backward(state, _pairs(reference=False), "dpo")
    with pytest.raises(ValueError, match="ValueHead"):
        objective_forward_backward(
            state,
            ValueRows(data.prompt_ids, data.prompt_mask, data.tokens, data.mask, data.old_logprobs),
            "ppo",
        )
    assert set(POLICY_LOSSES) | {
        "causal_lm",
        "dpo",
        "ipo",
        "simpo",
        "orpo",
        "kto",
        "reward_modeling",
    } == set(OBJECTIVES)
    assert isinstance(data, LossRows)
