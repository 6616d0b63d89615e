"""Statistical tests of ``relax.rollout.sampling``: the empirical distribution of ``sample_tokens`` against an
independent NumPy construction of the target distribution (temperature, top-k, top-p, min-p and
their composition in Hugging Face's order), the returned log-probs, ``uniforms`` and validation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.rollout.sampling import SamplingConfig, sample_tokens, uniform_table, uniforms

V = 12
# Two distinct logit vectors (no ties, not sorted) so that per-row filtering is exercised:
# rows alternate between them.
LOGITS_A = np.array([1.3, -0.4, 2.1, 0.2, 1.7, -1.9, 0.9, -0.8, 0.55, 1.1, -2.6, 0.05], np.float32)
LOGITS_B = np.array([-1.0, 0.4, -0.1, 2.4, 0.8, 1.5, -2.2, 0.15, 1.05, -0.5, 0.6, -1.4], np.float32)
N_PER_ROW = 100_000  # samples per logit vector (B = 200_000 rows in all)


# --------------------------------------------------------------------------- NumPy reference


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def _renorm(p, keep):
    p = np.where(keep, p, 0.0)
    return p / p.sum()


def reference_probs(logits, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Target distribution, built by sorting: temperature -> top-k -> top-p -> min-p."""
    p = _softmax(np.asarray(logits, np.float64) / temperature)
    if top_k is not None:
        order = np.argsort(-p)
        keep = np.zeros(p.shape, bool)
        keep[order[:top_k]] = True
        p = _renorm(p, keep)
    if top_p is not None:
        order = np.argsort(-p)
        mass_before = np.cumsum(p[order]) - p[order]
        keep = np.zeros(p.shape, bool)
        keep[order[mass_before < top_p]] = True  # the token that crosses top_p is kept
        p = _renorm(p, keep)
    if min_p is not None:
        p = _renorm(p, p >= min_p * p.max())
    return p


def _chi2_critical(df):
    """A generous upper critical value of chi^2(df): Wilson-Hilferty at z = 6 (p ~ 1e-9)."""
    z = 6.0
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def assert_matches(freq_counts, probs):
    n = freq_counts.sum()
    f = freq_counts / n
    excluded = probs == 0
    # excluded tokens are never drawn
    assert np.all(freq_counts[excluded] == 0), (freq_counts, probs)
    # per-bin: within 5 standard errors
    tol = 5 * np.sqrt(probs * (1 - probs) / n) + 1e-4
    assert np.all(np.abs(f - probs) <= tol), (f, probs, np.abs(f - probs) / tol)
    # chi-square over the kept bins
    kept = ~excluded
    expected = n * probs[kept]
    chi2 = np.sum((freq_counts[kept] - expected) ** 2 / expected)
    df = max(int(kept.sum()) - 1, 1)
    assert chi2 < _chi2_critical(df), (chi2, df)


@functools.partial(jax.jit, static_argnums=2)
def _sample_jit(logits, u, cfg):
    return sample_tokens(logits, u, cfg)


def _draw(cfg, seed=0):
    logits = np.tile(np.stack([LOGITS_A, LOGITS_B]), (N_PER_ROW, 1))  # rows alternate A, B
    u = 1.0 - jax.random.uniform(jax.random.key(seed), (logits.shape[0],))  # (0, 1]
    tok, logp = _sample_jit(jnp.asarray(logits), u, cfg)
    return logits, np.asarray(tok), np.asarray(logp)


