"""Host reward functions in a bounded pool of worker processes: per-call timeouts, crash isolation.

``RewardPool(reward_fns, PoolConfig(...))`` starts ``num_workers`` processes (``pebble.ProcessPool``,
"spawn" or "forkserver": never "fork", the trainer runs JAX, which is multithreaded). The reward
functions go to each worker ONCE, as ``cloudpickle`` bytes in the pool initializer (closures and
lambdas work); a task names a function by index and carries one chunk of ``chunk_size`` samples.

What is isolated: a crash or hang of reward code. A chunk that runs past its timeout (``timeout_s``,
or the longer worst-case time its function declares for the chunk's rows: ``code_exec``'s
sandboxed runs at their wall-clock limit, ``relax.rewards.contract.call_timeout_s``) has its
worker killed and replaced; a worker that dies (segfault, ``os._exit``, SIGKILL, the OOM killer)
is replaced; either way only that chunk's samples are lost (NaN with ``on_error="missing"``).
What is not: reward functions are TRUSTED code. The pool is not a sandbox: a worker runs with
the trainer's user, files, network and environment. Generated code (e.g. a model's programs)
runs only in ``relax.rewards.sandbox``. Arguments and results travel through multiprocessing's
pickle between our own processes.

Workers run JAX on the CPU only (set before the functions are unpickled) and ignore SIGINT, so
Ctrl-C reaches the trainer alone. With "spawn" the trainer's main module is imported again in
each worker: keep its entry point under ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import cloudpickle
import numpy as np
import pebble

from relax.choices import check_choice
from relax.rewards.contract import (
    ON_ERROR,
    RewardError,
    RewardFn,
    RewardFunction,
    as_reward_functions,
    call_timeout_s,
    raised_at,
    to_array,
    truncate,
)

logger = logging.getLogger(__name__)

CONTEXTS = ("spawn", "forkserver")
KIND_KEYS = {
    "error": "errors",
    "timeout": "timeouts",
    "crash": "crashes",
}  # failure kind -> info counter


@dataclasses.dataclass(frozen=True)
class PoolConfig:
    """How ``RewardPool`` runs the reward functions.

    ``num_workers`` processes; ``timeout_s`` per task (None: no limit; a late task's worker is
    killed and replaced; a function that declares a longer worst case for a chunk's rows gets
    that, ``call_timeout_s``); ``chunk_size`` samples per task (a batch of N is ceil(N / chunk_size)
    tasks per function; a failure costs only its chunk); ``max_tasks_per_worker`` tasks before a
    worker is replaced by a fresh one (None: never); ``context``: multiprocessing start method
    ("forkserver": workers fork from a server process that outlives the pool, one per trainer);
    ``start_timeout_s``: how long a (re)start waits for a first worker to come up.
    """

    num_workers: int = 4
    timeout_s: float | None = None
    chunk_size: int = 8
    max_tasks_per_worker: int | None = None
    context: str = "spawn"
    start_timeout_s: float = 120.0

    def __post_init__(self):
        _check("num_workers", self.num_workers, int)
        _check("chunk_size", self.chunk_size, int)
        _check("max_tasks_per_worker", self.max_tasks_per_worker, int, optional=True)
        _check("timeout_s", self.timeout_s, (int, float), optional=True)
        _check("start_timeout_s", self.start_timeout_s, (int, float))
        check_choice("PoolConfig.context", self.context, CONTEXTS)


def _check(field: str, value: Any, types: type | tuple[type, ...], optional: bool = False) -> None:
    """Raise ``ValueError`` naming ``PoolConfig.<field>`` unless ``value`` is a positive finite
    number of ``types`` (or None where ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, types) or not 0 < value < math.inf:
        kind = "an int >= 1" if types is int else "a finite number > 0"
        raise ValueError(
            f"PoolConfig.{field} must be {kind}{' or None' if optional else ''}, got {value!r}"
        )


# ----------------------------------------------------------------------------- worker side

_WORKER_FNS: tuple = ()  # in a worker: each reward callable, or the text of why it did not load


def _init_worker(payloads: tuple[bytes, ...]) -> None:
    """Pool initializer: ignore Ctrl-C, pin JAX to the CPU, then unpickle the reward functions."""
    global _WORKER_FNS
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["JAX_PLATFORMS"] = "cpu"  # for a jax first imported by the reward functions
    try:
        import jax
    except ImportError:
        pass
    else:
        jax.config.update("jax_platforms", "cpu")
    _WORKER_FNS = tuple(_load(p) for p in payloads)


