"""A checksum of a pytree's arrays that does not depend on how they are sharded.

``fingerprint(tree)`` gives each array leaf two wrapping uint32 sums of its 32-bit words, one
jitted reduction on device; ``relax.train.checkpoint`` stores it with every checkpoint and compares it
with the restored arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax

PyTree = Any
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: an odd multiplier that spreads word indices


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """Row-major flat index of every element, ``uint32`` (wrapping), from per-axis iotas so a
    sharded array is never reshaped."""
    index, stride = jnp.zeros(shape, jnp.uint32), 1
    for axis in reversed(range(len(shape))):
        index = index + lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % 2**32)
        stride *= shape[axis]
    return index


def _words(x: jax.Array) -> list[tuple[jax.Array, int, int]]:
    """``x`` as uint32 words ``[(w, scale, offset)]``: element ``i``'s word has index
    ``scale * i + offset``, in the order of the element's little-endian bytes.

    bool -> 0/1; 4/8/16/32-bit dtypes -> their bit pattern, zero-extended; 64-bit -> low word
    (index ``2i``) then high word (``2i + 1``); complex -> the real part's words, then the
    imaginary part's.
    """
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return [(x.astype(jnp.uint32), 1, 0)]
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return [
            (w, 2 * scale, part * scale + offset)
            for part, half in enumerate((jnp.real(x), jnp.imag(x)))
            for w, scale, offset in _words(half)
        ]
    bits = jax.dtypes.itemsize_bits(dtype)
    if bits == 64:
        u = lax.bitcast_convert_type(x, jnp.uint64)
        return [((u & 0xFFFFFFFF).astype(jnp.uint32), 2, 0), ((u >> 32).astype(jnp.uint32), 2, 1)]
    unsigned = {4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[bits]
    return [(lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32), 1, 0)]


def _host_words(x: np.ndarray) -> np.ndarray:
    """A numpy leaf as a uint32 array with the same fingerprint (the words of ``_words``, one
    element per row), converted on host: jit would narrow 64-bit numpy arrays without x64."""
    x = np.asarray(x if x.dtype.isnative else x.astype(x.dtype.newbyteorder("=")))
    if x.dtype == np.bool_:
        return x.astype(np.uint32)
    bits = jax.dtypes.itemsize_bits(x.dtype)
    if bits == 4:
        return (x.view(np.uint8) & 0xF).astype(np.uint32)
    if bits < 32:
        return x.view({8: np.uint8, 16: np.uint16}[bits]).astype(np.uint32)
    return np.ascontiguousarray(x).view(np.uint32).reshape(x.shape + (bits // 32,))


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """``[sum_j w_j, sum_j w_j * m(j)] mod 2^32`` with ``m(j) = (j * 0x9E3779B9 mod 2^32) | 1``."""
    s0 = s1 = jnp.zeros((), jnp.uint32)
    for w, scale, offset in _words(x):
        j = _flat_index(w.shape) * jnp.uint32(scale) + jnp.uint32(offset)
        m = (j * jnp.uint32(_GOLDEN)) | jnp.uint32(1)
        s0 = s0 + jnp.sum(w, dtype=jnp.uint32)
        s1 = s1 + jnp.sum(w * m, dtype=jnp.uint32)
    return jnp.stack([s0, s1])


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> jax.Array:
    """``[len(leaves), 2]`` uint32: one jitted reduction per save (cached per state layout)."""
    return jnp.stack([_leaf_fingerprint(x) for x in leaves])


def _device_memory(x: jax.Array) -> str:
    return next(iter(x.sharding.device_set)).default_memory().kind


def fingerprint(tree: PyTree) -> dict[str, list[int]]:
    """Per array leaf ``{key path: [s0, s1]}``: ``s0 = sum_j w_j``, ``s1 = sum_j w_j * m(j)``
    (mod 2^32), ``w_j`` the leaf's uint32 words (``_words``; PRNG keys via their key data) in
    row-major order, ``m(j) = (j * 0x9E3779B9 mod 2^32) | 1`` odd: a changed word changes both
    sums, swapped or moved words change ``s1``. Integer addition mod 2^32 is associative and
    commutative, so the record is bit-identical whatever the sharding or XLA's reduction order:
    a sharded multi-device (or multi-host) array gives the same record as on one device.

    One jitted call per device set (leaves in host memory are moved to device memory one at a
    time first); ``2 * leaves`` ints come back to host. Python scalar leaves are skipped (orbax
    keeps them in its JSON metadata).
    """
    keyless = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)
    flat = ocp.tree.to_flat_dict(keyless)
    arrays = {
        ".".join(map(str, path)): x if isinstance(x, jax.Array) else _host_words(x)
        for path, x in flat.items()
        if isinstance(x, (jax.Array, np.ndarray))
    }
    groups: dict[tuple, list[str]] = {}  # one jit call per device set; numpy leaves: their own
    for path, x in arrays.items():
        devices = frozenset(d.id for d in x.sharding.device_set) if isinstance(x, jax.Array) else ()
        on_host = isinstance(x, jax.Array) and x.sharding.memory_kind not in (
            None,
            _device_memory(x),
        )
        groups.setdefault((devices, path) if on_host else (devices,), []).append(path)
    record = {}
    for key, paths in groups.items():
        leaves = [arrays[p] for p in paths]
        if len(key) == 2:  # host memory (e.g. an offloaded reference model): one leaf at a time
            leaves = [
                jax.device_put(x, x.sharding.with_memory_kind(_device_memory(x))) for x in leaves
            ]
        sums = np.asarray(jax.device_get(_fingerprints(leaves)))
        record.update({p: [int(a), int(b)] for p, (a, b) in zip(paths, sums)})
    return dict(sorted(record.items()))
