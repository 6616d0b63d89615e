import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_reference import forward as np_forward

from relax.models import ModelConfig, RopeScaling, cast, init
from relax.models.config.families import get_family
from relax.models.decoder import logprobs as lp
from relax.models.decoder.transformer import hidden_states, positions_from_mask

FAMILIES = {
    "llama2_mha_untied": dict(family="llama", num_heads=4, num_kv_heads=4),
    "llama3_gqa_tied": dict(
        family="llama",
        num_heads=4,
        num_kv_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    ),
    "llama_bias": dict(
        family="llama", num_heads=4, num_kv_heads=2, qkv_bias=True, o_bias=True, mlp_bias=True
    ),
    "mistral_window": dict(family="mistral", num_heads=4, num_kv_heads=1, sliding_window=5),
    "qwen2_bias": dict(
        family="qwen2", num_heads=4, num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True
    ),
    "qwen3_qknorm": dict(family="qwen3", num_heads=4, num_kv_heads=2, head_dim=24, qk_norm=True),
    # one sliding (window 4, local RoPE) and one full layer (linear-scaled RoPE); q.k / sqrt(24)
    "gemma3_mixed": dict(
        family="gemma3_text",
        **get_family("gemma3_text").traits,
        num_heads=4,
        num_kv_heads=2,
        sliding_window=4,
        layer_types=("sliding", "full"),
        rope_theta=1e6,
        rope_local_theta=1e4,
        rope_scaling=RopeScaling("linear", 8.0),
        query_pre_attn_scalar=24.0,
        tie_word_embeddings=True,
    ),
    # LongRoPE: per-frequency short factors, cos/sin times an attention factor; a window on every layer
    "phi3_longrope_window": dict(
        family="phi3",
        num_heads=4,
        num_kv_heads=2,
        sliding_window=6,
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
        vocab_size=97,
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


def random_norms(model, key):
    """Unit norm scales hide bugs; perturb every norm weight."""
    L = model.layers
    names = [f for f in L.__dataclass_fields__ if f.endswith("norm") and getattr(L, f) is not None]
    keys = dict(zip(names, jax.random.split(key, len(names))))
    L = L.__class__(
        **{
            f: getattr(L, f) + 0.3 * jax.random.normal(keys[f], getattr(L, f).shape)
            if f in keys
            else getattr(L, f)
            for f in L.__dataclass_fields__
        }
    )
    return model.__class__(
        model.embed, L, model.norm * 1.1, model.lm_head, model.config, model.dtype
    )


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request):
    cfg = tiny(**FAMILIES[request.param])
    return random_norms(init(cfg, jax.random.key(1), std=0.1), jax.random.key(2))


def test_logits_match_numpy_reference(family_model):
    ids = jax.random.randint(jax.random.key(3), (2, 11), 0, family_model.config.vocab_size)
    logits = jax.jit(lambda m, x: m(x))(family_model, ids)
    chex.assert_shape(logits, (2, 11, family_model.config.vocab_size))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(logits), np_forward(family_model, ids), atol=2e-5, rtol=1e-4
    )


def test_left_padding_matches_unpadded(family_model):
    v = family_model.config.vocab_size
    rows = [np.arange(3, 10) % v, np.arange(20, 31) % v]
    T = 13
    ids = np.zeros((2, T), np.int32)
    mask = np.zeros((2, T), np.int32)
    for i, r in enumerate(rows):
        ids[i, T - len(r) :] = r
        mask[i, T - len(r) :] = 1
    padded = family_model(jnp.asarray(ids), jnp.asarray(mask))
    for i, r in enumerate(rows):
        alone = family_model(jnp.asarray(r[None], jnp.int32))
        np.testing.assert_allclose(padded[i, T - len(r) :], alone[0], atol=1e-5, rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(padded)))
    ref = np_forward(family_model, ids, mask)
    np.testing.assert_allclose(
        np.asarray(padded)[mask.astype(bool)], ref[mask.astype(bool)], atol=2e-5, rtol=1e-4
    )


def test_positions_from_mask():
    mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    np.testing.assert_array_equal(
        positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]]
    )


