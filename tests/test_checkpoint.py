"""relax.checkpoint: bit-exact round trips, retention, save cadence, crash safety, clear errors."""

import os
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import relax.models as rm
from relax.checkpoint import Checkpointer

CFG = rm.ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                     num_heads=2, num_kv_heads=1, head_dim=8)
OPT = optax.chain(optax.clip_by_global_norm(1.0),
                  optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100),
                              weight_decay=0.1))


def _make_state():
    """A train-state-like pytree: eqx model, adamw state after one step, typed key, step ints.

    The model is initialised from an ``rbg`` key: threefry's random normals cost ~10 s of XLA:CPU
    compiles on a loaded 2-core machine, rbg's ~2 s. The state's own key is a default one.
    """
    model = jax.jit(rm.init, static_argnums=0)(CFG, jax.random.key(0, impl="rbg"))

    @eqx.filter_jit
    def one_step(model):
        params = eqx.filter(model, eqx.is_array)
        opt_state = OPT.init(params)
        updates, opt_state = OPT.update(jax.tree.map(jnp.sin, params), opt_state, params)
        return eqx.apply_updates(model, updates), opt_state

    model, opt_state = one_step(model)
    return {"model": model, "opt_state": opt_state, "key": jax.random.key(3),
            "step": jnp.asarray(3, jnp.int32), "epoch": 3}


def _is_key(x):
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _perturbed(state):
    """Same structure, different values (no XLA compiles: numpy + device_put)."""
    def leaf(x):
        if _is_key(x):
            return jax.random.wrap_key_data(jax.device_put(np.asarray(jax.random.key_data(x)) + 1))
        if isinstance(x, jax.Array):
            return jax.device_put(np.asarray(x) + 1)
        return x + 1
    return jax.tree.map(leaf, state)


@pytest.fixture(scope="module")
def state():
    return _make_state()


def _raw(x):
    if _is_key(x):
        return np.asarray(jax.random.key_data(x))
    return np.asarray(x)


def _assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if hasattr(x, "dtype"):
            assert x.dtype == y.dtype
        assert np.array_equal(_raw(x), _raw(y))
        assert _raw(x).tobytes() == _raw(y).tobytes()


def test_round_trip_bit_exact(tmp_path, state):
    ckpt = Checkpointer(tmp_path / "ckpt")
    config = {"lr": 1e-3, "betas": (0.9, 0.95), "model": {"hidden": 16}, "name": "x"}
    assert ckpt.save(10, state, data_state={"pos": 7, "epoch": 1}, config=config)
    ckpt.wait()
    assert ckpt.latest_step() == 10

    # target: a different concrete state of the same structure
    restored, data_state, cfg = ckpt.restore(target=_perturbed(state))
    _assert_bit_identical(restored, state)
    assert isinstance(restored["model"], rm.Transformer)
    assert restored["model"].config == CFG and restored["model"].lm_head is not None
    assert restored["model"].layers.bq is None
    assert jax.dtypes.issubdtype(restored["key"].dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(restored["key"]) == jax.random.key_impl(state["key"])
    assert restored["epoch"] == 3 and isinstance(restored["epoch"], int)
    assert data_state == {"pos": 7, "epoch": 1}
    assert cfg == {"lr": 1e-3, "betas": [0.9, 0.95], "model": {"hidden": 16}, "name": "x"}

    # target: an abstract structure from jax.eval_shape, in a fresh Checkpointer
    abstract = jax.eval_shape(lambda: state)
    restored2, _, _ = Checkpointer(tmp_path / "ckpt").restore(10, target=abstract)
    # (eval_shape turns the Python int leaf into an int32 scalar; it restores into that)
    assert int(restored2.pop("epoch")) == 3
    _assert_bit_identical(restored2, {k: v for k, v in state.items() if k != "epoch"})
    ckpt.close()


@pytest.mark.parametrize("data_state", [b"\x00\x01grain-state\xff", None, {"a": [1, 2], "b": "s"}])
def test_data_state_round_trip(tmp_path, data_state):
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, data_state=data_state, config={})
        restored, got, cfg = ckpt.restore(target=state)
    assert got == data_state and type(got) is type(data_state)
    assert cfg == {}
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_max_to_keep_and_latest_step(tmp_path):
    state = {"w": np.zeros(3, np.float32)}
    ckpt = Checkpointer(tmp_path, max_to_keep=2)
    assert ckpt.latest_step() is None
    for step in range(1, 6):
        assert ckpt.save(step, {"w": state["w"] + step}, config={"step": step})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 5] and ckpt.latest_step() == 5
    assert sorted(p for p in os.listdir(tmp_path) if p.isdigit()) == ["4", "5"]
    restored, _, cfg = ckpt.restore(4, target=state)
    assert restored["w"].tolist() == [4.0, 4.0, 4.0] and cfg == {"step": 4}
    with pytest.raises(FileNotFoundError, match="step 2"):
        ckpt.restore(2, target=state)
    ckpt.close()


