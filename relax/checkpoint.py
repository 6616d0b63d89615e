"""Checkpoints: train state + data-iterator state + config, through one orbax ``CheckpointManager``.

    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=3, save_every=100)
    for step in ...:
        state = train_step(state, batch)
        ckpt.save(step, state, data_state=it.get_state(), config=dataclasses.asdict(cfg))
    ckpt.close()

    # resume: the target gives the structure (``jax.eval_shape(make_state)`` or a fresh state)
    state, data_state, config = Checkpointer(run_dir / "checkpoints").restore(target=state0)

Layout: ``<directory>/<step>/{state,data,config}``. ``state`` is an orbax standard pytree
(arrays in tensorstore/OCDBT; equinox Modules, optax states and dicts are saved by their
key paths). Typed PRNG keys (``jax.random.key``) are stored as their ``key_data`` (uint32) and
rewrapped with the target's key implementation on restore. ``data`` and ``config`` are JSON.

Saves are asynchronous: ``save`` returns once the arrays are copied to host, the write
continues in a background thread (``wait()`` blocks on it). Orbax writes a step into
``<step>.orbax-checkpoint-tmp-<timestamp>`` and renames it to ``<step>`` only when every item
is written, so a process killed mid-save leaves the previous checkpoint as the latest one;
leftover tmp directories are removed when the next ``Checkpointer`` opens the directory.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any
_STATE, _DATA, _CONFIG = "state", "data", "config"


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _encode_state(tree: PyTree) -> PyTree:
    """Typed PRNG keys -> their uint32 key data (orbax cannot store key dtypes)."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def _abstract_leaf(x):
    """Restore target for one leaf: shape/dtype(/sharding) only; Python scalars stay as they are."""
    if _is_key(x):
        return jax.eval_shape(jax.random.key_data, x)
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
    return x  # numpy arrays restore as numpy arrays, Python scalars as Python scalars


def _decode_leaf(target, restored):
    if _is_key(target):
        impl = jax.random.key_impl(target if isinstance(target, jax.Array)
                                   else jnp.zeros((), target.dtype))
        return jax.random.wrap_key_data(restored, impl=impl)
    return restored


def _encode_data(data_state: dict | bytes | None) -> dict:
    if data_state is None:
        return {"kind": "none", "value": None}
    if isinstance(data_state, (bytes, bytearray)):
        return {"kind": "bytes", "value": base64.b64encode(bytes(data_state)).decode("ascii")}
    if isinstance(data_state, Mapping):
        return {"kind": "json", "value": _to_json(data_state)}
    raise TypeError(f"data_state must be a dict, bytes or None, got {type(data_state).__name__}")


def _decode_data(stored: dict) -> dict | bytes | None:
    kind = stored["kind"]
    if kind == "none":
        return None
    if kind == "bytes":
        return base64.b64decode(stored["value"])
    return stored["value"]


