"""The precision policy (relax.models.config.precision): which values a low-precision forward keeps
in float32, the attention's float32 probabilities over a bfloat16 cache, and the sampler and the
trainer agreeing in bfloat16 on a model deep enough to show the effect."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.models import family_config, init
from relax.models.attention.blocks import probs_times_values
from relax.models.config.precision import Precision
from relax.models.decoder import taps
from relax.models.forward.prefix_shared import completion_logprobs
from relax.rollout import sampler as rollout

CFG = family_config(
    "llama",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=320,
    num_layers=8,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)


def test_a_bad_choice_names_the_field():
    with pytest.raises(ValueError, match="precision.residual"):
        Precision(residual="bfloat16")


def _dtypes(model, ids):
    """The dtype of every tapped value while tracing the model's forward (taps.recording)."""
    seen = {}

    def recorder(name, x):
        seen.setdefault(name, set()).add(jnp.dtype(x.dtype).name)
        return x

    with taps.recording(recorder):
        jax.eval_shape(model, ids)
    return seen


@pytest.mark.parametrize("policy", [Precision(), Precision.lowest()])
def test_the_policy_decides_what_stays_float32(policy):
    model = init(CFG, jax.random.key(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    model = dataclasses.replace(model, precision=policy)
    seen = _dtypes(model, jnp.ones((2, 5), jnp.int32))
    residual = "float32" if policy.residual == "float32" else "bfloat16"
    products = "float32" if policy.activations == "float32" else "bfloat16"
    for name in ("residual_in", "residual_mid", "residual_out", "attn_norm", "mlp_norm"):
        assert seen[name] == {residual}, name
    for name in ("q", "k", "v", "attn_proj", "mlp_act", "mlp"):
        assert seen[name] == {products}, name
    assert seen["final_norm"] == {residual}  # the head's operand is cast after the tap


def test_in_float32_every_policy_is_the_same_program():
    model = init(CFG, jax.random.key(0), std=0.1)
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, CFG.vocab_size)
    a = model(ids)
    b = dataclasses.replace(model, precision=Precision.lowest())(ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("probs, bound", [(jnp.float32, 2.0**-14), (jnp.bfloat16, 2.0**-7)])
def test_probabilities_times_a_bfloat16_cache(probs, bound):
    """``P V`` against float64: float32 ``P`` (two bfloat16 products, hi + lo) is exact to about
    2^-16 of the result's scale; ``P`` rounded to bfloat16 only to about 2^-9."""
    rng = np.random.default_rng(0)
    p = rng.random((2, 3, 5, 40)).astype(np.float32)
    v = jnp.asarray(rng.standard_normal((2, 3, 40, 8)), jnp.bfloat16)
    want = np.einsum("bhms,bhsd->bhmd", p.astype(np.float64), np.asarray(v, np.float64))
    got = np.asarray(probs_times_values(jnp.asarray(p), v, probs))
    scale = np.einsum("bhms,bhsd->bhmd", p.astype(np.float64), np.abs(np.asarray(v, np.float64)))
    err = np.max(np.abs(got - want) / scale)
    assert err <= bound
    if probs == jnp.float32:
        rounded = probs_times_values(jnp.asarray(p), v, jnp.bfloat16)
        assert np.max(np.abs(np.asarray(rounded) - want) / scale) > 8 * err


def _mismatch(model, p=4, g=8, n=64):
    """``d = log p_trainer - log p_sampler`` of the sampler's own tokens, valid tokens only."""
    rng = np.random.default_rng(0)
    ids, mask = np.zeros((p, 32), np.int32), np.zeros((p, 32), np.int32)
    for i in range(p):
        k = int(rng.integers(8, 30))
        ids[i, 32 - k :], mask[i, 32 - k :] = rng.integers(3, CFG.vocab_size, k), 1
    r = rollout.generate(
        model,
        jnp.asarray(ids),
        jnp.asarray(mask),
        key=jax.random.key(0),
        num_generations=g,
        max_new_tokens=n,
        eos_ids=(),
    )
    train = completion_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), r.tokens, r.mask)
    valid = np.asarray(r.mask).astype(bool)
    return (np.asarray(train, np.float64) - np.asarray(r.logprobs, np.float64))[valid]


@pytest.mark.slow
def test_sampler_and_trainer_agree_in_bfloat16():
    """An 8-layer model in bfloat16 params and compute, 32 completions of 64 tokens: the sampler's
    log-probs of its tokens and the trainer's, with the default policy, |d| <= 0.05 at p99.9 and
    <= 0.1 at most, every ratio in [0.95, 1.05]; with everything in bfloat16 (relax before the
    policy) they part further (p99.9 0.088, max 0.106, 96% of ratios in the band when written).
    In float16 operands (bfloat16 weights) the issue's bounds hold: p99.9 <= 0.02, max <= 0.1."""
    model = init(CFG, jax.random.key(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16, std=0.1)
    d = np.abs(_mismatch(model))
    assert np.quantile(d, 0.999) <= 0.05 and d.max() <= 0.1
    assert np.all(np.exp(d) <= 1.05)  # so every ratio exp(+-|d|) is in [0.95, 1.05]
    low = np.abs(_mismatch(dataclasses.replace(model, precision=Precision.lowest())))
    assert np.quantile(low, 0.999) > 2 * np.quantile(d, 0.999)
    fp16 = np.abs(_mismatch(dataclasses.replace(model, dtype=jnp.float16)))
    assert np.quantile(fp16, 0.999) <= 0.02 and fp16.max() <= 0.1
