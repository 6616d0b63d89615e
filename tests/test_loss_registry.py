"""The policy-loss registry against independent NumPy implementations of each formula: values,
gradients (hand derivatives and float64 finite differences), metrics, defaults and errors."""

import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.metrics import Metric
from relax.objectives.registry import (
    POLICY_LOSSES,
    PolicyLoss,
    as_policy_loss,
    loss_name,
    policy_loss,
)

N, T = 5, 7


def make_batch(seed=0, per_sequence_adv=False):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, size=(N, T))
    logp = old + rng.normal(0.0, 0.5, size=(N, T))  # ratios on both sides of every clip boundary
    adv = rng.normal(size=(N,)) if per_sequence_adv else rng.normal(size=(N, T))
    lengths = np.array([T, 4, 6, 1, 0])  # the last row is fully masked
    mask = np.arange(T)[None, :] < lengths[:, None]
    mask[0, 3] = False  # an interior hole
    return logp, old, adv, mask


def call(loss, logp, old, adv, mask):
    per_token, metrics = jax.jit(lambda *a: loss(*a))(logp, old, adv, mask)
    return np.asarray(per_token), metrics


def jax_grad(loss, logp, old, adv, mask, weights):
    """d/d logp of sum_t w_t loss_t (the weights make every token's gradient distinct)."""
    f = lambda lp: jnp.sum(weights * loss(lp, old, adv, mask)[0])  # noqa: E731
    return np.asarray(jax.jit(jax.grad(f))(jnp.asarray(logp, jnp.float32)))


# ------------------------------------------------------------- numpy references (float64)


def _adv(adv, shape):
    return np.broadcast_to(adv[:, None], shape) if adv.ndim == 1 else adv


def _log_ratio(logp, old, mask, sequence=False):
    d = np.where(mask, logp - old, 0.0)
    if sequence:
        seq = d.sum(-1) / np.maximum(mask.sum(-1), 1)
        d = np.broadcast_to(seq[:, None], d.shape)
    return np.clip(d, -20, 20)


def clipped_surrogate(logp, old, adv, mask, el, eh, delta=None, c=None, sequence=False):
    """(per-token loss, d loss / d logp) of the pessimistic clipped objective."""
    a = _adv(adv, logp.shape)
    r = np.exp(_log_ratio(logp, old, mask, sequence))
    unc = r if delta is None else np.minimum(r, delta)
    u_val, u_der = -a * unc, -a * r * (r < (np.inf if delta is None else delta))
    c_val, c_der = -a * np.clip(r, 1 - el, 1 + eh), -a * r * ((r > 1 - el) & (r < 1 + eh))
    loss = np.maximum(u_val, c_val)
    der = np.where(u_val >= c_val, u_der, c_der)
    if c is not None:
        dual = (a < 0) & (loss > -a * c)
        loss, der = np.where(dual, -a * c, loss), np.where(dual, 0.0, der)
    return np.where(mask, loss, 0.0), np.where(mask, der, 0.0)


def kl_ref(d, kind):
    """(estimate, d estimate / d d) of the per-token KL with d = logp - old_logp."""
    return {
        "k1": (d, np.ones_like(d)),
        "k2": (0.5 * d**2, d),
        "k3": (np.exp(-d) + d - 1, 1 - np.exp(-d)),
        "abs": (np.abs(d), np.sign(d)),
    }[kind]