def test_save_every(tmp_path):
    state = {"w": np.ones(2, np.float32)}
    ckpt = Checkpointer(tmp_path, save_every=5)
    saved = [step for step in range(1, 13) if ckpt.save(step, state, config={})]
    assert saved == [5, 10]
    assert ckpt.save(12, state, config={}, force=True)  # forced save off the cadence
    assert not ckpt.save(11, state, config={})  # never behind the latest step
    ckpt.wait()
    assert ckpt.all_steps() == [5, 10, 12]
    ckpt.close()


def test_empty_directory_restore_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Checkpointer(tmp_path).restore(target={"w": np.zeros(2)})


def test_incompatible_target_names_directory_and_step(tmp_path, state):
    ckpt = Checkpointer(tmp_path / "run")
    ckpt.save(7, state, config={})
    ckpt.wait()
    bigger = rm.ModelConfig(**{**CFG.__dict__, "hidden_size": 24})
    target = dict(state, model=jax.eval_shape(lambda: rm.init(bigger, jax.random.key(0))))
    with pytest.raises(ValueError) as err:
        ckpt.restore(target=target)
    msg = str(err.value)
    assert str(tmp_path / "run") in msg and "step 7" in msg
    assert "model.embed" in msg and "[32, 16]" in msg and "[32, 24]" in msg

    with pytest.raises(ValueError, match="missing from the checkpoint: extra"):
        ckpt.restore(target=dict(state, extra=jnp.zeros(2)))
    wrong_dtype = dict(state, step=jnp.zeros((), jnp.float32))
    with pytest.raises(ValueError, match=r"step: checkpoint int32\[\] vs target float32\[\]"):
        ckpt.restore(target=wrong_dtype)
    ckpt.close()


_CRASH_SCRIPT = textwrap.dedent("""
    import os, sys
    import jax, numpy as np
    from orbax.checkpoint._src.path import atomicity
    from relax.checkpoint import Checkpointer

    directory = sys.argv[1]
    ckpt = Checkpointer(directory)
    state = {"w": np.arange(4, dtype=np.float32), "key": jax.random.key(5)}
    ckpt.save(1, state, data_state=b"one", config={"step": 1})
    ckpt.wait()

    original = atomicity.AtomicRenameTemporaryPath.finalize
    async def crash_before_commit(self):
        if self._final_path.name == "2":  # every item of step 2 is written; die before the rename
            print("TMP", self.get(), flush=True)
            os._exit(17)
        return await original(self)
    atomicity.AtomicRenameTemporaryPath.finalize = crash_before_commit
    ckpt.save(2, {"w": state["w"] * 2, "key": state["key"]}, data_state=b"two", config={"step": 2})
    ckpt.wait()
    os._exit(0)  # not reached
""")


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    directory = tmp_path / "ckpt"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(directory)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-3000:]
    leftovers = [p for p in os.listdir(directory) if p.startswith("2.orbax-checkpoint-tmp")]
    assert leftovers, os.listdir(directory)  # a partial step-2 write is on disk ...

    ckpt = Checkpointer(directory)  # ... and the next run ignores and cleans it up
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    target = {"w": np.zeros(4, np.float32), "key": jax.random.key(0)}
    state, data_state, config = ckpt.restore(target=target)
    np.testing.assert_array_equal(state["w"], np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(jax.random.key_data(state["key"]),
                                  jax.random.key_data(jax.random.key(5)))
    assert data_state == b"one" and config == {"step": 1}
    assert not any(p.startswith("2.") for p in os.listdir(directory))
    assert ckpt.save(2, state, data_state=b"two", config={"step": 2})  # step 2 can be redone
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()
