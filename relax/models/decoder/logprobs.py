"""Token log-probabilities and entropies without a ``[B, T, V]`` float32 log-softmax.

Rows of hidden states are processed in chunks of ``chunk_size``; each chunk computes its
logits ``h @ W^T / temperature`` (float32 accumulation), their log-sum-exp and the target's
logit; the backward (a ``custom_vjp``) keeps only the per-row log-sum-exp and recomputes the chunk's
logits, writing their gradient in one pass, so peak memory is ``chunk_size * V`` floats instead of
``B * T * V``::

    log p(y | h) = z_y - logsumexp(z),          z = h W^T / tau
    H(h)        = logsumexp(z) - sum_v softmax(z)_v z_v
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax.models.config.sharding import (
    LOGICAL_AXES,
    ambient_batch_shards,
    gathered,
    rows_over_batch,
)
from relax.models.decoder.transformer import Transformer, hidden_states
from relax.models.layers.matmul import weight_grad

DEFAULT_CHUNK = 1024


def _chunked(fn, w: Array, h: Float[Array, "n d"], extra: Array, chunk_size: int) -> Array:
    """Apply ``fn(w, h_chunk, extra_chunk) -> [c, ...]`` over chunks of ``chunk_size`` rows (``fn``
    keeps O(rows) residuals).

    On a mesh whose batch axes split the ``n`` rows into ``S`` blocks (``ambient_batch_shards``),
    each chunk takes ``chunk_size`` rows of every block and each device runs ``fn`` on its own
    block's rows with its own copy of ``w`` (``w`` broadcast to ``[S, ...]`` over the batch axes):
    no device computes another's rows, and the backward sums ``w``'s gradient over a device's
    chunks locally, reducing it across devices once rather than once per chunk."""
    n, s = h.shape[0], ambient_batch_shards()
    s = 1 if n % s else s
    m = n // s  # rows per block
    c = min(chunk_size, m)
    pad = (-m) % c

    def blocks(x):  # [n, ...] -> [k, s, c, ...]: chunk j holds rows j c:(j+1) c of every block
        x = x.reshape((s, m) + x.shape[1:])
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.swapaxes(x.reshape((s, -1, c) + x.shape[2:]), 0, 1)

    if s == 1:
        chunk = lambda hc, ec: fn(w, hc[0], ec[0])[None]  # noqa: E731
    else:
        ws = rows_over_batch(jnp.broadcast_to(w, (s, *w.shape)))
        chunk = lambda hc, ec: jax.vmap(fn)(ws, *rows_over_batch((hc, ec)))  # noqa: E731
    hb, eb = blocks(h), blocks(extra)
    if hb.shape[0] == 1:  # one chunk: no loop
        out = chunk(hb[0], eb[0])[None]
    else:
        out = jax.lax.map(lambda xs: chunk(*xs), (hb, eb))
    out = jnp.swapaxes(out, 0, 1)  # [s, k, c, ...]
    return out.reshape((s, -1) + out.shape[3:])[:, :m].reshape((n,) + out.shape[3:])


def _logits(w, h, temperature):
    z = jnp.einsum("nd,vd->nv", h, w, preferred_element_type=jnp.float32)
    return z if temperature == 1.0 else z / temperature


class _Mode(NamedTuple):
    """Static choices of one head call: compute the entropy; let gradients flow through it (else
    the backward skips its term and the entropy is a stop-gradient metric)."""

    with_entropy: bool
    entropy_grad: bool


def _head_forward(temperature, mode, w, h, targets):
    z = _logits(w, h, temperature)
    m = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - m)
    l = jnp.sum(e, axis=-1)
    lse = m[:, 0] + jnp.log(l)
    zt = jnp.take_along_axis(z, targets[:, None], axis=-1)[:, 0]
    # H = lse - E_p[z] = log l - E_p[z - max]: shifted logits, no large terms that cancel
    ent = (
        jnp.log(l) - jnp.sum(e * (z - m), axis=-1) / l if mode.with_entropy else jnp.zeros_like(lse)
    )
    return (zt - lse, ent), (lse, ent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _head(temperature, mode, w, h, targets):
    return _head_forward(temperature, mode, w, h, targets)[0]


def _head_fwd(temperature, mode, w, h, targets):
    out, (lse, ent) = _head_forward(temperature, mode, w, h, targets)
    return out, (w, h, targets, lse, ent)


def _head_bwd(temperature, mode, res, g):
    """Recompute the chunk's logits and write the logit gradient in one pass::

    d logp_y / dz = onehot(y) - p,    d H / dz = -p (z - E_p[z]) = -p (log p + H),    z = h W^T / tau
    """
    w, h, targets, lse, ent = res
    g_lp, g_ent = g
    logp = _logits(w, h, temperature) - lse[:, None]
    p = jnp.exp(logp)
    with_ent = mode.with_entropy and mode.entropy_grad
    coef = g_lp[:, None] + (g_ent[:, None] * (logp + ent[:, None]) if with_ent else 0.0)
    hit = jnp.arange(logp.shape[-1])[None, :] == targets[:, None]
    dz = jnp.where(hit, g_lp[:, None], 0.0) - p * coef
    if temperature != 1.0:
        dz = dz / temperature
    # the two products run in the weights' dtype with float32 accumulation, like the forward's
    # (a bfloat16 model rounds dz to bfloat16 here, as mixed-precision training does)
    dz = dz.astype(w.dtype)
    dh = jnp.dot(dz, w, preferred_element_type=jnp.float32).astype(h.dtype)
    # dW = dz^T h (on CPU as (h^T dz)^T: relax.models.layers.matmul, ~1.5x faster for this vocabulary-sized product)
    dw = weight_grad(h.astype(w.dtype), dz, out_dtype=jnp.float32, transpose=True)
    return dw.astype(w.dtype), dh, None


_head.defvjp(_head_fwd, _head_bwd)


def _head_weight(model: Transformer) -> Float[Array, "V D"]:
    """The output head in the compute dtype, gathered over ``fsdp`` for the chunks' products (its
    gradient reduce-scattered back): each device multiplies its own rows by the whole head."""
    return gathered(model.head.astype(model.dtype), LOGICAL_AXES["lm_head"], model.config.head_dim)


def logprobs_from_hidden(
    model: Transformer,
    h: Float[Array, "*b d"],
    targets: Int[Array, "*b"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> Float[Array, "*b"]:
    """``log softmax(h W^T / temperature)[target]`` per row, in float32."""
    w = _head_weight(model)
    mode = _Mode(with_entropy=False, entropy_grad=False)
    fn = lambda w, hc, tc: _head(temperature, mode, w, hc, tc)[0]
    lead = targets.shape
    out = _chunked(fn, w, h.reshape(-1, h.shape[-1]), targets.reshape(-1), chunk_size)
    return out.reshape(lead)


def logprobs_and_entropy_from_hidden(
    model: Transformer,
    h: Float[Array, "*b d"],
    targets: Int[Array, "*b"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
    entropy_grad: bool = True,
) -> tuple[Float[Array, "*b"], Float[Array, "*b"]]:
    """Target log-prob and entropy of the full distribution, per row, one pass over the logits.
    ``entropy_grad=False``: the entropy is a metric (a stop-gradient), and the backward skips its
    term (one fewer pass over the chunk's logits)."""
    w = _head_weight(model)
    mode = _Mode(with_entropy=True, entropy_grad=entropy_grad)
    fn = lambda w, hc, tc: jnp.stack(_head(temperature, mode, w, hc, tc), axis=-1)
    lead = targets.shape
    out = _chunked(fn, w, h.reshape(-1, h.shape[-1]), targets.reshape(-1), chunk_size)
    ent = out[:, 1] if entropy_grad else jax.lax.stop_gradient(out[:, 1])
    return out[:, 0].reshape(lead), ent.reshape(lead)


def token_logprobs(
    model: Transformer,
    input_ids: Int[Array, "b t"],
    attention_mask: Array | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> Float[Array, "b t-1"]:
    """``out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])`` (float32).

    Positions whose target is padding hold the log-prob of the pad id; mask them out with
    ``attention_mask[:, 1:]``.

    Args:
        model: the ``Transformer``.
        input_ids: int ``[b t]`` token ids.
        attention_mask: ``[b t]``, 1 at real tokens (left padding works: positions come from
            it). None (default): every token is real.
        temperature: the logits are divided by it (default 1.0).
        chunk_size: rows of logits computed at a time (default 1024): the logits take
            ``chunk_size * V`` floats, not ``b * t * V``.

    Returns:
        float32 ``[b t-1]``: the log-prob of each next token given the tokens before it.
    """
    h = hidden_states(model, input_ids, attention_mask)
    return logprobs_from_hidden(
        model, h[:, :-1], input_ids[:, 1:], temperature=temperature, chunk_size=chunk_size
    )


def token_entropy(
    model: Transformer,
    input_ids: Int[Array, "b t"],
    attention_mask: Array | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK,
) -> Float[Array, "b t"]:
    """Entropy of the next-token distribution at every position (float32)."""
    h = hidden_states(model, input_ids, attention_mask)
    _, ent = logprobs_and_entropy_from_hidden(
        model,
        h,
        jnp.zeros(input_ids.shape, jnp.int32),
        temperature=temperature,
        chunk_size=chunk_size,
    )
    return ent
