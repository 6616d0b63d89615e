"""Reward functions: host-side Python callables (TRL's signature) and jittable token rewards.

Host rewards follow TRL's ``GRPOTrainer`` protocol::

    fn(prompts: list[str], completions: list[str], **fields) -> list[float | None]

``fields`` are the dataset row's other columns, each a list aligned with ``prompts``. With P
prompts and G completions each, pass N = P*G rows prompt-major (each prompt and its fields repeated
G times, as TRL does) and reshape the results to ``[P, G]``. ``None`` (or NaN) means "no reward for
this sample" (missing); ``score`` keeps it as NaN and ``shaping.combine`` skips it::

    total[i] = sum over f with v_f[i] not NaN of  w_f * v_f[i]     (NaN if every v_f[i] is NaN)

Rewards are float32. A value that is infinite there (inf, or a finite number beyond float32's
range such as 1e39) and a weighted sum that overflows float32 raise ``RewardError`` naming the
function(s) and the sample: an inf reward would turn the loss into NaN.

``score(..., pool=RewardPool(...))`` runs the host rewards in worker processes instead, with
per-call timeouts and crash isolation (``relax.rewards.pool``). The contract both share (the
``RewardFunction`` record, ``RewardError``, the checks of a call's return value) lives in
``relax.rewards.contract``; its names are importable from here too.

Token rewards (``TokenRewardFunction``) are pure JAX functions of the token arrays, scored by
``score_tokens`` inside ``jax.jit`` with no host round trip.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from relax.choices import check_choice
from relax.rewards.contract import (
    FLOAT32_MAX,
    ON_ERROR,
    TRUNCATE_CHARS,
    RewardError,
    RewardFn,
    RewardFunction,
    as_reward_functions,
    call_timeout_s,
    raised_at,
    to_array,
    truncate,
)
from relax.rewards.shaping import combine

if TYPE_CHECKING:
    from relax.rewards.pool import RewardPool

__all__ = [
    "FLOAT32_MAX",
    "ON_ERROR",
    "TRUNCATE_CHARS",
    "RewardError",
    "RewardFn",
    "RewardFunction",
    "ScoreHandle",
    "as_reward_functions",
    "call_timeout_s",
    "check_finite",
    "combine_checked",
    "raised_at",
    "score",
    "score_groups",
    "start_score_groups",
    "to_array",
    "truncate",
]

logger = logging.getLogger(__name__)


class _TimedOut(Exception):
    pass


def _call(fn: Callable, args: tuple, kwargs: dict, timeout_s: float | None, name: str) -> Any:
    """``fn(*args, **kwargs)``, waiting at most ``timeout_s`` seconds (None: call in this thread).

    Python cannot kill a thread: a call that runs past ``timeout_s`` is ABANDONED and its thread
    keeps running (and holding whatever it holds) until the function returns on its own. The
    worker is a daemon thread so that a hung call never blocks interpreter exit; a
    ``ThreadPoolExecutor`` is not used because its workers are joined at exit. For untrusted or
    hang-prone code (e.g. executing generated programs) enforce limits inside the function
    (subprocess with its own timeout) and keep this as the last line of defence.
    """
    if timeout_s is None:
        return fn(*args, **kwargs)
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            fut.set_exception(exc)

    threading.Thread(target=work, name=f"reward-{name}", daemon=True).start()
    done, _ = concurrent.futures.wait([fut], timeout=timeout_s)
    if not done:  # not fut.result(timeout): the function may raise TimeoutError itself
        raise _TimedOut
    return fut.result()


def _sample(i: int, shape: tuple[int, ...]) -> str:
    """``sample i`` (the prompt-major flat index, as ``score`` names it), and the prompt and
    completion for a ``[P, G]`` array."""
    if len(shape) != 2:
        return f"sample {i}"
    p, g = np.unravel_index(i, shape)
    return f"sample {i} (prompt {p}, completion {g})"


def check_finite(
    per: Mapping[str, np.ndarray],
    total: np.ndarray,
    weights: Mapping[str, float],
    *,
    kind: str = "reward function",
    completions: Sequence[str] | None = None,
) -> None:
    """Raise ``RewardError`` for an infinite float32 value in ``per`` (naming the function) or in
    the weighted sum ``total`` (naming the functions, their weights and values). NaN is missing."""
    for name, v in per.items():
        bad = np.flatnonzero(np.isinf(v))
        if bad.size:
            raise RewardError(
                f"{kind} {name!r} returned {v.flat[bad[0]]} at {_sample(bad[0], v.shape)}; rewards must be "
                "finite in float32 (NaN marks a missing reward)"
            )
    bad = np.flatnonzero(np.isinf(total))
    if bad.size:
        i = int(bad[0])
        terms = ", ".join(
            f"{name!r}: {weights[name]:g} x {v.flat[i]:g}"
            for name, v in per.items()
            if not np.isnan(v.flat[i])
        )
        where = "" if completions is None else f" (completion={truncate(completions[i])!r})"
        raise RewardError(
            f"weighted sum of the rewards overflows float32 at {_sample(i, total.shape)}: {terms}{where}"
        )


def combine_checked(
    per: Mapping[str, Any],
    weights: Mapping[str, float],
    *,
    all_missing: str = "nan",
    completions: Sequence[str] | None = None,
) -> np.ndarray:
    """``shaping.combine(per, weights)`` on the host, as a float32 numpy array, raising
    ``RewardError`` where a value of ``per`` or the weighted sum is infinite in float32.

    ``per``: ``{name: [P, G] or [N]}``; ``completions`` (flat, prompt-major), if given, go in
    the overflow message.
    """
    with np.errstate(over="ignore"):  # an overflow is reported below, by name
        per = {k: np.asarray(v, np.float32) for k, v in per.items()}
    if not per:
        raise ValueError("need at least one reward function")
    shapes = {v.shape for v in per.values()}
    if len(shapes) > 1:
        raise ValueError(f"reward values differ in shape: { {k: v.shape for k, v in per.items()} }")
    flat = {k: v.reshape(1, -1) for k, v in per.items()}  # combine wants [P, G]: one row of N
    total, _ = combine(flat, weights, all_missing=all_missing)
    total = np.asarray(total, np.float32).reshape(shapes.pop())
    check_finite(per, total, weights, completions=completions)
    return total


def _locate(
    rf: RewardFunction, exc: Exception, prompts, completions, fields, timeout_s
) -> RewardError:
    """Build the error for a raising batch call, re-running single samples to find the culprit.

    Only on the ``on_error="raise"`` path (the run is about to stop): calls ``fn`` on each sample
    alone until one raises. The index and truncated text of that sample go in the message.
    """

    def at(i: int, e: BaseException) -> RewardError:
        return raised_at(
            rf.name, f"{type(e).__name__}: {truncate(e)}", i, prompts[i], completions[i]
        )

    n = len(prompts)
    if n == 1:
        return at(0, exc)
    head = f"reward function {rf.name!r} raised {type(exc).__name__}: {truncate(exc)} on a batch of {n}"
    for i in range(n):
        row = {k: [v[i]] for k, v in fields.items()}
        try:
            _call(
                rf.fn,
                ([prompts[i]], [completions[i]]),
                row,
                call_timeout_s(rf.fn, timeout_s, row),
                rf.name,
            )
        except _TimedOut:
            return RewardError(f"{head} (sample {i} alone timed out; search stopped)")
        except Exception as sample_exc:  # noqa: BLE001
            return at(i, sample_exc)
    return RewardError(f"{head} (no single sample reproduces it)")


def score(
    reward_fns: Sequence[RewardFunction | RewardFn],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Mapping[str, Sequence[Any]] | None = None,
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
    all_missing: str = "nan",
    pool: RewardPool | None = None,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
    """Run each host reward function once on the whole batch and combine them by weight.

    Returns ``(rewards [N] float32, per_function {name: [N] float32, NaN = missing}, info)``;
    ``rewards`` is ``shaping.combine`` of the per-function values with the functions' weights.

    Failures of one call (it raises, or runs past ``timeout_s`` seconds, or past the longer
    worst-case time a function declares for its rows, ``call_timeout_s``):
      - ``on_error="raise"``: ``RewardError`` naming the function; for an exception, also the index
        and (truncated) prompt/completion of the first sample that raises on its own (single
        samples are re-run to find it); for a timeout, "timed out after Xs".
      - ``on_error="missing"``: all N values of that call are NaN, logged (``logging``) and counted.
    Contract violations (wrong length, non-numeric value, a value infinite in float32 such as
    ``inf`` or ``1e39``) always raise ``RewardError`` naming the function, the sample and its
    completion: they are bugs in the reward function, not per-sample failures. So does a weighted
    sum that overflows float32 (naming the functions, weights and values).

    ``info``: ``errors`` / ``timeouts`` (failed calls), ``failed`` (their names), ``missing``
    (NaN entries over all functions), ``all_missing`` (samples with every function NaN),
    ``time_s/<name>`` (wall time of each call).

    ``pool``: a ``relax.rewards.pool.RewardPool`` hosting ``reward_fns`` (same objects and order) runs
    them in its workers, chunk by chunk, with its timeout (``timeout_s``: None or the same); a failure
    costs only its chunk's samples, and ``info`` also counts ``crashes`` (``PendingScores.result``).
    """
    wait, _ = _start(
        reward_fns, prompts, completions, fields, on_error, timeout_s, all_missing, pool
    )
    return wait()


def _start(
    reward_fns, prompts, completions, fields, on_error, timeout_s, all_missing, pool
) -> tuple[
    Callable[[], tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]], Callable[[], bool]
]:
    """``score`` as ``(wait, done)``: with a pool, every chunk is submitted and ``wait()`` collects
    and combines; without, ``wait()`` returns what was scored here and now."""
    fns, prompts, completions, fields = _prepare(
        reward_fns, prompts, completions, fields, on_error, timeout_s, pool
    )
    if pool is None:
        out = _finish(
            fns,
            *_score_here(fns, prompts, completions, fields, on_error, timeout_s),
            completions,
            all_missing,
        )
        return (lambda: out), (lambda: True)
    pending = pool.submit(prompts, completions, fields)
    return (
        lambda: _finish(fns, *pending.result(on_error=on_error), completions, all_missing)
    ), pending.done


def _prepare(
    reward_fns,
    prompts,
    completions,
    fields,
    on_error: str,
    timeout_s: float | None,
    pool: RewardPool | None,
) -> tuple[tuple[RewardFunction, ...], list, list, dict[str, list]]:
    """Check ``score``'s arguments; return the functions and the inputs as lists."""
    check_choice("on_error", on_error, ON_ERROR)
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s}")
    fns = as_reward_functions(reward_fns)
    if pool is not None:
        pool.check(fns, timeout_s)
    prompts, completions = list(prompts), list(completions)
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    fields = {k: list(v) for k, v in (fields or {}).items()}
    for k, v in fields.items():
        if k in ("prompts", "completions"):
            raise ValueError(f"field name {k!r} clashes with the positional arguments")
        if len(v) != n:
            raise ValueError(f"field {k!r} has {len(v)} values for {n} samples")
    return fns, prompts, completions, fields


