import itertools
from math import comb

import numpy as np
import pytest

from relax.eval.passk import default_ks, pass_at_k, summarize

NAN = np.nan


def brute_pass_at_k(n, c, k):
    """Fraction of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 10])
def test_pass_at_k_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_pass_at_k(n, c, k), abs=1e-12), (
                n,
                c,
                k,
            )


def test_pass_at_k_vectorised_and_large():
    n = np.array([5, 8, 10, 10])
    c = np.array([0, 3, 10, 1])
    out = pass_at_k(n, c, 4)
    assert isinstance(out, np.ndarray) and out.shape == (4,)
    np.testing.assert_allclose(out, [brute_pass_at_k(a, b, 4) for a, b in zip(n, c)], atol=1e-12)
    np.testing.assert_allclose(pass_at_k(10, np.arange(11), 1), np.arange(11) / 10)  # pass@1 = c/n
    assert isinstance(pass_at_k(4, 2, 2), float)
    # large n: binomials near 1e299 would overflow float64 if formed; the product form is exact
    assert pass_at_k(1000, 10, 500) == pytest.approx(
        1 - comb(990, 500) / comb(1000, 500), rel=1e-12
    )


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match="k=5 and n=3"):
        pass_at_k(3, 1, 5)
    with pytest.raises(ValueError, match="k=4 and n=3"):
        pass_at_k(np.array([3, 8]), np.array([0, 0]), 4)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        pass_at_k(3, 1, 0)
    with pytest.raises(ValueError, match="c must hold integers"):
        pass_at_k(3, 1.5, 1)


def test_default_ks():
    assert default_ks(1) == (1,)
    assert default_ks(6) == (1, 2, 4, 6)
    assert default_ks(8) == (1, 2, 4, 8)


def test_summarize_hand_values():
    rewards = np.array([[1.0, 0.0, NAN, 1.0], [0.0, 0.0, 0.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
    out = summarize(rewards, correct, ks=(2, 4))
    assert out["num_prompts"] == 3
    assert out["reward"] == pytest.approx(np.nanmean(rewards))
    assert out["frac_reward_missing"] == pytest.approx(1 / 12)
    assert out["pass@1"] == pytest.approx(correct.mean())
    assert out["pass@2"] == pytest.approx((brute_pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert out["pass@4"] == pytest.approx(2 / 3)
    assert set(out) == {
        "num_prompts",
        "reward",
        "frac_reward_missing",
        "pass@1",
        "pass@2",
        "pass@4",
    }
    assert set(summarize(rewards, correct)) >= {"pass@1", "pass@2", "pass@4"}  # default ks


def test_summarize_grouped_by_data_source():
    rng = np.random.default_rng(0)
    correct = rng.random((6, 5)) < 0.4
    rewards = correct.astype(float)
    rewards[0, 0] = NAN
    src = ["math", "code", "math", "math", "code", "gsm8k"]
    out = summarize(rewards, correct, ks=(1, 3), data_source=src)
    for s in ("math", "code", "gsm8k"):
        rows = np.array(src) == s
        sub = summarize(rewards[rows], correct[rows], ks=(3,))
        for key in ("reward", "pass@1", "pass@3", "num_prompts", "frac_reward_missing"):
            assert out[f"{s}/{key}"] == pytest.approx(sub[key], nan_ok=True), (s, key)
        assert out[f"{s}/pass@3"] == pytest.approx(
            np.mean([brute_pass_at_k(5, int(c), 3) for c in correct[rows].sum(1)])
        )
    assert out["math/num_prompts"] == 3 and out["gsm8k/num_prompts"] == 1
    all_nan = summarize(np.full((1, 2), NAN), np.zeros((1, 2), bool))
    assert np.isnan(all_nan["reward"]) and all_nan["frac_reward_missing"] == 1.0


def test_summarize_errors():
    r, c = np.zeros((2, 3)), np.zeros((2, 3), bool)
    with pytest.raises(ValueError, match="k=4 and n=3"):
        summarize(r, c, ks=(1, 4))
    with pytest.raises(ValueError, match="both be \\[P, n\\]"):
        summarize(r, c[:, :2])
    with pytest.raises(ValueError, match="correct must be bool"):
        summarize(r, c.astype(int))
    with pytest.raises(ValueError, match="2 labels for 2|3 labels for 2"):
        summarize(r, c, data_source=["a", "b", "c"])
