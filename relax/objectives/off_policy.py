"""Off-policy corrections for samples drawn by an older policy (asynchronous RL, ``relax.train.pipeline``).

Three policies meet in a stale batch: the behaviour policy ``mu`` that sampled it (its log-probs
are the sampler's, stored with the sample), the proximal policy ``pi_prox`` (the trainer's
weights when the update starts) and the policy being optimised ``pi_theta``. Every correction
here is decoupled PPO (Hilton et al. 2021; AReaL, Fu et al. 2025): the trust region is centred on
the proximal policy and a detached behaviour weight ``w`` moves the expectation from ``mu`` to
``pi_prox``::

    loss_t = w_t * ppo_clip(r_t = pi_theta / pi_prox, A_t),     rho_t = pi_prox / mu

    decoupled:  w_t = rho_t
    tis:        w_t = min(rho_t, cap)                        (truncated importance sampling)
    mis:        w_t = rho_t * [lower <= rho_t <= cap]        (masked importance sampling)

At ``level="sequence"`` ``rho`` is the sequence's ratio ``prod_t rho_t`` (its log summed over
the valid tokens), truncated or masked per sequence and given to each of its tokens. A masked
token keeps its place in the loss's normaliser (its weight is 0), so the normaliser does not
depend on the weights (verl's rejection sampling removes it from the normaliser instead).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from relax.choices import check_choice
from relax.masked import masked_mean, masked_sum, token_inputs
from relax.metrics import Metric

CORRECTIONS = (
    "decoupled",
    "tis",
    "mis",
    "none",
)  # none: clip against the behaviour policy, no weight
LEVELS = ("token", "sequence")
_LOG_CLAMP = 20.0  # exp(20) ~ 5e8: no overflow, as the policy losses' ratio clamp


@dataclasses.dataclass(frozen=True)
class OffPolicyConfig:
    """The behaviour correction of a stale batch (module docstring): ``kind`` (decoupled | tis |
    mis | none: today's on-policy loss, clipped against the behaviour policy), ``level`` (token |
    sequence), ``cap`` (tis: the truncation; mis: the upper bound) and
    ``lower`` (mis: the lower bound; None: ``1 / cap``)."""

    kind: str = "decoupled"
    level: str = "token"
    cap: float = 2.0
    lower: float | None = None

    def __post_init__(self):
        check_choice("correction kind", self.kind, CORRECTIONS)
        check_choice("correction level", self.level, LEVELS)
        if self.cap <= 0:
            raise ValueError(f"correction cap must be > 0, got {self.cap}")
        if self.lower is not None and not 0 <= self.lower < self.cap:
            raise ValueError(
                f"correction lower bound must be in [0, cap={self.cap}), got {self.lower}"
            )

    @property
    def lower_bound(self) -> float:
        return 1.0 / self.cap if self.lower is None else self.lower


def behaviour_weights(
    prox_logp: Float[Array, "n t"],
    behaviour_logp: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    cfg: OffPolicyConfig,
) -> tuple[Float[Array, "n t"], dict[str, Metric | Array]]:
    """``(w [N, T], metrics)``: the detached weight of each valid token (0 where masked).

    Metrics over valid tokens: ``is_weight_mean/min/max`` (of ``rho``, before truncation or
    masking), ``is_truncated_frac`` (tis: ``rho > cap``), ``is_masked_frac`` (mis: outside
    ``[lower, cap]``), ``behaviour_kl`` (k1 estimate of KL(mu || pi_prox), ``mean(log mu - log pi_prox)``).
    """
    if cfg.kind == "none":
        raise ValueError(
            "correction kind 'none' has no behaviour weights: the loss is the on-policy one"
        )
    prox, behaviour, m = token_inputs(mask, prox_logp=prox_logp, behaviour_logp=behaviour_logp)
    log_rho = lax.stop_gradient(prox - behaviour)
    if cfg.level == "sequence":
        log_rho = jnp.broadcast_to(masked_sum(log_rho, m, axis=-1)[:, None], m.shape)
    rho = jnp.exp(jnp.clip(log_rho, -_LOG_CLAMP, _LOG_CLAMP))
    truncated = (rho > cfg.cap) & m if cfg.kind == "tis" else jnp.zeros_like(m)
    outside = (rho > cfg.cap) | (rho < cfg.lower_bound)
    masked = outside & m if cfg.kind == "mis" else jnp.zeros_like(m)
    if cfg.kind == "tis":
        w = jnp.minimum(rho, cfg.cap)
    elif cfg.kind == "mis":
        w = jnp.where(outside, 0.0, rho)
    else:
        w = rho
    any_valid = m.any()
    metrics = {
        "is_weight_mean": masked_mean(rho, m),
        "is_weight_min": Metric(
            jnp.where(any_valid, jnp.min(jnp.where(m, rho, jnp.inf)), 1.0), "min"
        ),
        "is_weight_max": Metric(
            jnp.where(any_valid, jnp.max(jnp.where(m, rho, -jnp.inf)), 1.0), "max"
        ),
        "is_truncated_frac": masked_mean(truncated.astype(jnp.float32), m),
        "is_masked_frac": masked_mean(masked.astype(jnp.float32), m),
        "behaviour_kl": masked_mean(behaviour - prox, m),
    }
    return jnp.where(m, w, 0.0), metrics


def needs_proximal_pass(cfg: OffPolicyConfig | None, optimizer_steps: int) -> bool:
    """Whether the proximal log-probs need a forward of their own before the update: a correction
    and an update of several optimizer steps (after the first the loss no longer sees the
    proximal weights; with one, they are the loss's own log-probs under a stop-gradient)."""
    return cfg is not None and optimizer_steps > 1


def corrected_loss(
    loss_fn: Callable,
    logp: Float[Array, "n t"],
    behaviour_logp: Float[Array, "n t"],
    advantages: Array,
    mask: Bool[Array, "n t"],
    cfg: OffPolicyConfig,
    prox_logp: Float[Array, "n t"] | None = None,
) -> tuple[Float[Array, "n t"], dict]:
    """``w_t * loss_fn(logp, prox, A, mask)`` per token (the module docstring's decoupled loss),
    with ``loss_fn(logp, old_logp, advantages, mask) -> (per_token, metrics)`` a policy loss
    (``relax.objectives.policy``) and ``prox = prox_logp``, or ``sg(logp)`` when None."""
    prox = lax.stop_gradient(logp) if prox_logp is None else prox_logp
    w, w_metrics = behaviour_weights(prox, behaviour_logp, mask, cfg)
    per_token, metrics = loss_fn(logp, prox, advantages, mask)
    return w * per_token, {**metrics, **w_metrics}
