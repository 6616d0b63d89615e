"""The prefix-shared KV-cache sampler (``relax.rollout.sampler``) against the no-cache oracle, the
trainer's log-probs, and its contract: shapes, stop ids, determinism, batch independence,
prompt sharing, bucketing and input validation.

Few distinct programs are compiled (each distinct RolloutConfig x shape is one compile), and
the models are tiny, so the file stays fast on a loaded CPU.
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core
from model_reference import forward as np_forward

from relax.models import ModelConfig, RopeScaling, init
from relax.models.config.families import get_family
from relax.models.decoder.logprobs import token_logprobs
from relax.rollout import naive as rollout_naive
from relax.rollout import sampler as rollout
from relax.rollout.sampler import RolloutConfig, generate
from relax.rollout.sampling import SamplingConfig

VOCAB = 97
# Log-prob tolerance. With std=0.3 weights the logits reach |8|, where float32 rounding of two
# differently-ordered but equivalent computations (merged prompt/completion partial softmaxes vs
# one softmax, different padding) is ~1e-5: the trainer differs from ITSELF by ~6e-6 under a
# different amount of left padding, and from a float64 reference by ~6e-6. A real bug (a wrong
# mask, position or window) moves log-probs by >1e-2.
LOGP_ATOL = 2e-5
MODELS = {
    "llama_gqa": dict(family="llama"),
    "mistral_window": dict(family="mistral", sliding_window=5),
    "qwen3_qknorm": dict(family="qwen3", head_dim=24, qk_norm=True, qkv_bias=False),
    # a sliding layer (window 3, its own RoPE base) then a full one; q.k / sqrt(24)
    "gemma3_mixed": dict(
        family="gemma3_text",
        **get_family("gemma3_text").traits,
        sliding_window=3,
        layer_types=("sliding", "full"),
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=24.0,
    ),
    "phi3_longrope": dict(
        family="phi3",
        rope_scaling=RopeScaling(
            "longrope",
            8.0,
            original_max_position=128,
            short_factor=(1.0, 1.4, 2.0, 1.1, 3.0, 2.5, 5.0, 4.0),
            long_factor=(9.0,) * 8,
            attention_factor=1.2,
        ),
    ),
}


def tiny(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
    )
    base.update(kw)
    return ModelConfig(**base)


_MODELS = {}


def get_model(name):
    if name not in _MODELS:
        _MODELS[name] = init(tiny(**MODELS[name]), jax.random.key(0), std=0.3)
    return _MODELS[name]


@pytest.fixture(scope="module")
def model():
    return get_model("llama_gqa")


def ragged_prompts(lengths=(9, 4, 6), width=9, seed=0, low=5):
    """Left-padded prompts (pad id 0) with ids in [low, VOCAB)."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((len(lengths), width), np.int32)
    mask = np.zeros((len(lengths), width), np.int32)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = rng.integers(low, VOCAB, n)
        mask[i, width - n :] = 1
    return ids, mask


# ----------------------------------------------------------------------------- greedy vs oracle

GREEDY = dict(num_generations=4, max_new_tokens=12)
_greedy_cache = {}


def greedy_rollout(name):
    if name not in _greedy_cache:
        ids, mask = ragged_prompts()
        _greedy_cache[name] = generate(
            get_model(name), ids, mask, key=jax.random.key(1), temperature=0.0, eos_ids=(), **GREEDY
        )
    return _greedy_cache[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_matches_no_cache_oracle(name):
    m = get_model(name)
    ids, mask = ragged_prompts()
    got = greedy_rollout(name)
    cfg = RolloutConfig(sampling=SamplingConfig(temperature=0.0), eos_ids=(), **GREEDY)
    want = rollout_naive.generate_no_cache(m, ids, mask, jax.random.key(1), cfg)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(want.mask))
    np.testing.assert_allclose(
        np.asarray(got.logprobs), np.asarray(want.logprobs), atol=LOGP_ATOL, rtol=0
    )
    # the G greedy completions of a prompt are identical; prompts differ
    toks = np.asarray(got.tokens)
    assert np.all(toks == toks[:, :1])
    assert not np.array_equal(toks[0, 0], toks[1, 0])
    assert np.all(np.asarray(got.mask) == 1) and not np.any(np.asarray(got.finished))
    # and they really are greedy: each token is the argmax of the full forward's logits
    seq = np.concatenate([ids, toks[:, 0]], 1)
    full_mask = np.concatenate([mask, np.ones_like(toks[:, 0])], 1)
    logits = np_forward(m, seq, full_mask)  # float64 NumPy restatement of the model
    lp = ids.shape[1]
    np.testing.assert_array_equal(logits[:, lp - 1 : -1].argmax(-1), toks[:, 0])
    logsm = logits - logits.max(-1, keepdims=True)
    logsm -= np.log(np.exp(logsm).sum(-1, keepdims=True))
    np.testing.assert_allclose(
        np.asarray(got.logprobs)[:, 0], logsm[:, lp - 1 : -1].max(-1), atol=LOGP_ATOL, rtol=0
    )


