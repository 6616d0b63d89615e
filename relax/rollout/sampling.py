"""Token sampling from logits: temperature, top-k, top-p, min-p and greedy.

The distribution is built in the order Hugging Face's logits processors apply
(temperature -> top-k -> top-p -> min-p, each on what the previous one left), and sampled by
inverse CDF with one uniform per row::

    p = softmax(filtered logits),   token = min{ i : sum_{j<=i} p_j >= u * sum_j p_j },  u ~ U(0, 1]

which draws from exactly the same distribution as Gumbel-max but costs a cumsum instead of
a ``[B, V]`` Gumbel draw (see benchmarks/RESULTS.md). The returned log-prob is that of the token
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
        threshold = jnp.min(
            jnp.where(before < cfg.top_p, sorted_p, jnp.inf), axis=-1, keepdims=True
        )
        z = jnp.where(p >= threshold, z, neg)
    if cfg.min_p is not None and cfg.min_p > 0.0:
        p = jax.nn.softmax(z, axis=-1)
        z = jnp.where(p >= cfg.min_p * jnp.max(p, axis=-1, keepdims=True), z, neg)
    return z


def sample_tokens(
    logits: Float[Array, "b v"], u: Float[Array, " b"], cfg: SamplingConfig
) -> tuple[Int[Array, " b"], Float[Array, " b"]]:
    """Draw one token per row with uniforms ``u`` in (0, 1]; return (token, log-prob)."""
    z = logits.astype(jnp.float32)
    if not cfg.greedy:
        z = z / cfg.temperature
    zmax = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - zmax)  # one exp serves the draw (when untruncated) and the log-prob
    if cfg.greedy:
        tok = jnp.argmax(z, axis=-1)
    elif filters_active(cfg):
        tok = _invert_cdf(
            jnp.where(jnp.isneginf(filter_logits(z, cfg)), 0.0, e), u
        )  # kept: e, cut: 0
    else:
        tok = _invert_cdf(e, u)
    tok = tok.astype(jnp.int32)
    z_tok = jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0]
    logp = z_tok - zmax[:, 0] - jnp.log(jnp.sum(e, axis=-1))
    return tok, logp


def filters_active(cfg: SamplingConfig) -> bool:
    return (
        (cfg.top_k is not None)
        or (cfg.top_p is not None and cfg.top_p < 1.0)
        or (cfg.min_p is not None and cfg.min_p > 0.0)
    )


def _invert_cdf(
    weights: Float[Array, "b v"], u: Float[Array, " b"], block: int = 64
) -> Int[Array, " b"]:
    """First index whose cumulative (unnormalised) weight reaches ``u * total``.

    Two levels - pick the block of ``block`` tokens by the cumulative block sums, then the token
    inside it - so the work is two short cumsums instead of one over the whole vocabulary
    (a ``[64, 4096]`` cumsum costs ~10x more on XLA:CPU). Padded weights are 0 and never drawn.
    """
    b, v = weights.shape
    nb = -(-v // block)
    w = jnp.pad(weights, ((0, 0), (0, nb * block - v))).reshape(b, nb, block)
    block_cdf = jnp.cumsum(jnp.sum(w, axis=-1), axis=-1)  # [b, nb]
    target = u * block_cdf[:, -1]
    blk = jnp.minimum(jnp.sum(block_cdf < target[:, None], axis=-1), nb - 1)
    before = jnp.where(
        blk > 0, jnp.take_along_axis(block_cdf, jnp.maximum(blk - 1, 0)[:, None], 1)[:, 0], 0.0
    )
    inner = jnp.take_along_axis(w, blk[:, None, None], axis=1)[:, 0]  # [b, block]
    cdf = before[:, None] + jnp.cumsum(inner, axis=-1)
    # rounding can leave the last partial sum a hair below target: never step past the block's
    # last token of positive weight (a filtered or padded token must never be drawn)
    last = block - 1 - jnp.argmax((inner > 0)[:, ::-1], axis=-1)
    idx = jnp.minimum(jnp.sum(cdf < target[:, None], axis=-1), last)
    return blk * block + idx


def uniforms(keys: Array, step: Array) -> Float[Array, "..."]:
    """One U(0, 1] draw per key at ``step``: ``1 - uniform(fold_in(key, step))``.

    Each completion owns a key, so its samples do not depend on the batch it is in or on
    how the batch is sharded.
    """
    flat = keys.reshape(-1)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step), ()))(flat)
    return (1.0 - u).reshape(keys.shape)


def uniform_table(keys: Array, steps: int) -> Float[Array, "... steps"]:
    """``uniforms(keys, t)`` for every ``t < steps`` at once, ``[..., steps]`` (bit-identical): the
    decode loop then indexes a column instead of running the key derivation at every step."""
    return jax.vmap(lambda t: uniforms(keys, t), out_axes=-1)(jnp.arange(steps))