@pytest.mark.slow
def test_bfloat16_params_and_compute():
    cfg = tiny(**FAMILIES["qwen3_qknorm"])
    m32 = init(cfg, jax.random.key(0), std=0.1)
    m16 = cast(m32, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    assert m16.layers.wq.dtype == jnp.bfloat16 and m16.embed.dtype == jnp.bfloat16
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    a, b = m32(ids), m16(ids)
    assert b.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(b)))
    scale = float(jnp.max(jnp.abs(a)))
    assert float(jnp.max(jnp.abs(a - b))) < 0.05 * scale
    # log-probs in bfloat16 compute are close to float32 as well
    la = lp.token_logprobs(m32, ids)
    lb = lp.token_logprobs(m16, ids)
    assert lb.dtype == jnp.float32
    np.testing.assert_allclose(la, lb, atol=0.1)


def test_layers_are_scanned_not_unrolled():
    """A deep model compiles the layer body once: the jaxpr holds one scan of length L."""
    cfg = tiny(num_layers=6)
    m = init(cfg, jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda m, x: m(x))(m, jnp.zeros((1, 4), jnp.int32))
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scans) == 1 and scans[0].params["length"] == 6


def _direct_logprobs(model, ids, mask, temperature=1.0):
    logits = model(ids, mask) / temperature
    logsm = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return jnp.take_along_axis(logsm, ids[:, 1:, None], axis=-1)[..., 0]


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_direct(chunk, temperature):
    cfg = tiny(**FAMILIES["llama3_gqa_tied"])
    m = init(cfg, jax.random.key(4), std=0.1)
    ids = jax.random.randint(jax.random.key(5), (3, 12), 0, cfg.vocab_size)
    mask = jnp.ones_like(ids).at[0, :4].set(0)
    got = jax.jit(
        lambda m: lp.token_logprobs(m, ids, mask, temperature=temperature, chunk_size=chunk)
    )(m)
    want = _direct_logprobs(m, ids, mask, temperature)
    chex.assert_shape(got, (3, 11))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_chunked_logprob_gradients_equal_direct():
    cfg = tiny(**FAMILIES["qwen2_bias"])
    m = init(cfg, jax.random.key(6), std=0.1)
    ids = jax.random.randint(jax.random.key(7), (2, 10), 0, cfg.vocab_size)
    w = jax.random.normal(jax.random.key(8), (2, 9))

    def loss(model, fn):
        return jnp.sum(w * fn(model))

    g1 = jax.grad(loss)(m, lambda mm: lp.token_logprobs(mm, ids, chunk_size=5))
    g2 = jax.grad(loss)(m, lambda mm: _direct_logprobs(mm, ids, None))
    chex.assert_trees_all_close(g1, g2, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_logprob_gradient_matches_finite_difference():
    cfg = tiny(num_layers=1)
    m = init(cfg, jax.random.key(9), std=0.1)
    ids = jax.random.randint(jax.random.key(10), (1, 6), 0, cfg.vocab_size)
    h = hidden_states(m, ids)
    f = lambda h: jnp.sum(lp.logprobs_from_hidden(m, h, ids, chunk_size=4))
    g = jax.grad(f)(h)
    d = jax.random.normal(jax.random.key(11), h.shape)
    eps = 1e-2
    fd = (f(h + eps * d) - f(h - eps * d)) / (2 * eps)
    np.testing.assert_allclose(jnp.vdot(g, d), fd, rtol=2e-3)


@pytest.mark.slow
def test_entropy_equals_direct_values_and_gradients():
    cfg = tiny()
    m = init(cfg, jax.random.key(12), std=0.3)
    ids = jax.random.randint(jax.random.key(13), (2, 8), 0, cfg.vocab_size)

    def direct(mm):
        logits = mm(ids)
        p = jax.nn.softmax(logits, -1)
        return -jnp.sum(p * jax.nn.log_softmax(logits, -1), -1)

    got = lp.token_entropy(m, ids, chunk_size=3)
    np.testing.assert_allclose(got, direct(m), atol=1e-5, rtol=1e-5)
    logits = np.asarray(m(ids), np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(got, -(p * np.log(p)).sum(-1), atol=1e-5)
    g1 = jax.grad(lambda mm: jnp.sum(lp.token_entropy(mm, ids, chunk_size=3)))(m)
    g2 = jax.grad(lambda mm: jnp.sum(direct(mm)))(m)
    chex.assert_trees_all_close(g1, g2, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_and_entropy_gradients_match_float64_reference(temperature):
    """The head's custom backward against the closed form in float64 numpy, with both outputs
    weighted (the update's loss uses the log-prob, an entropy bonus the entropy)::

        dz = w_lp (onehot(y) - p) - w_ent p (z - E_p[z]),   z = h W^T / tau,   dh = dz W / tau
    """
    cfg = tiny()
    m = init(cfg, jax.random.key(14), std=0.3)
    h = jax.random.normal(jax.random.key(15), (2, 7, cfg.hidden_size))
    ids = jax.random.randint(jax.random.key(16), (2, 7), 0, cfg.vocab_size)
    wl, we = jax.random.normal(jax.random.key(17), (2, 2, 7))
    f = lambda h, head: jnp.sum(wl * head[0] + we * head[1])
    gh, gm = jax.grad(
        lambda h, mm: f(
            h,
            lp.logprobs_and_entropy_from_hidden(mm, h, ids, temperature=temperature, chunk_size=3),
        ),
        argnums=(0, 1),
    )(h, m)
    H, W = np.asarray(h, np.float64).reshape(14, -1), np.asarray(m.head, np.float64)
    z = H @ W.T / temperature
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a, b = np.asarray(wl, np.float64).reshape(14, 1), np.asarray(we, np.float64).reshape(14, 1)
    dz = -a * p - b * p * (z - (p * z).sum(-1, keepdims=True))
    dz[np.arange(14), np.asarray(ids).reshape(-1)] += a[:, 0]
    np.testing.assert_allclose(np.asarray(gh).reshape(14, -1), dz @ W / temperature, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gm.head), dz.T @ H / temperature, atol=2e-5)


def test_entropy_as_a_metric_has_no_gradient_and_the_same_values():
    """``entropy_grad=False``: same log-probs and entropies, the log-prob gradient unchanged (the
    float64 closed form with w_ent = 0), and no gradient through the entropy."""
    cfg = tiny()
    m = init(cfg, jax.random.key(18), std=0.3)
    h = jax.random.normal(jax.random.key(19), (2, 7, cfg.hidden_size))
    ids = jax.random.randint(jax.random.key(20), (2, 7), 0, cfg.vocab_size)
    wl, we = jax.random.normal(jax.random.key(21), (2, 2, 7))
    head = lambda h, mm, grad: lp.logprobs_and_entropy_from_hidden(
        mm, h, ids, temperature=0.7, chunk_size=3, entropy_grad=grad
    )
    chex.assert_trees_all_close(head(h, m, False), head(h, m, True), atol=1e-6)
    gh, gm = jax.grad(
        lambda h, mm: jnp.sum(wl * head(h, mm, False)[0] + we * head(h, mm, False)[1]),
        argnums=(0, 1),
    )(h, m)
    H, W = np.asarray(h, np.float64).reshape(14, -1), np.asarray(m.head, np.float64)
    z = H @ W.T / 0.7
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.asarray(wl, np.float64).reshape(14, 1)
    dz = -a * p
    dz[np.arange(14), np.asarray(ids).reshape(-1)] += a[:, 0]
    np.testing.assert_allclose(np.asarray(gh).reshape(14, -1), dz @ W / 0.7, atol=2e-5)
    np.testing.assert_allclose(np.asarray(gm.head), dz.T @ H / 0.7, atol=2e-5)
    g_ent = jax.grad(lambda h: jnp.sum(head(h, m, False)[1]))(h)
    assert not np.any(np.asarray(g_ent))


def test_config_validation_names_field():
    with pytest.raises(ValueError, match="num_kv_heads"):
        tiny(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="family"):
        tiny(family="gpt2")