def reference(name, cfg, logp, old, adv, mask):
    """(per-token loss, d loss / d logp) of registry loss ``name`` with config ``cfg``."""
    a = _adv(adv, logp.shape)
    r = np.exp(_log_ratio(logp, old, mask))
    if name in (
        "ppo",
        "grpo",
        "dapo",
        "gspo",
    ):  # one clipped loss; the four differ in their defaults only
        # sequence importance in GSPO's token form: the value is the sequence ratio's, the gradient
        # d/d logp_t of s_i
        return clipped_surrogate(
            logp,
            old,
            adv,
            mask,
            cfg.epsilon_low,
            cfg.epsilon_high,
            delta=cfg.delta,
            c=cfg.clip_ratio_c,
            sequence=cfg.importance == "sequence",
        )
    if name == "cispo":
        w = np.clip(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        return np.where(mask, -w * a * logp, 0.0), np.where(mask, -w * a, 0.0)
    if name == "reinforce":
        return np.where(mask, -a * logp, 0.0), np.where(mask, -a, 0.0)
    if name == "importance_sampling":
        cap = np.inf if cfg.cap is None else cfg.cap
        return np.where(mask, -np.minimum(r, cap) * a, 0.0), np.where(mask & (r < cap), -a * r, 0.0)
    if name == "conservative_ppo":
        loss, der = clipped_surrogate(logp, old, adv, mask, cfg.epsilon, cfg.epsilon)
        kl, dkl = kl_ref(np.where(mask, logp - old, 0.0), cfg.kl_estimator)
        excess = np.maximum(kl - cfg.kl_threshold, 0.0)
        return (
            np.where(mask, loss + cfg.coef * excess**2, 0.0),
            np.where(mask, der + 2 * cfg.coef * excess * dkl, 0.0),
        )
    raise KeyError(name)


# Each name with its defaults and with every option moved (the options reach the loss).
CASES = [(name, {}) for name in POLICY_LOSSES] + [
    ("ppo", {"epsilon_low": 0.1, "epsilon_high": 0.1, "clip_ratio_c": 1.6}),
    (
        "ppo",
        {"epsilon_low": 0.1, "epsilon_high": 0.3, "clip_ratio_c": 1.6},
    ),  # asymmetric clip + dual-clip
    (
        "ppo",
        {"epsilon_low": 0.15, "epsilon_high": 0.25, "delta": 1.3},
    ),  # TRL's two-sided cap on PPO
    (
        "ppo",
        {"epsilon_low": 0.05, "epsilon_high": 0.02, "importance": "sequence", "clip_ratio_c": 1.01},
    ),
    ("grpo", {"epsilon_low": 0.15, "epsilon_high": 0.15, "delta": 1.3}),
    # a cap below 1 + epsilon_high binds for A > 0, the dual-clip for A < 0
    ("grpo", {"epsilon_low": 0.1, "epsilon_high": 0.3, "delta": 1.2, "clip_ratio_c": 1.25}),
    ("grpo", {"importance": "sequence", "epsilon_low": 0.05, "epsilon_high": 0.1, "delta": 1.05}),
    ("dapo", {"epsilon_low": 0.1, "epsilon_high": 0.4}),
    ("dapo", {"clip_ratio_c": 1.25, "delta": 1.2}),
    ("dapo", {"importance": "sequence"}),
    ("gspo", {"epsilon_low": 0.05, "epsilon_high": 0.02}),
    ("gspo", {"importance": "token", "epsilon_low": 0.1, "epsilon_high": 0.2}),
    ("gspo", {"epsilon_low": 0.05, "epsilon_high": 0.08, "clip_ratio_c": 1.05, "delta": 1.02}),
    ("cispo", {"epsilon_low": 0.3, "epsilon_high": 0.2}),
    ("importance_sampling", {"cap": 1.3}),
    ("importance_sampling", {"cap": None}),
    ("conservative_ppo", {"epsilon": 0.1, "kl_threshold": 0.01, "coef": 3.0, "kl_estimator": "k2"}),
    ("conservative_ppo", {"kl_estimator": "k1", "kl_threshold": 0.05}),
    ("conservative_ppo", {"kl_estimator": "abs", "kl_threshold": 0.1}),
]


def case_id(case):
    name, over = case
    return name + "".join(f"-{k}={v}" for k, v in over.items())


def _seed(name, over):  # a stable seed per case (str hash is salted per process)
    return int(hashlib.md5(case_id((name, over)).encode()).hexdigest()[:6], 16)


@pytest.mark.parametrize("name,over", CASES, ids=map(case_id, CASES))
@pytest.mark.parametrize("per_sequence_adv", [False, True])
def test_values_and_gradients_match_numpy(name, over, per_sequence_adv):
    loss = policy_loss(name, **over)
    logp, old, adv, mask = make_batch(_seed(name, over), per_sequence_adv)
    want, want_grad = reference(name, loss.config, logp, old, adv, mask)
    f32 = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv)]
    got, metrics = call(loss, *f32, mask)
    assert got.shape == (N, T) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)
    assert np.all(got[~mask] == 0.0)
    w = np.random.default_rng(1).uniform(0.5, 1.5, (N, T))
    grad = jax_grad(loss, *f32, mask, jnp.asarray(w, jnp.float32))
    np.testing.assert_allclose(grad, w * want_grad, rtol=2e-5, atol=2e-6)
    assert all(np.isfinite(float(v)) for v in metrics.values())
    if "ratio_min" in metrics:  # declared reductions survive the registry
        assert isinstance(metrics["ratio_min"], Metric) and metrics["ratio_min"].reduction == "min"
        assert isinstance(metrics["ratio_max"], Metric) and metrics["ratio_max"].reduction == "max"
        r = np.exp(
            _log_ratio(logp, old, mask, getattr(loss.config, "importance", "token") == "sequence")
        )[mask]
        np.testing.assert_allclose(float(metrics["ratio_min"]), r.min(), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["ratio_max"]), r.max(), rtol=1e-5)


