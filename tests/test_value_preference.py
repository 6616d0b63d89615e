import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives.preference import bradley_terry_loss, distillation_loss, dpo_loss, orpo_loss
from relax.objectives.value import clipped_value_loss

RNG = np.random.default_rng(0)


def J(f, **kw):
    """``f`` with keyword options bound, jitted (one compile instead of many eager op dispatches)."""
    return jax.jit(functools.partial(f, **kw))


def logsig(x):
    return -np.logaddexp(0.0, -x)


def fd_check(f, *args, n_dirs=3, eps=1e-6):
    """Central finite differences of scalar ``f`` along random directions vs ``jax.grad``, in float64."""
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        args = [jnp.asarray(a, jnp.float64) for a in args]
        fj = jax.jit(f)
        grads = jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args)
        for _ in range(n_dirs):
            d = [rng.normal(size=a.shape) for a in args]
            plus = fj(*[a + eps * di for a, di in zip(args, d)])
            minus = fj(*[a - eps * di for a, di in zip(args, d)])
            numeric = float(plus - minus) / (2 * eps)
            analytic = sum(float(jnp.sum(g * di)) for g, di in zip(grads, d))
            assert numeric == pytest.approx(analytic, rel=1e-5, abs=1e-7)


# ----------------------------------------------------------------------------- value loss


def np_value_loss(v, old, ret, m, c):
    un = (v - ret) ** 2
    if c is None:
        worst, frac = un, np.zeros_like(un)
    else:
        cl = (np.clip(v, old - c, old + c) - ret) ** 2
        worst, frac = np.maximum(un, cl), (cl > un).astype(float)
    return np.where(m, 0.5 * worst, 0.0), frac[m].mean()


def value_inputs(n=3, t=5):
    v = RNG.normal(size=(n, t)).astype(np.float32)
    old = (v + RNG.normal(scale=0.5, size=(n, t))).astype(np.float32)
    ret = RNG.normal(size=(n, t)).astype(np.float32)
    m = RNG.random((n, t)) > 0.3
    m[:, 0] = True
    return v, old, ret, m


