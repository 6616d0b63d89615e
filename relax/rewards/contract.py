"""The host reward function contract, shared by the in-process scorer and the worker pool.

:class:`RewardFunction` (a callable with TRL's signature, its name and weight), :class:`RewardError`,
and the checks both ``relax.rewards.functions`` (scoring in this process) and ``relax.rewards.pool``
(scoring in worker processes) apply to a call: its timeout (``call_timeout_s``), its return value
(``to_array``: N numbers or None, finite in float32) and the messages naming a failing sample.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

ON_ERROR = ("raise", "missing")
TRUNCATE_CHARS = 200
FLOAT32_MAX = float(np.finfo(np.float32).max)

RewardFn = Callable[..., Sequence[float | None]]


class RewardError(RuntimeError):
    """A reward function raised, timed out, or broke the return contract (named in the message)."""


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A host reward function with its name (for metrics) and weight in the combined reward.

    ``name`` defaults to the function's ``__name__`` (``functools.partial`` unwrapped).
    """

    fn: RewardFn
    name: str | None = None
    weight: float = 1.0

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"reward fn must be callable, got {type(self.fn).__name__}")
        if self.name is None:
            object.__setattr__(self, "name", _fn_name(self.fn))
        if not math.isfinite(float(self.weight)):
            raise ValueError(f"weight of reward {self.name!r} must be finite, got {self.weight}")
        object.__setattr__(self, "weight", float(self.weight))


def _fn_name(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def as_reward_functions(fns: Sequence[RewardFunction | RewardFn]) -> tuple[RewardFunction, ...]:
    """Wrap plain callables as ``RewardFunction`` (weight 1) and check that names are unique."""
    if callable(fns) or isinstance(fns, RewardFunction):
        fns = [fns]
    out = tuple(f if isinstance(f, RewardFunction) else RewardFunction(f) for f in fns)
    if not out:
        raise ValueError("need at least one reward function")
    names = [f.name for f in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(
            f"duplicate reward names {dup}; name them with RewardFunction(fn, name=...)"
        )
    return out


def truncate(s: Any, limit: int = TRUNCATE_CHARS) -> str:
    """``str(s)``, cut to its first ``limit`` characters (its full length noted) for an error message."""
    s = str(s)
    return s if len(s) <= limit else f"{s[:limit]}... [{len(s)} chars]"


def call_timeout_s(
    fn: Callable, timeout_s: float | None, fields: Mapping[str, Sequence[Any]]
) -> float | None:
    """The timeout of one call of ``fn`` on the rows ``fields``: ``timeout_s``, raised to the
    worst-case time the function declares for those rows when it declares one
    (``fn.time_bound_s(fields)``: e.g. ``code_exec``, every sandboxed run at its wall-clock limit),
    so that slow but legitimate work within the function's own limits is not cut. None: no limit."""
    bound = getattr(fn, "time_bound_s", None)
    if timeout_s is None or bound is None:
        return timeout_s
    need = bound(fields)
    return timeout_s if need is None else max(timeout_s, float(need))


def to_array(
    name: str, out: Any, prompts: list, completions: list, *, offset: int = 0
) -> np.ndarray:
    """Check the return contract (N numbers or None) and convert to float32 with NaN for None.

    ``offset``: the batch index of ``prompts[0]`` (a chunk scored by ``relax.rewards.pool``), so
    that messages name samples as ``score`` does."""
    n = len(prompts)
    try:
        length = None if isinstance(out, (str, bytes, Mapping)) else len(out)
    except TypeError:
        length = None
    if length is None:
        raise RewardError(
            f"reward function {name!r} returned {type(out).__name__}; expected a list of {n} floats"
        )
    if length != n:
        raise RewardError(f"reward function {name!r} returned {length} values for {n} samples")
    vals = np.empty(n, np.float32)
    for i, v in enumerate(out):
        if v is None:
            vals[i] = np.nan
            continue
        try:
            if isinstance(v, (str, bytes)):
                raise TypeError
            f = float(v)
        except OverflowError:  # an int beyond float64
            raise _not_finite(name, v, i + offset, completions[i]) from None
        except (TypeError, ValueError):
            raise RewardError(
                f"reward function {name!r} returned non-numeric {truncate(repr(v), 60)} "
                f"({type(v).__name__}) at sample {i + offset} (completion={truncate(completions[i])!r})"
            ) from None
        with np.errstate(over="ignore"):  # checked just below, after the float32 cast
            vals[i] = f
        if np.isinf(vals[i]):
            raise _not_finite(name, v, i + offset, completions[i])
    return vals


def _not_finite(name: str, value: Any, i: int, completion: str) -> RewardError:
    """The error for a host reward value that is not finite in float32."""
    is_inf = isinstance(value, float) and math.isinf(value)
    beyond = "" if is_inf else f" (beyond float32's +-{FLOAT32_MAX:.7g})"
    return RewardError(
        f"reward function {name!r} returned {truncate(value, 60)} at sample {i}{beyond}; rewards must be "
        f"finite in float32, use None for missing (completion={truncate(completion)!r})"
    )


def raised_at(name: str, exc: str, i: int, prompt: str, completion: str) -> RewardError:
    """The error for reward function ``name`` raising ``exc`` ("Type: message") on sample ``i``."""
    return RewardError(
        f"reward function {name!r} raised {exc} at sample {i} "
        f"(prompt={truncate(prompt)!r}, completion={truncate(completion)!r})"
    )