def _load(payload: bytes) -> RewardFn | str:
    """A reward function from the bytes ``_dumps`` made of it in the trainer process, handed over
    in memory through the pool's start-up pipe: the only unpickling in relax, of our own process's
    objects, never of a file or of anything from the network or a model."""
    try:
        return cloudpickle.loads(payload)
    except Exception as exc:  # noqa: BLE001 - reported by name through _ping
        return f"{type(exc).__name__}: {exc}"


def _ping() -> tuple[int, tuple[str | None, ...]]:
    """A worker's pid and, for each function, why it did not unpickle (None: it did)."""
    return os.getpid(), tuple(f if isinstance(f, str) else None for f in _WORKER_FNS)


def _run_chunk(
    index: int, name: str, offset: int, prompts: list, completions: list, fields: dict[str, list]
) -> tuple:
    """Score one chunk: ``("ok", float32 values)``, ``("contract", message)`` for a broken return
    contract (checked here, with batch indices), or ``("error", "Type: message", traceback)``."""
    fn = _WORKER_FNS[index]
    try:
        if isinstance(fn, str):
            raise RuntimeError(f"reward function {name!r} did not unpickle in this worker: {fn}")
        out = fn(prompts, completions, **fields)
    except BaseException as exc:  # noqa: BLE001 - sys.exit() in reward code is an error too
        return "error", f"{type(exc).__name__}: {truncate(exc)}", traceback.format_exc()
    try:
        return "ok", to_array(name, out, prompts, completions, offset=offset)
    except RewardError as exc:
        return "contract", str(exc)


# ----------------------------------------------------------------------------- trainer side


@dataclasses.dataclass
class _Chunk:
    """One task: function ``index`` on samples ``[start, stop)`` with ``timeout_s``; ``done_at`` set
    on completion."""

    index: int
    start: int
    stop: int
    future: Future
    timeout_s: float | None = None
    done_at: float = math.nan


