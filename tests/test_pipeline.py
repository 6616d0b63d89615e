"""Asynchronous RL (``relax.train.pipeline``): the schedule's staleness bound, s = 0 equals the
synchronous step bit for bit, s = 1 samples batch k + 1 with the weights before update k and
weights it by exp(proximal - behaviour) log-probs, and a pipelined run is reproducible."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import _decode, fives
from test_train import CFG, _prompts

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import preset
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.batch import step_input
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.step import make_ppo_step
from relax.models import init
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.heads.critic import init_critic
from relax.objectives.off_policy import OffPolicyConfig
from relax.train.optimizer import OptimizerConfig
from relax.train.pipeline import AsyncConfig, Pipeline, split_segments
from relax.train.state import init_state


@pytest.mark.parametrize("s,n", [(s, n) for s in range(4) for n in range(1, s + 2)])
def test_schedule_never_exceeds_the_staleness_bound(s, n):
    cfg = AsyncConfig(staleness=s, push_every=n)
    d = cfg.depth
    for i in range(40):
        v = cfg.version(i)
        assert 0 <= i - v <= s  # consumed at version i
        assert v % n == 0  # a pushed version
        assert v <= max(
            0, i - d
        )  # exists when batch i is produced (iteration i - d, or the prologue)
    # a checkpoint at `step` keeps every older version that batches step .. step + d use
    for step in range(1, 30):
        needed = {cfg.version(i) for i in range(step, step + d + 1)} - {step}
        assert set(cfg.live_versions(step, 100)) == needed
        assert len(needed) <= cfg.slots
    if s == 0:
        assert (cfg.depth, cfg.slots, cfg.off_policy) == (0, 0, None)


def test_bad_async_config_names_the_flag():
    with pytest.raises(ValueError, match="--async.push-every"):
        AsyncConfig(staleness=1, push_every=3)
    with pytest.raises(ValueError, match="--async.staleness"):
        AsyncConfig(staleness=-1)


class Batches:
    """A deterministic data iterator with ``get_state`` / ``set_state``."""

    def __init__(self):
        self.position = 0
        self.sets = [_prompts(2, 8, [8, 5], seed=k) for k in range(3)]

    def __next__(self):
        ids, pm = self.sets[self.position % len(self.sets)]
        self.position += 1
        return step_input(ids, pm, ["p"] * 2, {"weight": [1.0, 2.0]})

    def get_state(self):
        return {"position": self.position}

    def set_state(self, state):
        self.position = state["position"]


def _setup(async_cfg: AsyncConfig, **overrides):
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=5,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=3e-2),
        **overrides,
    )
    state = init_state(
        init(CFG, jax.random.key(0), std=0.3),
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
    )
    step = make_grpo_step(
        cfg,
        StepParts(
            reward_fns=[fives],
            decode=_decode,
            eos_ids=(3,),
            pad_id=0,
            off_policy=async_cfg.off_policy,
            pipelined=async_cfg.staleness > 0,
        ),
    )
    return cfg, state, step


def _pipelined(async_cfg: AsyncConfig, steps: int, setup=None, **overrides):
    """(states after each update (copies), the steps' outputs: ``WithHost(Updated, HostRecord)``,
    one per update) of a pipelined run."""
    _, state, step = (_setup if setup is None else setup)(async_cfg, **overrides)
    pipeline = Pipeline(step.segments, async_cfg, Batches(), lambda b: b)
    states, batches = [jax.tree.map(jnp.copy, state)], []
    for state, batch, _timings in pipeline.run(state, 0, steps):
        states.append(jax.tree.map(jnp.copy, state))
        batches.append(batch)
    return states, batches


def _assert_same(a, b):
    """Two train states bit for bit: weights, optimizer state, reference, step and key."""
    chex.assert_trees_all_equal(
        (a.policy, a.opt_state, a.ref, a.step), (b.policy, b.opt_state, b.ref, b.step)
    )
    np.testing.assert_array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key))


@pytest.mark.slow
def test_staleness_zero_is_the_synchronous_step_bit_for_bit():
    states, batches = _pipelined(AsyncConfig(staleness=0), 3)
    _, state, step = _setup(AsyncConfig(staleness=0))
    data = Batches()
    for k in range(3):
        state, out = step(state, next(data))
        _assert_same(state, states[k + 1])
        np.testing.assert_array_equal(out.device.batch.tokens, batches[k].device.batch.tokens)
    assert [int(np.max(b.device.batch.policy_version)) for b in batches] == [0, 1, 2]


@pytest.mark.slow
def test_staleness_one_samples_ahead_and_weights_by_the_stored_log_prob_difference():
    states, batches = _pipelined(
        AsyncConfig(staleness=1, correction=OffPolicyConfig(kind="decoupled")), 3
    )
    _check_versions_and_weights(states, batches)


def _ppo_setup(async_cfg: AsyncConfig, **overrides):
    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=5,
        kl_coef=0.05,
        num_iterations=2,
        optimizer=OptimizerConfig(learning_rate=3e-2),
        critic_optimizer=OptimizerConfig(learning_rate=1e-2),
    )
    policy = init(CFG, jax.random.key(0), std=0.3)
    state = init_state(
        policy,
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
        critic=init_critic(policy),
        critic_optimizer=cfg.critic_optimizer.make(),
    )
    step = make_ppo_step(
        cfg,
        StepParts(
            reward_fns=[fives],
            decode=_decode,
            eos_ids=(3,),
            pad_id=0,
            off_policy=async_cfg.off_policy,
            pipelined=async_cfg.staleness > 0,
        ),
    )
    return cfg, state, step


@pytest.mark.slow
def test_ppo_pipelined_with_a_proximal_pass():
    """PPO (critic, reference, two epochs: the proximal log-probs are a forward of their own)."""
    states, batches = _pipelined(
        AsyncConfig(staleness=1, correction=OffPolicyConfig(kind="decoupled")), 3, setup=_ppo_setup
    )
    _check_versions_and_weights(states, batches)
    # the KL in the reward is the behaviour policy's: batch 1 was sampled by version 0, the reference itself
    assert float(batches[1].device.metrics["kl"]) < 1e-6 < float(batches[2].device.metrics["kl"])


def _check_versions_and_weights(states, batches):
    assert [int(np.max(b.device.batch.policy_version)) for b in batches] == [
        0,
        0,
        1,
    ]  # v(i) = max(0, i - 1)
    for k, out in enumerate(batches):
        batch = out.device.batch
        version = int(batch.policy_version[0, 0])
        m = np.asarray(batch.loss_mask) > 0

        def logprobs(policy):
            return np.asarray(
                completion_logprobs(
                    policy,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.tokens,
                    batch.mask,
                    temperature=1.0,
                )
            )

        # the samples are the sampler's of the version they record, not of the policy that updates on them
        np.testing.assert_allclose(
            logprobs(states[version].policy)[m], np.asarray(batch.old_logprobs)[m], atol=1e-4
        )
        # the correction's weights are exp(proximal - behaviour): proximal = the weights the update started from
        rho = np.exp(logprobs(states[k].policy) - np.asarray(batch.old_logprobs))[m]
        metrics = out.device.metrics
        np.testing.assert_allclose(
            [metrics["is_weight_mean"], metrics["is_weight_min"], metrics["is_weight_max"]],
            [rho.mean(), rho.min(), rho.max()],
            rtol=2e-4,
        )
        stale = k > version  # batches 1 and 2: sampled one version before the update
        assert (abs(float(metrics["is_weight_max"]) - 1) > 1e-3) == stale


@pytest.mark.slow
def test_pipelined_runs_are_reproducible_bit_for_bit():
    async_cfg = AsyncConfig(
        staleness=2, push_every=2, correction=OffPolicyConfig(kind="tis", level="sequence")
    )
    a, _ = _pipelined(
        async_cfg, 4, num_minibatches=2
    )  # two optimizer steps: the proximal forward runs
    b, batches = _pipelined(async_cfg, 4, num_minibatches=2)
    for x, y in zip(a, b):
        _assert_same(x, y)
    assert not np.array_equal(np.asarray(a[0].policy.layers.wq), np.asarray(a[-1].policy.layers.wq))
    lags = [k - int(b_.device.batch.policy_version[0, 0]) for k, b_ in enumerate(batches)]
    assert max(lags) <= 2 and lags == [k - async_cfg.version(k) for k in range(4)]


def test_split_needs_a_producer_and_a_consumer():
    _, _, step = _setup(AsyncConfig(staleness=1))
    producer, consumer = split_segments(step.segments)
    assert [s.names for s in producer] == [
        ("rollout",),
        ("score_start",),
        ("score_finish",),
        ("pack",),
    ]
    assert consumer[0].names[:2] == ("reference", "advantage")
    with pytest.raises(ValueError, match="leading stages"):
        split_segments(consumer)
