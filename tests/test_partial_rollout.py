"""Partial rollouts (``relax.rollout.partial``, ``AsyncConfig.partial``): a batch sampled over K
rollouts records each token's version and behaviour log-prob (checked against the trainer's
forward of that version's weights), every token is within the staleness bound, the correction
weighs each token by its own log-prob, and runs reproduce and resume bit for bit."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_parallel import _decode, fives
from test_pipeline import Batches, _assert_same
from test_train import CFG

from relax.algorithms.grpo.config import preset
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.step import StepParts
from relax.models import init
from relax.models.forward.prefix_shared import completion_logprobs
from relax.objectives.off_policy import OffPolicyConfig
from relax.rollout.partial import PartialRequest, PartialRollouts
from relax.rollout.sampler import RolloutConfig
from relax.rollout.sampling import SamplingConfig
from relax.train.optimizer import OptimizerConfig
from relax.train.pipeline import AsyncConfig, Pipeline
from relax.train.state import init_state

EOS = 3


def _partial(k: int, n: int = 8, g: int = 4) -> PartialRollouts:
    cfg = RolloutConfig(
        num_generations=g,
        max_new_tokens=n,
        sampling=SamplingConfig(temperature=1.0),
        eos_ids=(EOS,),
        pad_id=0,
    )
    return PartialRollouts(
        Batches(),
        lambda w: (np.asarray(w.device.prompt_ids), np.asarray(w.device.prompt_mask), w.host),
        cfg,
        k,
        encode=lambda r: {"prompts": r.prompts, "fields": r.fields},
        decode=lambda d: (
            Batches().__next__().host.replace(prompts=d["prompts"], fields=d["fields"])
        ),
    )


def _forward(policy, done) -> np.ndarray:
    return np.asarray(
        completion_logprobs(
            policy,
            jnp.asarray(done.prompt_ids),
            jnp.asarray(done.prompt_mask),
            jnp.asarray(done.tokens),
            jnp.asarray(done.mask),
            temperature=1.0,
        )
    )


@pytest.mark.parametrize(
    "s,n,k",
    [
        (s, n, k)
        for s in range(1, 5)
        for n in range(1, s + 2)
        for k in range(2, 5)
        if s + 1 - n - (k - 1) >= 0
    ],
)
def test_partial_schedule_keeps_every_token_within_the_bound(s, n, k):
    cfg = AsyncConfig(staleness=s, push_every=n, partial=k)
    assert cfg.depth == s + 1 - n - (k - 1) >= 0
    for i in range(40):
        oldest, newest = cfg.oldest_version(i), cfg.version(i)
        assert oldest <= newest and 0 <= i - oldest <= s
        assert newest <= max(0, i - cfg.depth)  # the rollout of batch i runs once its weights exist
    assert max(cfg.histogram(40)) <= s


def test_partial_needs_staleness_for_its_chunks():
    with pytest.raises(ValueError, match="--async.partial 3 .* needs --async.staleness >= 2"):
        AsyncConfig(staleness=1, partial=3)
    with pytest.raises(ValueError, match="must divide"):
        _partial(3, n=8)


def test_partial_rollouts_record_each_tokens_version_and_behaviour_log_prob():
    """Batch 1's first chunk is sampled by policy A (version 0), its second by policy B (version
    1): each token's log-prob is the trainer's forward of the weights its version names."""
    a, b = init(CFG, jax.random.key(0), std=0.3), init(CFG, jax.random.key(5), std=0.3)
    partial, key = _partial(2), jax.random.key(7)
    first = partial.produce(a, 0, key, PartialRequest(0))
    assert (
        partial.last["partial/calls"] == 2 and len(partial.in_progress) == 1
    )  # the warm-up: K calls
    second = partial.produce(b, 1, key, PartialRequest(1))
    assert partial.last["partial/calls"] == 1
    for done, policies in ((first, {0: a}), (second, {0: a, 1: b})):
        sampled = done.versions >= 0
        np.testing.assert_array_equal(sampled, done.mask > 0)
        assert not done.running.any()  # every completion stopped or holds N tokens
        ends = done.tokens[
            np.arange(done.tokens.shape[0])[:, None],
            np.arange(done.tokens.shape[1]),
            np.maximum(done.lengths - 1, 0),
        ]
        np.testing.assert_array_equal(ends[done.finished], EOS)
        assert set(np.unique(done.versions[sampled]).tolist()) == set(policies)
        for version, policy in policies.items():
            here = done.versions == version
            np.testing.assert_allclose(done.logprobs[here], _forward(policy, done)[here], atol=1e-4)
    # chunk 1 (tokens 0..3) by A, chunk 2 (4..7) by B wherever a completion ran past 4 tokens
    long = second.lengths > 4
    assert long.any() and (second.versions[..., :4][second.mask[..., :4] > 0] == 0).all()
    assert (second.versions[long][:, 4:][second.mask[long][:, 4:] > 0] == 1).all()
    with pytest.raises(RuntimeError, match="in order"):
        partial.produce(b, 1, key, PartialRequest(5))


def test_partial_state_round_trips_through_json_and_resumes_exactly():
    a = init(CFG, jax.random.key(0), std=0.3)
    partial, key = _partial(4), jax.random.key(3)
    for i in range(2):
        partial.produce(a, i, key, PartialRequest(i))
    saved = json.loads(json.dumps(partial.get_state()))
    later = [partial.produce(a, i, key, PartialRequest(i)) for i in (2, 3)]
    resumed = _partial(4)
    resumed.set_state(saved)
    assert next(resumed) == PartialRequest(2)
    for i, done in zip((2, 3), later):
        again = resumed.produce(a, i, key, PartialRequest(i))
        for f in ("tokens", "logprobs", "versions", "lengths", "finished", "prompt_ids"):
            np.testing.assert_array_equal(getattr(again, f), getattr(done, f))
        assert again.record.prompts == done.record.prompts


ASYNC = AsyncConfig(staleness=2, partial=2, correction=OffPolicyConfig(kind="decoupled"))  # depth 1


def _grpo(partial: PartialRollouts):
    cfg = preset(
        "grpo",
        num_generations=4,
        max_new_tokens=8,
        beta=0.04,
        optimizer=OptimizerConfig(learning_rate=3e-2),
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
            eos_ids=(EOS,),
            pad_id=0,
            off_policy=ASYNC.off_policy,
            pipelined=True,
            partial=partial,
        ),
    )
    return state, step


def _run(partial, state, step, start, steps, views=None):
    pipeline = Pipeline(step.segments, ASYNC, partial, lambda r: r, views=views)
    states, outs, saved = [], [], {}
    for j, (state, out, _timings) in enumerate(pipeline.run(state, start, steps), start):
        states.append(jax.tree.map(jnp.copy, state))
        outs.append(out)
        saved[j + 1] = (
            pipeline.saved_views(state, j + 1, steps),
            json.loads(json.dumps(pipeline.data_state(j + 1))),
        )
    return states, outs, saved


def test_pipelined_partial_rollouts_reproduce_weigh_each_token_and_resume():
    partial = _partial(2)
    state0, step = _grpo(partial)
    states, outs, saved = _run(partial, jax.tree.map(jnp.copy, state0), step, 0, 5)
    states = [state0] + states
    for j, out in enumerate(outs):
        batch, m = out.device.batch, np.asarray(out.device.batch.loss_mask) > 0
        versions = np.asarray(batch.token_versions)
        assert versions[m].min() == ASYNC.oldest_version(j) and versions[m].max() <= ASYNC.version(
            j
        )
        assert j - versions[m].min() <= ASYNC.staleness
        # each token's behaviour log-prob is its own version's; the weights are exp(prox - behaviour) per token
        behaviour = np.zeros(m.shape, np.float32)
        for v in np.unique(versions[m]):
            fwd = np.asarray(
                completion_logprobs(
                    states[v].policy,
                    batch.prompt_ids,
                    batch.prompt_mask,
                    batch.tokens,
                    batch.mask,
                    temperature=1.0,
                )
            )
            behaviour = np.where(versions == v, fwd, behaviour)
        np.testing.assert_allclose(np.asarray(batch.old_logprobs)[m], behaviour[m], atol=1e-4)
        prox = np.asarray(
            completion_logprobs(
                states[j].policy,
                batch.prompt_ids,
                batch.prompt_mask,
                batch.tokens,
                batch.mask,
                temperature=1.0,
            )
        )
        rho = np.exp(prox - np.asarray(batch.old_logprobs))[m]
        metrics = out.device.metrics
        np.testing.assert_allclose(
            [metrics["is_weight_mean"], metrics["is_weight_min"], metrics["is_weight_max"]],
            [rho.mean(), rho.min(), rho.max()],
            rtol=2e-4,
        )
        assert out.host.partial["partial/calls"] == (2 if j == 0 else 1)
    assert any(out.host.partial["partial/mixed_version_frac"] > 0 for out in outs[1:])
    # the same run again: bit for bit
    partial_b = _partial(2)
    again, _, _ = _run(partial_b, *_grpo(partial_b), 0, 5)
    for x, y in zip(states[1:], again):
        _assert_same(x, y)
    # resumed from the checkpoint of step 2 (its state, sampler copies and data position): the same updates
    views, data = saved[2]
    resumed = _partial(2)
    resumed.set_state(data)
    _, step_r = _grpo(resumed)
    live = ASYNC.live_versions(2, 5)
    tail, _, _ = _run(resumed, states[2], step_r, 2, 5, views=dict(zip(live, views)))
    for x, y in zip(states[3:], tail):
        _assert_same(x, y)


def test_partial_rollouts_refuse_what_they_do_not_support():
    from relax.algorithms.agent.run import AgentRunConfig

    with pytest.raises(ValueError, match="--async.partial: partial rollouts are single-turn"):
        AgentRunConfig(async_=AsyncConfig(staleness=1, partial=2))
    partial = _partial(2)
    cfg = preset(
        "grpo", num_generations=4, max_new_tokens=6
    )  # not the partial rollouts' budget of 8
    with pytest.raises(
        ValueError, match="partial rollouts run pipelined, with the step's own sampler config"
    ):
        make_grpo_step(
            cfg,
            StepParts(
                reward_fns=[fives],
                decode=_decode,
                eos_ids=(EOS,),
                pad_id=0,
                pipelined=True,
                partial=partial,
            ),
        )


def test_ppo_with_partial_rollouts_trains_on_mixed_versions():
    """PPO (critic, two epochs: a proximal forward) on batches sampled over two rollouts."""
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.ppo.config import PPOConfig
    from relax.algorithms.ppo.step import make_ppo_step
    from relax.models.heads.critic import init_critic

    cfg = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=8,
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
    partial = _partial(2)
    step = make_ppo_step(
        cfg,
        StepParts(
            reward_fns=[fives],
            decode=_decode,
            eos_ids=(EOS,),
            pad_id=0,
            off_policy=ASYNC.off_policy,
            pipelined=True,
            partial=partial,
        ),
    )
    outs = [
        out for _, out, _ in Pipeline(step.segments, ASYNC, partial, lambda r: r).run(state, 0, 3)
    ]
    for j, out in enumerate(outs):
        versions = np.asarray(out.device.batch.token_versions)[
            np.asarray(out.device.batch.mask) > 0
        ]
        assert versions.min() == ASYNC.oldest_version(j) and versions.max() <= ASYNC.version(j)
        assert np.isfinite(float(out.device.metrics["loss"])) and np.isfinite(
            float(out.device.metrics["critic/vf_loss"])
        )
    assert float(outs[2].device.metrics["is_weight_max"]) != 1.0  # the stale tokens are weighted
