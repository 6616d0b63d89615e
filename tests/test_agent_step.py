"""GRPO and PPO on multi-turn trajectories (``relax.algorithms.agent.step``): the loss covers the
sampled tokens only, the trainer's log-probs equal the sampler's on the whole trajectory, and
both steps train."""

import dataclasses

import jax
import numpy as np
import pytest
from test_agent_rollout import stopping_model, tokenizer  # noqa: F401 - the fixture

from relax.algorithms.agent.config import AgentConfig
from relax.algorithms.agent.step import make_agent_grpo_step, make_agent_ppo_step
from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.online.batch import HostRecord
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.compose import WithHost
from relax.environments import StepResult
from relax.environments.chat import ChatFormat
from relax.models.heads.critic import init_value_head
from relax.train.state import init_state


class Counting:
    """Turn 1 is answered with a short user message; turn 2 ends the trajectory with reward 1 if
    the policy's two turns together sampled an even number of tokens, else 0."""

    def reset(self, row):
        self.sampled = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.sampled += len(action.token_ids)
        if self.sampled == len(action.token_ids):
            return StepResult(
                [{"role": "user", "content": "and then?"}],
                0.25,
                False,
                {"tool_calls": 1, "tool_errors": 0},
            )
        return StepResult(
            (), float(self.sampled % 2 == 0), True, {"tool_calls": 0, "tool_errors": 0}
        )


ROWS = [{"prompt": "one"}, {"prompt": "two words"}]


def run_step(step, state):
    """(state, the trained batch, its host record, the metrics as floats) of one step on ``ROWS``."""
    state, out = step(state, WithHost(None, HostRecord(rows=ROWS)))
    return (
        state,
        out.device.batch,
        out.host,
        {k: float(v) for k, v in jax.device_get(out.device.metrics).items()},
    )


@pytest.mark.parametrize("per_turn", [pytest.param(False, marks=pytest.mark.slow), True])
@pytest.mark.slow
def test_agent_grpo_step(tokenizer, per_turn):  # noqa: F811
    model = stopping_model(tokenizer)
    cfg = configure(
        GRPOConfig,
        num_generations=4,
        max_new_tokens=64,
        beta=0.04,
        temperature=1.0,
        optimizer=dataclasses.replace(GRPOConfig().optimizer, learning_rate=1e-3),
    )
    step = make_agent_grpo_step(
        cfg,
        AgentConfig(max_turns=3, max_turn_tokens=16, per_turn=per_turn),
        Counting,
        ChatFormat(tokenizer),
        StepParts(pad_id=0),
    )
    state = init_state(model, cfg.optimizer.make(), key=jax.random.key(0), with_reference=True)
    state, batch, host, metrics = run_step(step, state)
    sampled, filled = np.asarray(batch.sampled_mask) > 0, np.asarray(batch.mask) > 0
    observations = filled & ~sampled
    assert observations.any() and not (np.asarray(batch.loss_mask) > 0)[observations].any()
    assert np.all((np.asarray(batch.loss_mask) > 0) <= sampled)
    # the trainer's forward over [prompt | turns and observations] scores what the sampler sampled
    assert metrics["mismatch/abs_max"] < 1e-4
    adv = np.asarray(batch.advantages)
    if (
        per_turn
    ):  # turn 0 is credited with its 0.25 and what followed, turn 1 with what followed only
        index, rewards = np.asarray(batch.turn_index), np.asarray(batch.rewards)
        assert adv.ndim == 3 and not adv[observations].any()
        checked = 0
        for p, g in zip(*np.nonzero(rewards > 1.0)):  # two turns: 0.25 then 1
            if np.ptp(rewards[p]) == 0:
                continue
            a0, a1 = (
                adv[p, g][(index[p, g] == 0) & sampled[p, g]],
                adv[p, g][(index[p, g] == 1) & sampled[p, g]],
            )
            np.testing.assert_allclose(
                a0 - a1[0], 0.25 / (rewards[p].std(ddof=1) + cfg.advantage_eps), rtol=1e-4
            )
            checked += 1
        assert checked
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert host.agent["turns"] > 1 and host.agent["observation_tokens"] > 0
    assert host.agent["tool_call_success"] == 1.0
    before = np.asarray(state.policy.embed).copy()  # the step donates the state
    state, _, _, metrics = run_step(step, state)
    assert np.isfinite(metrics["loss"]) and not np.array_equal(
        before, np.asarray(state.policy.embed)
    )


