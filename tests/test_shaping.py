import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.rewards import (
    combine,
    dynamic_sampling_mask,
    group_stats,
    length_shaping,
    overlong_penalty,
)

NAN = np.nan


def J(f, **kw):
    return jax.jit(functools.partial(f, **kw))


# ----------------------------------------------------------------------------- combine


def np_combine(v, w, all_missing):
    total = np.nansum(v * np.asarray(w)[:, None, None], axis=0)
    if all_missing == "nan":
        total = np.where(np.isnan(v).all(axis=0), np.nan, total)
    return total


def test_combine_hand_values_and_missing():
    acc = np.array([[1.0, 0.0, NAN]], np.float32)
    fmt = np.array([[0.5, NAN, NAN]], np.float32)
    total, per = combine({"acc": acc, "fmt": fmt}, {"fmt": 0.2, "acc": 1.0})
    np.testing.assert_allclose(total, [[1.1, 0.0, NAN]], rtol=1e-6)
    np.testing.assert_array_equal(per["fmt"], fmt)  # unweighted, NaN kept
    total_zero, _ = combine({"acc": acc, "fmt": fmt}, {"fmt": 0.2, "acc": 1.0}, all_missing="zero")
    np.testing.assert_allclose(total_zero, [[1.1, 0.0, 0.0]], rtol=1e-6)  # TRL's nansum


@pytest.mark.parametrize("all_missing", ["nan", "zero"])
def test_combine_against_numpy_jit(all_missing):
    rng = np.random.default_rng(0)
    v = rng.normal(size=(3, 4, 5)).astype(np.float32)
    v[rng.random(v.shape) < 0.3] = NAN
    v[:, 0, 0] = NAN
    w = [1.0, 0.0, -0.5]  # 0.0 is a valid weight
    total, per = J(combine, weights=w, names=["a", "b", "c"], all_missing=all_missing)(v)
    np.testing.assert_allclose(total, np_combine(v, w, all_missing), rtol=1e-6, atol=1e-6)
    assert set(per) == {"a", "b", "c"}
    total_default, per_default = combine(v)  # weights all 1, names "0".."2"
    np.testing.assert_allclose(total_default, np_combine(v, [1, 1, 1], "nan"), rtol=1e-6, atol=1e-6)
    assert list(per_default) == ["0", "1", "2"]
    tb, _ = combine(jnp.asarray(v, jnp.bfloat16), w)
    assert tb.dtype == jnp.float32


def test_combine_errors():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="nan, zero"):
        combine({"a": a}, all_missing="drop")
    with pytest.raises(ValueError, match="differ"):
        combine({"a": a, "b": a}, {"a": 1.0})
    with pytest.raises(ValueError, match="2 weights for 3"):
        combine(np.zeros((3, 2, 3)), [1.0, 2.0])
    with pytest.raises(AssertionError, match=r"b=\(2, 2\)"):
        combine({"a": a, "b": a[:, :2]})


# ----------------------------------------------------------------------------- overlong


def np_overlong(L, max_len, buf, factor):
    """DAPO eq. 13 / TRL get_soft_overlong_punishment, written plainly."""
    out = []
    for x in np.asarray(L).ravel():
        if x <= max_len - buf:
            out.append(0.0)
        elif x <= max_len:
            out.append((max_len - buf - x) / buf * factor)
        else:
            out.append(-factor)
    return np.array(out).reshape(np.shape(L))


def test_overlong_penalty():
    L = np.array([[0, 10, 12, 13, 15, 16], [20, 11, 14, 100, 3, 16]], np.int32)
    got = J(overlong_penalty, max_length=16, buffer_length=4, penalty_factor=0.5)(L)
    np.testing.assert_allclose(got, np_overlong(L, 16, 4, 0.5), rtol=1e-6)
    # hand values: L_exp = 12; L=13 -> -0.25*0.5, L=16 -> -0.5, L=20 -> -0.5
    np.testing.assert_allclose(got[0, 2:], [0.0, -0.125, -0.375, -0.5])
    cliff = overlong_penalty(L, max_length=16, buffer_length=0, penalty_factor=1.0)
    np.testing.assert_array_equal(cliff, np.where(L > 16, -1.0, 0.0))
    with pytest.raises(ValueError, match="buffer_length"):
        overlong_penalty(L, max_length=4, buffer_length=5)


# ----------------------------------------------------------------------------- length shaping


def np_length_shaping(r, L, mode, target, coef):
    rel = (L - target) / target
    if mode == "linear":
        return r - coef * np.abs(rel)
    return np.where((r > 0) & (rel > 0), r * np.maximum(0.0, 1 - coef * rel), r)


