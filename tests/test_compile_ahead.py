"""Programs compiled before a step first runs (``relax.train.ahead``): the step's later calls
compile nothing, whatever the state's placement, and without the walk they would."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.compose import compose, stage
from relax.train.ahead import (
    call_aval,
    compile_programs,
    lower_step,
    walk_step,
    zeros,
)
from relax.train.run import CompileCounter


def _step():
    """jit(scale) -> host(tally, numpy) -> jit(update): the state's ``w`` moves by the batch's mean."""

    def scale(state, batch):
        return state, {"x": batch["x"] * state["w"][0]}

    def tally(state, batch):
        x = np.asarray(batch["x"])
        return state, {"x": x, "total": x.sum(-1)}

    def update(state, batch):
        w = state["w"] + jnp.mean(batch["total"])
        return {"w": w, "n": state["n"] + 1}, {"loss": jnp.sum(batch["x"] ** 2)}

    return compose(
        stage(scale, updates_state=False),
        stage(tally, jit=False),
        stage(update, donate_state=False),
    )


def _run_host(seg, state, batch):
    return seg.run(state, batch)[1]


def _batch(rows: int) -> dict:
    return {"x": jax.device_put(np.arange(rows * 3, dtype=np.float32).reshape(rows, 3))}


def _compiles_per_call(step, state, rows) -> list[int]:
    counts = []
    for n in rows:
        with CompileCounter() as c:
            state, out = step(state, _batch(n))
            jax.block_until_ready((state, out))
        counts.append(c.count)
    return counts


def _walk_and_compile(step, state, rows, **kwargs) -> list:
    seen, found = {}, []
    for n in rows:
        batch = {"x": jax.ShapeDtypeStruct((n, 3), jnp.float32)}
        found += walk_step(step.segments, state, batch, run_host=_run_host, seen=seen, **kwargs)
    return compile_programs(found, workers=2)


def test_every_program_of_every_batch_shape_is_compiled_before_the_step_runs():
    state = {"w": jnp.ones(2), "n": jnp.int32(0)}
    rows = (2, 5, 2, 5)
    assert _compiles_per_call(_step(), state, rows)[:2] == [
        2,
        2,
    ]  # without: each new shape compiles
    step = _step()
    compiled = _walk_and_compile(step, state, rows[:2])
    assert [c.name for c in compiled] == ["scale", "update"] * 2
    assert all(c.seconds > 0 and c.error is None for c in compiled)
    assert _compiles_per_call(step, state, rows) == [0, 0, 0, 0]
    assert step.cache_sizes() == (2, 2)  # the run found the executables the walk compiled


def test_a_state_committed_by_its_first_update_is_walked_again():
    """A state with a committed leaf: the update returns every leaf committed, so the second call's
    arguments differ from the first's; the walk follows the state the step returns."""
    state = {"w": jax.device_put(jnp.ones(2), jax.devices()[0]), "n": jnp.int32(0)}
    assert call_aval(state["w"]).sharding is not None and call_aval(state["n"]).sharding is None
    once = _step()
    batch = {"x": jax.ShapeDtypeStruct((2, 3), jnp.float32)}
    found, after = lower_step(
        once.segments, jax.tree.map(call_aval, state), batch, run_host=_run_host
    )
    assert after["n"].sharding is not None  # what the update returns is committed
    compile_programs(found)
    first, second = _compiles_per_call(once, state, (2, 2))
    assert first == 0 and second > 0  # one walk: the second call compiles
    step = _step()
    assert len(_walk_and_compile(step, state, (2,))) == 4  # both walks' programs
    assert _compiles_per_call(step, state, (2, 2, 2)) == [0, 0, 0]


def test_a_pipelined_producer_is_lowered_on_its_view_of_the_state():
    """The segments before the first that updates the state are called with ``views(state)`` (the
    pipeline's sampler copy), the rest with the state."""
    state = {"w": jnp.ones(2), "n": jnp.int32(0)}
    view = lambda s: {"w": s["w"], "n": None}  # noqa: E731
    step = _step()
    found = _walk_and_compile(step, state, (4,), views=view)
    assert jax.tree.structure(found[0].lowering.args[0]) == jax.tree.structure(view(state))
    assert jax.tree.structure(found[1].lowering.args[0]) == jax.tree.structure(state)
    producer, host, consumer = step.segments
    with CompileCounter() as c:
        _, batch = producer.run(view(state), _batch(4))
        _, batch = host.run(view(state), batch)
        jax.block_until_ready(consumer.run(state, batch))
    assert c.count == 0


@pytest.mark.parametrize(
    "value,expected",
    [
        (np.zeros((2, 3), np.int32), jax.ShapeDtypeStruct((2, 3), jnp.int32)),
        (1.5, jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)),
        (True, jax.ShapeDtypeStruct((), jnp.bool_)),
        (jnp.asarray(2.0), jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)),
    ],
)
def test_call_aval_is_what_jit_keys_a_call_by(value, expected):
    assert call_aval(value) == expected
    f = jax.jit(lambda x: x + 1)
    f.lower(call_aval(value)).compile()
    with CompileCounter() as c:
        f(value)
    assert c.count == 0


def test_host_segments_read_zeros_placed_as_the_run_places_them():
    device = jax.devices()[0]
    tree = zeros(
        {
            "a": jax.ShapeDtypeStruct((2,), jnp.int32),
            "b": jax.ShapeDtypeStruct(
                (3,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device)
            ),
        }
    )
    assert isinstance(tree["a"], np.ndarray) and not tree["a"].any()
    assert tree["b"].committed and not np.asarray(tree["b"]).any()


def test_a_plans_programs_compile_side_by_side():
    """``relax.plan.programs.Concurrently``: compiles start on a thread pool as they are handed
    over, and each program resolves to its own executable and compile seconds."""
    from relax.plan.programs import Concurrently, Program
    from relax.train.ahead import timed_compile

    x = jax.ShapeDtypeStruct((), jnp.float32)
    lowered = [jax.jit(lambda v, k=k: v * k).lower(x) for k in (2.0, 3.0)]
    with Concurrently(timed_compile, workers=2) as pending:
        programs = [Program(f"times {i}", None, (), *pending(lo)) for i, lo in enumerate(lowered)]
        assert all(p.compile_s == 0.0 for p in programs)  # handed over, not awaited
        done = [pending.resolved(p) for p in programs]
    assert [float(p.compiled(jnp.float32(1.5))) for p in done] == [3.0, 4.5]
    assert all(p.compile_s > 0 and p.error is None for p in done)