@pytest.mark.slow
def test_agent_ppo_step(tokenizer):  # noqa: F811
    model = stopping_model(tokenizer)
    cfg = configure(
        PPOConfig,
        num_generations=2,
        max_new_tokens=64,
        critic="shared",
        kl_coef=0.0,
        optimizer=dataclasses.replace(PPOConfig().optimizer, learning_rate=1e-3),
    )
    step = make_agent_ppo_step(
        cfg,
        AgentConfig(max_turns=3, max_turn_tokens=16),
        Counting,
        ChatFormat(tokenizer),
        StepParts(pad_id=0),
    )
    state = init_state(
        model,
        cfg.optimizer.make(),
        key=jax.random.key(0),
        with_reference=cfg.needs_reference,
        critic=init_value_head(model.config),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    state, batch, host, metrics = run_step(step, state)
    sampled, filled = np.asarray(batch.sampled_mask) > 0, np.asarray(batch.mask) > 0
    adv, returns = np.asarray(batch.advantages), np.asarray(batch.returns)
    assert not adv[filled & ~sampled].any() and not returns[filled & ~sampled].any()
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["explained_variance"])
    with pytest.raises(ValueError, match="per-turn advantages are GRPO's"):
        make_agent_ppo_step(
            cfg, AgentConfig(per_turn=True), Counting, ChatFormat(tokenizer), StepParts(pad_id=0)
        )


class Flaky(Counting):
    """``Counting``, but the environment raises at the first turn when the policy sampled a number
    of tokens divisible by 3 (a mix of errored and healthy trajectories, in the same groups)."""

    def step(self, action):
        if self.sampled == 0 and len(action.token_ids) % 3 == 0:
            raise RuntimeError("the environment broke")
        return super().step(action)


def _errored_tokens_are_out_of_the_loss(batch, host):
    rewards, sampled = np.asarray(batch.rewards), np.asarray(batch.sampled_mask) > 0
    errored = np.isnan(rewards)
    assert errored.any() and (~errored).any(), rewards  # the check is not vacuous either way
    assert host.agent["env_errors"] == errored.sum()
    loss_mask = np.asarray(batch.loss_mask) > 0
    assert sampled[errored].any()  # errored trajectories did sample tokens ...
    assert not loss_mask[
        errored
    ].any()  # ... none of which is in the loss (policy term, KL, entropy, normalisers)
    np.testing.assert_array_equal(loss_mask[~errored], sampled[~errored])


@pytest.mark.slow
def test_agent_grpo_step_leaves_errored_trajectories_out_of_the_loss(tokenizer):  # noqa: F811
    model = stopping_model(tokenizer)
    cfg = configure(
        GRPOConfig,
        num_generations=4,
        max_new_tokens=64,
        beta=0.04,
        temperature=1.0,
        entropy_coef=0.01,
    )
    step = make_agent_grpo_step(
        cfg,
        AgentConfig(max_turns=3, max_turn_tokens=16),
        Flaky,
        ChatFormat(tokenizer),
        StepParts(pad_id=0),
    )
    state = init_state(model, cfg.optimizer.make(), key=jax.random.key(0), with_reference=True)
    _, batch, host, metrics = run_step(step, state)
    _errored_tokens_are_out_of_the_loss(batch, host)
    assert (
        np.isfinite(metrics["loss"])
        and np.isfinite(metrics["kl"])
        and np.isfinite(metrics["entropy"])
    )


@pytest.mark.slow
def test_agent_ppo_step_leaves_errored_trajectories_out_of_the_loss(tokenizer):  # noqa: F811
    model = stopping_model(tokenizer)
    cfg = configure(PPOConfig, num_generations=4, max_new_tokens=64, critic="shared", kl_coef=0.0)
    step = make_agent_ppo_step(
        cfg,
        AgentConfig(max_turns=3, max_turn_tokens=16),
        Flaky,
        ChatFormat(tokenizer),
        StepParts(pad_id=0),
    )
    state = init_state(
        model,
        cfg.optimizer.make(),
        key=jax.random.key(0),
        with_reference=cfg.needs_reference,
        critic=init_value_head(model.config),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    _, batch, host, metrics = run_step(step, state)
    _errored_tokens_are_out_of_the_loss(batch, host)
    assert np.isfinite(metrics["loss"])