def test_every_moved_option_binds_in_its_case():
    """Each option a case moves changes the loss on that case's batches (one advantage layout or
    the other): the numpy comparison above is not vacuous for it (e.g. a dual-clip bound that no
    token reaches, or a cap hidden by a lower dual-clip)."""
    for name, over in CASES:
        batches = [
            make_batch(_seed(name, over), per_sequence_adv) for per_sequence_adv in (False, True)
        ]
        args = [([jnp.asarray(x, jnp.float32) for x in b[:3]], b[3]) for b in batches]
        full = [np.asarray(policy_loss(name, **over)(*a, m)[0]) for a, m in args]
        for option in over:
            without = policy_loss(name, **{k: v for k, v in over.items() if k != option})
            assert any(
                not np.array_equal(np.asarray(without(*a, m)[0]), f)
                for (a, m), f in zip(args, full)
            ), f"{case_id((name, over))}: {option} changes nothing"


@pytest.mark.parametrize(
    "name,over",
    [
        ("ppo", {}),
        ("ppo", {"clip_ratio_c": 1.6}),
        ("grpo", {"delta": 1.3}),
        ("ppo", {"epsilon_low": 0.1, "epsilon_high": 0.3, "clip_ratio_c": 1.6}),
        ("dapo", {"delta": 1.4, "clip_ratio_c": 1.5}),
        ("dapo", {}),
        ("importance_sampling", {}),
        ("conservative_ppo", {}),
        ("conservative_ppo", {"kl_estimator": "k2", "kl_threshold": 0.01}),
    ],
)
def test_gradients_match_finite_differences(name, over):
    """jax.grad against central differences of the float64 NumPy loss (for the losses whose
    value is a plain function of logp: no stop-gradient in their gradient)."""
    loss = policy_loss(name, **over)
    logp, old, adv, mask = make_batch(_seed(name, over) + 7)
    w = np.random.default_rng(2).uniform(0.5, 1.5, (N, T))
    total = lambda lp: np.sum(w * reference(name, loss.config, lp, old, adv, mask)[0])  # noqa: E731
    h, fd = 1e-6, np.zeros((N, T))
    for i in range(N):
        for t in range(T):
            e = np.zeros((N, T))
            e[i, t] = h
            fd[i, t] = (total(logp + e) - total(logp - e)) / (2 * h)
    grad = jax_grad(
        loss,
        *(jnp.asarray(x, jnp.float32) for x in (logp, old, adv)),
        mask,
        jnp.asarray(w, jnp.float32),
    )
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-5)
    assert np.abs(fd).max() > 0.1  # not vacuous


def test_ppo_clipping_direction_for_negative_advantages():
    """A < 0: the ratio is clipped (no gradient) BELOW 1 - eps, never above 1 + eps, where the
    pessimistic objective keeps the unclipped, larger loss; A > 0 the other way round."""
    loss = policy_loss("ppo")
    r = np.array([[0.5, 1.5, 1.1, 0.5, 1.5, 0.9]])
    a = np.array([[-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]])
    old = np.full_like(r, -1.0)
    logp, mask = old + np.log(r), np.ones_like(r, bool)
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, a)]
    got, m = call(loss, *args, mask)
    np.testing.assert_allclose(got[0], [0.8, 1.5, 1.1, -0.5, -1.2, -0.9], rtol=1e-6)
    grad = jax_grad(loss, *args, mask, jnp.ones_like(args[0]))
    # d/dlogp (-A r) = -A r where unclipped, 0 where clipped
    np.testing.assert_allclose(grad[0], [0.0, 1.5, 1.1, -0.5, 0.0, -0.9], rtol=1e-6)
    np.testing.assert_allclose(
        [float(m["clip_frac_low"]), float(m["clip_frac_high"])], [1 / 6, 1 / 6]
    )
    # dual-clip bounds the A < 0, r > c loss at -A c: A = -1, r = 4, c = 3 gives 3 and no gradient
    dual = policy_loss("ppo", clip_ratio_c=3.0)
    args = [jnp.asarray([[x]], jnp.float32) for x in (np.log(4.0) - 1.0, -1.0, -1.0)]
    got, m = call(dual, *args, np.ones((1, 1), bool))
    np.testing.assert_allclose(got, [[3.0]], rtol=1e-6)
    assert float(jax_grad(dual, *args, np.ones((1, 1), bool), jnp.ones((1, 1)))[0, 0]) == 0.0
    assert float(m["clip_frac_dual"]) == 1.0


