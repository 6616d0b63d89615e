"""Sampler-vs-trainer mismatch: how far the trainer's log-probs of the sampled tokens are from the
sampler's (verl's ``rollout_corr`` off-policy metrics).

The sampler ``mu`` drew the tokens; the trainer ``pi`` scores them again. With the same weights
the two differ only by numerics (precision, a quantized sampler, kernels); with a stale batch
(asynchronous runs, partial rollouts) also by the weights' staleness. Per valid token, with
``d_t = log pi(y_t) - log mu(y_t)`` and ``r_t = exp(d_t) = pi / mu``::

    mismatch/k3                    mean_t  r_t - d_t - 1       (k3 estimate of KL(mu || pi))
    mismatch/abs_mean              mean_t  |d_t|
    mismatch/abs_max               max_t   |d_t|
    mismatch/ratio_out_frac        mean_t  [r_t < 0.8 or r_t > 1.25]
    mismatch/seq_log_ratio         mean_s  D_s,   D_s = sum_{t in s} d_t   (log prod_t r_t)
    mismatch/seq_log_ratio_abs_max max_s   |D_s|

The KL's direction: the tokens are samples of ``mu``, so ``E_mu[r - 1 - log r] = E_mu[log mu -
log pi] = KL(mu || pi)`` (``r - 1`` has mean 0 under ``mu``), as verl's ``rollout_corr/k3_kl``
(``exp(d) - d - 1`` with ``d = log pi_train - log pi_rollout``); it is
``relax.objectives.kl.kl_estimate(sampler_logp, logp, "k3")``, the sampler in the policy's place.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.masked import masked_count, masked_mean, token_inputs
from relax.metrics import Metric

RATIO_BAND = (0.8, 1.25)  # a token's ratio pi / mu outside it counts in ratio_out_frac
_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: the k3 term of an extreme token cannot overflow


def mismatch_metrics(
    logp: Float[Array, "n t"], sampler_logp: Float[Array, "n t"], mask: Bool[Array, "n t"]
) -> dict[str, Metric]:
    """The module docstring's metrics of one micro-batch, detached, in float32.

    ``logp``: the trainer's log-probs of the sampled tokens; ``sampler_logp``: the sampler's
    (the behaviour policy's); ``mask``: the valid tokens. Means over tokens are ``first_mean``
    metrics weighted by the micro-batch's valid tokens, the sequence mean by its sequences with a
    valid token (so each is the exact mean over the first optimizer step's tokens or sequences);
    the maxima are ``first_step`` (``relax.metrics``). Only the first optimizer step of an update
    measures the sampler against the trainer: later steps score with weights the update moved.
    In ``k3``, ``d_t`` is clamped at 20 inside the exponential, the term is computed as
    ``expm1(d_t) - d_t`` (no cancellation against 1 when ``d_t`` is tiny) and floored at its
    mathematical minimum 0, which float32 rounding could otherwise undercut. A micro-batch without a valid
    token gives 0 for every metric, with weight 0.

    Example: ``d = (log 2, 0)`` on two valid tokens of one sequence gives ``k3 = (2 - log 2 - 1)
    / 2 = 0.1534``, ``abs_mean = 0.3466``, ``abs_max = 0.6931``, ``ratio_out_frac = 0.5`` and
    ``seq_log_ratio = 0.6931``.
    """
    logp, sampler, m = token_inputs(
        mask, logp=jax.lax.stop_gradient(logp), sampler_logp=jax.lax.stop_gradient(sampler_logp)
    )
    d = logp - sampler  # 0 where masked
    k3 = jnp.maximum(jnp.expm1(jnp.minimum(d, _LOG_CLAMP)) - d, 0.0)  # >= 0 as e^d >= 1 + d
    low, high = (math.log(b) for b in RATIO_BAND)
    outside = ((d < low) | (d > high)).astype(jnp.float32)
    seq = jnp.sum(d, axis=-1)
    has_token = jnp.any(m, axis=-1)
    tokens = masked_count(m)
    return {
        "mismatch/k3": Metric(masked_mean(k3, m), "first_mean", tokens),
        "mismatch/abs_mean": Metric(masked_mean(jnp.abs(d), m), "first_mean", tokens),
        "mismatch/abs_max": Metric(jnp.max(jnp.abs(d)), "first_step"),
        "mismatch/ratio_out_frac": Metric(masked_mean(outside, m), "first_mean", tokens),
        "mismatch/seq_log_ratio": Metric(
            masked_mean(seq, has_token), "first_mean", masked_count(has_token)
        ),
        "mismatch/seq_log_ratio_abs_max": Metric(jnp.max(jnp.abs(seq)), "first_step"),
    }