def _all_shapes(jaxpr):
    """Every intermediate shape in a (closed) jaxpr, sub-jaxprs (while bodies) included."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for s in subs:
                if isinstance(s, jex_core.ClosedJaxpr):
                    shapes += _all_shapes(s.jaxpr)
                elif isinstance(s, jex_core.Jaxpr):
                    shapes += _all_shapes(s)
    return shapes


def test_prompt_kv_is_stored_once_per_prompt(model):
    c = model.config
    ids, mask = ragged_prompts()
    p, lp = ids.shape
    pk, pv, logits, routes = jax.eval_shape(
        rollout._prefill, model, jnp.asarray(ids), jnp.asarray(mask)
    )
    assert pk.shape == pv.shape == (c.num_layers, p, c.num_kv_heads, lp, c.head_dim)
    assert logits.shape == (p, c.vocab_size)  # last position only
    assert routes is None  # a dense model records no experts
    # in the whole generate program (decode loop included) no [P*G, Hkv, Lp, D] prompt copy exists
    g, n = 4, 6
    cfg = RolloutConfig(num_generations=g, max_new_tokens=n, eos_ids=())
    jaxpr = jax.make_jaxpr(lambda m, i, k_, key: rollout.generate_program(m, i, k_, key, cfg))(
        model, jnp.asarray(ids), jnp.asarray(mask), jax.random.key(0)
    )
    shapes = set(_all_shapes(jaxpr.jaxpr))
    assert (p, c.num_kv_heads, lp, c.head_dim) in shapes  # the shared prompt block
    assert (p * g, c.num_kv_heads, n, c.head_dim) in shapes  # each completion's own cache
    assert not any(len(s) >= 2 and s[0] == p * g and lp in s[1:] for s in shapes), sorted(
        s for s in shapes if s and s[0] == p * g
    )


# ----------------------------------------------------------------------------- sampled rollout

STOP_IDS = tuple(range(1, VOCAB, 3))  # a third of the vocabulary; pad id 0 is not one of them
SAMPLED = dict(
    num_generations=4, max_new_tokens=10, temperature=0.8, top_k=20, eos_ids=STOP_IDS, pad_id=0
)


@pytest.fixture(scope="module")
def sampled(model):
    ids, mask = ragged_prompts()
    return ids, mask, generate(model, ids, mask, key=jax.random.key(5), **SAMPLED)


@pytest.mark.slow
def test_rollout_shapes_and_dtypes(sampled):
    _, _, r = sampled
    P, G, N = 3, SAMPLED["num_generations"], SAMPLED["max_new_tokens"]
    chex.assert_shape([r.tokens, r.mask, r.logprobs], (P, G, N))
    chex.assert_shape([r.lengths, r.finished], (P, G))
    assert r.tokens.dtype == jnp.int32 and r.mask.dtype == jnp.int32
    assert r.logprobs.dtype == jnp.float32 and r.finished.dtype == jnp.bool_


def test_sampled_logprobs_equal_trainer_logprobs(model, sampled):
    """Zero sampler/trainer mismatch: the trainer's recomputation at temperature 0.8 on
    [prompt | completion] equals the sampler's log-probs at every completion token."""
    ids, mask, r = sampled
    P, G, N = r.tokens.shape
    seq = np.concatenate([np.repeat(ids, G, 0), np.asarray(r.tokens).reshape(P * G, N)], 1)
    full_mask = np.concatenate([np.repeat(mask, G, 0), np.asarray(r.mask).reshape(P * G, N)], 1)
    lp_train = token_logprobs(model, jnp.asarray(seq), jnp.asarray(full_mask), temperature=0.8)
    lp_train = np.asarray(lp_train)[:, ids.shape[1] - 1 :]  # predictions of the completion tokens
    valid = np.asarray(r.mask).reshape(P * G, N).astype(bool)
    diff = np.abs(np.asarray(r.logprobs).reshape(P * G, N)[valid] - lp_train[valid])
    assert diff.max() <= LOGP_ATOL and np.mean(diff) < 5e-6, (diff.max(), np.mean(diff))
    assert np.all(np.asarray(r.logprobs)[np.asarray(r.mask) == 1] < 0)


