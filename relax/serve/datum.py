"""Tinker's datum losses: per-token losses *summed* over a list of ``Datum`` s.

A datum is ``tokens [T]`` (what the model reads) and ``loss_fn_inputs`` of length ``T``:
``target_tokens`` (``y_t``, predicted at position ``t``) and what the loss reads. With
``logp_t = log pi(y_t | tokens_{<=t})``, the losses, summed over every position of every datum
(so that splitting a batch over several ``forward_backward`` calls sums to the same gradient):

=====================  ======================================  ===============================
``cross_entropy``      ``-sum_t w_t logp_t``                   ``weights``
policy losses          ``sum_t loss_t(logp, q, A)``: the       ``logprobs`` (``q_t``, the
(``importance_        registry's per-token loss               sampler's), ``advantages``
sampling``, ``ppo``,   (``relax.objectives.registry``), e.g.   (``A_t``)
``cispo``, ...)        ``-(p/q) A`` for importance_sampling
=====================  ======================================  ===============================

Tinker's PPO options ``clip_low_threshold`` / ``clip_high_threshold`` (ratio bounds, 0.8 / 1.2)
are taken as ``epsilon_low = 1 - low`` and ``epsilon_high = high - 1``; every other option is the
registry loss's own field. The datums are right-padded into ``[B, T]`` rows with ``B`` and ``T``
rounded up (``bucket``: ``B`` to a power of two, ``T`` to a quarter-octave step, at most 25% padding),
so nearby sizes share one compiled program.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax import metrics as M
from relax.models.decoder.logprobs import logprobs_from_hidden
from relax.models.forward.packed import packed_hidden
from relax.objectives.registry import POLICY_LOSSES, policy_loss
from relax.serve.wire import RequestError

__all__ = [
    "DATUM_LOSSES",
    "DatumRows",
    "datum_lengths",
    "datum_loss",
    "datum_rows",
    "pack_rows",
    "row_shape",
    "tinker_options",
]

DATUM_LOSSES = ("cross_entropy", *POLICY_LOSSES)


class DatumRows(eqx.Module):
    """Datums right-padded into rows; ``valid`` is 0 on padding (every input there is 0)."""

    ids: Int[Array, "b t"]
    targets: Int[Array, "b t"]
    valid: Int[Array, "b t"]
    weights: Float[Array, "b t"]
    logprobs: Float[Array, "b t"]
    advantages: Float[Array, "b t"]


def bucket(n: int, least: int = 1, steps_per_octave: int = 1) -> int:
    """``max(n, least)`` rounded up to the next of ``steps_per_octave`` evenly spaced sizes per
    power of two (1: the power of two at or above it; 4: 64, 80, 96, 112, 128, 160, ...)."""
    n = max(n, least)
    if n <= steps_per_octave:
        return n
    step = max(1, (1 << ((n - 1).bit_length() - 1)) // steps_per_octave)
    return -(-n // step) * step


def _needs(loss: str) -> tuple[str, ...]:
    return ("weights",) if loss == "cross_entropy" else ("logprobs", "advantages")


def datum_lengths(data: Any, loss: str, vocab_size: int, max_length: int) -> list[int]:
    """Each datum's length, every datum checked first (``data[i].<field>`` named in a
    ``RequestError``): tokens in the vocabulary, at most ``max_length`` (the model's positions),
    the loss's inputs of the same length and finite in float32 (where they are used)."""
    if not isinstance(data, list) or not data:
        raise RequestError("data", "a non-empty list of datums is needed")
    needs = ("target_tokens", *_needs(loss))
    lengths = []
    for i, d in enumerate(data):
        at = f"data[{i}]"
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("tokens"), np.ndarray)
            or d["tokens"].ndim != 1
        ):
            raise RequestError(f"{at}.model_input", "the tokens must be a 1-D array")
        n = len(d["tokens"])
        if not 1 <= n <= max_length:
            raise RequestError(
                f"{at}.model_input",
                f"length {n} must be in [1, {max_length}] (the model's positions)",
            )
        inputs = d.get("inputs")
        if not isinstance(inputs, dict):
            raise RequestError(f"{at}.loss_fn_inputs", "a map of arrays is needed")
        for key in needs:
            _check_input(f"{at}.loss_fn_inputs.{key}", inputs.get(key), n, loss)
        for key, a in (
            ("model_input", d["tokens"]),
            ("loss_fn_inputs.target_tokens", inputs["target_tokens"]),
        ):
            if a.dtype.kind not in "iu" or (a.size and (a.min() < 0 or a.max() >= vocab_size)):
                raise RequestError(
                    f"{at}.{key}", f"token ids must be integers in [0, {vocab_size})"
                )
        lengths.append(n)
    return lengths


