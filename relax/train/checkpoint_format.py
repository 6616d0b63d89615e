"""How a checkpoint's items are stored: the encodings ``relax.train.checkpoint`` writes and reads.

The train state's typed PRNG keys as their uint32 key data (and the abstract restore targets that
match them), the data-iterator state and the config as JSON, the integrity record's format, and
the helpers that phrase a damaged or mismatched checkpoint's message.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
RECORD_FORMAT = "relax-fingerprint-v1"
"""The ``format`` of the integrity record each save writes (``relax.train.fingerprint``)."""


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def encode_state(tree: PyTree) -> PyTree:
    """Typed PRNG keys -> their uint32 key data (orbax cannot store key dtypes)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def abstract_leaf(x):
    """Restore target for one leaf: shape/dtype(/sharding) only; Python scalars stay as they are."""
    if _is_key(x):
        return jax.eval_shape(jax.random.key_data, x)
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x  # numpy arrays restore as numpy arrays, Python scalars as Python scalars


def decode_leaf(target, restored):
    """One restored leaf as ``target`` holds it: key data rewrapped as a typed PRNG key."""
    if _is_key(target):
        impl = jax.random.key_impl(
            target if isinstance(target, jax.Array) else jnp.zeros((), target.dtype)
        )
        return jax.random.wrap_key_data(restored, impl=impl)
    return restored


def encode_data(data_state: dict | bytes | None) -> dict:
    """The ``data`` item's JSON of a data-iterator state: a dict, bytes (base64) or None."""
    if data_state is None:
        return {"kind": "none", "value": None}
    if isinstance(data_state, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(data_state)).decode("ascii")}
    if isinstance(data_state, Mapping):
        return {"kind": "json", "value": to_json(data_state)}
    raise TypeError(f"data_state must be a dict, bytes or None, got {type(data_state).__name__}")


def decode_data(stored: dict) -> dict | bytes | None:
    """The data-iterator state from the ``data`` item's JSON (``encode_data`` read back)."""
    kind = stored["kind"]
    if kind == "none":
        return None
    if kind == "bytes":
        return base64.b64decode(stored["value"], validate=True)
    if kind == "json":
        return stored["value"]
    raise ValueError(f"unknown data_state kind {kind!r}")


def decode_record(stored: Any) -> dict[str, list[int]]:
    """The per-leaf fingerprints of an ``integrity`` item; ``ValueError`` if it is not one."""
    fmt = stored.get("format") if isinstance(stored, dict) else type(stored).__name__
    if fmt != RECORD_FORMAT or not all(len(v) == 2 for v in stored["leaves"].values()):
        raise ValueError(f"not a {RECORD_FORMAT} record (format {fmt!r})")
    return stored["leaves"]


def to_json(obj: Any) -> Any:
    """A JSON round-trippable copy: dataclasses -> dicts, tuples -> lists, others via ``str``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line`` of an exception, without tensorstore's spec dump, at most ``limit``."""
    lines = str(e).strip().splitlines()
    text = lines[0].split(" [tensorstore_spec=", 1)[0] if lines else ""
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def mismatches(stored_tree: PyTree, abstract: PyTree) -> list[str]:
    """How a checkpoint's metadata tree (``stored_tree``) differs from a restore target's abstract
    tree: leaves missing on either side, shapes and dtypes that differ; empty when they fit."""
    stored = ocp.tree.to_flat_dict(stored_tree)
    wanted = ocp.tree.to_flat_dict(abstract)
    problems = []
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing:
        problems.append(f"target leaves missing from the checkpoint: {paths(missing)}")
    if extra:
        problems.append(f"checkpoint leaves absent from the target: {paths(extra)}")
    for path in sorted(set(wanted) & set(stored)):
        want = wanted[path]
        if not hasattr(want, "dtype"):  # Python scalar: orbax restores its stored value
            continue
        have_shape, want_shape = tuple(getattr(stored[path], "shape", ())), tuple(want.shape)
        have_dtype = getattr(stored[path], "dtype", None)
        if isinstance(stored[path], ocp.metadata.ScalarMetadata):
            have_dtype = None  # a saved Python scalar restores into any scalar dtype
        if have_shape != want_shape or (
            have_dtype is not None and np.dtype(have_dtype) != np.dtype(want.dtype)
        ):
            problems.append(
                f"{'.'.join(path)}: checkpoint {have_dtype}{list(have_shape)} "
                f"vs target {want.dtype}{list(want_shape)}"
            )
    return problems


def paths(paths: list[tuple[str, ...]], limit: int = 8) -> str:
    """Key paths joined by dots for a message, at most ``limit`` of them (the rest counted)."""
    shown = [".".join(p) for p in paths[:limit]]
    return ", ".join(shown) + (f" (+{len(paths) - limit} more)" if len(paths) > limit else "")
