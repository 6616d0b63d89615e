"""Policy-gradient losses: clipped PPO / GRPO / DAPO / GSPO, CISPO, REINFORCE, and TIS weights.

Every loss returns ``(per_token_loss [N, T], metrics)``: the loss of each valid token (exactly 0
at masked tokens) and a dict of float32 scalars (extremes declared as ``relax.metrics.Metric`` with
their reduction). Reduce it with
``relax.objectives.aggregation.aggregate``; the aggregation mode is not the loss's business.

Importance ratios are always taken against the *old* policy, the one that sampled the batch
(``old_logp``), never against the reference model. Log-ratios are clamped to ``[-20, 20]``
before ``exp`` as verl does (no overflow; no gradient beyond the clamp). Inputs are upcast to at
least float32, and masked positions are replaced by 0 before any arithmetic, so padding that
holds ``-inf`` or NaN gives neither NaN losses nor NaN gradients.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float

from relax.choices import check_choice
from relax.masked import assert_same_shape, at_least_float32, masked_mean, token_inputs
from relax.metrics import Metric

IMPORTANCE_LEVELS = ("token", "sequence")
_LOG_RATIO_CLAMP = 20.0


def _inputs(mask: Array, advantages: Array | None = None, **arrays: Array) -> tuple[Array, ...]:
    """Check ``[N, T]`` shapes; return the arrays (floats, 0 where masked), advantages ``[N, T]``, mask."""
    *out, m = token_inputs(mask, **arrays)
    if advantages is not None:
        adv = jnp.asarray(advantages)
        chex.assert_rank(
            adv, {1, 2}, custom_message=f"advantages must be [N] or [N, T], got {adv.shape}"
        )
        if adv.ndim == 1:
            chex.assert_shape(
                adv, m.shape[:1], custom_message=f"advantages={adv.shape}, mask={m.shape}"
            )
            adv = jnp.broadcast_to(adv[:, None], m.shape)
        assert_same_shape(advantages=adv, mask=mask)
        out.append(jnp.where(m, at_least_float32(adv), 0.0))
    return (*out, m)


def _log_ratio(logp: Array, old_logp: Array, m: Array, importance: str) -> Array:
    """Per-token log importance ratio: token level, or GSPO's sequence level in its token form."""
    check_choice("importance level", importance, IMPORTANCE_LEVELS)
    diff = logp - old_logp
    if importance == "sequence":
        seq = masked_mean(diff, m, axis=-1)[:, None]
        diff = lax.stop_gradient(seq) + logp - lax.stop_gradient(logp)
    return jnp.clip(diff, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _ratio_metrics(ratio: Array, logp: Array, old_logp: Array, m: Array) -> dict[str, Array]:
    """ratio mean/min/max over valid tokens; ``approx_kl`` (k2) and ``ppo_kl`` (k1) to the old policy."""
    ratio, d = lax.stop_gradient(ratio), lax.stop_gradient(logp - old_logp)
    any_valid = m.any()
    return {
        "ratio_mean": masked_mean(ratio, m),
        "ratio_min": Metric(
            jnp.where(any_valid, jnp.min(jnp.where(m, ratio, jnp.inf)), 1.0), "min"
        ),
        "ratio_max": Metric(
            jnp.where(any_valid, jnp.max(jnp.where(m, ratio, -jnp.inf)), 1.0), "max"
        ),
        "approx_kl": masked_mean(0.5 * d**2, m),
        "ppo_kl": masked_mean(-d, m),
    }


def _fraction(flags: Array, m: Array) -> Array:
    return masked_mean(flags.astype(jnp.float32), m)


def ppo_clip(
    logp: Float[Array, "n t"],
    old_logp: Float[Array, "n t"],
    advantages: Float[Array, "n t"] | Float[Array, " n"],
    mask: Bool[Array, "n t"],
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
    clip_ratio_c: float | None = None,
    importance: str = "token",
) -> tuple[Float[Array, "n t"], dict[str, Float[Array, ""]]]:
    """Clipped surrogate (PPO, GRPO, DAPO's clip-higher, two-sided GRPO, dual-clip, GSPO).

    Per valid token, with ``r = exp(logp - old_logp)`` and advantage ``A``::

        loss = max(-A * min(r, delta), -A * clip(r, 1 - epsilon_low, 1 + epsilon_high))
        if clip_ratio_c is not None and A < 0:  loss = min(loss, -A * clip_ratio_c)

    the pessimistic (max-of-losses) PPO objective. ``epsilon_low``/``epsilon_high`` are TRL's names
    (verl: ``clip_ratio_low``/``clip_ratio_high``); unequal values give DAPO's clip-higher.
    ``delta`` is TRL's two-sided GRPO cap on the unclipped ratio (None: no cap).
    ``clip_ratio_c`` is verl's dual-clip bound (Ye et al. 2020), which must be > 1; None turns it
    off (verl always applies it, default 3.0). Example: ``A = -1, r = 4, c = 3`` gives loss 3.

    ``importance="sequence"`` is GSPO (Zheng et al. 2025, arXiv:2507.18071; TRL's
    ``importance_sampling_level``, verl's ``policy_loss.loss_mode="gspo"``): the ratio of every
    token of sequence i is ``s_i = exp(mean_{valid t} (logp - old_logp))``, written in GSPO's
    token form ``sg(s_i) * exp(logp - sg(logp))`` so the value is ``s_i`` and the gradient flows
    through each token's own ``logp``. With ``seq-mean-token-mean`` aggregation and sequence-level
    advantages this equals GSPO's sequence objective. verl clamps GSPO's log-ratio at 10; this
    uses the same ``[-20, 20]`` clamp as the token level.

    Metrics (fractions of valid tokens, TRL's definitions): ``clip_frac_low`` (``A < 0`` and
    ``r < 1 - epsilon_low``), ``clip_frac_high`` (``A > 0`` and ``r > 1 + epsilon_high``),
    ``clip_frac_dual`` (``A < 0`` and ``r > clip_ratio_c``; 0 when off), ``ratio_mean/min/max``
    of the ratio used, ``approx_kl`` = mean of ``0.5 (logp - old_logp)^2`` (k2, TRL's PPO
    ``approxkl``) and ``ppo_kl`` = mean of ``old_logp - logp`` (k1, verl's ``ppo_kl``), both per token.
    """
    if clip_ratio_c is not None and isinstance(clip_ratio_c, (int, float)) and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    lp, old, adv, m = _inputs(mask, advantages, logp=logp, old_logp=old_logp)
    ratio = jnp.exp(_log_ratio(lp, old, m, importance))
    capped = ratio if delta is None else jnp.minimum(ratio, delta)
    clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = jnp.maximum(-adv * capped, -adv * clipped)
    dual = jnp.zeros_like(m)
    if clip_ratio_c is not None:
        loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * clip_ratio_c), loss)
        dual = (adv < 0) & (ratio > clip_ratio_c)
    r = lax.stop_gradient(ratio)
    metrics = {
        "clip_frac_low": _fraction((adv < 0) & (r < 1.0 - epsilon_low), m),
        "clip_frac_high": _fraction((adv > 0) & (r > 1.0 + epsilon_high), m),
        "clip_frac_dual": _fraction(dual, m),
        **_ratio_metrics(ratio, lp, old, m),
    }
    return jnp.where(m, loss, 0.0), metrics


