"""The online batch's phase types (``relax.algorithms.online.batch``): every field of every phase a real
GRPO, PPO and agent step produces has the shape and dtype its jaxtyping annotation documents, with
the dimension names (p, g, n, lp) bound consistently across the fields; the phases follow each
other as the docs say; host values never reach the device part."""

from __future__ import annotations

import dataclasses
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.algorithms.cli.configure import configure
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.step import GRPOBatch, make_grpo_step
from relax.algorithms.online.batch import (
    Advantaged,
    HostRecord,
    LossRows,
    Phase,
    Prompts,
    Sampled,
    Scored,
    step_input,
)
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.batch import PPOBatch
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.run import make_state as ppo_state
from relax.algorithms.ppo.step import make_ppo_step
from relax.compose import WithHost
from relax.models import ModelConfig, init
from relax.train.state import init_state
from relax.train.update import Updated

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
P, LP, G, N = 2, 8, 4, 5


def _decode(tokens, mask):
    return [" ".join(str(t) for t, m in zip(row, mr) if m) for row, mr in zip(tokens, mask)]


def _fives(prompts, completions, **fields):
    return [c.split().count("5") / 6 for c in completions]


def _input():
    ids = jnp.asarray(np.random.default_rng(0).integers(1, CFG.vocab_size, (P, LP)), jnp.int32)
    mask = jnp.ones((P, LP), jnp.int32).at[1, :3].set(0)
    return step_input(ids, mask, ["a", "b"], {"answer": ["1", "2"]})


def annotated_dims(phase: Phase) -> dict[str, int]:
    """Check every array field of ``phase`` against its jaxtyping annotation (rank, dtype kind,
    and each named dimension bound to one size across all fields); the sizes bound."""
    hints = typing.get_type_hints(type(phase))
    bound: dict[str, int] = {}
    for field in dataclasses.fields(phase):
        value = getattr(phase, field.name)
        options = [
            a
            for a in (typing.get_args(hints[field.name]) or (hints[field.name],))
            if hasattr(a, "dim_str")
        ]
        if value is None or not options or not hasattr(value, "shape"):
            continue
        fits = [
            a
            for a in options
            if len(a.dim_str.split()) == value.ndim and str(value.dtype) in a.dtypes
        ]
        assert fits, (
            f"{type(phase).__name__}.{field.name}: {value.dtype}{list(value.shape)} is none of "
            f"{[a.dim_str for a in options]}"
        )
        for name, size in zip(fits[0].dim_str.split(), value.shape):
            assert bound.setdefault(name, size) == size, (
                f"{type(phase).__name__}.{field.name}: dimension {name} is {size}, elsewhere {bound[name]}"
            )
    return bound


def _phases(step, state, batch):
    """The device part after every segment of ``step`` and the final (state, batch)."""
    seen = []
    for seg in step.segments:
        state, batch = seg.run(state, batch)
        seen.append(batch.device)
    return seen, state, batch


@pytest.mark.slow
def test_grpo_phases_follow_the_docs():
    cfg = configure(GRPOConfig, num_generations=G, max_new_tokens=N, beta=0.04)
    state = init_state(
        init(CFG, jax.random.key(0), std=0.3),
        cfg.optimizer.make(),
        key=jax.random.key(1),
        with_reference=True,
    )
    step = make_grpo_step(
        cfg, StepParts(reward_fns=[_fives], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    seen, _, out = _phases(step, state, _input())
    kinds = [type(x).__name__ for x in seen]
    # rollout, score_start, pack (a no-op here: padded), reference, score_finish, advantage+update
    assert kinds == ["Sampled", "Scored", "Scored", "Scored", "Scored", "Updated"], kinds
    for phase in seen[:-1]:
        assert annotated_dims(phase) == {"p": P, "lp": LP, "g": G, "n": N}
    trained = out.device.batch
    assert (
        isinstance(out.device, Updated)
        and type(trained) is GRPOBatch
        and isinstance(trained, Advantaged)
    )
    assert annotated_dims(trained) == {"p": P, "lp": LP, "g": G, "n": N}
    chex.assert_shape([trained.advantages, trained.shaped_rewards], (P, G))
    chex.assert_shape(trained.group_keep, (P,))
    assert trained.ref_logprobs is not None and bool(
        trained.ref_is_policy
    )  # first step: the policy is the ref
    np.testing.assert_array_equal(trained.ref_logprobs, trained.old_logprobs)
    # host values stay beside the device batch, none of them inside it
    host = out.host
    assert (
        isinstance(host, HostRecord)
        and len(host.completions) == P * G
        and host.pending_scores is None
    )
    assert host.reward_info["errors"] == 0 and host.prompts == ["a", "b"]
    assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(out.device))


@pytest.mark.slow
def test_ppo_phases_and_rows():
    cfg = configure(PPOConfig, num_generations=2, max_new_tokens=N)
    state = ppo_state(cfg, init(CFG, jax.random.key(0), std=0.3), jax.random.key(1))
    step = make_ppo_step(
        cfg, StepParts(reward_fns=[_fives], decode=_decode, eos_ids=(3,), pad_id=0)
    )
    _, _, out = _phases(step, state, _input())
    trained = out.device.batch
    assert type(trained) is PPOBatch
    assert annotated_dims(trained) == {"p": P, "lp": LP, "g": 2, "n": N}
    chex.assert_shape(
        [trained.old_values, trained.returns, trained.token_rewards, trained.advantages], (P, 2, N)
    )
    rows = LossRows.of(trained)
    assert annotated_dims(rows) == {"p": P, "lp": LP, "g": 2, "n": N}
    assert all(
        x.shape[0] == P for x in jax.tree.leaves(rows)
    )  # the update slices every leaf by prompt


def test_the_checker_and_the_constructors_refuse_what_they_should():
    ids = jnp.zeros((P, LP), jnp.int32)
    good = Sampled.of(
        Prompts(ids, ids),
        tokens=jnp.zeros((P, G, N), jnp.int32),
        mask=jnp.zeros((P, G, N), jnp.int32),
        old_logprobs=jnp.zeros((P, G, N)),
        lengths=jnp.zeros((P, G), jnp.int32),
        finished=jnp.zeros((P, G), bool),
        policy_version=jnp.zeros((P, G), jnp.int32),
    )
    assert annotated_dims(good) == {"p": P, "lp": LP, "g": G, "n": N}
    with pytest.raises(AssertionError, match="dimension n is 6"):
        annotated_dims(good.replace(old_logprobs=jnp.zeros((P, G, N + 1))))
    with pytest.raises(AssertionError, match="finished"):
        annotated_dims(
            good.replace(finished=jnp.zeros((P, G), jnp.float32))
        )  # a float where a bool is documented
    with pytest.raises(TypeError, match="no field"):
        Scored.of(good, reward=jnp.zeros((P, G)))  # a typo is an error, not a new key
    scored = Scored.of(good, rewards=jnp.ones((P, G)))
    assert (
        scored.tokens is good.tokens
        and scored.ref_logprobs is None
        and scored.policy_tokens is good.mask
    )
    assert WithHost(scored, HostRecord()).replace(host=None).device is scored