@pytest.mark.parametrize("clip", [0.2, 0.0, None])
def test_value_loss_against_numpy(clip):
    v, old, ret, m = value_inputs()
    loss, metrics = jax.jit(lambda *a: clipped_value_loss(*a, clip_range=clip))(v, old, ret, m)
    ref, frac = np_value_loss(v, old, ret, m, clip)
    np.testing.assert_allclose(loss, ref, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(metrics["vf_clipfrac"], frac, rtol=1e-6)
    np.testing.assert_allclose(metrics["vf_mse"], ((v - ret) ** 2)[m].mean(), rtol=1e-6)


def test_value_loss_hand_values():
    # V=1.0, old=0.0, R=2.0, c=0.5: unclipped (1-2)^2=1, clipped (0.5-2)^2=2.25 -> 0.5*2.25
    # V=1.0, old=0.0, R=0.0, c=0.5: unclipped 1, clipped 0.25 -> 0.5*1
    v, old, ret = (
        jnp.array([[1.0, 1.0, 9.0]]),
        jnp.array([[0.0, 0.0, 0.0]]),
        jnp.array([[2.0, 0.0, 0.0]]),
    )
    m = jnp.array([[True, True, False]])
    loss, metrics = J(clipped_value_loss, clip_range=0.5)(v, old, ret, m)
    np.testing.assert_allclose(loss, [[1.125, 0.5, 0.0]])
    assert float(metrics["vf_clipfrac"]) == 0.5


def test_value_loss_grad_bf16_errors():
    v, old, ret, m = value_inputs()
    fd_check(lambda v: jnp.sum(clipped_value_loss(v, old, ret, m, clip_range=0.3)[0]), v)
    loss, _ = J(clipped_value_loss, clip_range=0.2)(jnp.asarray(v, jnp.bfloat16), old, ret, m)
    assert loss.dtype == jnp.float32
    vb = np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_allclose(loss, np_value_loss(vb, old, ret, m, 0.2)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(AssertionError, match=r"returns=\(3, 4\)"):
        clipped_value_loss(v, old, ret[:, :4], m, clip_range=0.2)
    with pytest.raises(ValueError, match="clip_range"):
        clipped_value_loss(v, old, ret, m, clip_range=-1.0)


# ----------------------------------------------------------------------------- DPO


def np_dpo(pc, pr, rc, rr, beta, kind, e):
    z = (pc - pr) - (rc - rr)
    if kind == "sigmoid":
        return -(1 - e) * logsig(beta * z) - e * logsig(-beta * z)
    if kind == "robust":
        return (-(1 - e) * logsig(beta * z) + e * logsig(-beta * z)) / (1 - 2 * e)
    if kind == "hinge":
        return np.maximum(0.0, 1 - beta * z)
    return (z - 1 / (2 * beta)) ** 2


def dpo_inputs(b=6):
    return [RNG.normal(loc=-20, scale=3, size=b).astype(np.float32) for _ in range(4)]


CASES = [
    ("sigmoid", 0.0),
    ("sigmoid", 0.1),
    ("robust", 0.0),
    ("robust", 0.2),
    ("hinge", 0.0),
    ("ipo", 0.0),
]


@pytest.mark.parametrize("kind,e", CASES)
def test_dpo_against_numpy_and_grad(kind, e):
    beta = 0.1
    args = dpo_inputs()
    losses, metrics = jax.jit(
        lambda *a: dpo_loss(*a, beta=beta, loss_type=kind, label_smoothing=e)
    )(*args)
    np.testing.assert_allclose(losses, np_dpo(*args, beta, kind, e), rtol=1e-5, atol=1e-6)
    pc, pr, rc, rr = args
    np.testing.assert_allclose(metrics["rewards/chosen"], beta * (pc - rc), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        metrics["rewards/margins"], beta * (pc - rc) - beta * (pr - rr), rtol=1e-4, atol=1e-5
    )
    np.testing.assert_array_equal(
        metrics["rewards/accuracies"], (beta * (pc - rc) > beta * (pr - rr)).astype(np.float32)
    )
    f = lambda pc, pr: jnp.sum(
        dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=kind, label_smoothing=e)[0]
    )
    fd_check(f, pc, pr)


def test_dpo_hand_values():
    z0 = [np.zeros(1, np.float32)] * 4
    assert float(J(dpo_loss, beta=0.1)(*z0)[0][0]) == pytest.approx(math.log(2))
    assert float(J(dpo_loss, beta=0.1, loss_type="hinge")(*z0)[0][0]) == pytest.approx(1.0)
    assert float(J(dpo_loss, beta=0.1, loss_type="ipo")(*z0)[0][0]) == pytest.approx(
        25.0
    )  # (0 - 1/0.2)^2
    # z = 2, beta = 0.5: -log s(1)
    one = np.array([2.0], np.float32), *z0[:3]
    assert float(J(dpo_loss, beta=0.5)(*one)[0][0]) == pytest.approx(
        math.log1p(math.exp(-1)), rel=1e-6
    )
    # robust with e: ((1-e) * softplus(-1) - e * softplus(1)) / (1 - 2e)
    e = 0.25
    want = ((1 - e) * math.log1p(math.exp(-1)) - e * math.log1p(math.exp(1))) / (1 - 2 * e)
    got = J(dpo_loss, beta=0.5, loss_type="robust", label_smoothing=e)(*one)[0][0]
    assert float(got) == pytest.approx(want, rel=1e-6)


def test_robust_dpo_is_unbiased_under_label_noise():
    # rDPO property (Chowdhury et al.): E_flip[robust] = clean DPO loss when flip prob = e.
    args, e, beta = dpo_inputs(), 0.2, 0.3
    pc, pr, rc, rr = args
    clean = J(dpo_loss, beta=beta)(*args)[0]
    robust = J(dpo_loss, beta=beta, loss_type="robust", label_smoothing=e)
    rob, rob_flip = robust(pc, pr, rc, rr)[0], robust(pr, pc, rr, rc)[0]
    np.testing.assert_allclose((1 - e) * rob + e * rob_flip, clean, rtol=1e-4, atol=1e-5)


def test_dpo_bf16_and_errors():
    args = dpo_inputs()
    lb, _ = J(dpo_loss, beta=0.1)(*[jnp.asarray(a, jnp.bfloat16) for a in args])
    assert lb.dtype == jnp.float32
    rounded = [np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32)) for a in args]
    np.testing.assert_allclose(lb, np_dpo(*rounded, 0.1, "sigmoid", 0.0), rtol=1e-5)
    with pytest.raises(ValueError, match="sigmoid, hinge, ipo, robust"):
        dpo_loss(*args, beta=0.1, loss_type="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=0.1, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=0.1, loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*args, beta=0.0)
    with pytest.raises(AssertionError, match=r"ref_rejected_logps=\(5,\)"):
        dpo_loss(*args[:3], args[3][:5], beta=0.1)


# ----------------------------------------------------------------------------- ORPO


def np_orpo(c, r, nll, beta):
    log_odds = (c - r) - (np.log1p(-np.exp(c)) - np.log1p(-np.exp(r)))
    return nll - beta * logsig(log_odds), log_odds


def test_orpo_against_numpy_hand_and_grad():
    c = RNG.uniform(-3, -0.05, size=5).astype(np.float32)
    r = RNG.uniform(-3, -0.05, size=5).astype(np.float32)
    nll = -c
    losses, metrics = jax.jit(lambda *a: orpo_loss(*a, beta=0.1))(c, r, nll)
    ref, log_odds = np_orpo(c.astype(np.float64), r.astype(np.float64), nll, 0.1)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    np.testing.assert_allclose(metrics["log_odds_chosen"], log_odds, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(metrics["rewards/chosen"], 0.1 * c, rtol=1e-6)
    # hand: c = r = log(0.5) -> log_odds = 0 -> loss = nll + beta log 2
    half = np.array([math.log(0.5)], np.float32)
    h, _ = J(orpo_loss, beta=0.2)(half, half, np.ones(1, np.float32))
    assert float(h[0]) == pytest.approx(1.0 + 0.2 * math.log(2), rel=1e-6)
    fd_check(lambda c, r, n: jnp.sum(orpo_loss(c, r, n, beta=0.3)[0]), c, r, nll)


def test_orpo_stable_at_extremes():
    c = jnp.array([-1e-6, -40.0, -200.0], jnp.float32)
    r = jnp.array([-50.0, -1e-7, -201.0], jnp.float32)
    losses, _ = J(orpo_loss, beta=1.0)(c, r, jnp.zeros(3))
    g = jax.jit(jax.grad(lambda c: orpo_loss(c, r, jnp.zeros(3), beta=1.0)[0].sum()))(c)
    assert np.all(np.isfinite(losses)) and np.all(np.isfinite(g))
    lb, _ = J(orpo_loss, beta=1.0)(
        c.astype(jnp.bfloat16), r.astype(jnp.bfloat16), jnp.zeros(3, jnp.bfloat16)
    )
    assert lb.dtype == jnp.float32 and np.all(np.isfinite(lb))


# ----------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry():
    rc, rr = RNG.normal(size=6).astype(np.float32), RNG.normal(size=6).astype(np.float32)
    margin = RNG.uniform(0, 1, size=6).astype(np.float32)
    bt = jax.jit(bradley_terry_loss, static_argnames="center_rewards_coefficient")
    np.testing.assert_allclose(bt(rc, rr)[0], -logsig(rc - rr), rtol=1e-5)
    np.testing.assert_allclose(bt(rc, rr, margin=margin)[0], -logsig(rc - rr - margin), rtol=1e-5)
    np.testing.assert_allclose(bt(rc, rr, margin=0.5)[0], -logsig(rc - rr - 0.5), rtol=1e-5)
    got = jax.jit(lambda a, b: bradley_terry_loss(a, b, center_rewards_coefficient=0.01)[0])(rc, rr)
    np.testing.assert_allclose(got, -logsig(rc - rr) + 0.01 * (rc + rr) ** 2, rtol=1e-5)
    assert float(bt(np.zeros(6, np.float32), np.zeros(6, np.float32))[0][0]) == pytest.approx(
        math.log(2)
    )
    _, m = bt(np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32))
    np.testing.assert_array_equal(m["accuracy"], [1.0, 0.0])
    fd_check(
        lambda a, b: jnp.sum(
            bradley_terry_loss(a, b, margin=margin, center_rewards_coefficient=0.1)[0]
        ),
        rc,
        rr,
    )
    assert bt(jnp.asarray(rc, jnp.bfloat16), rr)[0].dtype == jnp.float32
    with pytest.raises(AssertionError, match=r"margin=\(5,\)"):
        bradley_terry_loss(rc, rr, margin=margin[:5])


# ----------------------------------------------------------------------------- distillation


def np_distill(s, t, m, T, direction):
    def log_softmax(x):
        x = x / T
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lq, lp = log_softmax(s.astype(np.float64)), log_softmax(t.astype(np.float64))
    if direction == "forward":
        kl = (np.exp(lp) * (lp - lq)).sum(-1)
    else:
        kl = (np.exp(lq) * (lq - lp)).sum(-1)
    return np.where(m, T**2 * kl, 0.0)


def distill_inputs(n=2, t=3, v=7):
    s = RNG.normal(size=(n, t, v)).astype(np.float32)
    te = RNG.normal(size=(n, t, v)).astype(np.float32) * 2
    m = np.array([[True, True, False], [True, False, False]])
    return s, te, m


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("T", [1.0, 2.0])
def test_distillation_against_numpy_and_grad(direction, T):
    s, te, m = distill_inputs()
    loss, metrics = jax.jit(lambda *a: distillation_loss(*a, temperature=T, direction=direction))(
        s, te, m
    )
    ref = np_distill(s, te, m, T, direction)
    np.testing.assert_allclose(loss, ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["kl"], ref[m].mean() / T**2, rtol=1e-5)
    fd_check(
        lambda s: jnp.sum(distillation_loss(s, te, m, temperature=T, direction=direction)[0]), s
    )


def test_distillation_properties():
    s, te, m = distill_inputs()
    fwd, _ = J(distillation_loss, temperature=1.0, direction="forward")(s, te, m)
    rev, _ = J(distillation_loss, temperature=1.0, direction="reverse")(s, te, m)
    assert not np.allclose(fwd, rev)  # KL is asymmetric
    same, metrics = J(distillation_loss, temperature=3.0)(s, s, m)
    np.testing.assert_allclose(same, 0.0, atol=1e-6)
    assert float(metrics["top1_agreement"]) == 1.0
    g = jax.jit(jax.grad(lambda t: distillation_loss(s, t, m, temperature=1.0)[0].sum()))(te)
    assert np.all(np.asarray(g) == 0)  # teacher is stop_gradient'ed
    # a teacher with -inf logits (masked vocab) stays finite in the forward direction
    te_inf = te.copy()
    te_inf[..., 0] = -np.inf
    out, _ = J(distillation_loss, temperature=1.0)(s, te_inf, m)
    assert np.all(np.isfinite(out))
    lb, _ = J(distillation_loss, temperature=2.0)(
        jnp.asarray(s, jnp.bfloat16), jnp.asarray(te, jnp.bfloat16), m
    )
    assert lb.dtype == jnp.float32
    np.testing.assert_allclose(lb, np_distill(s, te, m, 2.0, "forward"), rtol=0.05, atol=0.05)


def test_distillation_errors():
    s, te, m = distill_inputs()
    with pytest.raises(ValueError, match="forward, reverse"):
        distillation_loss(s, te, m, temperature=1.0, direction="jsd")
    with pytest.raises(ValueError, match="temperature"):
        distillation_loss(s, te, m, temperature=0.0)
    with pytest.raises(AssertionError, match=r"teacher_logits=\(2, 3, 6\)"):
        distillation_loss(s, te[..., :6], m, temperature=1.0)
    with pytest.raises(AssertionError, match=r"mask=\(2, 2\)"):
        distillation_loss(s, te, m[:, :2], temperature=1.0)