def _check_input(at: str, a: Any, n: int, loss: str) -> None:
    if not isinstance(a, np.ndarray):
        raise RequestError(at, f"loss {loss!r} needs it (an array of length {n})")
    if a.shape != (n,):
        raise RequestError(at, f"shape {list(a.shape)} must be [{n}], the model input's length")
    if a.dtype.kind == "f":
        with np.errstate(over="ignore"):
            finite = np.isfinite(a.astype(np.float32))
        if not finite.all():
            raise RequestError(at, "non-finite value(s) in float32 (|x| <= 3.4e38)")


def row_shape(lengths: list[int], rows_multiple: int = 1) -> tuple[int, int]:
    """``[B, T]`` of the rows of datums of ``lengths`` (module docstring: bucketed), ``B`` a
    multiple of ``rows_multiple`` (a mesh's batch shards)."""
    b, t = bucket(len(lengths)), bucket(max(lengths), 16, steps_per_octave=4)
    return -(-b // rows_multiple) * rows_multiple, t


def datum_rows(
    data: Any, loss: str, vocab_size: int, max_length: int, *, rows_multiple: int = 1
) -> tuple[DatumRows, list[int]]:
    """The rows of ``data`` (the wire form of ``Datum.to_wire``) for ``loss``, and each datum's
    length (``datum_lengths`` checks them; ``pack_rows`` pads them into ``row_shape``)."""
    lengths = datum_lengths(data, loss, vocab_size, max_length)
    return pack_rows(data, lengths, loss, row_shape(lengths, rows_multiple)), lengths


def pack_rows(data: list, lengths: list[int], loss: str, shape: tuple[int, int]) -> DatumRows:
    """Checked datums right-padded into ``shape``: empty rows are ``valid`` 0 and add nothing to
    a loss's sums."""
    rows = {k: np.zeros(shape, np.int32) for k in ("ids", "targets", "valid")}
    rows.update({k: np.zeros(shape, np.float32) for k in ("weights", "logprobs", "advantages")})
    for i, (d, n) in enumerate(zip(data, lengths)):
        rows["ids"][i, :n], rows["targets"][i, :n], rows["valid"][i, :n] = (
            d["tokens"],
            d["inputs"]["target_tokens"],
            1,
        )
        for key in _needs(loss):
            rows[key][i, :n] = d["inputs"][key]
    return DatumRows(**rows)


def tinker_options(config: dict) -> dict:
    """A datum loss's options with Tinker's clip thresholds as the registry's ``epsilon_*``."""
    config = dict(config)
    for name, to, sign in (
        ("clip_low_threshold", "epsilon_low", -1.0),
        ("clip_high_threshold", "epsilon_high", 1.0),
    ):
        if name in config:
            v = config.pop(name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise RequestError(f"loss_fn_config.{name}", f"a number is needed, got {v!r}")
            config[to] = sign * (v - 1.0)
    return config


def datum_loss(loss: str, config: dict):
    """``fn(policy, rows) -> (loss, (logp [B, T], metrics))`` of the named datum loss (module
    docstring); a bad name or option is a ``RequestError`` (``loss_fn`` / ``loss_fn_config``)."""
    if loss not in DATUM_LOSSES:
        raise RequestError(
            "loss_fn",
            f"unknown loss {loss!r} for datums; valid: {', '.join(DATUM_LOSSES)} "
            "(a typed batch takes relax's named objectives)",
        )
    if loss == "cross_entropy":
        if config:
            raise RequestError(
                "loss_fn_config", f"cross_entropy takes no options, got {sorted(config)}"
            )
        per_token_loss = None
    else:
        try:
            per_token_loss = policy_loss(loss, **tinker_options(config))
        except (TypeError, ValueError) as e:
            raise RequestError("loss_fn_config", str(e)) from None

    def fn(policy, rows: DatumRows):
        logp = logprobs_from_hidden(
            policy, packed_hidden(policy, rows.ids, rows.valid), rows.targets
        )
        m = rows.valid > 0
        logp = jnp.where(m, logp, 0.0)
        if per_token_loss is None:
            total, metrics = -jnp.sum(rows.weights * logp), {}
        else:
            per_token, metrics = per_token_loss(logp, rows.logprobs, rows.advantages, m)
            total = jnp.sum(jnp.where(m, per_token, 0.0))
        return total, (logp, {**M.values(metrics), "loss:sum": total})

    return fn
