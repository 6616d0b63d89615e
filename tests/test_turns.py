"""Multi-turn decoding with the cache carried across turns (``relax.rollout.turns``) against a
forward over the whole conversation (re-prefilling it), and the trainer's log-probs.

Rows are ragged on purpose: prompts of different lengths, turns that stop at different tokens,
observations of different lengths (some rows get none), and a compaction in between.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollout import MODELS, VOCAB, tiny

from relax.models import init
from relax.models.decoder.transformer import hidden_states, project
from relax.models.forward.prefix_shared import completion_logprobs
from relax.rollout import turns
from relax.rollout.sampling import SamplingConfig

LOGIT_ATOL = 1e-4  # logits reach |10| with std=0.3 weights; a wrong slot, mask or position moves them by >1e-1
LOGP_ATOL = 2e-5  # as test_rollout.LOGP_ATOL


def conversation(state, prompt_ids, prompt_mask, rows):
    """Each row's whole conversation so far (prompt + filled slots), left-padded, and its mask."""
    tokens, length = np.asarray(state.tokens), np.asarray(state.length)
    seqs = []
    for i, (_, prompt) in enumerate(rows):
        p = np.asarray(prompt_ids)[prompt][np.asarray(prompt_mask)[prompt] > 0]
        seqs.append(np.concatenate([p, tokens[i, : length[i]]]))
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = s, 1
    return jnp.asarray(ids), jnp.asarray(mask)


def check_against_prefill(model, state, prompt_ids, prompt_mask, rows):
    ids, mask = conversation(state, prompt_ids, prompt_mask, rows)
    full = project(model, hidden_states(model, ids, mask)[:, -1])
    np.testing.assert_allclose(
        np.asarray(turns.next_logits(model, state)), np.asarray(full), atol=LOGIT_ATOL, rtol=1e-5
    )


