"""Compaction of the sampler's decode batch (``relax.rollout.compaction``): the phase sizes and
the rows kept, worked by hand; a compacted rollout equals the uncompacted one (tokens, mask,
lengths, stop flags, log-probs, a mixture of experts' recorded routes) on ragged lengths, with
windows and several cache blocks; its log-probs equal the trainer's; its program holds the
smaller phases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rollout import LOGP_ATOL, VOCAB, _all_shapes, get_model, ragged_prompts, tiny

from relax.models import init
from relax.models.decoder.logprobs import token_logprobs
from relax.rollout import sampler as rollout
from relax.rollout.compaction import compaction_sizes, keep_rows
from relax.rollout.sampler import RolloutConfig, compiled_generate
from relax.rollout.sampling import SamplingConfig

STOPS = tuple(range(1, VOCAB, 9))  # ~11% of the vocabulary: lengths from 1 to the budget
G, N = 4, 20


def test_phase_sizes_and_kept_rows_by_hand():
    assert compaction_sizes(12, 2) == (12, 6, 3)
    assert compaction_sizes(12, 5) == (12, 6, 3, 2, 1)
    assert compaction_sizes(12, 3, multiple=4) == (
        12,
        8,
        4,
    )  # 6 -> 8, 4 -> 4; 2 -> 4 does not shrink
    assert compaction_sizes(5, 2) == (5, 3, 2)
    assert compaction_sizes(1, 3) == (1,) and compaction_sizes(12, 0) == (12,)
    finished = jnp.asarray([False, True, False, True, True, False])
    np.testing.assert_array_equal(np.asarray(keep_rows(finished, 4)), [0, 2, 5, 1])


def _run(model, compactions, chunk=8, record=False, seed=3):
    ids, mask = ragged_prompts()
    cfg = RolloutConfig(
        num_generations=G,
        max_new_tokens=N,
        eos_ids=STOPS,
        cache_chunk=chunk,
        sampling=SamplingConfig(temperature=1.0),
        compactions=compactions,
        record_routes=record,
    )
    return (
        ids,
        mask,
        compiled_generate(cfg)(model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(seed)),
    )


def _compacts(r, size):
    """Whether some step had between 1 and ``size`` running rows (a phase of ``size`` rows ran)."""
    lengths = np.asarray(r.lengths).reshape(-1)
    running = [(lengths > t + 1).sum() for t in range(N - 1)]  # rows still drawing after step t
    return any(0 < k <= size for k in running)


@pytest.mark.parametrize(
    "name, runs",
    [
        pytest.param(
            "llama_gqa", ((1, 8), (3, 3)), marks=pytest.mark.slow
        ),  # make test-all; gemma3_mixed is fast
        (
            "gemma3_mixed",
            ((2, 3),),
        ),  # a sliding layer: per-row query positions against the prompt's
        pytest.param("mistral_window", ((3, 8),), marks=pytest.mark.slow),
    ],
)
@pytest.mark.slow
def test_compacted_rollout_equals_the_uncompacted_one(name, runs):
    model = get_model(name)
    _, _, want = _run(model, 0)
    assert (
        _compacts(want, 3 * len(want.lengths.ravel()) // 4)
        and len(set(np.asarray(want.lengths).ravel())) > 3
    )
    for compactions, chunk in runs:
        _, _, got = _run(model, compactions, chunk)
        for field in ("tokens", "mask", "lengths", "finished"):
            np.testing.assert_array_equal(
                np.asarray(getattr(got, field)),
                np.asarray(getattr(want, field)),
                err_msg=f"{name} {compactions} {field}",
            )
        np.testing.assert_allclose(
            np.asarray(got.logprobs), np.asarray(want.logprobs), atol=LOGP_ATOL
        )


@pytest.mark.slow
def test_compacted_logprobs_equal_the_trainer():
    model = get_model("llama_gqa")
    ids, mask, r = _run(model, 3, chunk=4, seed=7)
    P = ids.shape[0]
    seq = np.concatenate([np.repeat(ids, G, 0), np.asarray(r.tokens).reshape(P * G, N)], 1)
    full = np.concatenate([np.repeat(mask, G, 0), np.asarray(r.mask).reshape(P * G, N)], 1)
    trainer = np.asarray(token_logprobs(model, jnp.asarray(seq), jnp.asarray(full)))[
        :, ids.shape[1] - 1 :
    ]
    valid = np.asarray(r.mask).reshape(P * G, N).astype(bool)
    diff = np.abs(np.asarray(r.logprobs).reshape(P * G, N)[valid] - trainer[valid])
    # 2.46e-5 at most, as uncompacted (logits up to |8|: test_rollout's LOGP_ATOL note)
    assert diff.max() <= 1.5 * LOGP_ATOL and diff.mean() < 5e-6, (diff.max(), diff.mean())


@pytest.mark.slow
def test_compacted_routes_equal_the_uncompacted_ones():
    moe = init(
        tiny(
            family="mixtral",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
        jax.random.key(0),
        std=0.3,
    )
    _, _, want = _run(moe, 0, record=True)
    _, _, got = _run(moe, 2, record=True)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(
        np.asarray(got.routes.completion), np.asarray(want.routes.completion)
    )
    routes, mask = np.asarray(got.routes.completion), np.asarray(got.mask)
    fed = np.zeros_like(mask, bool)
    fed[..., :-1] = mask[..., 1:] > 0  # token t is fed by a running row when token t+1 was drawn
    assert np.all(routes[fed] >= 0) and np.all(routes[~fed] == -1)


@pytest.mark.slow
def test_phases_are_in_the_program_and_none_without_stop_ids():
    model = get_model("llama_gqa")
    ids, mask = ragged_prompts()
    c, b = model.config, ids.shape[0] * G

    def shapes(**kw):
        cfg = RolloutConfig(num_generations=G, max_new_tokens=N, **{"cache_chunk": 8, **kw})
        jaxpr = jax.make_jaxpr(lambda m, i, k_, key: rollout.generate_program(m, i, k_, key, cfg))(
            model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0)
        )
        return set(_all_shapes(jaxpr.jaxpr))

    own = lambda rows: (rows, c.num_kv_heads, 8, c.head_dim)  # noqa: E731  a completion cache block
    got = shapes(eos_ids=STOPS, compactions=2)
    assert {own(b), own(b // 2), own(b // 4)} <= got
    assert (
        b // 2,
        c.num_kv_heads,
        c.head_dim,
        ids.shape[1],
    ) in got  # per-row prompt keys once compacted
    assert own(b // 2) not in shapes(eos_ids=(), compactions=2)  # every row runs to the budget
    assert own(b // 2) not in shapes(eos_ids=STOPS, compactions=0)
    # ten blocks of 2 slots: the compacted phases read four blocks (three of phase 0's each, the last 2)
    blocks = lambda rows, slots: (rows, c.num_kv_heads, slots, c.head_dim)  # noqa: E731
    got = shapes(eos_ids=STOPS, compactions=2, cache_chunk=2)
    assert {blocks(b, 2), blocks(b // 2, 6), blocks(b // 4, 6), blocks(b // 2, 2)} <= got
    assert blocks(b // 2, 4) not in got
