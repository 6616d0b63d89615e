"""Checkpoints: train state + data-iterator state + config, through one orbax ``CheckpointManager``.

    ckpt = Checkpointer(run_dir / "checkpoints", max_to_keep=3, save_every=100)
    for step in ...:
        state = train_step(state, batch)
        ckpt.save(step, state, data_state=it.get_state(), config=dataclasses.asdict(cfg))
    ckpt.close()

    # resume: the target gives the structure (``jax.eval_shape(make_state)`` or a fresh state)
    state, data_state, config = Checkpointer(run_dir / "checkpoints").restore(target=state0)

Layout: ``<directory>/<step>/{state,data,config,integrity}``. ``state`` is an orbax standard
pytree (arrays in tensorstore/OCDBT; equinox Modules, optax states and dicts are saved by their
key paths). Typed PRNG keys (``jax.random.key``) are stored as their ``key_data`` (uint32) and
rewrapped with the target's key implementation on restore. The other items are JSON.

LoRA: a model with adapters (``relax.models.adapters.operations``) is stored as its adapters only; the
base weights are not written. Their fingerprint is (the pointer to the base, besides the run
config's ``model``), and ``restore`` puts the restored adapters on the target's base after
checking that it is the same base, bit for bit (a different one raises ``ValueError``).

Integrity: every save also writes ``integrity``, the state's :func:`fingerprint` (two wrapping
uint32 sums per array leaf, one jitted reduction on device), in the same orbax save: committed
atomically with the arrays. ``restore`` recomputes it from the restored arrays and raises
:class:`CheckpointCorruptError` naming the leaves that differ (orbax's zstd chunks carry no
checksum: flipped bytes in a data file can decode to other values without any error). A
checkpoint saved before the record existed restores with an :class:`UnverifiedCheckpointWarning`.

Errors: a damaged checkpoint (an item missing, unreadable orbax/tensorstore metadata or arrays,
unparsable JSON, values that differ from the record) raises ``CheckpointCorruptError`` (a
``ValueError``) naming the directory, step and item, with the underlying error's first line (the
full exception is chained). An intact checkpoint that does not fit the restore target (tree,
shapes, dtypes) raises a plain ``ValueError``: a config mismatch, not damage.
``restore_latest_intact`` falls back to the newest step that restores and verifies;
``quarantine`` moves a damaged step out of the directory, deleting nothing.

Saves are asynchronous: ``save`` returns once the arrays are copied to host, the write
continues in a background thread (``wait()`` blocks on it). Orbax writes a step into
``<step>.orbax-checkpoint-tmp-<timestamp>`` and renames it to ``<step>`` only when every item
is written, so a process killed mid-save leaves the previous checkpoint as the latest one;
leftover tmp directories are removed when the next ``Checkpointer`` opens the directory.

The items' encodings (PRNG keys, data state, config, integrity record) are in
``relax.train.checkpoint_format``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import orbax.checkpoint as ocp

from relax.models.adapters.operations import base_weights, without_base
from relax.train.checkpoint_format import (
    RECORD_FORMAT,
    PyTree,
    abstract_leaf,
    decode_data,
    decode_leaf,
    decode_record,
    encode_data,
    encode_state,
    first_line,
    mismatches,
    paths,
    to_json,
)
from relax.train.fingerprint import fingerprint

_STATE, _DATA, _CONFIG, _INTEGRITY = "state", "data", "config", "integrity"


class CheckpointCorruptError(ValueError):
    """A checkpoint on disk that cannot be read back as saved. ``directory``, ``step`` and ``item``
    (``"state"``, ``"data"``, ``"config"``, ``"integrity"``) say where; the cause is chained."""

    def __init__(
        self,
        message: str,
        *,
        directory: str | None = None,
        step: int | None = None,
        item: str | None = None,
    ):
        super().__init__(message)
        self.directory, self.step, self.item = directory, step, item


class UnverifiedCheckpointWarning(UserWarning):
    """A checkpoint without an integrity record (written before relax saved one)."""


# ----------------------------------------------------------------------------- Checkpointer


class Checkpointer:
    """Save / restore ``(train_state, data_state, config)`` every ``save_every`` steps.

    Call ``save`` / ``restore`` / ``quarantine`` on every process (orbax coordinates multi-host
    writes, the fingerprint is a collective computation; the JSON items are written by the
    primary process, so ``data_state`` should be the same on every process or be process 0's).
    ``read_only``: restore only, writing and deleting nothing in ``directory`` (not even a
    running save's tmp directory): to read a run's checkpoints while it trains.
    """

    _barriers = itertools.count()  # unique multi-host barrier names (calls are collective)

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_every: int = 1,
        async_save: bool = True,
        read_only: bool = False,
    ):
        if save_every < 1:
            raise ValueError(f"save_every must be >= 1, got {save_every}")
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None (keep all), got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        # Orbax's default policy also saves the first step of a run whatever its number
        # (InitialSavePolicy); relax saves exactly at multiples of save_every (and when a
        # multi-host preemption notice arrives).
        policy = ocp.checkpoint_managers.AnySavePolicy(
            [
                ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
                ocp.checkpoint_managers.PreemptionCheckpointingPolicy(),
            ]
        )
        self._options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_decision_policy=policy,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
        )
        if read_only:  # another process may be writing here: touch nothing, not even tmp dirs
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(f"no checkpoint directory {self.directory}")
            self._options = ocp.CheckpointManagerOptions(
                read_only=True, save_interval_steps=0, max_to_keep=None, create=False
            )
        self._closed, self._read_only = False, read_only
        self._manager = self._make_manager()

    def _make_manager(self) -> ocp.CheckpointManager:
        return ocp.CheckpointManager(
            self.directory,
            options=self._options,
            item_names=(_STATE, _DATA, _CONFIG, _INTEGRITY),
            item_handlers={
                _STATE: ocp.StandardCheckpointHandler(),
                _DATA: ocp.JsonCheckpointHandler(),
                _CONFIG: ocp.JsonCheckpointHandler(),
                _INTEGRITY: ocp.JsonCheckpointHandler(),
            },
        )

    def save(
        self,
        step: int,
        train_state: PyTree,
        *,
        data_state: dict | bytes | None = None,
        config: Mapping | Any,
        force: bool = False,
    ) -> bool:
        """Start saving ``step`` if ``step % save_every == 0`` (or ``force``); True if it did.

        A step at or below the latest saved one is skipped (``force`` raises instead: orbax
        never overwrites a step). ``config`` is a dict or dataclass, stored as JSON. The state's
        :func:`fingerprint` is saved with it (one jitted reduction, a few ints to host).
        """
        self._check_open(write=True)
        step = int(step)
        if not force and not self._manager.should_save(step):
            return False
        stored = without_base(train_state)
        record = {"format": RECORD_FORMAT, "leaves": fingerprint(stored)}
        base = base_weights(train_state)
        if jax.tree.leaves(base):
            record["lora_base"] = fingerprint(base)
        args = ocp.args.Composite(
            **{
                _STATE: ocp.args.StandardSave(encode_state(stored)),
                _DATA: ocp.args.JsonSave(encode_data(data_state)),
                _CONFIG: ocp.args.JsonSave({"config": to_json(config)}),
                _INTEGRITY: ocp.args.JsonSave(record),
            }
        )
        return bool(self._manager.save(step, args=args, force=force))

    def latest_step(self) -> int | None:
        """The newest committed step (in-flight and interrupted saves do not count)."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, step: int | None = None, *, target: PyTree) -> tuple[PyTree, Any, Any]:
        """``(train_state, data_state, config)`` of ``step`` (default: the latest), verified.

        ``target`` fixes the structure, shapes and dtypes: a fresh train state or its
        ``jax.eval_shape``. Arrays come back bit-identical, checked against the integrity record.
        Raises ``FileNotFoundError`` (no such step), ``CheckpointCorruptError`` (the step is
        damaged) or ``ValueError`` (its tree, shapes or dtypes differ from the target's), each
        naming the directory and step.
        """
        step = self._step_with(step, (_STATE, _DATA, _CONFIG))
        state = self._restore_state(step, target)
        data_state = self._read(
            step, _DATA, "cannot read it", lambda: decode_data(self._restore_item(step, _DATA))
        )
        return state, data_state, self._config(step)

    def restore_policy(self, step: int | None = None, *, target: PyTree) -> tuple[PyTree, Any]:
        """``(policy, config)``: only the train state's ``policy`` of ``step`` (default: the
        latest), verified as ``restore`` verifies the whole state; the optimizer state, the
        reference and the critic are not read (what ``relax eval`` needs of a run).

        ``target``: the policy's model (or its ``jax.eval_shape``); with LoRA adapters, on the
        base weights they were trained on. Raises as ``restore`` does.
        """
        step = self._step_with(step, (_STATE, _CONFIG))
        policy = self._restore_state(step, {"policy": target}, partial=True)["policy"]
        return policy, self._config(step)

    def config(self, step: int | None = None) -> Any:
        """The config saved with ``step`` (default: the latest), as JSON."""
        self._check_open()
        return self._config(self._resolve_step(step))

    def restore_latest_intact(
        self, *, target: PyTree
    ) -> tuple[PyTree, Any, Any, int, list[tuple[int, str]]]:
        """``(train_state, data_state, config, step, damaged)`` of the newest step that restores
        and verifies; ``damaged`` lists ``(step, error message)`` of the newer ones it skipped.

        Only :class:`CheckpointCorruptError` makes it fall back: a target mismatch still raises.
        Raises ``FileNotFoundError`` if there is no checkpoint, ``CheckpointCorruptError`` if
        every step is damaged. ``quarantine`` the damaged steps before saving again: a save at or
        below the latest step is skipped.
        """
        damaged: list[tuple[int, str]] = []
        steps = self.all_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        for step in reversed(steps):
            try:
                state, data_state, config = self.restore(step, target=target)
            except CheckpointCorruptError as e:
                damaged.append((step, str(e)))
                continue
            return state, data_state, config, step, damaged
        raise CheckpointCorruptError(
            f"no intact checkpoint in {self.directory}: every step is damaged:\n  "
            + "\n  ".join(message for _, message in damaged),
            directory=self.directory,
        )

    def quarantine(self, step: int, dest_dir: str | os.PathLike) -> str:
        """Move step ``step``'s directory into ``dest_dir`` (outside this checkpoint directory)
        and forget it; nothing is deleted. Returns the new path (``<dest_dir>/<step>``, or
        ``<step>.<n>`` if that exists). Later saves of that step number work again.
        """
        self._check_open(write=True)
        self.wait()
        step = int(step)
        source = self._path(step)
        if not os.path.isdir(source):
            raise FileNotFoundError(f"no checkpoint directory {source} to quarantine")
        dest_root = os.path.abspath(os.fspath(dest_dir))
        if os.path.commonpath([dest_root, self.directory]) == self.directory:
            raise ValueError(f"quarantine directory {dest_root} must be outside {self.directory}")
        dest, n = os.path.join(dest_root, str(step)), 0
        while os.path.exists(dest):  # never overwrite an earlier quarantined copy
            n += 1
            dest = os.path.join(dest_root, f"{step}.{n}")
        self._sync("quarantine_planned")
        if jax.process_index() == 0:
            os.makedirs(dest_root, exist_ok=True)
            shutil.move(source, dest)
        self._sync("quarantine_moved")
        self._manager.close()
        self._manager = self._make_manager()
        return dest

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; re-raises its error once."""
        if not self._closed:
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads. Safe to call again (a
        no-op) and after an error; a failed background save is raised by the first call."""
        if self._closed:
            return
        self._closed = True
        try:
            self._manager.wait_until_finished()
        finally:  # runs even if the save failed: its error is raised once, threads are released
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------- internals

    def _check_open(self, write: bool = False) -> None:
        if self._closed:
            raise RuntimeError(f"Checkpointer for {self.directory} is closed")
        if write and self._read_only:
            raise RuntimeError(f"Checkpointer for {self.directory} is read-only")

    def _path(self, step: int, *item: str) -> str:
        return os.path.join(self.directory, str(step), *item)

    def _sync(self, name: str) -> None:
        ocp.multihost.sync_global_processes(f"relax_checkpoint_{name}_{next(self._barriers)}")

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step = int(step)
        if step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}"
            )
        return step

    def _corrupt(self, step: int, item: str, detail: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(
            f"checkpoint {self.directory} step {step} is damaged: item '{item}': {detail}",
            directory=self.directory,
            step=step,
            item=item,
        )

    def _read(self, step: int, item: str, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``; any error from orbax/tensorstore/JSON -> ``CheckpointCorruptError``."""
        try:
            return fn()
        except Exception as e:
            raise self._corrupt(step, item, f"{what}: {first_line(e)}") from e

    def _restore_item(self, step: int, item: str, args=None) -> Any:
        args = ocp.args.Composite(**{item: ocp.args.JsonRestore() if args is None else args})
        return self._manager.restore(step, args=args)[item]

    def _has_record(self, step: int) -> bool:
        """Whether the step has an integrity record; a record its metadata lists but that is
        missing on disk is damage, a step saved without one (older relax) is not."""
        if os.path.isdir(self._path(step, _INTEGRITY)):
            return True
        try:
            saved_items = self._manager.metadata(step).item_handlers or {}
        except Exception:  # unreadable step metadata: the items on disk decide
            saved_items = {}
        if _INTEGRITY in saved_items:
            raise self._corrupt(step, _INTEGRITY, f"{self._path(step, _INTEGRITY)} does not exist")
        return False

    def _step_with(self, step: int | None, items: tuple[str, ...]) -> int:
        """``step`` resolved (None: the latest) after pending saves, each of its ``items`` on
        disk (else ``CheckpointCorruptError``)."""
        self._check_open()
        self.wait()
        step = self._resolve_step(step)
        for item in items:
            if not os.path.isdir(path := self._path(step, item)):
                raise self._corrupt(step, item, f"{path} does not exist")
        return step

    def _config(self, step: int) -> Any:
        return self._read(
            step, _CONFIG, "cannot read it", lambda: self._restore_item(step, _CONFIG)["config"]
        )

    def _restore_state(self, step: int, target: PyTree, partial: bool = False) -> PyTree:
        """The ``state`` item of ``step`` as ``target``, checked against the step's metadata and
        integrity record. ``partial``: ``target`` is a dict of some of the state's top-level
        fields (e.g. ``{"policy": model}``) and only they are read and verified."""
        where = f"checkpoint {self.directory} step {step}"
        verified = self._has_record(step)
        full_target, target = target, without_base(target)
        abstract = jax.tree.map(abstract_leaf, target)
        meta = self._read(
            step,
            _STATE,
            "cannot read its metadata",
            lambda: self._manager.item_metadata(step)[_STATE],
        )
        if meta is None:
            raise self._corrupt(step, _STATE, "its metadata (_METADATA) is missing or unreadable")
        stored = getattr(meta, "tree", meta)
        if partial:
            stored = {name: stored.get(name) for name in abstract}
        if problems := mismatches(stored, abstract):
            shown = problems[:10] + ([f"... and {len(problems) - 10} more"] * (len(problems) > 10))
            raise ValueError(f"{where} does not match the restore target:\n  " + "\n  ".join(shown))
        encoded = self._read(
            step, _STATE, "cannot read its arrays", lambda: self._arrays(step, abstract, partial)
        )
        if verified:
            self._check_integrity(step, encoded, full_target, set(abstract) if partial else None)
        else:
            warnings.warn(
                f"{where} has no integrity record (saved before relax wrote one): "
                "its values cannot be verified",
                UnverifiedCheckpointWarning,
                stacklevel=3,
            )
        return eqx.combine(jax.tree.map(decode_leaf, target, encoded), full_target)

    def _arrays(self, step: int, abstract: PyTree, partial: bool) -> PyTree:
        """The ``state`` item's arrays as ``abstract``; ``partial``: only its fields (orbax's
        partial restore: the others are not read)."""
        if not partial:
            return self._restore_item(step, _STATE, ocp.args.StandardRestore(abstract))
        args = ocp.args.PyTreeRestore(
            item=abstract,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=True,
        )
        with ocp.PyTreeCheckpointer() as reader:
            return reader.restore(self._path(step, _STATE), args=args)

    def _check_integrity(self, step: int, encoded, full_target, fields: set | None) -> None:
        """``encoded`` (and a LoRA target's base) against the step's integrity record; ``fields``:
        the state's top-level fields read (None: all of it), the only record entries compared."""
        record = self._read(
            step, _INTEGRITY, "cannot read it", lambda: self._restore_item(step, _INTEGRITY)
        )
        leaves = self._read(step, _INTEGRITY, "cannot read it", lambda: decode_record(record))
        base = record.get("lora_base")
        if fields is not None:
            leaves, base = (
                None if r is None else {p: v for p, v in r.items() if p.split(".")[0] in fields}
                for r in (leaves, base)
            )
        self._verify(step, encoded, leaves)
        self._check_base(step, full_target, base or None)

    def _verify(self, step: int, encoded: PyTree, record: dict[str, list[int]]) -> None:
        """Recompute the fingerprint of the restored state and compare it with ``record``."""
        got = fingerprint(encoded)
        bad = [path for path in sorted(record) if got.get(path) != list(record[path])]
        if bad:
            raise self._corrupt(
                step,
                _STATE,
                (
                    f"{len(bad)} of {len(record)} array leaves differ from the integrity record "
                    f"written at save time: {paths([(p,) for p in bad], limit=5)}"
                ),
            )

    def _check_base(self, step: int, target: PyTree, record: dict | None) -> None:
        """A LoRA checkpoint (``record``: its base weights' fingerprint) restores only onto the base
        weights its adapters were trained on."""
        base = base_weights(target)
        if record is None and not jax.tree.leaves(base):
            return
        if record is None or not jax.tree.leaves(base):
            have = "adapters" if record is not None else "full weights"
            raise ValueError(
                f"checkpoint {self.directory} step {step} holds {have}, the restore target "
                f"{'does not' if record is not None else 'does'} have LoRA adapters"
            )
        got = fingerprint(base)
        bad = sorted(p for p in record if got.get(p) != list(record[p]))
        if bad:
            raise ValueError(
                f"checkpoint {self.directory} step {step}: its adapters were trained on other base "
                f"weights than the target's ({paths([(p,) for p in bad], limit=5)} differ)"
            )