def test_stop_ids(sampled):
    _, _, r = sampled
    toks, mask, lps = np.asarray(r.tokens), np.asarray(r.mask), np.asarray(r.logprobs)
    lengths, finished = np.asarray(r.lengths), np.asarray(r.finished)
    N = toks.shape[-1]
    stop = np.isin(toks, STOP_IDS)
    seen = set()
    for p in range(toks.shape[0]):
        for g in range(toks.shape[1]):
            hits = np.nonzero(stop[p, g])[0]
            end = hits[0] + 1 if hits.size else N  # first stop token included
            if hits.size:
                seen.add(int(toks[p, g, hits[0]]))
            np.testing.assert_array_equal(mask[p, g], (np.arange(N) < end).astype(np.int32))
            assert np.all(toks[p, g, end:] == 0)  # pad id after the stop
            assert np.all(lps[p, g, end:] == 0.0)
            assert lengths[p, g] == end == mask[p, g].sum()
            assert finished[p, g] == bool(hits.size)
    assert np.sum(finished) >= 4 and np.any(lengths <= N // 2)  # many stop early
    assert len(seen) >= 3, seen  # several distinct stop ids honoured


# ------------------------------------------------------------------- determinism and independence

FREE = dict(num_generations=4, max_new_tokens=8, temperature=1.0, eos_ids=())


@pytest.fixture(scope="module")
def free(model):
    ids, mask = ragged_prompts()
    return ids, mask, generate(model, ids, mask, key=jax.random.key(7), **FREE)


def test_no_stop_ids_runs_to_budget(free):
    _, _, r = free
    assert np.all(np.asarray(r.mask) == 1)
    assert np.all(np.asarray(r.lengths) == FREE["max_new_tokens"])
    assert not np.any(np.asarray(r.finished))


def test_determinism_and_diversity(model, free):
    ids, mask, r = free
    again = generate(model, ids, mask, key=jax.random.key(7), **FREE)
    chex.assert_trees_all_equal(r, again)
    other = generate(model, ids, mask, key=jax.random.key(8), **FREE)
    assert not np.array_equal(np.asarray(r.tokens), np.asarray(other.tokens))
    toks = np.asarray(r.tokens)
    for p in range(toks.shape[0]):  # completions of one prompt differ from each other
        rows = {tuple(t) for t in toks[p]}
        assert len(rows) == toks.shape[1]


def test_batch_independence(model, free):
    """Prompt A's completions don't depend on which other prompts share the batch."""
    ids, mask, r = free
    alone = generate(model, ids[:1], mask[:1], key=jax.random.key(7), **FREE)
    np.testing.assert_array_equal(np.asarray(alone.tokens)[0], np.asarray(r.tokens)[0])
    np.testing.assert_allclose(
        np.asarray(alone.logprobs)[0], np.asarray(r.logprobs)[0], atol=LOGP_ATOL, rtol=0
    )


def test_prompt_sharing_equals_repeated_prompts(model, free):
    """G=4 over P prompts (one prompt KV copy each, completions folded into the query heads)
    == G=1 over every prompt repeated 4 times. Completion i = p*G + g owns key i in both
    layouts, so even the SAMPLED tokens are identical, not just greedy ones."""
    ids, mask, shared = free
    P, G, N = shared.tokens.shape
    kw = {**FREE, "num_generations": 1}
    rep = generate(model, np.repeat(ids, G, 0), np.repeat(mask, G, 0), key=jax.random.key(7), **kw)
    chex.assert_shape(rep.tokens, (P * G, 1, N))
    np.testing.assert_array_equal(
        np.asarray(shared.tokens).reshape(P * G, N), np.asarray(rep.tokens)[:, 0]
    )
    np.testing.assert_allclose(
        np.asarray(shared.logprobs).reshape(P * G, N),
        np.asarray(rep.logprobs)[:, 0],
        atol=LOGP_ATOL,
        rtol=0,
    )


# ------------------------------------------------------------------------------------- buckets


def test_prompt_buckets_share_a_compile(model):
    kw = dict(
        key=jax.random.key(0),
        num_generations=1,
        max_new_tokens=3,
        temperature=0.0,
        eos_ids=(),
        prompt_buckets=(16, 32),
    )
    cfg = RolloutConfig(
        num_generations=1,
        max_new_tokens=3,
        sampling=SamplingConfig(temperature=0.0),
        eos_ids=(),
        prompt_buckets=(16, 32),
    )
    fn = rollout.compiled_generate(cfg)
    assert fn._cache_size() == 0
    ids10, mask10 = ragged_prompts((10, 3), width=10)
    r10 = generate(model, ids10, mask10, **kw)
    ids13, mask13 = ragged_prompts((13, 7), width=13, seed=1)
    generate(model, ids13, mask13, **kw)
    assert fn._cache_size() == 1
    ids20, mask20 = ragged_prompts((20, 11), width=20, seed=2)
    generate(model, ids20, mask20, **kw)
    assert fn._cache_size() == 2
    # bucket padding doesn't change the result: the width-10 prompts left-padded by hand to 13
    pad = np.zeros((2, 3), np.int32)
    r10b = generate(model, np.concatenate([pad, ids10], 1), np.concatenate([pad, mask10], 1), **kw)
    assert fn._cache_size() == 2
    np.testing.assert_array_equal(np.asarray(r10.tokens), np.asarray(r10b.tokens))


# ----------------------------------------------------------------------------------- bad input


@pytest.fixture
def no_compile(monkeypatch):
    def boom(cfg):
        raise AssertionError("compiled before validating")

    monkeypatch.setattr(rollout, "compiled_generate", boom)


def _call(model, ids=None, mask=None, **kw):
    if ids is None:
        ids, mask = ragged_prompts()
    args = dict(key=jax.random.key(0), num_generations=2, max_new_tokens=4)
    args.update(kw)
    return generate(model, ids, mask, **args)


def test_bad_inputs_raise_before_compiling(model, no_compile):
    ctx = model.config.max_position_embeddings
    long_ids = np.full((1, ctx + 2), 5, np.int32)
    with pytest.raises(ValueError, match=r"longer than the model's context \(128\)"):
        _call(model, long_ids, np.ones_like(long_ids))
    ids, mask = ragged_prompts()
    with pytest.raises(ValueError, match="largest prompt bucket 8"):
        _call(model, ids, mask, prompt_buckets=(4, 8))
    with pytest.raises(ValueError, match="max_new_tokens=40 .* overflows the model's context"):
        _call(model, np.full((1, 100), 5, np.int32), np.ones((1, 100), np.int32), max_new_tokens=40)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _call(model, max_new_tokens=0)
    empty = mask.copy()
    empty[1] = 0
    with pytest.raises(ValueError, match=r"rows \[1\] are empty"):
        _call(model, ids, empty)
    with pytest.raises(ValueError, match="num_generations must be >= 1, got 0"):
        _call(model, num_generations=0)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match="top_p"):
            _call(model, top_p=top_p)
    with pytest.raises(ValueError, match="temperature"):
        _call(model, temperature=-1.0)
    with pytest.raises(ValueError, match="stop id 97 is outside the vocabulary"):
        _call(model, eos_ids=(3, VOCAB))
    with pytest.raises(ValueError, match="stop id -1"):
        _call(model, eos_ids=-1)
    bad = ids.copy()
    bad[2, 7] = VOCAB
    with pytest.raises(ValueError, match=r"prompt_ids\[2, 7\] = 97 is outside the vocabulary"):
        _call(model, bad, mask)
    bad[2, 7] = -3
    with pytest.raises(ValueError, match=r"prompt_ids\[2, 7\] = -3"):
        _call(model, bad, mask)
    with pytest.raises(ValueError, match="pad_id"):
        _call(model, pad_id=VOCAB)
    with pytest.raises(ValueError, match=r"must both be \[P, Lp\]"):
        _call(model, ids, mask[:, 1:])