class RewardPool:
    """Worker processes hosting ``reward_fns``; ``submit`` scores a batch in chunks, in parallel.

    Waits until a first worker is up (its start-up errors raise here, naming the function that
    did not unpickle). ``close()`` (or ``with``) stops every worker; a broken pool (a worker died
    while idle) is restarted by the next ``submit``.
    """

    def __init__(self, reward_fns: Sequence[RewardFunction | RewardFn], cfg: PoolConfig):
        self.reward_fns = as_reward_functions(reward_fns)
        self.cfg = cfg
        self._payloads = tuple(_dumps(rf) for rf in self.reward_fns)
        self._lock = threading.Lock()
        self._live: set[Future] = set()
        self._extended: set[str] = set()  # functions whose longer declared worst case was logged
        self._pool: pebble.ProcessPool | None = self._start()

    def _start(self) -> pebble.ProcessPool:
        cfg = self.cfg
        max_tasks = (
            0 if cfg.max_tasks_per_worker is None else cfg.max_tasks_per_worker
        )  # pebble: 0 = never
        pool = pebble.ProcessPool(
            max_workers=cfg.num_workers,
            max_tasks=max_tasks,
            initializer=_init_worker,
            initargs=(self._payloads,),
            context=multiprocessing.get_context(cfg.context),
        )
        try:
            _, unloaded = pool.schedule(_ping).result(timeout=cfg.start_timeout_s)
        except Exception as exc:
            _stop(pool)
            raise RuntimeError(
                f"no reward pool worker came up within PoolConfig.start_timeout_s="
                f"{cfg.start_timeout_s:g} ({type(exc).__name__}: {exc}); see the workers' log "
                "above"
            ) from exc
        bad = [(rf.name, why) for rf, why in zip(self.reward_fns, unloaded) if why is not None]
        if bad:
            _stop(pool)
            raise RuntimeError(
                f"reward function {bad[0][0]!r} did not unpickle in a worker: {bad[0][1]}"
            )
        return pool

    def check(self, fns: Sequence[RewardFunction], timeout_s: float | None = None) -> None:
        """Raise ``ValueError`` unless ``fns`` are this pool's functions (same objects, same order)
        and ``timeout_s`` is None or the pool's."""
        if tuple(fns) != self.reward_fns:
            raise ValueError(
                f"the reward pool hosts {[f.name for f in self.reward_fns]} but the scorer got "
                f"{[f.name for f in fns]}: build RewardPool with the same RewardFunction objects, "
                "in the same order"
            )
        if timeout_s is not None and timeout_s != self.cfg.timeout_s:
            raise ValueError(
                f"timeout_s={timeout_s} with a reward pool: the pool's PoolConfig.timeout_s="
                f"{self.cfg.timeout_s} applies; pass timeout_s=None"
            )

    def submit(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        fields: Mapping[str, Sequence[Any]],
    ) -> PendingScores:
        """Schedule every chunk of every function and return at once (``PendingScores.result`` waits)."""
        if self._pool is None:
            raise RuntimeError("RewardPool is closed")
        if not self._pool.active:
            logger.warning("reward pool broken (a worker died while idle); restarting it")
            _stop(self._pool)
            self._pool = self._start()
        prompts, completions = list(prompts), list(completions)
        fields = {k: list(v) for k, v in fields.items()}
        n, step = len(prompts), self.cfg.chunk_size
        if len(completions) != n or any(len(v) != n for v in fields.values()):
            raise ValueError(
                f"submit needs aligned inputs: {n} prompts, {len(completions)} completions, "
                f"fields { ({k: len(v) for k, v in fields.items()}) }"
            )
        t0 = time.perf_counter()
        chunks = [
            [
                self._schedule(i, s, min(s + step, n), prompts, completions, fields)
                for s in range(0, n, step)
            ]
            for i in range(len(self.reward_fns))
        ]
        return PendingScores(self, chunks, prompts, completions, fields, t0)

    def _schedule(
        self,
        index: int,
        start: int,
        stop: int,
        prompts: list,
        completions: list,
        fields: dict[str, list],
    ) -> _Chunk:
        if self._pool is None:
            raise RuntimeError("RewardPool is closed")
        rows = {k: v[start:stop] for k, v in fields.items()}
        rf = self.reward_fns[index]
        timeout = call_timeout_s(rf.fn, self.cfg.timeout_s, rows)
        if timeout != self.cfg.timeout_s and rf.name not in self._extended:
            self._extended.add(rf.name)
            logger.info(
                "reward function %r: a chunk's timeout is %gs, not PoolConfig.timeout_s=%g: the worst case "
                "it declares for the chunk's rows (e.g. each sandboxed run at its wall-clock limit)",
                rf.name,
                timeout,
                self.cfg.timeout_s,
            )
        args = (index, rf.name, start, prompts[start:stop], completions[start:stop], rows)
        chunk = _Chunk(
            index, start, stop, self._pool.schedule(_run_chunk, args=args, timeout=timeout), timeout
        )
        with self._lock:
            self._live.add(chunk.future)
        chunk.future.add_done_callback(lambda fut: self._done(chunk, fut))
        return chunk

    def _done(self, chunk: _Chunk, fut: Future) -> None:
        chunk.done_at = time.perf_counter()
        with self._lock:
            self._live.discard(fut)

    @property
    def closed(self) -> bool:
        return self._pool is None

    def close(self) -> None:
        """Stop every worker (running chunks are killed; waiting on them raises ``RewardError``)."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        _stop(pool)
        with self._lock:
            left, self._live = tuple(self._live), set()
        for fut in left:  # pebble leaves them pending forever
            if not fut.cancel():
                try:
                    fut.set_exception(CancelledError())
                except InvalidStateError:  # finished meanwhile
                    pass

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _dumps(rf: RewardFunction) -> bytes:
    try:
        return cloudpickle.dumps(rf.fn)
    except Exception as exc:
        raise TypeError(
            f"reward function {rf.name!r} cannot be pickled for the reward pool: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def _stop(pool: pebble.ProcessPool) -> None:
    """Stop a pebble pool now and wait for its workers (terminated, then killed after 3 s)."""
    pool.stop()
    pool.join()


class PendingScores:
    """The chunks of one ``RewardPool.submit``; ``result`` waits for them."""

    def __init__(
        self,
        pool: RewardPool,
        chunks: list[list[_Chunk]],
        prompts: list,
        completions: list,
        fields: dict[str, list],
        t0: float,
    ):
        self._pool, self._chunks, self._t0 = pool, chunks, t0
        self._prompts, self._completions, self._fields = prompts, completions, fields

    def done(self) -> bool:
        """Whether every chunk has finished (does not wait)."""
        return all(c.future.done() for cs in self._chunks for c in cs)

    def result(self, on_error: str = "raise") -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Wait; return ``({name: float32 [N], NaN = missing}, info)``.

        A chunk whose function raised, timed out (worker killed) or crashed its worker: with
        ``on_error="missing"`` its samples are NaN, logged and counted in ``info`` (``errors``,
        ``timeouts``, ``crashes``: chunks; ``failed``: function names); with ``"raise"``,
        ``RewardError`` names the function, the kind of failure and the first failing sample
        (single samples of a raising chunk are re-run to find it). A broken return contract always
        raises. ``info["time_s/<name>"]``: from ``submit`` until that function's last chunk finished.
        """
        check_choice("on_error", on_error, ON_ERROR)
        per: dict[str, np.ndarray] = {}
        info: dict[str, Any] = {"errors": 0, "timeouts": 0, "crashes": 0, "failed": ()}
        for rf, chunks in zip(self._pool.reward_fns, self._chunks):
            vals = np.full(len(self._prompts), np.nan, np.float32)
            failed = []
            for chunk in chunks:
                out = self._outcome(rf, chunk)
                if out[0] == "ok":
                    vals[chunk.start : chunk.stop] = out[1]
                elif on_error == "raise":
                    raise self._error(rf, chunk, out)
                else:
                    failed.append((chunk, out))
                    info[KIND_KEYS[out[0]]] += 1
            if failed:
                info["failed"] += (rf.name,)
                _log_missing(rf.name, failed)
            per[rf.name] = vals
            info[f"time_s/{rf.name}"] = max((c.done_at - self._t0 for c in chunks), default=0.0)
        return per, info

    def _outcome(self, rf: RewardFunction, chunk: _Chunk) -> tuple:
        """``_run_chunk``'s answer, ``("timeout",)`` or ``("crash", exit code)``; raise for the rest."""
        try:
            out = chunk.future.result()
        except Exception as exc:  # CancelledError included
            if self._pool.closed:  # close() kills and aborts tasks: whatever they then report
                raise RewardError(
                    f"reward pool closed while reward function {rf.name!r} was scoring "
                    f"{_span(chunk.start, chunk.stop)}"
                ) from None
            if isinstance(
                exc, TimeoutError
            ):  # pebble's: the function's own exceptions come back as values
                return ("timeout",)
            if isinstance(
                exc, (pebble.ProcessExpired, BrokenProcessPool)
            ):  # broken: a worker died idle
                return "crash", getattr(exc, "exitcode", None)
            raise RewardError(
                f"reward pool could not run reward function {rf.name!r} on "  # e.g. unpicklable field
                f"{_span(chunk.start, chunk.stop)}: {type(exc).__name__}: {exc}"
            ) from exc
        if out[0] == "contract":
            raise RewardError(out[1])
        return out

    def _error(self, rf: RewardFunction, chunk: _Chunk, out: tuple) -> RewardError:
        """The ``on_error="raise"`` error for a failed chunk."""
        if out[0] != "error":
            return RewardError(
                f"reward function {rf.name!r} {_what(out, chunk.timeout_s)} on "
                f"{_span(chunk.start, chunk.stop)} (first: sample {chunk.start}, "
                f"completion={truncate(self._completions[chunk.start])!r})"
            )
        err = self._locate(rf, chunk, out[1])
        err.add_note(f"worker traceback of the chunk:\n{out[2]}")
        return err

    def _locate(self, rf: RewardFunction, chunk: _Chunk, exc: str) -> RewardError:
        """Re-run a raising chunk's samples one by one in the pool; name the first that raises."""
        if chunk.stop - chunk.start == 1:
            return raised_at(
                rf.name,
                exc,
                chunk.start,
                self._prompts[chunk.start],
                self._completions[chunk.start],
            )
        singles = [
            self._pool._schedule(
                chunk.index, i, i + 1, self._prompts, self._completions, self._fields
            )
            for i in range(chunk.start, chunk.stop)
        ]
        head = f"reward function {rf.name!r} raised {exc} on {_span(chunk.start, chunk.stop)}"
        for single in singles:
            out = self._outcome(rf, single)
            i = single.start
            if out[0] == "error":
                return raised_at(rf.name, out[1], i, self._prompts[i], self._completions[i])
            if out[0] != "ok":
                return RewardError(f"{head} (sample {i} alone: {out[0]}; search stopped)")
        return RewardError(f"{head} (no single sample reproduces it)")


def _span(start: int, stop: int) -> str:
    return f"sample {start}" if stop - start == 1 else f"samples {start}-{stop - 1}"


def _what(out: tuple, timeout_s: float | None) -> str:
    """What went wrong with a chunk, from its outcome (not "ok")."""
    if out[0] == "error":
        return f"raised {out[1]}"
    if out[0] == "timeout":
        return f"timed out after {timeout_s:g}s (its worker was killed and replaced)"
    return f"crashed its worker process (exit code {out[1]}; replaced)"


def _log_missing(name: str, failed: list[tuple[_Chunk, tuple]]) -> None:
    """One warning per failure kind of a function in a batch, naming the samples it cost."""
    for kind in KIND_KEYS:
        these = [(c, out) for c, out in failed if out[0] == kind]
        if these:
            spans = ", ".join(_span(c.start, c.stop) for c, _ in these[:8]) + (
                ", ..." if len(these) > 8 else ""
            )
            out = these[0][1]
            tb = f"\nworker traceback (first):\n{out[2]}" if kind == "error" else ""
            logger.warning(
                "reward function %r %s in %d chunk(s): %s; their values count as missing%s",
                name,
                _what(out, these[0][0].timeout_s),
                len(these),
                spans,
                tb,
            )