def test_length_shaping_modes_differ():
    r = np.array([[1.0, 1.0, 1.0, 0.0, 0.0, NAN]], np.float32)
    L = np.array([[50, 100, 150, 50, 150, 150]], np.int32)
    lin = J(length_shaping, mode="linear", target=100.0, coef=0.5)(r, L)
    pun = J(length_shaping, mode="punitive", target=100.0, coef=0.5)(r, L)
    np.testing.assert_allclose(lin, np_length_shaping(r, L, "linear", 100.0, 0.5), rtol=1e-6)
    np.testing.assert_allclose(pun, np_length_shaping(r, L, "punitive", 100.0, 0.5), rtol=1e-6)
    # hand: linear penalises both sides and wrong answers; punitive only correct-and-long
    np.testing.assert_allclose(lin, [[0.75, 1.0, 0.75, -0.25, -0.25, NAN]])
    np.testing.assert_allclose(pun, [[1.0, 1.0, 0.75, 0.0, 0.0, NAN]])
    assert not np.allclose(lin, pun, equal_nan=True)
    # punitive floors at 0: a long correct answer is never worse than a wrong one
    far = length_shaping(
        np.ones((1, 1)), np.array([[10_000]]), mode="punitive", target=100.0, coef=0.5
    )
    assert float(far[0, 0]) == 0.0
    # coef = 0.0 is a valid value: identity for both modes
    np.testing.assert_array_equal(length_shaping(r, L, mode="linear", target=100.0, coef=0.0), r)
    np.testing.assert_array_equal(length_shaping(r, L, mode="punitive", target=100.0, coef=0.0), r)


def test_length_shaping_grad_and_errors():
    rng = np.random.default_rng(1)
    r = rng.normal(size=(3, 4))
    L = rng.integers(10, 200, size=(3, 4))
    with jax.enable_x64(True):
        for mode in ("linear", "punitive"):
            f = jax.jit(
                lambda r: jnp.sum(length_shaping(r, L, mode=mode, target=100.0, coef=0.3) ** 2)
            )
            g = jax.grad(f)(jnp.asarray(r))
            d = rng.normal(size=r.shape)
            eps = 1e-6
            num = (f(r + eps * d) - f(r - eps * d)) / (2 * eps)
            assert float(num) == pytest.approx(float(jnp.sum(g * d)), rel=1e-5)
    with pytest.raises(ValueError, match="linear, punitive"):
        length_shaping(r, L, mode="cosine", target=100.0, coef=0.1)
    with pytest.raises(ValueError, match="target"):
        length_shaping(r, L, target=0.0, coef=0.1)
    with pytest.raises(AssertionError, match=r"lengths=\(3, 3\)"):
        length_shaping(r, L[:, :3], target=10.0, coef=0.1)


# ----------------------------------------------------------------------------- dynamic sampling, stats


def np_keep(r):
    out = []
    for row in r:
        v = row[~np.isnan(row)]
        out.append(len(v) >= 2 and np.std(v) > 0)
    return np.array(out)


def test_dynamic_sampling_and_group_stats():
    r = np.array(
        [
            [1.0, 1.0, 1.0, 1.0],  # all equal -> drop
            [0.0, 1.0, 0.0, 0.0],  # keep
            [1.0, NAN, 1.0, NAN],  # valid all equal -> drop
            [NAN, NAN, NAN, 0.5],  # one valid -> drop
            [NAN, NAN, NAN, NAN],  # none valid -> drop
            [0.2, NAN, 0.7, 0.2],  # keep
        ],
        np.float32,
    )
    keep = jax.jit(dynamic_sampling_mask)(r)
    np.testing.assert_array_equal(keep, [False, True, False, False, False, True])
    np.testing.assert_array_equal(keep, np_keep(r))
    stats = jax.jit(group_stats)(r)
    valid = r[~np.isnan(r)]
    assert float(stats["reward"]) == pytest.approx(valid.mean(), rel=1e-6)
    stds = [
        np.std(row[~np.isnan(row)], ddof=1) if (~np.isnan(row)).sum() > 1 else 0.0 for row in r[:4]
    ]
    stds.append(np.std(r[5][~np.isnan(r[5])], ddof=1))
    assert float(stats["reward_std"]) == pytest.approx(np.mean(stds), rel=1e-5)
    assert float(stats["frac_reward_zero_std"]) == pytest.approx(4 / 6)
    assert float(stats["frac_reward_missing"]) == pytest.approx(np.isnan(r).mean())
    rng = np.random.default_rng(2)
    rr = rng.integers(0, 2, size=(16, 4)).astype(np.float32)
    np.testing.assert_array_equal(dynamic_sampling_mask(rr), np_keep(rr))
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        dynamic_sampling_mask(rr.ravel())
