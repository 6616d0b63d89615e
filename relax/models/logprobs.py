"""Token log-probabilities and entropies without a ``[B, T, V]`` float32 log-softmax.

Rows of hidden states are processed in chunks of ``chunk_size``; each chunk computes its
logits ``h @ W^T / temperature`` (float32 accumulation), their log-sum-exp and the target's
logit, and is rematerialised in the backward pass (``jax.checkpoint``), so peak memory is
``chunk_size * V`` floats instead of ``B * T * V``::

    log p(y | h) = z_y - logsumexp(z),          z = h W^T / tau
    H(h)        = logsumexp(z) - sum_v softmax(z)_v z_v
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax.models.transformer import Transformer, hidden_states, project

DEFAULT_CHUNK = 1024


def _chunked(fn, h: Float[Array, "n d"], extra: Array, chunk_size: int) -> Array:
    """Apply ``fn(h_chunk, extra_chunk) -> [c, ...]`` over row chunks with remat."""
    n = h.shape[0]
    if n <= chunk_size:  # one chunk: no loop, no rematerialisation (it would only add memory)
        return fn(h, extra)
    c = chunk_size
    pad = (-n) % c
    h = jnp.pad(h, ((0, pad), (0, 0)))
    extra = jnp.pad(extra, ((0, pad),) + ((0, 0),) * (extra.ndim - 1))
    h = h.reshape(-1, c, h.shape[-1])
    extra = extra.reshape((-1, c) + extra.shape[1:])
    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), (h, extra))
    return out.reshape((-1,) + out.shape[2:])[:n]


def _stats(model: Transformer, temperature: float):
    def logits(h):
        z = project(model, h)
        return z if temperature == 1.0 else z / temperature

    return logits


def logprobs_from_hidden(model: Transformer, h: Float[Array, "*b d"], targets: Int[Array, "*b"],
                         *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Float[Array, "*b"]:
    """``log softmax(h W^T / temperature)[target]`` per row, in float32."""
    logits = _stats(model, temperature)

    def fn(hc, tc):
        z = logits(hc)
        zt = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]
        return zt - jax.nn.logsumexp(z, axis=-1)

    lead = targets.shape
    out = _chunked(fn, h.reshape(-1, h.shape[-1]), targets.reshape(-1), chunk_size)
    return out.reshape(lead)


def logprobs_and_entropy_from_hidden(model: Transformer, h: Float[Array, "*b d"], targets: Int[Array, "*b"],
                                     *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK
                                     ) -> tuple[Float[Array, "*b"], Float[Array, "*b"]]:
    """Target log-prob and entropy of the full distribution, per row, one pass over the logits."""
    logits = _stats(model, temperature)

    def fn(hc, tc):
        z = logits(hc)
        lse = jax.nn.logsumexp(z, axis=-1)
        zt = jnp.take_along_axis(z, tc[:, None], axis=-1)[:, 0]
        ent = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
        return jnp.stack([zt - lse, ent], axis=-1)

    lead = targets.shape
    out = _chunked(fn, h.reshape(-1, h.shape[-1]), targets.reshape(-1), chunk_size)
    return out[:, 0].reshape(lead), out[:, 1].reshape(lead)


def token_logprobs(model: Transformer, input_ids: Int[Array, "b t"], attention_mask: Array | None = None,
                   *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Float[Array, "b t-1"]:
    """``out[:, t] = log p(input_ids[:, t+1] | input_ids[:, :t+1])`` (float32).

    Positions whose target is padding hold the log-prob of the pad id; mask them out with
    ``attention_mask[:, 1:]``.
    """
    h = hidden_states(model, input_ids, attention_mask)
    return logprobs_from_hidden(model, h[:, :-1], input_ids[:, 1:], temperature=temperature,
                                chunk_size=chunk_size)


def token_entropy(model: Transformer, input_ids: Int[Array, "b t"], attention_mask: Array | None = None,
                  *, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK) -> Float[Array, "b t"]:
    """Entropy of the next-token distribution at every position (float32)."""
    h = hidden_states(model, input_ids, attention_mask)
    _, ent = logprobs_and_entropy_from_hidden(
        model, h, jnp.zeros(input_ids.shape, jnp.int32), temperature=temperature, chunk_size=chunk_size)
    return ent
