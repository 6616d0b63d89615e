"""Token sampling from logits: temperature, top-k, top-p, min-p and greedy.

The distribution is built in the order Hugging Face's logits processors apply
(temperature -> top-k -> top-p -> min-p, each on what the previous one left), and sampled by
inverse CDF with one uniform per row::

    p = softmax(filtered logits),   token = min{ i : sum_{j<=i} p_j >= u * sum_j p_j },  u ~ U(0, 1]

which draws from exactly the same distribution as Gumbel-max but costs a cumsum instead of
a ``[B, V]`` Gumbel draw (see DESIGN.md §6). The returned log-prob is that of the token
under the temperature-scaled distribution BEFORE truncation (what the trainer recomputes);
for greedy decoding (temperature 0) it is the plain ``log_softmax(logits)``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Sampling controls. ``temperature=0`` is greedy; ``None`` disables a filter."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_p is not None and not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def filter_logits(z: Float[Array, "b v"], cfg: SamplingConfig) -> Float[Array, "b v"]:
    """Temperature-scaled logits with everything outside top-k / top-p / min-p set to -inf."""
    neg = jnp.asarray(-jnp.inf, z.dtype)
    if cfg.top_k is not None and cfg.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, cfg.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, neg)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        p = jax.nn.softmax(z, axis=-1)
        sorted_p = -jnp.sort(-p, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly above each token
        # smallest probability still inside the nucleus (the token that crosses top_p is kept)
        threshold = jnp.min(jnp.where(before < cfg.top_p, sorted_p, jnp.inf), axis=-1, keepdims=True)
        z = jnp.where(p >= threshold, z, neg)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        p = jax.nn.softmax(z, axis=-1)
        z = jnp.where(p >= cfg.min_p * jnp.max(p, axis=-1, keepdims=True), z, neg)
    return z


def sample(logits: Float[Array, "b v"], u: Float[Array, " b"], cfg: SamplingConfig
           ) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """Draw one token per row with uniforms ``u`` in (0, 1]; return (token, log-prob)."""
    z = logits.astype(jnp.float32)
    if not cfg.greedy:
        z = z / cfg.temperature
    zmax = jnp.max(z, axis=-1, keepdims=True)
    if cfg.greedy:
        tok = jnp.argmax(z, axis=-1)
        e = jnp.exp(z - zmax)
    elif filters_active(cfg):
        e = jnp.exp(z - zmax)
        filtered = filter_logits(z, cfg)
        cdf = jnp.cumsum(jnp.exp(filtered - zmax), axis=-1)
        tok = _invert_cdf(cdf, u)
    else:  # the untruncated softmax: one exp serves both the draw and the log-prob
        e = jnp.exp(z - zmax)
        tok = _invert_cdf(jnp.cumsum(e, axis=-1), u)
    tok = tok.astype(jnp.int32)
    z_tok = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
    logp = z_tok - zmax[:, 0] - jnp.log(jnp.sum(e, axis=-1))
    return tok, logp


def filters_active(cfg: SamplingConfig) -> bool:
    return ((cfg.top_k is not None) or (cfg.top_p is not None and cfg.top_p < 1.0)
            or (cfg.min_p is not None and cfg.min_p > 0.0))


def _invert_cdf(cdf: Float[Array, "b v"], u: Float[Array, " b"]) -> Int[Array, " b"]:
    """First index whose (unnormalised) CDF reaches ``u * total``."""
    tok = jnp.sum(cdf < u[:, None] * cdf[:, -1:], axis=-1)
    return jnp.minimum(tok, cdf.shape[-1] - 1)


def uniforms(keys: Array, step: Array) -> Float[Array, "..."]:
    """One U(0, 1] draw per key at ``step``: ``1 - uniform(fold_in(key, step))``.

    Each completion owns a key, so its samples do not depend on the batch it is in or on
    how the batch is sharded.
    """
    flat = keys.reshape(-1)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step), ()))(flat)
    return (1.0 - u).reshape(keys.shape)
