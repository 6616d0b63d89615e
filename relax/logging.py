"""Run logging on the host: ``metrics.jsonl``, TensorBoard scalars, a progress bar, ``summary.json``.

    with MetricsLogger(run_dir) as log, ProgressBar(total=num_steps) as bar:
        for step in range(num_steps):
            state, metrics = train_step(state, batch)
            log.log(step, metrics)          # one JSON line + one TB scalar per metric
            bar.update(1, metrics)          # postfix: reward, kl, length, tokens/s
    write_summary(run_dir, {"final_reward": ...})

Conventions:

- Every ``log`` call writes one line ``{"step": int, "time": unix seconds, **metrics}`` to
  ``run_dir/metrics.jsonl``; metric values are Python floats. NaN and +-inf are written as JSON
  ``null`` (the file is strict JSON, readable by any parser); TensorBoard gets the raw value.
- TensorBoard event files (``events.out.tfevents.*``) go to ``run_dir/tb``.
- Only the main process (``jax.process_index() == 0``) writes, unless told otherwise:
  ``enabled=None`` means ``is_main_process()``. A disabled logger touches no files.

This module is ``relax.logging``; inside the package ``import logging`` still means the
standard library (absolute imports), so nothing is shadowed unless ``relax/`` itself is put on
``sys.path`` (do not run files in ``relax/`` as scripts; use ``python -m``).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["MetricsLogger", "ProgressBar", "is_main_process", "write_summary"]

METRICS_FILE = "metrics.jsonl"
TEXT_FILE = "text.jsonl"
SUMMARY_FILE = "summary.json"
TB_DIR = "tb"
_RESERVED = ("step", "time")


def is_main_process() -> bool:
    """True on JAX process 0 (the one that logs and writes summaries)."""
    return jax.process_index() == 0


def _scalar(name: str, value: Any) -> float:
    """A metric value as a Python float (jax / numpy scalars and size-1 arrays accepted)."""
    try:
        arr = np.asarray(value)
    except Exception as e:  # e.g. a traced value logged from inside jit
        raise TypeError(f"metric {name!r}: cannot convert {type(value).__name__} to a float") from e
    if arr.size != 1 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise TypeError(f"metric {name!r} must be a real scalar, got {arr.dtype}{list(arr.shape)}")
    return float(arr.reshape(()))


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _jsonable(obj: Any) -> Any:
    """Plain JSON values: non-finite floats -> None, arrays -> (nested) lists, tuples -> lists."""
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, bool)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return _finite_or_none(obj)
    if isinstance(obj, (np.ndarray, np.generic, jax.Array)):
        arr = np.asarray(obj)
        return _jsonable(arr.item() if arr.ndim == 0 else arr.tolist())
    return str(obj)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, allow_nan=False, separators=(",", ":"))


class MetricsLogger:
    """Scalars to ``run_dir/metrics.jsonl`` and (optionally) TensorBoard ``run_dir/tb``.

    ``flush_every`` is in ``log`` calls (1 = every line reaches the disk at once; a crash then
    loses nothing). ``enabled=None`` enables the logger on the main process only.
    """

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool | None = None,
                 tensorboard: bool = True, flush_every: int = 1):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        self.run_dir = os.fspath(run_dir)
        self.enabled = is_main_process() if enabled is None else bool(enabled)
        self.flush_every = flush_every
        self._pending = 0
        self._file = self._text_file = self._writer = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        self._file = open(os.path.join(self.run_dir, METRICS_FILE), "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # imported lazily: only the logger needs it

            self._writer = SummaryWriter(os.path.join(self.run_dir, TB_DIR), flush_secs=30)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` (name -> scalar) for ``step``: one JSON line and one TB point each."""
        if not self.enabled:
            return
        bad = [k for k in metrics if k in _RESERVED]
        if bad:
            raise ValueError(f"metric names {bad} are reserved for the record's own fields")
        values = {str(k): _scalar(k, v) for k, v in metrics.items()}
        step = int(step)
        record = {"step": step, "time": time.time()}
        record.update({k: _finite_or_none(v) for k, v in values.items()})
        self._file.write(_dumps(record) + "\n")
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, value, global_step=step)
        self._pending += 1
        if self._pending >= self.flush_every:
            self.flush()

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Free text (sample completions, the config) to ``text.jsonl`` and TensorBoard's text tab."""
        if not self.enabled:
            return
        if self._text_file is None:
            self._text_file = open(os.path.join(self.run_dir, TEXT_FILE), "a", encoding="utf-8")
        self._text_file.write(_dumps({"step": int(step), "time": time.time(), "tag": tag,
                                      "text": str(text)}) + "\n")
        self._text_file.flush()
        if self._writer is not None:
            self._writer.add_text(tag, str(text), global_step=int(step))

    def flush(self) -> None:
        if not self.enabled:
            return
        self._file.flush()
        if self._writer is not None:
            self._writer.flush()
        self._pending = 0

    def close(self) -> None:
        if not self.enabled or self._file is None:
            return
        self.flush()
        self._file.close()
        self._file = None
        if self._text_file is not None:
            self._text_file.close()
            self._text_file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self.enabled = False  # later calls are no-ops, not errors on closed files

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DEFAULT_BAR_KEYS = ("reward", "kl", "length", "tokens/s")


class ProgressBar:
    """A ``tqdm`` bar whose postfix shows the chosen metrics (missing ones are left out).

    ``keys`` are metric names, ``(name, label)`` pairs pick a shorter label. Disabled on
    non-main processes by default (``enabled=None``).
    """

    def __init__(self, total: int | None = None, *, keys: Iterable[str | tuple[str, str]] = DEFAULT_BAR_KEYS,
                 enabled: bool | None = None, desc: str | None = None, initial: int = 0, **tqdm_kwargs):
        from tqdm import tqdm

        self.enabled = is_main_process() if enabled is None else bool(enabled)
        self.keys = [(k, k) if isinstance(k, str) else tuple(k) for k in keys]
        self._bar = tqdm(total=total, desc=desc, initial=initial, disable=not self.enabled,
                         dynamic_ncols=True, **tqdm_kwargs)

    def postfix(self, metrics: Mapping[str, Any]) -> dict[str, str]:
        """The postfix fields for ``metrics``: ``label -> value`` formatted to 4 significant digits."""
        shown = {}
        for name, label in self.keys:
            if name in metrics:
                shown[label] = f"{_scalar(name, metrics[name]):.4g}"
        return shown

    def update(self, n: int = 1, metrics: Mapping[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        if metrics:
            self._bar.set_postfix(self.postfix(metrics), refresh=False)
        self._bar.update(n)

    def write(self, message: str) -> None:
        """Print a line without breaking the bar."""
        if self.enabled:
            self._bar.write(message)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_summary(run_dir: str | os.PathLike, summary: Mapping[str, Any], *,
                  enabled: bool | None = None) -> str | None:
    """Write ``run_dir/summary.json`` atomically (temporary file + ``os.replace``); its path.

    Values are made strict JSON (NaN/inf -> null, arrays -> lists). Returns None when
    disabled (by default: on non-main processes).
    """
    if not (is_main_process() if enabled is None else enabled):
        return None
    run_dir = os.fspath(run_dir)
    os.makedirs(run_dir, exist_ok=True)
    text = json.dumps(_jsonable(summary), allow_nan=False, indent=2, sort_keys=True) + "\n"
    path = os.path.join(run_dir, SUMMARY_FILE)
    fd, tmp = tempfile.mkstemp(prefix=f".{SUMMARY_FILE}.", suffix=".tmp", dir=run_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
