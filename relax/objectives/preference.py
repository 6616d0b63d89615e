"""Offline preference and distillation losses: DPO family, SimPO, ORPO, KTO, Bradley-Terry, token-level KD.

Each loss returns per-example (or per-token) values plus a dict of per-example metrics; the caller
reduces them (the mean over real pairs reproduces what TRL logs). Everything is computed in at
least float32, so bfloat16 log-probs and logits are accepted.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from relax.choices import check_choice
from relax.masked import assert_same_shape, at_least_float32, masked_mean

DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
DISTILLATION_DIRECTIONS = ("forward", "reverse")

Metrics = dict[str, Array]


def _f32(*xs) -> tuple[Array, ...]:
    return tuple(at_least_float32(x) for x in xs)


def dpo_loss(
    policy_chosen_logps: Float[Array, " b"],
    policy_rejected_logps: Float[Array, " b"],
    ref_chosen_logps: Float[Array, " b"],
    ref_rejected_logps: Float[Array, " b"],
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, " b"], Metrics]:
    """Per-pair DPO-family loss with TRL ``DPOTrainer`` semantics.

    With ``z = (pi_c - pi_r) - (ref_c - ref_r)`` (sequence log-probs) and ``e = label_smoothing``::

        sigmoid: -(1 - e) log s(beta z) - e log s(-beta z)           (DPO; e > 0 = conservative DPO)
        robust:  (-(1 - e) log s(beta z) + e log s(-beta z)) / (1 - 2e)  (rDPO, Chowdhury et al. 2024)
        hinge:   max(0, 1 - beta z)                                   (SLiC)
        ipo:     (z - 1 / (2 beta))^2                                 (IPO eq. 17, beta = tau)

    IPO expects log-probs the caller has AVERAGED over completion tokens (TRL divides the summed
    log-probs by the completion length for ``loss_type="ipo"``); the others take summed log-probs.
    ``label_smoothing`` must be in ``[0, 0.5]`` for sigmoid and ``[0, 0.5)`` for robust; hinge and
    ipo do not read it, so a nonzero value raises (TRL silently ignores it).

    Metrics (per pair, no gradient; TRL logs their means): ``rewards/chosen = beta (pi_c - ref_c)``,
    ``rewards/rejected = beta (pi_r - ref_r)``, ``rewards/margins`` (their difference) and
    ``rewards/accuracies = [chosen > rejected]``.
    """
    check_choice("loss_type", loss_type, DPO_LOSS_TYPES)
    assert_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    e = label_smoothing
    if loss_type in ("hinge", "ipo") and e != 0:
        raise ValueError(f"label_smoothing is not used by loss_type={loss_type!r}; got {e}")
    if loss_type == "sigmoid" and not 0 <= e <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5] for sigmoid, got {e}")
    if loss_type == "robust" and not 0 <= e < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) for robust, got {e}")

    pc, pr, rc, rr = _f32(
        policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    )
    z = (pc - pr) - (rc - rr)
    if loss_type == "sigmoid":
        losses = -(1 - e) * jax.nn.log_sigmoid(beta * z) - e * jax.nn.log_sigmoid(-beta * z)
    elif loss_type == "robust":
        losses = (-(1 - e) * jax.nn.log_sigmoid(beta * z) + e * jax.nn.log_sigmoid(-beta * z)) / (
            1 - 2 * e
        )
    elif loss_type == "hinge":
        losses = jax.nn.relu(1 - beta * z)
    else:  # ipo
        losses = (z - 1 / (2 * beta)) ** 2

    chosen = jax.lax.stop_gradient(beta * (pc - rc))
    rejected = jax.lax.stop_gradient(beta * (pr - rr))
    return losses, _reward_metrics(chosen, rejected)


def _reward_metrics(chosen: Array, rejected: Array) -> Metrics:
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": (chosen > rejected).astype(chosen.dtype),
    }


def _log1mexp(x: Array) -> Array:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (Maechler 2012)."""
    return jnp.where(x > -jnp.log(2.0), jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_loss(
    chosen_logps_mean: Float[Array, " b"],
    rejected_logps_mean: Float[Array, " b"],
    chosen_nll: Float[Array, " b"],
    *,
    beta: float,
) -> tuple[Float[Array, " b"], Metrics]:
    """Per-pair ORPO loss (Hong et al. 2024; TRL ``ORPOTrainer``)::

        log_odds = (c - r) - (log(1 - e^c) - log(1 - e^r))        c, r = mean token log-probs < 0
        loss     = nll_c - beta * log s(log_odds)

    ``chosen_nll`` is the SFT term for the chosen completion. TRL uses ONE token-mean cross-entropy
    over all chosen tokens of the batch; pass per-pair token-mean NLLs here, and the mean over pairs
    equals TRL's loss when completions have equal lengths (otherwise it weights pairs equally).
    Metrics (TRL names, per pair, no gradient): ``rewards/*`` with ``rewards/chosen = beta c``,
    ``log_odds_ratio = log s(log_odds)``, ``log_odds_chosen = log_odds``, ``nll_loss``.
    """
    assert_same_shape(
        chosen_logps_mean=chosen_logps_mean,
        rejected_logps_mean=rejected_logps_mean,
        chosen_nll=chosen_nll,
    )
    if not beta >= 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    c, r, nll = _f32(chosen_logps_mean, rejected_logps_mean, chosen_nll)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    ratio = jax.nn.log_sigmoid(log_odds)
    losses = nll - beta * ratio
    sg = jax.lax.stop_gradient
    metrics = _reward_metrics(sg(beta * c), sg(beta * r))
    metrics |= {"log_odds_ratio": sg(ratio), "log_odds_chosen": sg(log_odds), "nll_loss": sg(nll)}
    return losses, metrics


def simpo_loss(
    chosen_logps_mean: Float[Array, " b"],
    rejected_logps_mean: Float[Array, " b"],
    *,
    beta: float,
    gamma: float,
    label_smoothing: float = 0.0,
) -> tuple[Float[Array, " b"], Metrics]:
    """Per-pair SimPO loss (Meng et al. 2024; TRL ``CPOTrainer(loss_type="simpo")`` with ``cpo_alpha=0``),
    reference-free, on LENGTH-NORMALISED log-probs ``c``, ``r`` (mean over completion tokens)::

        z    = beta (c - r) - gamma
        loss = -(1 - e) log s(z) - e log s(-z)                  e = label_smoothing in [0, 0.5]

    ``gamma`` is the target reward margin (TRL's ``simpo_gamma``; TRL writes it as
    ``beta (c - r - gamma / beta)``, the same). Metrics (per pair, no gradient; TRL's CPO names):
    ``rewards/chosen = beta c``, ``rewards/rejected = beta r``, ``rewards/margins``,
    ``rewards/accuracies``.
    """
    assert_same_shape(chosen_logps_mean=chosen_logps_mean, rejected_logps_mean=rejected_logps_mean)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    c, r = _f32(chosen_logps_mean, rejected_logps_mean)
    e = label_smoothing
    z = beta * (c - r) - gamma
    losses = -(1 - e) * jax.nn.log_sigmoid(z) - e * jax.nn.log_sigmoid(-z)
    sg = jax.lax.stop_gradient
    return losses, _reward_metrics(sg(beta * c), sg(beta * r))


def kto_reference_point(
    policy_kl_logps: Float[Array, " b"],
    ref_kl_logps: Float[Array, " b"],
    mask: Bool[Array, " b"] | None = None,
) -> Float[Array, ""]:
    """KTO's reference point ``z0`` (TRL ``KTOTrainer``), a stop-gradient scalar::

        z0 = max(0, mean_i (pi(y'_i | x_i) - ref(y'_i | x_i)))

    over MISMATCHED pairs ``(x_i, y'_i)`` (a prompt with another example's completion; sequence
    log-probs), the examples where ``mask`` is True (all when None): a batch estimate of
    ``KL(pi || ref)``, clamped at 0 and detached, as in TRL.
    """
    assert_same_shape(policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    p, r = _f32(policy_kl_logps, ref_kl_logps)
    m = jnp.ones(p.shape, bool) if mask is None else jnp.asarray(mask).astype(bool)
    return jax.lax.stop_gradient(jnp.maximum(masked_mean(p - r, m), 0.0))


def kto_loss(
    policy_logps: Float[Array, " b"],
    ref_logps: Float[Array, " b"],
    desirable: Bool[Array, " b"],
    kl: Float[Array, ""] | Float[Array, " b"],
    *,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Float[Array, " b"], Metrics]:
    """Per-example KTO loss (Ethayarajh et al. 2024; TRL ``KTOTrainer``, ``loss_type="kto"``).

    With ``rho = pi(y | x) - ref(y | x)`` (sequence log-probs) and ``z0 = kl`` (the reference point
    of ``kto_reference_point``, taken under a stop-gradient here too)::

        desirable:    w_d (1 - s(beta (rho - z0)))
        undesirable:  w_u (1 - s(beta (z0 - rho)))

    TRL's loss is the mean over all examples of the batch. Metrics (per example, no gradient):
    ``rewards = beta rho``; TRL logs ``rewards/chosen`` / ``rewards/rejected`` as its means over
    the desirable / undesirable examples.
    """
    assert_same_shape(policy_logps=policy_logps, ref_logps=ref_logps, desirable=desirable)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not (desirable_weight >= 0 and undesirable_weight >= 0):
        raise ValueError(
            f"desirable_weight={desirable_weight} and undesirable_weight={undesirable_weight} "
            "must be >= 0"
        )
    p, r = _f32(policy_logps, ref_logps)
    z0 = jax.lax.stop_gradient(at_least_float32(kl))
    rho = p - r
    d = jnp.asarray(desirable).astype(bool)
    losses = jnp.where(
        d,
        desirable_weight * (1 - jax.nn.sigmoid(beta * (rho - z0))),
        undesirable_weight * (1 - jax.nn.sigmoid(beta * (z0 - rho))),
    )
    return losses, {"rewards": jax.lax.stop_gradient(beta * rho)}


def bradley_terry_loss(
    chosen_rewards: Float[Array, " b"],
    rejected_rewards: Float[Array, " b"],
    *,
    margin: float | Float[Array, " b"] | None = None,
    center_rewards_coefficient: float | None = None,
) -> tuple[Float[Array, " b"], Metrics]:
    """Per-pair reward-model loss (TRL ``RewardTrainer``)::

        loss = -log s(r_c - r_r - margin)  [+ center_rewards_coefficient * (r_c + r_r)^2]

    ``margin`` (TRL's optional per-pair ``margin`` column) is a scalar or a ``[b]`` array; None means
    0. The centering term (Eisenstein et al. 2023) is per pair; its mean over pairs equals TRL's
    ``coef * mean((r_c + r_r)^2)``. Metrics: ``accuracy = [r_c > r_r]``, ``margins = r_c - r_r``.
    """
    assert_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    rc, rr = _f32(chosen_rewards, rejected_rewards)
    diff = rc - rr
    if margin is not None:
        if jnp.ndim(margin) != 0:
            assert_same_shape(chosen_rewards=chosen_rewards, margin=margin)
        diff = diff - jnp.asarray(margin).astype(diff.dtype)
    losses = -jax.nn.log_sigmoid(diff)
    if center_rewards_coefficient is not None:
        losses = losses + center_rewards_coefficient * (rc + rr) ** 2
    sg = jax.lax.stop_gradient
    return losses, {"accuracy": sg((rc > rr).astype(rc.dtype)), "margins": sg(rc - rr)}


def distillation_loss(
    student_logits: Float[Array, "n t v"],
    teacher_logits: Float[Array, "n t v"],
    mask: Bool[Array, "n t"],
    *,
    temperature: float,
    direction: str = "forward",
) -> tuple[Float[Array, "n t"], Metrics]:
    """Per-token knowledge-distillation loss on temperature-softened distributions (Hinton et al.)::

        p = softmax(teacher / T),  q = softmax(student / T)
        forward: T^2 * KL(p || q) = T^2 * sum_v p (log p - log q)     (mean-seeking)
        reverse: T^2 * KL(q || p) = T^2 * sum_v q (log q - log p)     (mode-seeking)

    0 where ``mask`` is False. The teacher gets no gradient (``stop_gradient``). TRL's GKD uses
    ``beta=0`` for forward and ``beta=1`` for reverse KL and does NOT multiply by ``T^2``; the ``T^2``
    factor here keeps gradient magnitudes independent of ``T`` (Hinton et al. 2015), so divide by
    ``T^2`` to reproduce GKD. Metrics: ``kl`` (masked mean KL without ``T^2``) and
    ``top1_agreement`` (masked fraction where the argmaxes agree). Materialises ``[n, t, v]``
    float32 log-softmaxes: chunk over ``t`` upstream for large vocabularies.
    """
    check_choice("direction", direction, DISTILLATION_DIRECTIONS)
    assert_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    msg = f"mask={jnp.shape(mask)} must be student_logits={jnp.shape(student_logits)} without the vocab axis"
    chex.assert_shape(mask, jnp.shape(student_logits)[:-1], custom_message=msg)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    s, t = _f32(student_logits, jax.lax.stop_gradient(teacher_logits))
    log_q = jax.nn.log_softmax(s / temperature, axis=-1)
    log_p = jax.nn.log_softmax(t / temperature, axis=-1)
    a, log_a, log_b = (
        (jnp.exp(log_p), log_p, log_q) if direction == "forward" else (jnp.exp(log_q), log_q, log_p)
    )
    kl = jnp.sum(jnp.where(a > 0, a * (log_a - log_b), 0.0), axis=-1)
    m = jnp.asarray(mask).astype(bool)
    loss = jnp.where(m, temperature**2 * kl, 0.0)
    agree = (jnp.argmax(s, -1) == jnp.argmax(t, -1)).astype(kl.dtype)
    metrics = {
        "kl": jax.lax.stop_gradient(masked_mean(kl, m)),
        "top1_agreement": masked_mean(agree, m),
    }
    return loss, metrics