def _score_here(
    fns: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    fields: dict[str, list],
    on_error: str,
    timeout_s: float | None,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``score`` without a pool: each function called once on the whole batch, in this process."""
    n = len(prompts)
    per: dict[str, np.ndarray] = {}
    info: dict[str, Any] = {"errors": 0, "timeouts": 0, "failed": ()}
    for rf in fns:
        t0 = time.perf_counter()
        limit = call_timeout_s(rf.fn, timeout_s, fields)
        try:
            out = _call(rf.fn, (prompts, completions), dict(fields), limit, rf.name)
        except Exception as exc:  # _TimedOut included
            timed_out = isinstance(exc, _TimedOut)
            if on_error == "raise" and timed_out:
                raise RewardError(
                    f"reward function {rf.name!r} timed out after {limit:g}s on {n} samples "
                    "(its thread is abandoned)"
                ) from None
            if on_error == "raise":
                raise _locate(rf, exc, prompts, completions, fields, timeout_s) from exc
            what = f"timed out after {limit:g}s (thread abandoned)" if timed_out else "raised"
            logger.warning(
                "reward function %r %s; its %d values count as missing",
                rf.name,
                what,
                n,
                exc_info=not timed_out,
            )
            info["timeouts" if timed_out else "errors"] += 1
            info["failed"] += (rf.name,)
            per[rf.name] = np.full(n, np.nan, np.float32)
        else:
            per[rf.name] = to_array(rf.name, out, prompts, completions)
        info[f"time_s/{rf.name}"] = time.perf_counter() - t0
    return per, info


def _finish(
    fns: Sequence[RewardFunction],
    per: dict[str, np.ndarray],
    info: dict[str, Any],
    completions: list,
    all_missing: str,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any]]:
    """Combine the per-function values by weight (checked) and count the missing ones in ``info``."""
    weights = {rf.name: rf.weight for rf in fns}
    total = combine_checked(per, weights, all_missing=all_missing, completions=completions)
    stacked = np.stack(list(per.values()))
    info["missing"] = int(np.isnan(stacked).sum())
    info["all_missing"] = int(np.isnan(stacked).all(axis=0).sum())
    return total, per, info


def score_groups(
    reward_fns: Sequence[RewardFunction | RewardFn],
    decode: Callable[[np.ndarray, np.ndarray], list[str]],
    prompts: Sequence[str],
    fields: Mapping[str, Sequence[Any]],
    tokens: np.ndarray,
    mask: np.ndarray,
    **kwargs: Any,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any], list[str]]:
    """``score`` on G completions per prompt, TRL's layout: completions decoded with
    ``decode(tokens [P*G, N], mask [P*G, N])``, each prompt's text and dataset fields repeated over
    its G completions. Returns ``(rewards [P, G], per_function {name: [P, G]}, info, completions)``;
    ``kwargs`` go to ``score`` (``pool=`` included)."""
    return start_score_groups(
        reward_fns, decode, prompts, fields, tokens, mask, **{"pool": None, **kwargs}
    ).result()


@dataclasses.dataclass(frozen=True)
class ScoreHandle:
    """A ``start_score_groups`` in flight: ``result()`` waits and returns what ``score_groups``
    returns (each call waits and combines again: call it once); ``done()`` does not wait."""

    result: Callable[[], tuple[np.ndarray, dict[str, np.ndarray], dict[str, Any], list[str]]]
    done: Callable[[], bool]


def start_score_groups(
    reward_fns: Sequence[RewardFunction | RewardFn],
    decode: Callable[[np.ndarray, np.ndarray], list[str]],
    prompts: Sequence[str],
    fields: Mapping[str, Sequence[Any]],
    tokens: np.ndarray,
    mask: np.ndarray,
    *,
    pool: RewardPool | None,
    on_error: str = "raise",
    timeout_s: float | None = None,
    all_missing: str = "nan",
) -> ScoreHandle:
    """``score_groups`` without waiting for the reward functions: decodes, hands every chunk to
    ``pool`` and returns at once, so the trainer can dispatch device work meanwhile; the handle's
    ``result()`` waits and combines. Without a pool, scores here and now (a done handle). Argument
    errors and ``pool``/``reward_fns`` mismatches raise here; reward failures raise in ``result()``."""
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    p, g, n = tokens.shape
    completions = decode(tokens.reshape(p * g, n), mask.reshape(p * g, n))
    rep_prompts = [t for t in prompts for _ in range(g)]
    rep_fields = {k: [v for v in vals for _ in range(g)] for k, vals in fields.items()}
    wait, done = _start(
        reward_fns, rep_prompts, completions, rep_fields, on_error, timeout_s, all_missing, pool
    )

    def result():
        total, per, info = wait()
        per = {k: np.asarray(v, np.float32).reshape(p, g) for k, v in per.items()}
        return np.asarray(total, np.float32).reshape(p, g), per, info, completions

    return ScoreHandle(result, done)