# gemma3_mixed (a sliding window and a full layer) covers the per-row windows; llama_gqa is slow-only
@pytest.mark.parametrize(
    "name", [pytest.param("llama_gqa", marks=pytest.mark.slow), "gemma3_mixed"]
)
@pytest.mark.slow
def test_cache_continuation_equals_reprefill_and_trainer_logprobs(name):
    model = init(tiny(**MODELS[name]), jax.random.key(0), std=0.3)
    p, g, n = 2, 3, 40
    prompt_ids = jnp.asarray(np.random.default_rng(0).integers(3, VOCAB, (p, 8)), jnp.int32)
    prompt_mask = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], jnp.int32)
    cfg = turns.TurnConfig(
        num_generations=g,
        max_tokens=n,
        max_turn_tokens=6,
        eos_ids=(5, 7, 11),
        sampling=SamplingConfig(temperature=1.0),
    )
    rows = [(b, b // g) for b in range(p * g)]
    state = turns.start(model, prompt_ids, prompt_mask, jax.random.key(1), cfg=cfg)
    check_against_prefill(model, state, prompt_ids, prompt_mask, rows)
    state, stopped, count = turns.decode_turn(model, state, jnp.ones(p * g, bool), cfg=cfg)
    assert np.all(np.asarray(count) >= 1) and np.all(np.asarray(count) <= 6)
    check_against_prefill(model, state, prompt_ids, prompt_mask, rows)
    obs_len = jnp.asarray([3, 0, 5, 2, 1, 4], jnp.int32)
    obs = jnp.asarray(np.random.default_rng(1).integers(3, VOCAB, (p * g, 8)), jnp.int32)
    state = turns.append(model, state, obs, obs_len, cfg=cfg)
    check_against_prefill(model, state, prompt_ids, prompt_mask, rows)
    active = jnp.asarray([True, True, False, True, True, False])
    before = np.asarray(state.length)
    state, _, count = turns.decode_turn(model, state, active, cfg=cfg)
    assert np.all(np.asarray(count)[~np.asarray(active)] == 0)
    assert np.all(np.asarray(state.length) == before + np.asarray(count))
    check_against_prefill(model, state, prompt_ids, prompt_mask, rows)

    # the trainer's prefix-shared forward over [prompt | whole trajectory] gives the sampler's
    # log-probs at every sampled token (observation slots attended, not scored)
    valid = (np.arange(n)[None, :] < np.asarray(state.length)[:, None]).astype(np.int32)
    sampled = np.asarray(state.sampled)
    assert not np.any(sampled & ~valid.astype(bool))
    assert sampled.sum() == np.asarray(state.length).sum() - int(obs_len.sum())
    trainer = completion_logprobs(
        model,
        prompt_ids,
        prompt_mask,
        state.tokens.reshape(p, g, n),
        jnp.asarray(valid).reshape(p, g, n),
    )
    np.testing.assert_allclose(
        np.asarray(trainer).reshape(p * g, n)[sampled],
        np.asarray(state.logprobs)[sampled],
        atol=LOGP_ATOL,
    )

    # compaction: the rows still running, each with its own prompt copy, decode on identically
    keep = jnp.asarray([0, 3, 4, 4], jnp.int32)  # a duplicate stands for a padding row
    small = turns.compact(state, keep)
    assert small.group == 1 and small.prompt_len.shape == (4,)
    small, _, _ = turns.decode_turn(model, small, jnp.asarray([True, True, True, False]), cfg=cfg)
    check_against_prefill(
        model, small, prompt_ids, prompt_mask, [(int(k), int(k) // g) for k in keep]
    )


def test_budgets_end_turns_and_trajectories():
    model = init(tiny(**MODELS["llama_gqa"]), jax.random.key(0), std=0.3)
    cfg = turns.TurnConfig(
        num_generations=2,
        max_tokens=9,
        max_turn_tokens=4,
        eos_ids=(VOCAB - 1,),
        sampling=SamplingConfig(temperature=1.0),
    )
    ids, mask = jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    state = turns.start(model, ids, mask, jax.random.key(0), cfg=cfg)
    state, stopped, count = turns.decode_turn(model, state, jnp.ones(2, bool), cfg=cfg)
    hit = np.asarray(stopped)
    assert np.all(np.asarray(count)[~hit] == 4)  # a turn that does not stop ends at its budget
    state = turns.append(
        model,
        state,
        jnp.full((2, 8), 3, jnp.int32),
        jnp.asarray([8, 8], jnp.int32) - jnp.asarray(count),
        cfg=cfg,
    )
    state, _, count = turns.decode_turn(model, state, jnp.ones(2, bool), cfg=cfg)
    assert np.all(np.asarray(state.length) <= 9) and np.all(
        np.asarray(count) == 1
    )  # one slot was left
    with pytest.raises(ValueError, match="eos_ids"):
        turns.TurnConfig(num_generations=1, max_tokens=4, max_turn_tokens=2)


def test_trajectory_keys_given_whole_or_as_a_share_of_a_larger_split():
    """``start`` splits one key into the P x G trajectories' keys, or takes those keys themselves
    (a process's share of a larger batch's split: ``relax.parallel.local``); a count that is not
    P x G is an error naming both."""
    model = init(tiny(**MODELS["llama_gqa"]), jax.random.key(0), std=0.3)
    cfg = turns.TurnConfig(num_generations=2, max_tokens=4, max_turn_tokens=4, eos_ids=(VOCAB - 1,))
    ids, mask = jnp.ones((1, 3), jnp.int32), jnp.ones((1, 3), jnp.int32)
    key = jax.random.key(7)
    whole = turns.start(model, ids, mask, key, cfg=cfg).keys
    share = turns.start(model, ids, mask, jax.random.split(key, 6)[2:4], cfg=cfg).keys
    np.testing.assert_array_equal(
        jax.random.key_data(whole), jax.random.key_data(jax.random.split(key, 2))
    )
    np.testing.assert_array_equal(
        jax.random.key_data(share), jax.random.key_data(jax.random.split(key, 6)[2:4])
    )
    with pytest.raises(ValueError, match="3 keys for 2 trajectories"):
        turns.start(model, ids, mask, jax.random.split(key, 3), cfg=cfg)
