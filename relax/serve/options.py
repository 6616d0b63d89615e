"""A session request's options, checked before anything runs: Adam's, a loss's, sampling's, and
the extent of a typed batch.

    hyper = adam_hyperparams({"learning_rate": 1e-4}, max_learning_rate=1.0)
    statics, numbers = loss_options({"loss_type": "token-mean", "beta": 0.04})
    sequences, length, field = batch_extent(batch)

Numbers are checked in float32, the dtype they are used in (``relax.serve.numerics``). Adam's:
``learning_rate`` in ``(0, --limits.max-learning-rate]``, ``beta1``, ``beta2`` in ``[0, 1)`` in
float32 (``0.99999999`` is 1 there, and ``1 - beta2**t`` would be 0), ``eps`` and
``max_grad_norm`` at least the smallest normal float32 (``eps`` 0 makes ``m / (sqrt(v) + eps)``
0/0 where a gradient is 0), ``weight_decay >= 0`` with ``learning_rate * weight_decay < 1``
(AdamW's decay ``p <- p (1 - lr wd)`` would overshoot 0). A loss's numeric options are split
from its other options: they are arguments of its compiled program, not part of its key
(``relax.serve.programs``).
"""

from __future__ import annotations

import math
from typing import Any

from relax.serve.numerics import F32_TINY, INT32_MAX, SEED_END, float32, integer
from relax.serve.wire import RequestError

__all__ = ["ADAM_DEFAULTS", "adam_hyperparams", "batch_extent", "loss_options", "sampling_options"]

ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "max_grad_norm": None,
}


def adam_hyperparams(params: Any, max_learning_rate: float) -> dict[str, float]:
    """The optimizer's hyperparameters from an ``AdamParams`` map, each checked (module
    docstring) and named ``adam_params.<name>`` as sent."""
    if not isinstance(params, dict) or set(params) - set(ADAM_DEFAULTS):
        raise RequestError("adam_params", f"a map with keys among {', '.join(ADAM_DEFAULTS)}")
    p = {**ADAM_DEFAULTS, **params}
    at = "adam_params."
    lr = float32(at + "learning_rate", p["learning_rate"], low=0, high=max_learning_rate)
    if lr == 0:
        raise RequestError(at + "learning_rate", "must be > 0")
    b1 = float32(at + "beta1", p["beta1"], low=0, high=1, open_high=True)
    b2 = float32(at + "beta2", p["beta2"], low=0, high=1, open_high=True)
    eps = float32(at + "eps", p["eps"], low=F32_TINY)
    wd = float32(at + "weight_decay", p["weight_decay"], low=0)
    if lr * wd >= 1:
        raise RequestError(
            at + "weight_decay",
            f"learning_rate x weight_decay = {lr * wd:g} must be < 1 (AdamW's decay "
            "p <- p (1 - lr wd) would overshoot zero)",
        )
    clip = p["max_grad_norm"]
    clip = math.inf if clip is None else float32(at + "max_grad_norm", clip, low=F32_TINY)
    return {
        "learning_rate": lr,
        "b1": b1,
        "b2": b2,
        "eps": eps,
        "weight_decay": wd,
        "max_grad_norm": clip,
    }


def _static(field: str, v: Any) -> Any:
    """A non-numeric option as a hashable constant: a string, bool, None, or a list of them."""
    if isinstance(v, (str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_static(f"{field}[{i}]", x) for i, x in enumerate(v))
    if isinstance(v, (int, float)):  # inside a list: a constant of the program
        return _number(field, v)
    raise RequestError(field, "options are numbers, strings, booleans or lists of them")


def _number(field: str, v: int | float) -> int | float:
    if isinstance(v, int):
        return integer(field, v, -INT32_MAX, INT32_MAX + 1)
    return float32(field, v)


def loss_options(config: dict) -> tuple[tuple, dict[str, int | float]]:
    """``(statics, numbers)`` of a ``loss_fn_config``: its non-numeric options as a sorted tuple
    (a compiled program's key) and its numbers, each checked (floats in float32, ints in
    int32), its arguments."""
    statics, numbers = [], {}
    for k, v in config.items():
        field = f"loss_fn_config.{k}"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            numbers[k] = _number(field, v)
        else:
            statics.append((k, _static(field, v)))
    return tuple(sorted(statics)), numbers


def sampling_options(params: Any, vocab_size: int, max_positions: int) -> dict[str, Any]:
    """A ``SamplingParams`` map checked: ``max_tokens``, ``top_k`` (None: off), ``stop`` token ids,
    ``seed`` (None: the session's next key) and the numbers ``temperature`` and ``top_p``
    (None: off)."""
    known = {"max_tokens", "temperature", "top_k", "top_p", "stop", "seed"}
    params = {} if params is None else params
    if not isinstance(params, dict) or set(params) - known:
        raise RequestError("sampling_params", f"a map with keys among {', '.join(sorted(known))}")
    at = "sampling_params."
    top_k, top_p = params.get("top_k", -1), params.get("top_p", 1.0)
    stop = params.get("stop")
    stop = [] if stop is None else stop
    if not isinstance(stop, list):
        raise RequestError(at + "stop", "a list of token ids is needed")
    seed = params.get("seed")
    options = {
        "max_tokens": integer(at + "max_tokens", params.get("max_tokens", 16), 1, max_positions),
        "temperature": float32(at + "temperature", params.get("temperature", 1.0), low=0),
        "top_k": None if top_k is None else integer(at + "top_k", top_k, -1, INT32_MAX),
        "top_p": None
        if top_p is None
        else float32(at + "top_p", top_p, low=0, high=1, open_low=True),
        "stop": tuple(integer(f"{at}stop[{i}]", s, 0, vocab_size) for i, s in enumerate(stop)),
        "seed": None if seed is None else integer(at + "seed", seed, 0, SEED_END),
    }
    if options["top_k"] == 0:
        raise RequestError(at + "top_k", "-1 (off) or a number of tokens >= 1 is needed, got 0")
    if options["top_k"] == -1:
        options["top_k"] = None
    if options["top_p"] == 1.0:
        options["top_p"] = None  # off
    return options


def batch_extent(batch) -> tuple[int, int, str]:
    """``(sequences, positions, field)`` of a typed batch: its rows times completions per row, the
    positions each reads (prompt plus completion, or a packed row's length), and the field
    that sets them."""
    if hasattr(batch, "prompt_ids"):
        p, lp = batch.prompt_ids.shape
        g, n = batch.tokens.shape[1:]
        return p * g, lp + n, "batch.tokens"
    rows, t = batch.ids.shape
    return rows, t, "batch.ids"
