"""KL estimators, entropy, and the KL / entropy terms that enter rewards or losses.

Per-token KL estimators follow J. Schulman, "Approximating KL divergence" (2020) with samples
from the policy: ``log_ratio = logp - ref_logp``, and ``ref/policy = exp(ref_logp - logp)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.choices import check_choice
from relax.masked import assert_same_shape, at_least_float32

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl")
KL_ALIASES = {"kl": "k1", "mse": "k2"}  # verl's other names for k1 and k2


def kl_estimate(
    logp: Float[Array, "*s"],
    ref_logp: Float[Array, "*s"],
    kind: str,
    *,
    mask: Bool[Array, "*s"] | None = None,
) -> Float[Array, "*s"]:
    """Per-token estimate of ``KL(policy || ref)`` from the sampled tokens' log-probs (verl's ``kl_penalty``).

    With ``d = logp - ref_logp``:

    - ``k1`` (alias ``kl``): ``d`` (unbiased, high variance, can be negative)
    - ``k2`` (alias ``mse``): ``0.5 d^2``
    - ``k3``: ``exp(-d) + d - 1`` (unbiased, >= 0; TRL GRPO's estimator), unclamped; computed as
      ``max(expm1(-d) + d, 0)``, which keeps its ``d^2 / 2`` near ``d = 0`` where float32
      ``exp(-d) - 1`` would round it away (or below 0)
    - ``low_var_kl``: ``k3`` with ``-d`` clamped to ``[-20, 20]`` and the result to ``[-10, 10]``
      (verl's; verl also treats ``k3`` as this clamped form, here ``k3`` is left unclamped)
    - ``abs``: ``|d|``

    Example: ``k3`` with ``ref_logp - logp = -0.5`` is ``exp(-0.5) + 0.5 - 1 = 0.1065307``.
    With ``mask`` the inputs are zeroed at masked positions first (so padding holding ``-inf``
    gives no NaN, in values or gradients) and the result is 0 there.
    """
    check_choice("KL estimator", kind, (*KL_ESTIMATORS, *KL_ALIASES))
    kind = KL_ALIASES.get(kind, kind)
    assert_same_shape(logp=logp, ref_logp=ref_logp, **({} if mask is None else {"mask": mask}))
    m = jnp.ones(jnp.shape(logp), bool) if mask is None else jnp.asarray(mask).astype(bool)
    d = jnp.where(m, at_least_float32(logp), 0.0) - jnp.where(m, at_least_float32(ref_logp), 0.0)
    if kind == "k1":
        kl = d
    elif kind == "k2":
        kl = 0.5 * d**2
    elif kind == "abs":
        kl = jnp.abs(d)
    elif kind == "k3":
        kl = jnp.maximum(jnp.expm1(-d) + d, 0.0)
    else:
        neg = jnp.clip(-d, -20.0, 20.0)
        kl = jnp.clip(jnp.exp(neg) - neg - 1.0, -10.0, 10.0)
    return jnp.where(m, kl, 0.0)


def entropy_from_logits(logits: Float[Array, "*s v"]) -> Float[Array, "*s"]:
    """Entropy of ``softmax(logits)`` over the last axis: ``H = -sum_v p_v log p_v``, in float32.

    Computed from ``log p = logits - logsumexp(logits)`` (stable for any scale; bfloat16 logits
    are upcast first). Entries with ``p = 0`` (``-inf`` logits) contribute 0, with finite gradients.
    """
    x = at_least_float32(logits)
    logp = jax.nn.log_softmax(x, axis=-1)
    p = jnp.exp(logp)
    safe = jnp.where(p > 0, logp, 0.0)
    return -jnp.sum(p * safe, axis=-1)


def kl_penalty_reward(
    token_rewards: Float[Array, "n t"],
    kl: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    beta: float,
) -> Float[Array, "n t"]:
    """KL-shaped token rewards ``r'_t = r_t - beta * kl_t`` on valid tokens, 0 elsewhere.

    verl's ``apply_kl_penalty`` (``kl_ctrl.kl_coef``) / TRL PPO's ``kl_coef``: the KL to the
    reference enters the reward (then the advantage) instead of the loss.
    """
    assert_same_shape(token_rewards=token_rewards, kl=kl, mask=mask)
    m = jnp.asarray(mask).astype(bool)
    return jnp.where(
        m,
        jnp.where(m, at_least_float32(token_rewards), 0.0)
        - beta * jnp.where(m, at_least_float32(kl), 0.0),
        0.0,
    )


def conservative_penalty(
    kl: Float[Array, "*s"], *, threshold: float, coef: float
) -> Float[Array, "*s"]:
    """One-sided quadratic KL penalty ``coef * max(0, kl - threshold)^2`` (elementwise).

    Zero (with zero gradient) while the KL stays under ``threshold``; grows quadratically above it.
    Apply it to a per-token KL (then aggregate) or to an already averaged KL.
    """
    return coef * jnp.square(jnp.maximum(at_least_float32(kl) - threshold, 0.0))


def entropy_bonus(
    entropy: Float[Array, "n t"], mask: Bool[Array, "n t"], *, coef: float
) -> Float[Array, "n t"]:
    """Per-token loss term ``-coef * H_t`` on valid tokens, 0 elsewhere.

    Add it to the per-token policy loss before aggregation (verl: ``pg_loss - entropy_coeff *
    entropy``, with the entropy aggregated by the same ``loss_agg_mode``). Minimising it raises
    the entropy for ``coef > 0``.
    """
    assert_same_shape(entropy=entropy, mask=mask)
    m = jnp.asarray(mask).astype(bool)
    return jnp.where(m, -coef * jnp.where(m, at_least_float32(entropy), 0.0), 0.0)