def cispo(
    logp: Float[Array, "n t"],
    old_logp: Float[Array, "n t"],
    advantages: Float[Array, "n t"] | Float[Array, " n"],
    mask: Bool[Array, "n t"],
    *,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[Float[Array, "n t"], dict[str, Float[Array, ""]]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``loss = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``.

    The importance weight is clipped and detached, so every token keeps a REINFORCE gradient
    ``-w A grad logp`` (no token is dropped, unlike PPO's clip). MiniMax-M1 effectively has no lower
    bound (``epsilon_low >= 1``). TRL's ``loss_type="cispo"`` clamps only from above and uses
    ``epsilon_high`` as the absolute cap: TRL's ``epsilon_high = 5`` is ``epsilon_high = 4`` here.
    Metrics: ``clip_frac_low`` / ``clip_frac_high`` (fractions of valid tokens whose weight is
    clipped, whatever the sign of A) and the ratio / KL metrics of ``ppo_clip``.
    """
    lp, old, adv, m = _inputs(mask, advantages, logp=logp, old_logp=old_logp)
    ratio = jnp.exp(_log_ratio(lp, old, m, "token"))
    weight = lax.stop_gradient(jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high))
    r = lax.stop_gradient(ratio)
    metrics = {
        "clip_frac_low": _fraction(r < 1.0 - epsilon_low, m),
        "clip_frac_high": _fraction(r > 1.0 + epsilon_high, m),
        **_ratio_metrics(ratio, lp, old, m),
    }
    return jnp.where(m, -weight * adv * lp, 0.0), metrics


def reinforce(
    logp: Float[Array, "n t"],
    advantages: Float[Array, "n t"] | Float[Array, " n"],
    mask: Bool[Array, "n t"],
) -> tuple[Float[Array, "n t"], dict[str, Float[Array, ""]]]:
    """REINFORCE / on-policy policy gradient: ``loss = -A * logp`` per valid token.

    Its gradient equals ``ppo_clip``'s at ``r = 1`` (the first minibatch of an on-policy step).
    verl calls it ``policy_loss.loss_mode="gpg"``. Returns ``(loss, {})`` to share the loss interface.
    """
    lp, adv, m = _inputs(mask, advantages, logp=logp)
    return jnp.where(m, -adv * lp, 0.0), {}


def truncated_importance_sampling(
    logp: Float[Array, "n t"],
    old_logp: Float[Array, "n t"],
    advantages: Float[Array, "n t"] | Float[Array, " n"],
    mask: Bool[Array, "n t"],
    *,
    cap: float | None,
) -> tuple[Float[Array, "n t"], dict[str, Float[Array, ""]]]:
    """Importance-sampling loss with the ratio truncated at ``cap``: ``loss = -min(r, cap) * A``.

    Tinker's ``importance_sampling`` loss is ``-r A`` (``cap=None``); truncated, the gradient
    ``-r A grad logp`` flows where ``r < cap`` and is 0 where ``r > cap``. Metrics: ``clip_frac``
    (valid tokens with ``r > cap``) and the ratio / KL metrics of ``ppo_clip``.
    """
    lp, old, adv, m = _inputs(mask, advantages, logp=logp, old_logp=old_logp)
    ratio = jnp.exp(_log_ratio(lp, old, m, "token"))
    weight = ratio if cap is None else jnp.minimum(ratio, cap)
    capped = jnp.zeros_like(m) if cap is None else ratio > cap
    metrics = {"clip_frac": _fraction(capped, m), **_ratio_metrics(ratio, lp, old, m)}
    return jnp.where(m, -weight * adv, 0.0), metrics


def truncated_importance_weight(
    old_logp_trainer: Float[Array, "n t"],
    sampler_logp: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    cap: float,
) -> Float[Array, "n t"]:
    """Truncated importance sampling (TIS) weight ``w = sg(min(exp(old_logp_trainer - sampler_logp), cap))``.

    Corrects for the sampler's log-probs differing from the trainer's for the same old policy
    (different kernels / precision); multiply the per-token policy loss by ``w``. verl's
    ``tis_imp_ratio_cap``, TRL's ``vllm_importance_sampling_cap`` (token level). Computed as
    ``exp(min(log_ratio, log cap))`` so it cannot overflow; 0 at masked tokens.
    """
    if isinstance(cap, (int, float)) and cap <= 0:
        raise ValueError(f"cap must be > 0, got {cap}")
    trainer, sampler, m = _inputs(
        mask, old_logp_trainer=old_logp_trainer, sampler_logp=sampler_logp
    )
    w = jnp.exp(jnp.minimum(trainer - sampler, jnp.log(jnp.asarray(cap, trainer.dtype))))
    return lax.stop_gradient(jnp.where(m, w, 0.0))
