import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.compose import Stage, WithHost, compose, stage


def make_stages(traces):
    """Three jittable stages and one host stage over state={"w", "n"} and batch={"x", ...}."""

    def rollout(state, batch):
        traces.append("rollout")
        return state, dict(batch, y=batch["x"] * state["w"])

    def advantage(state, batch):
        traces.append("advantage")
        y = batch["y"]
        return state, dict(batch, adv=y - y.mean())

    def update(state, batch):
        traces.append("update")
        return {"w": state["w"] - 0.1 * batch["adv"], "n": state["n"] + 1}, batch

    def score(state, batch):  # host: numpy, Python side effects
        assert not isinstance(batch["y"], jax.core.Tracer)
        traces.append("score")
        y = np.asarray(batch["y"])
        return state, dict(batch, y=jnp.asarray(np.where(y > 0, 1.0, 0.0), jnp.float32))

    return stage(rollout), stage(advantage), stage(update), stage(score, jit=False)


def init():
    return {"w": jnp.linspace(-1.0, 1.0, 8), "n": jnp.asarray(0)}, {"x": jnp.arange(8.0) - 3.0}


def by_hand(fns, state, batch):
    for f in fns:
        state, batch = f(state, batch)
    return state, batch


def assert_same(a, b):
    jax.tree.map(
        lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6), a, b
    )


def test_all_jit_compose_fuses_and_compiles_once():
    traces = []
    rollout, advantage, update, _ = make_stages(traces)
    step = compose(rollout, advantage, update)
    assert step.jittable and step.donate_state and step.name == "rollout+advantage+update"
    assert len(step.segments) == 1 and step.segments[0].names == ("rollout", "advantage", "update")
    state, batch = init()
    ref_state, ref_batch = by_hand([rollout.fn, advantage.fn, update.fn], *init())
    for i in range(4):
        state, out = step(state, batch)
        if i == 0:
            assert_same((state, out), (ref_state, ref_batch))
    assert (
        traces.count("rollout") == 1 + 1 and traces.count("update") == 1 + 1
    )  # 1 trace + 1 by_hand
    assert step.cache_sizes() == (1,)
    assert int(state["n"]) == 4


def test_host_stage_splits_into_two_jits():
    traces = []
    rollout, advantage, update, score = make_stages(traces)
    step = compose(rollout, score, advantage, update)
    assert not step.jittable
    assert [(s.names, s.jittable) for s in step.segments] == [
        (("rollout",), True),
        (("score",), False),
        (("advantage", "update"), True),
    ]
    expected = by_hand([rollout.fn, score.fn, advantage.fn, update.fn], *init())
    traces.clear()
    state, batch = init()
    for i in range(3):
        state, out = step(state, batch)
        if i == 0:
            assert_same((state, out), expected)
    assert traces.count("score") == 3  # host stage runs every call
    assert (
        traces.count("rollout") == 1 and traces.count("advantage") == 1
    )  # jitted ones traced once
    assert step.cache_sizes() == (1, 1)


def test_nesting_flattens_and_fuses_across():
    traces = []
    rollout, advantage, update, score = make_stages(traces)
    inner = compose(rollout, advantage)
    outer = compose(inner, update)
    assert len(outer.segments) == 1 and outer.parts == (rollout, advantage, update)
    assert_same(outer(*init()), compose(rollout, advantage, update)(*init()))
    mixed = compose(compose(rollout, score), compose(advantage, update))
    assert [s.names for s in mixed.segments] == [("rollout",), ("score",), ("advantage", "update")]
    assert_same(mixed(*init()), by_hand([rollout.fn, score.fn, advantage.fn, update.fn], *init()))
    # a jittable composed stage's .fn is pure and can itself be jitted/vmapped by a caller
    assert_same(jax.jit(inner.fn)(*init()), inner(*init()))


def test_donation_and_state_reuse():
    _, advantage, update, _ = make_stages([])
    rollout = stage(lambda s, b: (s, dict(b, y=b["x"] * s["w"])), name="rollout")
    step = compose(rollout, advantage, update)
    state, batch = init()
    new_state, _ = step(state, batch)
    assert state["w"].is_deleted()  # donated
    assert not batch["x"].is_deleted()  # batch is never donated
    for _ in range(3):  # the returned state feeds the next call
        new_state, _ = step(new_state, batch)
    assert int(new_state["n"]) == 4

    keep = compose(rollout, advantage, stage(update.fn, name="update", donate_state=False))
    assert not keep.donate_state
    state, batch = init()
    keep(state, batch)
    assert not state["w"].is_deleted()
    leaf = stage(update.fn)  # a single jittable stage is jitted (and donates) on its own
    state, batch = init()
    _, b = compose(rollout, advantage)(init()[0], batch)
    leaf(state, b)
    assert state["w"].is_deleted() and leaf.cache_sizes() == (1,)