CASES = {
    "softmax_t1": dict(temperature=1.0),
    "softmax_t0.6": dict(temperature=0.6),
    "softmax_t1.7": dict(temperature=1.7),
    "top_k3": dict(temperature=1.0, top_k=3),
    "top_k5_t0.8": dict(temperature=0.8, top_k=5),
    "top_p0.6": dict(temperature=1.0, top_p=0.6),
    "top_p0.9_t1.3": dict(temperature=1.3, top_p=0.9),
    "min_p0.2": dict(temperature=1.0, min_p=0.2),
    "min_p0.05_t0.7": dict(temperature=0.7, min_p=0.05),
    "top_k_top_p_min_p": dict(temperature=0.9, top_k=7, top_p=0.85, min_p=0.12),
    "top_k_top_p": dict(temperature=1.2, top_k=8, top_p=0.7),
    "noop_filters": dict(temperature=1.0, top_k=V, top_p=1.0, min_p=0.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_empirical_distribution_matches_reference(case):
    kw = CASES[case]
    cfg = SamplingConfig(**kw)
    logits, tok, logp = _draw(cfg, seed=len(case))
    for row, ref_logits in enumerate([LOGITS_A, LOGITS_B]):
        probs = reference_probs(ref_logits, **kw)
        # the reference must not sit on a top-p boundary, or float rounding could flip a token
        if kw.get("top_p") is not None and kw["top_p"] < 1:
            p = reference_probs(ref_logits, kw["temperature"], kw.get("top_k"))
            c = np.cumsum(np.sort(p)[::-1])
            assert np.min(np.abs(c - kw["top_p"])) > 1e-3
        counts = np.bincount(tok[row::2], minlength=V)
        assert_matches(counts, probs)
    # a non-trivial filter really removes something (guards the reference itself)
    if case not in ("noop_filters",) and any(
        kw.get(f) is not None for f in ("top_k", "top_p", "min_p")
    ):
        assert np.sum(reference_probs(LOGITS_A, **kw) == 0) > 0


def test_reference_sanity():
    """The NumPy reference does what its definitions say on a hand-checked example."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1]))
    np.testing.assert_allclose(reference_probs(logits, top_k=2), [4 / 7, 3 / 7, 0, 0])
    # top_p=0.7: 0.4 < 0.7 so the crossing token 0.3 is included (mass 0.7), 0.2 is not
    np.testing.assert_allclose(reference_probs(logits, top_p=0.65), [4 / 7, 3 / 7, 0, 0])
    np.testing.assert_allclose(reference_probs(logits, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0])
    np.testing.assert_allclose(reference_probs(logits, min_p=0.5), [4 / 9, 3 / 9, 2 / 9, 0])
    # sequential: top-k 3 renormalises to [4/9, 3/9, 2/9]; top-p 0.5 keeps 4/9 and 3/9 (crossing)
    np.testing.assert_allclose(reference_probs(logits, top_k=3, top_p=0.5), [4 / 7, 3 / 7, 0, 0])
    # min-p after top-p: [4/7, 3/7] -> 3/7 >= 0.8 * 4/7 is False
    np.testing.assert_allclose(reference_probs(logits, top_k=3, top_p=0.5, min_p=0.8), [1, 0, 0, 0])


@pytest.mark.parametrize("case", ["softmax_t0.6", "top_k_top_p_min_p", "top_p0.6"])
def test_logprob_is_untruncated_tempered_log_softmax(case):
    kw = CASES[case]
    logits, tok, logp = _draw(SamplingConfig(**kw), seed=7)
    z = logits.astype(np.float64) / kw["temperature"]
    logsm = z - z.max(-1, keepdims=True)
    logsm = logsm - np.log(np.exp(logsm).sum(-1, keepdims=True))
    want = logsm[np.arange(len(tok)), tok]
    np.testing.assert_allclose(logp, want, atol=1e-5, rtol=0)
    assert logp.dtype == np.float32


def test_greedy_is_argmax_with_plain_log_softmax():
    logits = jax.random.normal(jax.random.key(3), (64, 50)) * 3.0
    u = 1.0 - jax.random.uniform(jax.random.key(4), (64,))
    for extra in [{}, dict(top_k=2, top_p=0.5, min_p=0.3)]:  # filters don't change greedy
        tok, logp = _sample_jit(logits, u, SamplingConfig(temperature=0.0, **extra))
        ln = np.asarray(logits, np.float64)
        np.testing.assert_array_equal(np.asarray(tok), ln.argmax(-1))
        ls = ln - ln.max(-1, keepdims=True)
        ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
        np.testing.assert_allclose(np.asarray(logp), ls.max(-1), atol=1e-5, rtol=0)
    assert SamplingConfig(temperature=0.0).greedy and not SamplingConfig().greedy


def test_extreme_uniforms_never_pick_excluded_tokens():
    """u = 1 (the largest draw) and the smallest possible u stay inside the kept set, also when
    excluded tokens sit at both ends of the vocabulary."""
    logits = np.array([[-5.0, 2.0, 1.0, 0.5, -6.0]] * 4, np.float32)
    u = jnp.array([1.0, 2.0**-24, 0.5, 1e-12], jnp.float32)
    for cfg in [
        SamplingConfig(top_k=3),
        SamplingConfig(top_p=0.8),
        SamplingConfig(min_p=0.2),
        SamplingConfig(temperature=0.5, top_k=2, top_p=0.99, min_p=0.01),
    ]:
        tok, _ = _sample_jit(jnp.asarray(logits), u, cfg)
        probs = reference_probs(logits[0], cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)
        assert np.all(probs[np.asarray(tok)] > 0), (cfg, tok)
    # without filters: u = 1 gives the last token, a tiny u the first
    tok, _ = _sample_jit(jnp.asarray(logits), u, SamplingConfig())
    assert int(tok[0]) == 4 and int(tok[3]) == 0


def test_uniforms_range_determinism_and_independence():
    keys = jax.random.split(jax.random.key(11), 4096)
    u0 = np.asarray(uniforms(keys, 0))
    u1 = np.asarray(uniforms(keys, jnp.int32(1)))
    assert u0.shape == (4096,) and u0.dtype == np.float32
    for u in (u0, u1):
        assert np.all(u > 0) and np.all(u <= 1)
        assert abs(u.mean() - 0.5) < 0.03 and abs(u.var() - 1 / 12) < 0.01
    np.testing.assert_array_equal(u0, np.asarray(uniforms(keys, 0)))  # deterministic
    assert len(np.unique(u0)) > 4000  # differs across keys
    assert np.mean(u0 == u1) < 0.01  # differs across steps
    assert abs(np.corrcoef(u0, u1)[0, 1]) < 0.1
    # shape of the key array is kept; each key's draw doesn't depend on its neighbours
    grid = uniforms(keys.reshape(64, 64), 0)
    assert grid.shape == (64, 64)
    np.testing.assert_array_equal(np.asarray(grid).reshape(-1), u0)
    np.testing.assert_array_equal(np.asarray(uniforms(keys[:10], 0)), u0[:10])
    # traced step under jit equals the eager value
    jitted = jax.jit(uniforms)(keys, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(jitted), u1)
    # the sampler's table of every step's draws holds exactly the per-step values
    table = jax.jit(uniform_table, static_argnums=1)(keys[:64], 5)
    assert table.shape == (64, 5)
    for t in range(5):
        np.testing.assert_array_equal(np.asarray(table[:, t]), np.asarray(uniforms(keys[:64], t)))


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
    ],
)
def test_sampling_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kw)


def test_sampling_config_accepts_edges():
    SamplingConfig(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)
    SamplingConfig(min_p=1.0, top_p=1e-6)