def test_importance_sampling_and_conservative_by_hand():
    # r = 3 > cap 2: loss -2 A, no gradient; r = 0.5: loss -0.5 A, gradient -0.5 A
    isl = policy_loss("importance_sampling")
    args = [
        jnp.asarray(x, jnp.float32)
        for x in ([[np.log(3.0), np.log(0.5)]], [[0.0, 0.0]], [[1.5, 1.5]])
    ]
    mask = np.ones((1, 2), bool)
    got, m = call(isl, *args, mask)
    np.testing.assert_allclose(got, [[-3.0, -0.75]], rtol=1e-6)
    np.testing.assert_allclose(
        jax_grad(isl, *args, mask, jnp.ones((1, 2))), [[0.0, -0.75]], rtol=1e-6
    )
    assert float(m["clip_frac"]) == 0.5
    # conservative: r = 2 (d = ln 2) with A > 0 is clipped, so the gradient is the penalty's alone:
    # k3 = 1/2 + ln 2 - 1, loss = -1.2 A + coef (k3 - thr)^2, grad = 2 coef (k3 - thr)(1 - 1/2)
    cons = policy_loss("conservative_ppo", coef=4.0, kl_threshold=0.1)
    d = np.log(2.0)
    args = [jnp.asarray([[x]], jnp.float32) for x in (d, 0.0, 1.0)]
    got, m = call(cons, *args, np.ones((1, 1), bool))
    k3 = 0.5 + d - 1
    np.testing.assert_allclose(got, [[-1.2 + 4.0 * (k3 - 0.1) ** 2]], rtol=1e-6)
    np.testing.assert_allclose(
        jax_grad(cons, *args, np.ones((1, 1), bool), jnp.ones((1, 1))),
        [[2 * 4.0 * (k3 - 0.1) * 0.5]],
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        [float(m["kl_old"]), float(m["kl_old_max"]), float(m["kl_over_threshold"])],
        [k3, k3, 1.0],
        rtol=1e-6,
    )
    assert m["kl_old_max"].reduction == "max"
    # inside the threshold the penalty and its gradient are exactly 0: plain PPO
    near = [jnp.asarray([[x]], jnp.float32) for x in (0.05, 0.0, 1.0)]
    ppo, one = policy_loss("ppo"), np.ones((1, 1), bool)
    assert call(cons, *near, one)[0][0, 0] == call(ppo, *near, one)[0][0, 0]
    assert (
        jax_grad(cons, *near, one, jnp.ones((1, 1)))[0, 0]
        == jax_grad(ppo, *near, one, jnp.ones((1, 1)))[0, 0]
    )


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_padding_with_nonfinite_values_is_harmless(name):
    loss = policy_loss(name)
    logp, old, adv, mask = make_batch(3)
    logp, old, adv = (
        np.where(mask, logp, -np.inf),
        np.where(mask, old, np.nan),
        np.where(mask, adv, np.nan),
    )
    args = [jnp.asarray(x, jnp.float32) for x in (logp, old, adv)]
    got, metrics = call(loss, *args, mask)
    assert np.all(np.isfinite(got)) and np.all(got[~mask] == 0.0)
    assert np.all(np.isfinite(jax_grad(loss, *args, mask, jnp.ones((N, T)))))
    assert all(np.isfinite(float(v)) for v in metrics.values())