def test_stage_api_and_errors():
    @stage(jit=False, name="log")
    def log(state, batch):
        return state, batch

    assert isinstance(log, Stage) and not log.jittable and log.name == "log" and log.jitted == ()
    assert log(1, 2) == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        log.jittable = True
    with pytest.raises(ValueError, match="at least one stage"):
        compose()
    with pytest.raises(TypeError, match="wrap functions with stage"):
        compose(log, lambda s, b: (s, b))
    with pytest.raises(TypeError, match="already a Stage"):
        stage(log)


def test_read_only_stage_returns_the_callers_state_before_a_failing_host_stage():
    """A program of ``updates_state=False`` stages neither donates nor copies the state: when the
    host stage after it raises, the caller's state is whole and the step can simply be retried."""
    _, advantage, update, _ = make_stages([])
    rollout = stage(
        lambda s, b: (s, dict(b, y=b["x"] * s["w"])), name="rollout", updates_state=False
    )
    fail = {"now": True}

    def score(state, batch):
        if fail["now"]:
            raise RuntimeError("reward server down")
        return state, batch

    step = compose(rollout, stage(score, jit=False), advantage, update)
    assert [s.updates_state for s in step.segments] == [False, True, True]
    state, batch = init()
    with pytest.raises(RuntimeError, match="reward server down"):
        step(state, batch)
    assert not state["w"].is_deleted()
    out_state, batch_out = step.segments[0].run(state, batch)
    assert out_state is state and np.array_equal(batch_out["y"], batch["x"] * state["w"])
    fail["now"] = False
    want, _ = by_hand([rollout.fn, advantage.fn, update.fn], *init())
    got, _ = step(state, batch)  # the retry, from the same state
    assert_same(got, want)

    liar = stage(lambda s, b: ({"w": s["w"] + 1, "n": s["n"]}, b), name="liar", updates_state=False)
    with pytest.raises(ValueError, match="liar declared updates_state=False but changed the state"):
        liar(*init())


class Untraceable:
    """A host value that fails if anything makes it an array (a jit argument, ``jnp.asarray``)."""

    def __init__(self, text):
        self.text = text

    def __jax_array__(self):
        raise AssertionError("a host record reached a jitted program")

    def __array__(self, *args, **kwargs):
        raise AssertionError("a host record reached a jitted program")


def test_with_host_record_never_enters_the_jitted_programs():
    """A ``WithHost`` batch: the jitted segments get the device part alone and the host record
    passes around them unchanged (the same object), host stages get the pair; a new host record
    (other text, another length) compiles nothing new."""
    from relax.algorithms.online.batch import HostRecord

    traces, seen = [], []

    def scale(state, batch):  # jitted: the device part only, never the pair
        assert not isinstance(batch, WithHost) and set(batch) == {"x"}, batch
        traces.append("scale")
        return state, {"x": batch["x"], "y": batch["x"] * state["w"]}

    def note(state, batch):  # host: reads the record, adds to it
        assert isinstance(batch, WithHost) and not isinstance(batch.device["y"], jax.core.Tracer)
        seen.append(batch.host)
        words = [o.text for o in batch.host.fields["obj"]]
        host = batch.host.replace(completions=words, reward_info={"n": len(words)})
        return state, batch.replace(
            device={**batch.device, "r": jnp.full(8, float(len(words)))}, host=host
        )

    def update(state, batch):  # jitted again
        assert not isinstance(batch, WithHost) and set(batch) == {"x", "y", "r"}, batch
        traces.append("update")
        return {"w": state["w"] + batch["r"] * batch["y"], "n": state["n"] + 1}, {
            "total": jnp.sum(batch["y"])
        }

    step = compose(stage(scale, updates_state=False), stage(note, jit=False), stage(update))
    assert [s.jittable for s in step.segments] == [True, False, True]
    state, batch = init()
    for i, words in enumerate((["a", "b"], ["ccc", "dd", "e", "f"])):
        host = HostRecord(
            prompts=[f"p{i}"] * len(words), fields={"obj": [Untraceable(w) for w in words]}
        )
        w0 = np.asarray(state["w"])
        state, out = step(state, WithHost(dict(batch), host))
        assert isinstance(out, WithHost) and seen[-1] is host  # the record the caller passed
        assert out.host.fields is host.fields and out.host.completions == words
        assert (
            out.host.reward_info == {"n": len(words)} and host.completions is None
        )  # the caller's is unchanged
        y = np.asarray(batch["x"]) * w0
        np.testing.assert_allclose(out.device["total"], y.sum(), rtol=1e-6)
        np.testing.assert_allclose(state["w"], w0 + len(words) * y, rtol=1e-6)
    assert traces == ["scale", "update"]  # traced once: the host record is no part of the signature
    assert step.cache_sizes() == (1, 1) and int(state["n"]) == 2
    # the guard itself works: the record (or its values) as a jit argument is an error
    for value in (Untraceable("x"), host, WithHost(dict(batch), host)):
        with pytest.raises((TypeError, ValueError, AssertionError)):
            jax.jit(lambda v: v)(value)