def test_long_budgets_get_larger_cache_blocks_not_more_loops():
    """The compiled program grows with the square of the number of cache blocks: at most
    max_segments of them, larger blocks for long budgets."""
    assert rollout.block_size(RolloutConfig(num_generations=1, max_new_tokens=128)) == 64
    assert rollout.block_size(RolloutConfig(num_generations=1, max_new_tokens=4096)) == 256
    assert (
        rollout.block_size(
            RolloutConfig(num_generations=1, max_new_tokens=12, cache_chunk=5, max_segments=2)
        )
        == 6
    )
    with pytest.raises(ValueError, match="max_segments must be >= 1"):
        RolloutConfig(num_generations=1, max_new_tokens=8, max_segments=0)


@pytest.mark.parametrize("name", ["llama_gqa", "mistral_window"])
@pytest.mark.slow
def test_blocked_completion_cache_matches_single_block(name):
    """Cache blocks of 5 slots (segments 5, 5, 2) decode exactly what one 12-slot block does."""
    ids, mask = ragged_prompts()
    cfg = RolloutConfig(
        sampling=SamplingConfig(temperature=0.0), eos_ids=(), cache_chunk=5, **GREEDY
    )
    want = greedy_rollout(name)
    for c in (
        cfg,
        dataclasses.replace(cfg, max_segments=2),
    ):  # blocks of 5 (5, 5, 2) and of 6 (6, 6)
        got = rollout.generate_with(get_model(name), ids, mask, jax.random.key(1), c)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_allclose(
            np.asarray(got.logprobs), np.asarray(want.logprobs), atol=LOGP_ATOL, rtol=0
        )