def _to_json(obj: Any) -> Any:
    """A JSON round-trippable copy: dataclasses -> dicts, tuples -> lists, others via ``str``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    return json.loads(json.dumps(obj, default=str))


def _describe(meta) -> tuple[tuple[int, ...], Any]:
    return tuple(getattr(meta, "shape", ())), getattr(meta, "dtype", None)


class Checkpointer:
    """Save / restore ``(train_state, data_state, config)`` every ``save_every`` steps.

    Call ``save`` / ``restore`` on every process (orbax coordinates multi-host writes; the
    JSON items are written by the primary process, so ``data_state`` should be the same on
    every process or be process 0's).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 save_every: int = 1, async_save: bool = True):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        # Orbax's default policy also saves the first step of a run whatever its number
        # (InitialSavePolicy); relax saves exactly at multiples of save_every (and when a
        # multi-host preemption notice arrives).
        policy = ocp.checkpoint_managers.AnySavePolicy([
            ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
            ocp.checkpoint_managers.PreemptionCheckpointingPolicy()])
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, save_decision_policy=policy, create=True,
            cleanup_tmp_directories=True, enable_async_checkpointing=async_save)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_names=(_STATE, _DATA, _CONFIG),
            item_handlers={_STATE: ocp.StandardCheckpointHandler(),
                           _DATA: ocp.JsonCheckpointHandler(),
                           _CONFIG: ocp.JsonCheckpointHandler()})

    def save(self, step: int, train_state: PyTree, *, data_state: dict | bytes | None = None,
             config: Mapping | Any, force: bool = False) -> bool:
        """Start saving ``step`` if ``step % save_every == 0`` (or ``force``); True if it did.

        A step at or below the latest saved one is skipped (``force`` raises instead: orbax
        never overwrites a step). ``config`` is a dict or dataclass, stored as JSON.
        """
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        args = ocp.args.Composite(**{
            _STATE: ocp.args.StandardSave(_encode_state(train_state)),
            _DATA: ocp.args.JsonSave(_encode_data(data_state)),
            _CONFIG: ocp.args.JsonSave({"config": _to_json(config)}),
        })
        return bool(self._manager.save(step, args=args, force=force))

    def latest_step(self) -> int | None:
        """The newest committed step (in-flight and interrupted saves do not count)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int | None = None, *, target: PyTree) -> tuple[PyTree, Any, Any]:
        """``(train_state, data_state, config)`` of ``step`` (default: the latest).

        ``target`` fixes the structure, shapes and dtypes: a fresh train state or its
        ``jax.eval_shape``. Arrays come back bit-identical; a checkpoint whose tree, shapes or
        dtypes differ from the target's raises ``ValueError`` naming the directory and step.
        """
        self.wait()
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step = int(step)
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        where = f"checkpoint {self.directory} step {step}"
        abstract = jax.tree.map(_abstract_leaf, target)
        self._check_compatible(step, abstract, where)
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{
                _STATE: ocp.args.StandardRestore(abstract),
                _DATA: ocp.args.JsonRestore(),
                _CONFIG: ocp.args.JsonRestore(),
            }))
        except Exception as e:  # orbax/tensorstore errors do not say which checkpoint
            raise ValueError(f"cannot restore {where}: {e}") from e
        state = jax.tree.map(_decode_leaf, target, restored[_STATE])
        return state, _decode_data(restored[_DATA]), restored[_CONFIG]["config"]

    def _check_compatible(self, step: int, abstract: PyTree, where: str) -> None:
        meta = self._manager.item_metadata(step)[_STATE]
        stored = ocp.tree.to_flat_dict(getattr(meta, "tree", meta))
        wanted = ocp.tree.to_flat_dict(abstract)
        problems = []
        missing = sorted(set(wanted) - set(stored))
        extra = sorted(set(stored) - set(wanted))
        if missing:
            problems.append(f"target leaves missing from the checkpoint: {_paths(missing)}")
        if extra:
            problems.append(f"checkpoint leaves absent from the target: {_paths(extra)}")
        for path in sorted(set(wanted) & set(stored)):
            want = wanted[path]
            if not hasattr(want, "dtype"):  # Python scalar: orbax restores its stored value
                continue
            (have_shape, have_dtype), want_shape = _describe(stored[path]), tuple(want.shape)
            if isinstance(stored[path], ocp.metadata.ScalarMetadata):
                have_dtype = None  # a saved Python scalar restores into any scalar dtype
            if have_shape != want_shape or (have_dtype is not None
                                            and np.dtype(have_dtype) != np.dtype(want.dtype)):
                problems.append(f"{'.'.join(path)}: checkpoint {have_dtype}{list(have_shape)} "
                                f"vs target {want.dtype}{list(want_shape)}")
        if problems:
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] if len(problems) > 10 else [])
            raise ValueError(f"{where} does not match the restore target:\n  " + "\n  ".join(shown))

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _paths(paths: list[tuple[str, ...]], limit: int = 8) -> str:
    shown = [".".join(p) for p in paths[:limit]]
    return ", ".join(shown) + (f" (+{len(paths) - limit} more)" if len(paths) > limit else "")
