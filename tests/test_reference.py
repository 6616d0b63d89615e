import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.objectives.reference import (
    ReferenceConfig,
    ema,
    make_reference_rule,
    mixup,
    periodic,
    prorl_reset,
    prorl_should_reset,
    static,
)

RNG = np.random.default_rng(0)


def tree(seed_shift=0.0):
    """A small params pytree: nested dicts, a None (eqx-filtered) leaf, a bfloat16 leaf."""
    return {
        "w": jnp.asarray(RNG.normal(size=(3, 4)) + seed_shift, jnp.float32),
        "blocks": [{"b": jnp.asarray(RNG.normal(size=(4,)), jnp.float32), "act": None}],
        "h": jnp.asarray(RNG.normal(size=(2,)), jnp.bfloat16),
    }


def np_leaves(t):
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(t)]


def assert_tree_close(a, b):
    """Leafwise closeness; bfloat16 leaves to one rounding (XLA may fuse the mix differently)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y, leaf in zip(np_leaves(a), np_leaves(b), jax.tree.leaves(a)):
        tol = 1e-2 if leaf.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(x, y, rtol=tol, atol=tol)


def run(rule, ref, policies, stats_seq):
    """Apply ``rule`` under one jit for steps 1..n with traced step and stats; count traces."""
    traces = []

    def step_fn(ref, policy, step, stats):
        traces.append(1)
        return rule(ref, policy, step, stats)

    f = jax.jit(step_fn)
    out = []
    for i, (pol, stats) in enumerate(zip(policies, stats_seq), start=1):
        ref = f(ref, pol, jnp.asarray(i), stats)
        out.append(ref)
    assert len(traces) == 1
    return out


def np_mix(r, p, a):
    return [a * pp + (1 - a) * rr for rr, pp in zip(r, p)]


def test_static_and_ema():
    ref, pol = tree(), tree(1.0)
    assert static()(ref, pol, 5, {}) is ref
    alpha = 0.25
    got = jax.jit(ema(alpha))(ref, pol, 3, {})
    for x, want, leaf in zip(
        np_leaves(got), np_mix(np_leaves(ref), np_leaves(pol), alpha), jax.tree.leaves(ref)
    ):
        tol = 1e-2 if leaf.dtype == jnp.bfloat16 else 1e-6
        np.testing.assert_allclose(x, want, rtol=tol, atol=tol)
    assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, ref)
    assert_tree_close(ema(0.0)(ref, pol, 1, {}), ref)
    assert_tree_close(ema(1.0)(ref, pol, 1, {}), pol)


def test_periodic_and_mixup_schedules():
    ref0 = tree()
    policies = [tree(float(i)) for i in range(1, 8)]
    stats = [{}] * 7
    hard = run(periodic(3), ref0, policies, stats)
    mix = run(mixup(3, 0.6), ref0, policies, stats)
    want_hard, want_mix = np_leaves(ref0), np_leaves(ref0)
    for step, pol in enumerate(policies, start=1):
        if step % 3 == 0:  # steps 3 and 6 only
            want_hard = np_leaves(pol)
            want_mix = np_mix(want_mix, np_leaves(pol), 0.6)
        for got, want in ((hard[step - 1], want_hard), (mix[step - 1], want_mix)):
            for x, w in zip(np_leaves(got), want):
                np.testing.assert_allclose(x, w, rtol=2e-2, atol=2e-2)
    # step 0 never syncs (TRL syncs on global_step % N == 0 after an optimizer step)
    assert_tree_close(periodic(1)(ref0, policies[0], jnp.asarray(0), {}), ref0)
    # mixup(1, a) == ema(a); mixup(every, 1) == periodic(every)
    assert_tree_close(mixup(1, 0.3)(ref0, policies[0], 7, {}), ema(0.3)(ref0, policies[0], 7, {}))
    assert_tree_close(
        mixup(2, 1.0)(ref0, policies[0], 4, {}), periodic(2)(ref0, policies[0], 4, {})
    )


@pytest.mark.parametrize("mode", ["hard", "mixup"])
def test_prorl_reset(mode):
    ref0, pol = tree(), tree(2.0)
    alpha = 0.5 if mode == "mixup" else None
    rule = prorl_reset(kl_target=0.1, entropy_floor=0.5, mode=mode, alpha=alpha)
    reset = np_leaves(pol) if mode == "hard" else np_mix(np_leaves(ref0), np_leaves(pol), 0.5)
    stats_seq = [
        {"kl": 0.05, "entropy": 1.0},  # no reset
        {"kl": 0.2, "entropy": 1.0},  # kl above target
        {"kl": 0.05, "entropy": 0.1},  # entropy below floor
        {"kl": 0.1, "entropy": 0.5},  # thresholds are strict
    ]
    for stats, should in zip(stats_seq, [False, True, True, False]):
        stats = {k: jnp.asarray(v, jnp.float32) for k, v in stats.items()}
        out = run(rule, ref0, [pol], [stats])[0]
        want = reset if should else np_leaves(ref0)
        for x, w in zip(np_leaves(out), want):
            np.testing.assert_allclose(x, w, rtol=2e-2, atol=2e-2)
        assert bool(prorl_should_reset(stats, kl_target=0.1, entropy_floor=0.5)) == should
    # only enabled thresholds are read
    only_kl = prorl_reset(kl_target=0.1)
    assert_tree_close(only_kl(ref0, pol, 1, {"kl": jnp.asarray(1.0)}), pol)
    with pytest.raises(KeyError, match="entropy"):
        prorl_reset(entropy_floor=0.1)(ref0, pol, 1, {"kl": 0.0})


def test_mismatched_trees_raise():
    ref, pol = tree(), tree()
    bad = dict(pol, w=jnp.zeros((3, 5)))
    with pytest.raises(AssertionError, match="ref_params vs policy_params"):
        ema(0.5)(ref, bad, 1, {})
    with pytest.raises(AssertionError):
        periodic(2)(ref, {"w": pol["w"]}, 2, {})
    with pytest.raises(TypeError, match="non-floating"):
        ema(0.5)({"i": jnp.arange(3)}, {"i": jnp.arange(3)}, 1, {})


def test_config_builds_every_kind():
    ref, pol = tree(), tree(1.0)
    cases = [
        (ReferenceConfig(), static()),
        (ReferenceConfig(kind="ema", alpha=0.1), ema(0.1)),
        (ReferenceConfig(kind="periodic", every=2), periodic(2)),
        (ReferenceConfig(kind="mixup", every=2, alpha=0.6), mixup(2, 0.6)),
        (ReferenceConfig(kind="prorl", kl_target=0.1), prorl_reset(kl_target=0.1)),
        (
            ReferenceConfig(kind="prorl", entropy_floor=0.3, reset_mode="mixup", alpha=0.2),
            prorl_reset(entropy_floor=0.3, mode="mixup", alpha=0.2),
        ),
    ]
    stats = {"kl": jnp.asarray(0.5), "entropy": jnp.asarray(0.1)}
    for cfg, rule in cases:
        assert_tree_close(make_reference_rule(cfg)(ref, pol, 2, stats), rule(ref, pol, 2, stats))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cases[0][0].kind = "ema"


def test_config_validation():
    with pytest.raises(ValueError, match="static, ema, periodic, mixup, prorl"):
        ReferenceConfig(kind="polyak")
    with pytest.raises(ValueError, match="does not read every"):
        ReferenceConfig(kind="ema", alpha=0.1, every=3)
    with pytest.raises(ValueError, match="needs alpha"):
        ReferenceConfig(kind="mixup", every=3)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        ReferenceConfig(kind="ema", alpha=1.5)
    with pytest.raises(ValueError, match="every must be an integer >= 1"):
        ReferenceConfig(kind="periodic", every=0)
    with pytest.raises(ValueError, match="kl_target and/or entropy_floor"):
        ReferenceConfig(kind="prorl")
    with pytest.raises(ValueError, match="hard, mixup"):
        ReferenceConfig(kind="prorl", kl_target=0.1, reset_mode="soft")
    with pytest.raises(ValueError, match="needs alpha"):
        ReferenceConfig(kind="prorl", kl_target=0.1, reset_mode="mixup")
    with pytest.raises(ValueError, match="only read by mode='mixup'"):
        ReferenceConfig(kind="prorl", kl_target=0.1, alpha=0.5)
    ReferenceConfig(kind="ema", alpha=0.0)  # 0.0 is a valid value


@pytest.mark.parametrize("smallest_first", [False, True])
def test_params_equal_is_bitwise_equality(smallest_first):
    from relax.objectives.reference import params_equal

    a = {
        "big": jnp.arange(12.0).reshape(3, 4),
        "small": jnp.ones(2),
        "n": jnp.zeros((2, 2), jnp.bfloat16),
    }
    b = jax.tree.map(jnp.copy, a)
    eq = jax.jit(lambda x, y: params_equal(x, y, smallest_first=smallest_first))
    assert bool(eq(a, b))
    assert not bool(eq(a, {**b, "big": b["big"].at[2, 3].add(1e-6)}))  # a large leaf differs
    assert not bool(eq(a, {**b, "small": b["small"].at[0].set(-0.0 + 2.0)}))  # the smallest differs
    assert not bool(eq(a, {**b, "n": b["n"].astype(jnp.float32)}))  # same values, another dtype
    assert not bool(eq(a, {**b, "big": jnp.full((3, 4), jnp.nan)}))
