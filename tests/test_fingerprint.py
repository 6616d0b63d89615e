"""relax.train.fingerprint: the per-leaf checksum against an independent numpy computation, the same
on any sharding, computed without retracing on every checkpoint save."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.train.checkpoint import Checkpointer
from relax.train.fingerprint import fingerprint


def _np_fingerprint(words: np.ndarray) -> list[int]:
    """Independent reference: ``words`` (uint32, the leaf's words in memory order), 64-bit
    products reduced mod 2^32 one by one, the flat index from ``arange``, sums by Python ints."""
    w = np.ascontiguousarray(words).ravel().astype(np.uint64)
    j = np.arange(w.size, dtype=np.uint64)
    m = ((j * np.uint64(0x9E3779B9)) % np.uint64(2**32)) | np.uint64(1)
    return [
        int(w.sum(dtype=np.uint64)) % 2**32,
        sum(int(v) for v in (w * m) % np.uint64(2**32)) % 2**32,
    ]


def _np_words(x: np.ndarray) -> np.ndarray:
    """uint32 words of ``x``: bit patterns zero-extended (<= 16 bit), 32-bit words in memory order."""
    if x.dtype == np.bool_ or x.dtype.itemsize < 4:
        return (x if x.dtype == np.bool_ else x.view(f"u{x.dtype.itemsize}")).astype(np.uint32)
    return x.view(np.uint32)


_RNG = np.random.default_rng(0)
_REFERENCE_CASES = {
    "float32": _RNG.standard_normal((5, 7)).astype(np.float32),
    "bfloat16": _RNG.standard_normal((3, 4, 5)).astype(jnp.bfloat16),
    "float16": _RNG.standard_normal(9).astype(np.float16),
    "int32": _RNG.integers(-(2**31), 2**31, (6, 5), dtype=np.int32),
    "int8": _RNG.integers(-128, 128, 11, dtype=np.int8),
    "uint32": _RNG.integers(0, 2**32, 17, dtype=np.uint32),  # like PRNG key data
    "bool": _RNG.random((4, 3)) > 0.5,
    "scalar": np.float32(-3.5).reshape(()),
    "complex64": (_RNG.standard_normal(4) + 1j * _RNG.standard_normal(4)).astype(np.complex64),
    "float64_host": _RNG.standard_normal((2, 3)),  # numpy leaf, 64-bit words split on host
    "int64_host": _RNG.integers(-(2**62), 2**62, 5, dtype=np.int64),
}


@pytest.mark.parametrize("name", sorted(_REFERENCE_CASES))
def test_fingerprint_matches_numpy_reference(name):
    x = _REFERENCE_CASES[name]
    leaf = x if name.endswith("_host") else jax.device_put(x)
    got = fingerprint({"a": {"x": leaf}})
    assert got == {"a.x": _np_fingerprint(_np_words(x))}
    if name.endswith("_host"):  # 64-bit numpy leaves keep all their bits (jit would narrow them)
        assert got != fingerprint(
            {"a": {"x": x.astype(np.float32 if x.dtype.kind == "f" else np.int32)}}
        )
    elif x.size > 1:  # moving words changes s1, not s0: the index multiplier catches swaps
        reversed_x = np.ascontiguousarray(x.ravel()[::-1]).reshape(x.shape)
        flipped = fingerprint({"a": {"x": jax.device_put(reversed_x)}})
        assert flipped["a.x"][0] == got["a.x"][0] and flipped["a.x"][1] != got["a.x"][1]


_SHARDED_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from relax.train.fingerprint import fingerprint
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rng = np.random.default_rng(1)
    tree = {"w": rng.standard_normal((8, 6)).astype(np.float32),
            "h": rng.standard_normal((16, 4)).astype(jnp.bfloat16),
            "i": rng.integers(0, 9, (4, 8), dtype=np.int32), "b": rng.random(8) > 0.5,
            "d": rng.standard_normal((4, 6))}  # float64: JAX_ENABLE_X64 is set
    specs = {"w": P("a", "b"), "h": P("a"), "i": P(None, ("a", "b")), "b": P("b"), "d": P("a", "b")}
    one = fingerprint({k: jax.device_put(v, jax.devices()[0]) for k, v in tree.items()})
    sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in tree.items()}
    assert len(sharded["w"].sharding.device_set) == 8 and sharded["d"].dtype == np.float64
    print(json.dumps({"one": one, "sharded": fingerprint(sharded), "numpy": fingerprint(tree)}))
""")


def test_fingerprint_is_independent_of_sharding():
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.getcwd(),
        JAX_ENABLE_X64="1",
        XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _SHARDED_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["one"] == out["sharded"] == out["numpy"] and set(out["one"]) == {
        "w",
        "h",
        "i",
        "b",
        "d",
    }


def test_save_does_not_retrace_the_fingerprint(tmp_path):
    from relax.train.fingerprint import _fingerprints

    state = {"w": jnp.ones((3, 2)), "k": jax.random.key(1)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, config={})
        size = _fingerprints._cache_size()
        ckpt.save(2, {"w": -state["w"], "k": jax.random.key(2)}, config={})
        assert _fingerprints._cache_size() == size


def test_keys_numpy_and_host_memory_leaves_are_fingerprinted_and_verified(tmp_path):
    # an offloaded reference model lives in pinned host memory: jit cannot mix it with device
    # arrays, so its leaves are moved to device memory one at a time for the fingerprint
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    state = {
        "ref": jax.device_put(w, host),
        "policy": jax.device_put(w + 1),
        "np": w - 1,
        "key": jax.random.key(7),
        "n": 3,
    }
    assert state["ref"].sharding.memory_kind == "pinned_host"
    assert fingerprint(state) == {  # (Python scalars are not fingerprinted)
        "key": _np_fingerprint(np.asarray(jax.random.key_data(state["key"]))),
        "np": _np_fingerprint(_np_words(w - 1)),
        "policy": _np_fingerprint(_np_words(w + 1)),
        "ref": _np_fingerprint(_np_words(w)),
    }
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, config={})
        restored, _, _ = ckpt.restore(target=state)
    assert restored["ref"].sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(restored["ref"], w)