def test_default_configs():
    expect = {
        "ppo": {
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            "clip_ratio_c": None,
            "delta": None,
            "importance": "token",
        },
        "grpo": {
            "epsilon_low": 0.2,
            "epsilon_high": 0.2,
            "clip_ratio_c": None,
            "delta": None,
            "importance": "token",
        },
        "dapo": {
            "epsilon_low": 0.2,
            "epsilon_high": 0.28,
            "clip_ratio_c": None,
            "delta": None,
            "importance": "token",
        },
        "gspo": {
            "epsilon_low": 3e-4,
            "epsilon_high": 4e-4,
            "clip_ratio_c": None,
            "delta": None,
            "importance": "sequence",
        },
        "cispo": {"epsilon_low": 1.0, "epsilon_high": 4.0},
        "reinforce": {},
        "importance_sampling": {"cap": 2.0},
        "conservative_ppo": {
            "epsilon": 0.2,
            "kl_threshold": 0.02,
            "coef": 10.0,
            "kl_estimator": "k3",
        },
    }
    assert set(POLICY_LOSSES) == set(expect)
    for name, fields in expect.items():
        loss = policy_loss(name)
        assert loss.name == name and type(loss.config) is POLICY_LOSSES[name]
        assert dataclasses.asdict(loss.config) == fields, name


