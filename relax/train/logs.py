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

Resuming. ``MetricsLogger(run_dir, resume_step=S)`` continues a run restored from the checkpoint
of step ``S``: on open, ``metrics.jsonl`` and ``text.jsonl`` keep exactly their records with
``step <= S`` (same order, byte-identical lines) and drop the rest, including a torn last line
left by a kill mid-write and any line that is not a JSON record with an integer ``step``. The
cut is crash-safe (temporary file in ``run_dir``, fsync, ``os.replace``): a kill during it leaves
either the old or the new file, never fewer kept lines. A negative ``S`` (``-1``: nothing trained
yet) empties both files. ``logger.dropped`` says how many lines each file lost. TensorBoard gets a
new event file that starts with ``SessionLog.START`` at step ``S + 1`` (tensorboardX's
``purge_step``); TensorBoard's Python loader then discards the earlier files' events with
``step >= S + 1`` (its Rust data server ignores that marker, and instead drops a tag's points at
steps ``>=`` any step re-logged for that tag). ``resume_step=None`` (the default) appends, as a
fresh or continued run always did; it only cuts off a torn last line, which would otherwise glue
itself to the next record. Each logger picks an event file name that is new (tensorboardX names
files by the second and hostname, and would truncate a same-named file) and sorts after the
existing ones, so TensorBoard reads the files in the order they were written (a warning says
when a clock set back or another host's files defeat that).

This module is ``relax.train.logs``; inside the package ``import logging`` still means the
standard library (absolute imports), so nothing is shadowed unless ``relax/`` itself is put on
``sys.path`` (do not run files in ``relax/`` as scripts; use ``python -m``).
"""

from __future__ import annotations

import contextlib
import json
import math
import operator
import os
import socket
import stat
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["MetricsLogger", "ProgressBar", "is_main_process", "truncate_jsonl", "write_summary"]

METRICS_FILE = "metrics.jsonl"
TEXT_FILE = "text.jsonl"
SUMMARY_FILE = "summary.json"
STARTUP_FILE, CONFIG_FILE = (
    "startup.txt",
    "config.json",
)  # the start-up report and the effective config
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


def _fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort: some platforms cannot open folders)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def _replacing(path: str):
    """A binary file to write ``path``'s new content to; on success it replaces ``path`` atomically.

    The content goes to a temporary file in the same folder, is fsynced, then ``os.replace``d over
    ``path``: a crash at any point leaves the old file or the new one, whole. On an error the
    temporary file is removed and ``path`` is untouched. A replaced file keeps its permissions.
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with contextlib.suppress(FileNotFoundError):  # mkstemp makes 0600 files
            os.chmod(tmp, stat.S_IMODE(os.stat(path).st_mode))
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _record_step(line: bytes) -> int | None:
    """The integer ``step`` of one whole JSON-lines record, or None when ``line`` is not one.

    Not records: a line without its newline (the writer was killed mid-line), unparsable JSON,
    anything but an object with an integer ``step``.
    """
    if not line.endswith(b"\n"):
        return None
    try:
        record = json.loads(line)
    except ValueError:  # UnicodeDecodeError included
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if type(step) is int else None


def truncate_jsonl(path: str | os.PathLike, resume_step: int) -> int:
    """Keep the records of the JSON-lines file ``path`` with ``step <= resume_step``; lines dropped.

    Kept lines stay byte-identical and in their order. Dropped: records of later steps, a torn last
    line, lines that are not JSON objects with an integer ``step``; with a negative
    ``resume_step``, every line. The file is rewritten crash-safely (see ``_replacing``) and only
    when something is dropped; a missing file stays missing. Reads the file twice, holding one line
    at a time.
    """
    path = os.fspath(path)

    def keep(line: bytes) -> bool:
        step = _record_step(line)
        return resume_step >= 0 and step is not None and step <= resume_step

    try:
        with open(path, "rb") as f:
            dropped = sum(not keep(line) for line in f)
    except FileNotFoundError:
        return 0
    if dropped:
        with open(path, "rb") as src, _replacing(path) as dst:
            dst.writelines(line for line in src if keep(line))
    return dropped


def _cut_torn_tail(path: str) -> int:
    """Cut a last line that lacks its newline off ``path`` (1 if cut, else 0; no file: 0).

    A process killed mid-``write`` leaves such a line; appending after it would glue the next
    record onto it. Only bytes after the last newline go, so whole lines are never at risk.
    """
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        end = f.seek(0, os.SEEK_END)
        if end == 0:
            return 0
        f.seek(end - 1)
        if f.read(1) == b"\n":
            return 0
        keep, pos = 0, end
        while pos > 0:  # scan back for the last newline, a block at a time
            start = max(0, pos - (1 << 16))
            f.seek(start)
            i = f.read(pos - start).rfind(b"\n")
            if i >= 0:
                keep = start + i + 1
                break
            pos = start
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
    return 1


def _event_files(tb_dir: str) -> list[str]:
    """The TensorBoard event file names in ``tb_dir``, sorted as TensorBoard reads them."""
    try:
        return sorted(n for n in os.listdir(tb_dir) if "tfevents" in n)
    except FileNotFoundError:
        return []


def _event_file_suffix(tb_dir: str) -> str:
    """A ``filename_suffix`` that makes tensorboardX's next event file name new and sort last.

    tensorboardX (2.6) names the file ``events.out.tfevents.<unix seconds>.<hostname><suffix>``,
    with no counter or pid, and opens it with ``"wb"``: a second writer within the same second
    would truncate the first one's file. When that name is taken, extend the largest taken name
    that starts with it: the result is unused and sorts after every taken one.
    """
    base = f"events.out.tfevents.{str(time.time())[:10]}.{socket.gethostname()}"  # as tensorboardX
    taken = [n for n in _event_files(tb_dir) if n.startswith(base)]
    return max(taken)[len(base) :] + ".1" if taken else ""


def _open_tensorboard(tb_dir: str, purge_step: int | None):
    """A tensorboardX ``SummaryWriter`` on a new event file in ``tb_dir`` that sorts after the others.

    With ``purge_step`` the file starts with ``SessionLog.START`` at that step, which makes
    TensorBoard drop the earlier files' events with ``step >= purge_step``. Warns if the new file
    did not come out new and last (a clock set back, or another host's files in the same second).
    """
    from tensorboardX import SummaryWriter  # imported lazily: only the logger needs it

    os.makedirs(tb_dir, exist_ok=True)
    before = set(_event_files(tb_dir))
    writer = SummaryWriter(
        tb_dir, flush_secs=30, purge_step=purge_step, filename_suffix=_event_file_suffix(tb_dir)
    )
    after = _event_files(tb_dir)
    if not after or after[-1] in before:
        warnings.warn(
            f"tensorboardX's new event file in {tb_dir} is not the last one by name "
            f"(last: {after[-1] if after else None}); TensorBoard may read it out of "
            "order or not purge the steps of a resumed run",
            RuntimeWarning,
            stacklevel=3,
        )
    return writer


class MetricsLogger:
    """Scalars to ``run_dir/metrics.jsonl`` and (optionally) TensorBoard ``run_dir/tb``.

    ``flush_every`` is in ``log`` calls (1 = every line reaches the disk at once; a crash then
    loses no ``metrics.jsonl`` line; TensorBoard events pass through tensorboardX's writer
    thread, so a kill may lose the last ones). ``enabled=None`` enables the logger on the main
    process only.

    ``resume_step``: None (default) appends to what is there. An int ``S`` says the run goes on
    after step ``S`` (restored from that checkpoint): ``metrics.jsonl`` and ``text.jsonl`` are cut
    back to their records with ``step <= S`` (see ``truncate_jsonl``; a negative ``S`` empties
    them), and TensorBoard is told to purge steps ``>= S + 1`` (``purge_step``). Either way a
    torn last line is removed. ``dropped`` maps each file name to the number of lines removed,
    for the run loop to report.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        enabled: bool | None = None,
        tensorboard: bool = True,
        flush_every: int = 1,
        resume_step: int | None = None,
    ):
        if flush_every < 1:
            raise ValueError(f"flush_every must be >= 1, got {flush_every}")
        if isinstance(resume_step, bool):
            raise TypeError("resume_step must be an int or None, got a bool")
        self.run_dir = os.fspath(run_dir)
        self.enabled = is_main_process() if enabled is None else bool(enabled)
        self.flush_every = flush_every
        self.resume_step = None if resume_step is None else max(operator.index(resume_step), -1)
        self.dropped = {METRICS_FILE: 0, TEXT_FILE: 0}
        self._pending = 0
        self._file = self._text_file = self._writer = None
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        for name in self.dropped:
            path = os.path.join(self.run_dir, name)
            self.dropped[name] = (
                _cut_torn_tail(path)
                if self.resume_step is None
                else truncate_jsonl(path, self.resume_step)
            )
        self._file = open(os.path.join(self.run_dir, METRICS_FILE), "a", encoding="utf-8")
        if tensorboard:
            purge_step = None if self.resume_step is None else self.resume_step + 1
            self._writer = _open_tensorboard(os.path.join(self.run_dir, TB_DIR), purge_step)

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
        self._text_file.write(
            _dumps({"step": int(step), "time": time.time(), "tag": tag, "text": str(text)}) + "\n"
        )
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

    def __init__(
        self,
        total: int | None = None,
        *,
        keys: Iterable[str | tuple[str, str]] = DEFAULT_BAR_KEYS,
        enabled: bool | None = None,
        desc: str | None = None,
        initial: int = 0,
        **tqdm_kwargs,
    ):
        from tqdm import tqdm

        self.enabled = is_main_process() if enabled is None else bool(enabled)
        self.keys = [(k, k) if isinstance(k, str) else tuple(k) for k in keys]
        self._bar = tqdm(
            total=total,
            desc=desc,
            initial=initial,
            disable=not self.enabled,
            dynamic_ncols=True,
            **tqdm_kwargs,
        )

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


def write_summary(
    run_dir: str | os.PathLike, summary: Mapping[str, Any], *, enabled: bool | None = None
) -> str | None:
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
    with _replacing(path) as f:
        f.write(text.encode("utf-8"))
    return path
