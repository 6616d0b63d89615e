"""relax.train.checkpoint: bit-exact round trips, retention, save cadence, crash safety, clear errors,
integrity records (corruption caught on restore; the fingerprint itself: tests/test_fingerprint.py),
fallback to the newest intact checkpoint and quarantine."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import relax.models as rm
from relax.train.checkpoint import CheckpointCorruptError, Checkpointer, UnverifiedCheckpointWarning

CFG = rm.ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
)
KEY = jax.random.key(0, impl="rbg")


def _random_words(n: int = 16384) -> np.ndarray:
    """``n`` float32 of random bit patterns (non-finite ones zeroed): zstd stores them raw, so a
    flipped byte decodes without an error, to other values."""
    w = np.random.default_rng(5).integers(0, 2**32, n, dtype=np.uint32).view(np.float32)
    return np.where(np.isfinite(w), w, 0).astype(np.float32)


RANDOM_W = _random_words()
OPT = optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100), weight_decay=0.1),
)


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
    return {
        "model": model,
        "opt_state": opt_state,
        "key": jax.random.key(3),
        "step": jnp.asarray(3, jnp.int32),
        "epoch": 3,
    }


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
    assert not isinstance(err.value, CheckpointCorruptError)  # a config mismatch, not damage
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
    from relax.train.checkpoint import Checkpointer

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
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH_SCRIPT, str(directory)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 17, proc.stderr[-3000:]
    leftovers = [p for p in os.listdir(directory) if p.startswith("2.orbax-checkpoint-tmp")]
    assert leftovers, os.listdir(directory)  # a partial step-2 write is on disk ...

    ckpt = Checkpointer(directory)  # ... and the next run ignores and cleans it up
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    target = {"w": np.zeros(4, np.float32), "key": jax.random.key(0)}
    state, data_state, config = ckpt.restore(target=target)
    np.testing.assert_array_equal(state["w"], np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(
        jax.random.key_data(state["key"]), jax.random.key_data(jax.random.key(5))
    )
    assert data_state == b"one" and config == {"step": 1}
    assert not any(p.startswith("2.") for p in os.listdir(directory))
    assert ckpt.save(2, state, data_state=b"two", config={"step": 2})  # step 2 can be redone
    ckpt.wait()
    assert ckpt.latest_step() == 2
    ckpt.close()


# ----------------------------------------------------------------------------- integrity


def _saved(directory, states: dict[int, dict]) -> Checkpointer:
    ckpt = Checkpointer(directory, max_to_keep=None)
    for step, state in states.items():
        assert ckpt.save(step, state, data_state={"step": step}, config={"step": step})
    ckpt.wait()
    return ckpt


def _flip_middle_of_largest_chunk(step_dir, nbytes: int = 64) -> None:
    """XOR ``nbytes`` bytes in the middle of the largest OCDBT data file under ``<step>/state``."""
    files = [
        os.path.join(root, f)
        for root, _, names in os.walk(os.path.join(step_dir, "state"))
        for f in names
        if os.path.basename(root) == "d"
    ]
    path = max(files, key=os.path.getsize)
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    data[middle : middle + nbytes] = bytes(b ^ 0x5A for b in data[middle : middle + nbytes])
    open(path, "wb").write(bytes(data))


def test_flipped_bytes_in_raw_chunk_change_values_and_are_caught(tmp_path):
    # Random 32-bit words do not compress: zstd stores them as a raw block, so flipped bytes in
    # the middle decode without any error, to different values (the user's report).
    w = RANDOM_W
    state = {"w": jax.device_put(w), "b": jnp.arange(4, dtype=jnp.int32)}
    ckpt = _saved(tmp_path / "ckpt", {5: state})
    _flip_middle_of_largest_chunk(tmp_path / "ckpt" / "5")

    with ocp.StandardCheckpointer() as plain:
        raw = plain.restore(tmp_path / "ckpt" / "5" / "state", state)
    changed = np.asarray(raw["w"]) != w
    assert 0 < changed.sum() <= 17  # orbax alone: no error, ~16 weights silently changed

    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.restore(target=state)
    msg = str(err.value)
    assert f"checkpoint {tmp_path / 'ckpt'} step 5 is damaged: item 'state'" in msg
    assert "1 of 2 array leaves differ from the integrity record" in msg and msg.endswith(": w")
    assert (err.value.step, err.value.item) == (5, "state")
    ckpt.close()


@pytest.mark.parametrize("values", ["normal", "ramp"])
def test_flipped_bytes_in_compressed_chunk_are_caught(tmp_path, values):
    # Compressible arrays: the flip lands in a zstd-coded stream; tensorstore may fail to decode
    # it or decode garbage. Either way the restore names the damaged checkpoint.
    rng = np.random.default_rng(6)
    w = (rng.standard_normal(16384) if values == "normal" else np.arange(16384) / 7).astype(
        np.float32
    )
    state = {"w": jax.device_put(w)}
    ckpt = _saved(tmp_path, {3: state})
    _flip_middle_of_largest_chunk(tmp_path / "3")
    with pytest.raises(CheckpointCorruptError, match="step 3 is damaged: item 'state'") as err:
        ckpt.restore(target=state)
    assert len(str(err.value)) < 400
    ckpt.close()


def test_verification_compares_values(tmp_path):
    # Two valid checkpoints, integrity records swapped: every byte on disk is well-formed, only
    # the values disagree with the record, and only in the leaf whose values differ.
    a = {"same": jnp.arange(5, dtype=jnp.int32), "moved": jnp.zeros(4), "key": jax.random.key(0)}
    b = dict(a, moved=jnp.zeros(4).at[2].set(1.0))
    ckpt = _saved(tmp_path / "ckpt", {1: a, 2: b})
    ckpt.restore(1, target=a)
    ckpt.restore(2, target=a)
    for name in ("1", "2"):
        shutil.move(tmp_path / "ckpt" / name / "integrity", tmp_path / f"integrity{name}")
    shutil.move(tmp_path / "integrity1", tmp_path / "ckpt" / "2" / "integrity")
    shutil.move(tmp_path / "integrity2", tmp_path / "ckpt" / "1" / "integrity")
    with pytest.raises(
        CheckpointCorruptError,
        match=r"step 2 is damaged: item 'state': 1 of 3 array "
        r"leaves differ from the integrity record written at save time: moved$",
    ):
        ckpt.restore(2, target=a)
    ckpt.close()


@pytest.mark.parametrize("item", ["state", "data", "config", "integrity"])
def test_missing_item_names_step_and_path(tmp_path, item):
    ckpt = _saved(tmp_path / "ckpt", {4: {"w": np.ones(3, np.float32)}})
    shutil.rmtree(tmp_path / "ckpt" / "4" / item)
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.restore(target={"w": np.zeros(3, np.float32)})
    path = tmp_path / "ckpt" / "4" / item
    assert str(err.value) == (
        f"checkpoint {tmp_path / 'ckpt'} step 4 is damaged: item '{item}': {path} does not exist"
    )
    assert (err.value.directory, err.value.step, err.value.item) == (
        str(tmp_path / "ckpt"),
        4,
        item,
    )
    ckpt.close()


@pytest.mark.parametrize("damage", ["manifest.ocdbt", "_METADATA", "ocdbt.process_0"])
def test_damaged_state_metadata_gives_short_error(tmp_path, damage):
    # (random floats: chunks under 1 KiB compressed are inlined in the OCDBT b-tree)
    state = {
        "w": np.random.default_rng(7).standard_normal(4096).astype(np.float32),
        "key": jax.random.key(0),
    }
    ckpt = _saved(tmp_path, {6: state})
    target = tmp_path / "6" / "state" / damage
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.restore(target=state)
    msg = str(err.value)
    assert msg.startswith(f"checkpoint {tmp_path} step 6 is damaged: item 'state': ")
    assert len(msg) < 400 and "\n" not in msg and "tensorstore_spec" not in msg
    if damage != "_METADATA":  # (orbax reads a missing _METADATA as "no metadata", no error)
        assert err.value.__cause__ is not None  # the full error stays chained
    ckpt.close()


@pytest.mark.parametrize("item", ["data", "config", "integrity"])
def test_unparsable_json_item(tmp_path, item):
    ckpt = _saved(tmp_path, {2: {"w": np.ones(3, np.float32)}})
    (tmp_path / "2" / item / "metadata").write_text('{"kind": "json", "valu')
    with pytest.raises(
        CheckpointCorruptError,
        match=rf"step 2 is damaged: item '{item}': cannot "
        r"read it: JSONDecodeError: ",
    ) as err:
        ckpt.restore(target={"w": np.zeros(3, np.float32)})
    assert isinstance(err.value.__cause__, json.JSONDecodeError)
    ckpt.close()


def test_old_checkpoint_without_record_restores_with_warning(tmp_path):
    # exactly what relax wrote before the integrity record: three items, no ``integrity``
    state = {"w": np.arange(3, dtype=np.float32)}
    with ocp.CheckpointManager(tmp_path, item_names=("state", "data", "config")) as manager:
        manager.save(
            8,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                config=ocp.args.JsonSave({"config": {"lr": 1}}),
                data=ocp.args.JsonSave({"kind": "bytes", "value": "AAE="}),
            ),
        )
    with (
        Checkpointer(tmp_path) as ckpt,
        pytest.warns(UnverifiedCheckpointWarning, match=r"step 8 has no integrity record"),
    ):
        restored, data_state, config = ckpt.restore(target={"w": np.zeros(3, np.float32)})
    np.testing.assert_array_equal(restored["w"], state["w"])
    assert data_state == b"\x00\x01" and config == {"lr": 1}


def test_restore_latest_intact_and_quarantine(tmp_path):
    directory, aside = tmp_path / "ckpt", tmp_path / "quarantine"
    states = {s: {"w": np.full(3, s, np.float32), "k": jax.random.key(s)} for s in (1, 2, 3)}
    ckpt, target = _saved(directory, states), states[1]
    os.remove(directory / "3" / "state" / "manifest.ocdbt")
    (directory / "2" / "config" / "metadata").write_text("not json")

    with pytest.raises(CheckpointCorruptError, match="step 3 is damaged"):
        ckpt.restore(target=target)  # by default a damaged latest checkpoint raises
    with pytest.raises(ValueError, match="does not match the restore target") as err:
        ckpt.restore_latest_intact(target=dict(target, extra=np.zeros(1)))  # no fallback for this
    assert not isinstance(err.value, CheckpointCorruptError)

    state, data_state, config, step, damaged = ckpt.restore_latest_intact(target=target)
    assert step == 1 and data_state == {"step": 1} and config == {"step": 1}
    np.testing.assert_array_equal(state["w"], states[1]["w"])
    assert [s for s, _ in damaged] == [3, 2]
    assert "step 3 is damaged: item 'state'" in damaged[0][1]
    assert "step 2 is damaged: item 'config'" in damaged[1][1]

    with pytest.raises(ValueError, match="must be outside"):
        ckpt.quarantine(3, directory / "aside")
    before = sorted(os.listdir(directory / "3" / "state"))
    assert ckpt.quarantine(3, aside) == str(aside / "3")
    assert ckpt.quarantine(2, aside) == str(aside / "2")
    assert ckpt.all_steps() == [1] and ckpt.latest_step() == 1
    assert sorted(os.listdir(aside / "3" / "state")) == before  # moved whole, nothing deleted
    assert ckpt.save(2, states[2], config={"step": 2})  # the step numbers are free again
    ckpt.wait()
    assert ckpt.restore(2, target=target)[2] == {"step": 2}
    ckpt.save(3, states[3], config={}, force=True)
    ckpt.wait()
    assert ckpt.quarantine(3, aside) == str(aside / "3.1")  # never overwrites a quarantined step

    shutil.rmtree(directory / "1" / "state")
    shutil.rmtree(directory / "2" / "data")
    with pytest.raises(CheckpointCorruptError, match="no intact checkpoint") as err:
        ckpt.restore_latest_intact(target=target)
    assert "step 2 is damaged: item 'data'" in str(err.value)
    assert "step 1 is damaged: item 'state'" in str(err.value)
    ckpt.close()


def test_close_and_wait_are_idempotent_and_safe_after_errors(tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    ckpt = _saved(tmp_path / "a", {1: {"w": np.ones(2, np.float32)}})
    ckpt.close(), ckpt.close(), ckpt.wait()
    with pytest.raises(RuntimeError, match="is closed"):
        ckpt.save(2, {"w": np.ones(2, np.float32)}, config={})
    with pytest.raises(RuntimeError, match="is closed"):
        ckpt.restore(target={"w": np.ones(2, np.float32)})

    async def fail(self):
        raise OSError("disk full")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", fail)
    ckpt = Checkpointer(tmp_path / "b")
    ckpt.save(1, {"w": np.ones(2, np.float32)}, config={})  # fails in the background thread
    with pytest.raises(OSError, match="disk full"):
        ckpt.close()  # the failed save is reported once ...
    ckpt.close()  # ... and a second close (e.g. from __exit__) is a no-op
    ckpt.wait()


# ----------------------------------------------------------------------------- the policy alone


def test_restore_policy_reads_and_verifies_only_the_policy(tmp_path, state):
    # A train state's policy is restored onto other weights, bit for bit; the record is checked
    # for its leaves only: a wrong record for another field does not stop it, one for the
    # policy does.
    full = {"policy": state["model"], "opt_state": state["opt_state"], "key": state["key"]}
    other = dict(full, opt_state=_perturbed(state["opt_state"]))
    ckpt = _saved(tmp_path / "ckpt", {1: full, 2: other})
    target = _perturbed(state["model"])
    policy, config = ckpt.restore_policy(1, target=target)
    _assert_bit_identical(policy, state["model"])
    assert config == {"step": 1}
    with pytest.raises(ValueError, match=r"step 1 does not match the restore target:\n.*layers"):
        ckpt.restore_policy(1, target=rm.init(dataclasses.replace(CFG, num_layers=3), KEY))
    for name in ("1", "2"):  # records swapped: they differ only in the optimizer state's leaves
        shutil.move(tmp_path / "ckpt" / name / "integrity", tmp_path / f"integrity{name}")
    shutil.move(tmp_path / "integrity1", tmp_path / "ckpt" / "2" / "integrity")
    shutil.move(tmp_path / "integrity2", tmp_path / "ckpt" / "1" / "integrity")
    _assert_bit_identical(ckpt.restore_policy(2, target=target)[0], state["model"])
    with pytest.raises(CheckpointCorruptError, match="step 2 is damaged: item 'state'"):
        ckpt.restore(2, target=full)
    ckpt.close()
    ckpt = _saved(tmp_path / "flipped", {3: {"policy": {"w": jax.device_put(RANDOM_W)}}})
    _flip_middle_of_largest_chunk(tmp_path / "flipped" / "3")
    with pytest.raises(
        CheckpointCorruptError, match=r"step 3 is damaged: item 'state'.*: policy\.w"
    ):
        ckpt.restore_policy(target={"w": RANDOM_W})
    ckpt.close()


def test_restore_policy_puts_adapters_on_their_own_base_only(tmp_path, state):
    from relax.models.adapters.operations import add_lora, base_weights, has_lora, without_base
    from relax.models.layers.lora import LoRAConfig

    lora = LoRAConfig(rank=2)
    fresh = add_lora(state["model"], lora, jax.random.key(1))
    policy = eqx.combine(_perturbed(without_base(fresh)), base_weights(fresh))  # nonzero B
    ckpt = _saved(tmp_path, {4: {"policy": policy, "step": jnp.asarray(4)}})
    restored, _ = ckpt.restore_policy(target=add_lora(state["model"], lora, jax.random.key(2)))
    assert has_lora(restored)
    _assert_bit_identical(restored, policy)
    _assert_bit_identical(base_weights(restored), base_weights(add_lora(state["model"], lora, KEY)))
    with pytest.raises(ValueError, match="trained on other base weights"):
        ckpt.restore_policy(target=add_lora(_perturbed(state["model"]), lora, KEY))
    with pytest.raises(
        ValueError, match="checkpoint leaves absent from the target: policy.layers.lora"
    ):
        ckpt.restore_policy(target=state["model"])
    ckpt.close()


def test_a_read_only_checkpointer_writes_and_deletes_nothing(tmp_path):
    ckpt = _saved(tmp_path, {1: {"policy": {"w": jnp.arange(3.0)}}})
    ckpt.close()
    running = tmp_path / "2.orbax-checkpoint-tmp-1234"  # another process's save in flight
    running.mkdir()
    with Checkpointer(tmp_path, read_only=True) as reader:
        assert reader.all_steps() == [1] and reader.config() == {"step": 1}
        with pytest.raises(RuntimeError, match="read-only"):
            reader.save(2, {"policy": {"w": jnp.arange(3.0)}}, config={}, force=True)
    assert running.is_dir()
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        Checkpointer(tmp_path / "absent", read_only=True)