def test_policy_loss_objects():
    loss = policy_loss("dapo", epsilon_high=0.3)
    assert loss.config == POLICY_LOSSES["dapo"](epsilon_high=0.3) and loss.config.epsilon_low == 0.2
    assert loss == policy_loss("dapo", epsilon_high=0.3) and hash(loss) == hash(
        policy_loss("dapo", epsilon_high=0.3)
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.config.epsilon_high = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        loss.name = "ppo"
    # hashable: a static argument of jit
    f = jax.jit(lambda lf, *a: lf(*a)[0], static_argnums=0)
    logp, old, adv, mask = make_batch(4)
    np.testing.assert_allclose(
        f(loss, logp, old, adv, mask), call(loss, logp, old, adv, mask)[0], rtol=1e-6
    )
    with pytest.raises(TypeError, match="DAPOLossConfig"):
        PolicyLoss("dapo", POLICY_LOSSES["ppo"]())
    # the clipped losses' configs share their fields, but each name takes its own class only
    with pytest.raises(
        TypeError, match="policy loss 'ppo' takes a PPOLossConfig, got DAPOLossConfig"
    ):
        PolicyLoss("ppo", POLICY_LOSSES["dapo"]())
    assert as_policy_loss(POLICY_LOSSES["gspo"](epsilon_high=0.01)) == policy_loss(
        "gspo", epsilon_high=0.01
    )
    assert [loss_name(POLICY_LOSSES[n]()) for n in POLICY_LOSSES] == list(POLICY_LOSSES)
    with pytest.raises(TypeError, match="dict is not a policy loss config"):
        loss_name({"epsilon_low": 0.2})


def test_errors_name_the_valid_choices():
    with pytest.raises(
        ValueError,
        match="unknown policy loss 'ppo2'; valid: ppo, grpo, dapo, gspo, cispo, "
        "reinforce, importance_sampling, conservative_ppo",
    ):
        policy_loss("ppo2")
    with pytest.raises(
        ValueError,
        match="policy loss 'ppo' has no option 'epsilon'; "
        "valid: epsilon_low, epsilon_high, clip_ratio_c, delta, importance",
    ):
        policy_loss("ppo", epsilon=0.3)
    with pytest.raises(
        ValueError,
        match="policy loss 'conservative_ppo' has no option 'epsilon_high'; "
        "valid: epsilon, kl_threshold",
    ):
        policy_loss("conservative_ppo", epsilon_high=0.3)
    with pytest.raises(ValueError, match="'reinforce' has no option 'epsilon'; valid: none"):
        policy_loss("reinforce", epsilon=0.2)
    with pytest.raises(
        ValueError,
        match="no option 'beta', 'kl_coef'; valid: epsilon, kl_threshold, coef, kl_estimator",
    ):
        policy_loss("conservative_ppo", kl_coef=1.0, beta=0.1)
    with pytest.raises(ValueError, match="unknown policy loss"):
        PolicyLoss("nope", None)
    for name, over, msg in [
        ("ppo", {"clip_ratio_c": 0.9}, "clip_ratio_c must be > 1"),
        ("grpo", {"delta": 1.0}, "delta must be > 1"),
        ("ppo", {"delta": 0.5}, "delta must be > 1"),
        ("dapo", {"epsilon_low": 1.5}, "epsilon_low must be in"),
        ("ppo", {"epsilon_high": -0.1}, "epsilon_high must be >= 0"),
        ("gspo", {"importance": "batch"}, "unknown importance 'batch'; valid: token, sequence"),
        ("dapo", {"clip_ratio_c": 1.0}, "clip_ratio_c must be > 1"),
        ("importance_sampling", {"cap": 0.0}, "cap must be > 0"),
        ("conservative_ppo", {"kl_estimator": "k9"}, "unknown KL estimator 'k9'; valid: k1"),
        ("conservative_ppo", {"coef": -1.0}, "coef must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            policy_loss(name, **over)


# ------------------------------------------------------------- the command line (relax.algorithms.cli.flags)


def test_loss_flags_translate_the_command_line():
    import warnings

    from relax.algorithms.cli.flags import loss_flags

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the current flags translate without a warning
        assert loss_flags(["--grpo.policy-loss", "cispo", "--steps", "2"]) == [
            "grpo.policy-loss:cispo",
            "--steps",
            "2",
        ]
        assert loss_flags(["--grpo.policy-loss=dapo"]) == ["grpo.policy-loss:dapo"]
        assert loss_flags(["--ppo.policy-loss", "conservative-ppo"]) == [
            "ppo.policy-loss:conservative_ppo"
        ]
        assert loss_flags(["--grpo.policy-loss.epsilon-high", "0.3", "--grpo.beta=0.04"]) == [
            "--grpo.policy-loss.epsilon-high",
            "0.3",
            "--grpo.beta=0.04",
        ]
        # the loss's name goes first, whatever its place: its options apply to it
        assert loss_flags(
            ["--grpo.policy-loss.epsilon-high", "0.3", "--grpo.policy-loss", "dapo"]
        ) == ["grpo.policy-loss:dapo", "--grpo.policy-loss.epsilon-high", "0.3"]
    with pytest.warns(
        FutureWarning, match=r"--grpo.epsilon-high is now --grpo.policy-loss.epsilon-high"
    ):
        assert loss_flags(["--grpo.epsilon-high", "0.3"]) == [
            "--grpo.policy-loss.epsilon-high",
            "0.3",
        ]
    with pytest.warns(
        FutureWarning,
        match=r"--grpo.importance-sampling-level is now --grpo.policy-loss.importance",
    ):
        assert loss_flags(["--grpo.importance-sampling-level=sequence"]) == [
            "--grpo.policy-loss.importance=sequence"
        ]
    for old in ("epsilon-low", "delta", "clip-ratio-c"):
        with pytest.warns(FutureWarning, match=f"--grpo.policy-loss.{old}"):
            assert loss_flags([f"--grpo.{old}", "1.5"]) == [f"--grpo.policy-loss.{old}", "1.5"]
    for argv in (
        ["--ppo.policy-loss-args", "kl_threshold=0.02"],
        ["--ppo.policy-loss-args=epsilon=0.1"],
    ):
        with pytest.raises(
            SystemExit,
            match=r"--ppo.policy-loss-args was replaced by typed options: "
            r"--ppo.policy-loss NAME --ppo.policy-loss.FIELD VALUE",
        ):
            loss_flags(argv)


def _parse(algorithm, argv):
    """The algorithm config of ``argv`` parsed as examples/train_<algorithm>.py parses it."""
    from relax.algorithms.cli.flags import flag_value, parse_flags
    from relax.algorithms.grpo import run as grpo_run
    from relax.algorithms.ppo import run as ppo_run

    if algorithm == "grpo":
        name = flag_value(argv, "--preset", "grpo")
        return parse_flags(
            grpo_run.GRPORunConfig,
            argv,
            builtin=lambda: grpo_run.builtin_defaults(name),
            real=lambda: grpo_run.real_defaults(name),
        ).grpo
    return parse_flags(
        ppo_run.PPORunConfig, argv, builtin=ppo_run.builtin_defaults, real=ppo_run.real_defaults
    ).ppo


def test_command_line_gives_the_typed_loss_config():
    from relax.objectives.registry import (
        CISPOLossConfig,
        ConservativePPOLossConfig,
        DAPOLossConfig,
        GSPOLossConfig,
        PPOLossConfig,
    )

    def same(got, want):  # equal and of the very class: DAPOLossConfig is a PPOLossConfig subclass
        assert got == want and type(got) is type(want), (got, want)

    same(_parse("grpo", []).policy_loss, PPOLossConfig())
    g = _parse(
        "grpo",
        [
            "--grpo.policy-loss",
            "dapo",
            "--grpo.policy-loss.epsilon-high",
            "0.3",
            "--grpo.temperature",
            "0.7",
            "--grpo.train-attention",
            "dense",
        ],
    )
    same(g.policy_loss, DAPOLossConfig(epsilon_high=0.3))
    assert g.policy_loss.epsilon_low == 0.2  # the loss's own default
    assert (
        g.generation.temperature == 0.7 and g.forward.train_attention == "dense"
    )  # flat flags still read
    same(
        _parse(
            "grpo", ["--grpo.policy-loss=cispo", "--grpo.policy-loss.epsilon-low", "0.5"]
        ).policy_loss,
        CISPOLossConfig(epsilon_low=0.5),
    )
    same(
        _parse(
            "grpo",
            [
                "--grpo.policy-loss.epsilon-high",
                "0.3",
                "--steps",
                "2",
                "--grpo.policy-loss",
                "dapo",
            ],
        ).policy_loss,
        DAPOLossConfig(epsilon_high=0.3),
    )  # an option before its loss's name
    same(
        _parse(
            "grpo", ["--grpo.policy-loss", "gspo", "--grpo.policy-loss.importance", "token"]
        ).policy_loss,
        GSPOLossConfig(importance="token"),
    )
    same(_parse("grpo", ["--preset", "gspo"]).policy_loss, GSPOLossConfig())
    with pytest.warns(
        FutureWarning, match="--grpo.policy-loss.epsilon-high"
    ):  # a preset keeps its loss
        same(
            _parse("grpo", ["--preset", "dapo", "--grpo.epsilon-high", "0.35"]).policy_loss,
            DAPOLossConfig(epsilon_high=0.35),
        )
    with pytest.warns(FutureWarning) as record:
        same(
            _parse(
                "grpo",
                [
                    "--grpo.epsilon-high",
                    "0.3",
                    "--grpo.clip-ratio-c",
                    "3",
                    "--grpo.importance-sampling-level",
                    "sequence",
                ],
            ).policy_loss,
            PPOLossConfig(epsilon_high=0.3, clip_ratio_c=3.0, importance="sequence"),
        )
    renamed = [w for w in record if issubclass(w.category, FutureWarning)]  # not a GC's warning
    assert sorted(str(w.message).split()[3] for w in renamed) == [
        "--grpo.policy-loss.clip-ratio-c",
        "--grpo.policy-loss.epsilon-high",
        "--grpo.policy-loss.importance",
    ]

    same(_parse("ppo", []).policy_loss, PPOLossConfig())
    same(
        _parse(
            "ppo",
            [
                "--ppo.policy-loss.epsilon-low",
                "0.1",
                "--ppo.policy-loss.epsilon-high",
                "0.3",
                "--ppo.policy-loss.clip-ratio-c",
                "3",
            ],
        ).policy_loss,
        PPOLossConfig(epsilon_low=0.1, epsilon_high=0.3, clip_ratio_c=3.0),
    )
    p = _parse(
        "ppo",
        [
            "--ppo.policy-loss",
            "conservative_ppo",
            "--ppo.policy-loss.kl-threshold",
            "0.05",
            "--ppo.policy-loss.kl-estimator",
            "k2",
            "--ppo.num-generations",
            "2",
        ],
    )
    same(p.policy_loss, ConservativePPOLossConfig(kl_threshold=0.05, kl_estimator="k2"))
    assert p.generation.num_generations == 2
    with pytest.raises(SystemExit, match="--ppo.policy-loss.FIELD"):
        _parse("ppo", ["--ppo.policy-loss-args", "kl_threshold=0.02"])


def test_command_line_refuses_an_option_the_chosen_loss_lacks(capsys):
    for algorithm, argv in (
        ("grpo", ["--grpo.policy-loss", "cispo", "--grpo.policy-loss.delta", "1.5"]),
        ("ppo", ["--ppo.policy-loss", "reinforce", "--ppo.policy-loss.epsilon-high", "0.3"]),
        ("grpo", ["--grpo.policy-loss", "ppo2"]),
    ):
        with pytest.raises(SystemExit):
            _parse(algorithm, argv)
    err = capsys.readouterr().err
    assert "policy-loss.delta" in err and "ppo2" in err
