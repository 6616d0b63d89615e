"""Named policy losses: a frozen config per name and one calling convention for all of them.

    loss = policy_loss("dapo", epsilon_high=0.3)          # PolicyLoss(name, config)
    per_token, metrics = loss(logp, old_logp, advantages, mask)
    scalar = aggregate(per_token, mask, "token-mean")     # relax.objectives.aggregation

Every loss takes ``logp`` / ``old_logp`` / ``mask`` ``[N, T]`` and advantages ``[N]`` or
``[N, T]`` and returns ``(per_token [N, T], metrics)`` like the functions of
``relax.objectives.policy`` it is built on: exactly 0 at masked tokens, ``ratio_min`` /
``ratio_max`` declared ``relax.metrics.Metric`` reductions. Ratios are
``r_t = exp(clamp(logp_t - old_logp_t, -20, 20))`` against the OLD (sampling) policy, never the
reference model; ``sg`` is stop-gradient, ``A_t`` the advantage. The losses, per valid token:

=====================  =====================================================================
``ppo``                ``max(-A min(r, delta), -A clip(r, 1-eps_low, 1+eps_high))``; with
                       ``clip_ratio_c`` and ``A < 0`` then ``min(., -A c)`` (dual-clip);
                       ``delta=None``: no cap (TRL's two-sided GRPO with one);
                       ``importance="sequence"``: every token of sequence i at ratio
                       ``s_i = exp(mean_{valid t}(logp - old_logp))``, gradient through each
                       token's own ``logp`` (GSPO's token form)
``grpo``               ``ppo`` (TRL's GRPO defaults: the same)
``dapo``               ``ppo`` with clip-higher defaults (``eps_high = 0.28``)
``gspo``               ``ppo`` with ``importance="sequence"`` and GSPO's tight clip
``cispo``              ``-sg(clip(r, 1-eps_low, 1+eps_high)) A logp``
``reinforce``          ``-A logp`` (``old_logp`` unused)
``importance_sampling``  ``-min(r, cap) A``: Tinker's importance-sampling loss ``-r A`` with
                       the ratio truncated at ``cap``; the gradient ``-r A grad logp`` flows
                       where ``r < cap`` and is 0 where ``r > cap`` (``cap=None``: Tinker's loss
                       itself)
``conservative_ppo``   ``ppo`` (no dual-clip) ``+ coef max(0, KL_t - kl_threshold)^2`` with
                       ``KL_t = kl_estimate(logp, old_logp, kl_estimator)`` (per-token KL to the
                       OLD policy; ``k3``: ``exp(-d) + d - 1``, ``d = logp - old_logp``)
=====================  =====================================================================

``conservative_ppo``'s penalty is the restoring force PPO's clip lacks: a clipped token has no
surrogate gradient at all, so nothing stops it from drifting further; the one-sided quadratic
(``relax.objectives.kl.conservative_penalty``) is 0 inside the trust region and pulls the token
back once its KL to the sampling policy passes the threshold. Its defaults (threshold 0.02,
about the ``k3`` of a ratio at the clip edges 0.8 / 1.2; coef 10) are this library's choice, not
a published recipe.

The configs are frozen dataclasses and ``PolicyLoss`` is too: hashable, so a loss can be closed
over by a jitted function or passed as a static argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Annotated, Any, Union

import jax.numpy as jnp
import tyro
from jaxtyping import Array

from relax.choices import check_choice
from relax.masked import masked_mean
from relax.metrics import Metric
from relax.objectives.kl import KL_ALIASES, KL_ESTIMATORS, conservative_penalty, kl_estimate
from relax.objectives.policy import (
    IMPORTANCE_LEVELS,
    cispo,
    ppo_clip,
    reinforce,
    truncated_importance_sampling,
)

__all__ = [
    "POLICY_LOSSES",
    "LOSS_FUNCTIONS",
    "PolicyLoss",
    "policy_loss",
    "PPOLossConfig",
    "GRPOLossConfig",
    "DAPOLossConfig",
    "GSPOLossConfig",
    "CISPOLossConfig",
    "ReinforceLossConfig",
    "ImportanceSamplingLossConfig",
    "ConservativePPOLossConfig",
    "LossConfig",
    "as_policy_loss",
    "loss_name",
]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_clip(low: float, high: float, low_name: str, high_name: str) -> None:
    _check(
        0.0 <= low <= 1.0,
        f"{low_name} must be in [0, 1] (the lower clip 1 - {low_name} >= 0), got {low}",
    )
    _check(high >= 0.0, f"{high_name} must be >= 0, got {high}")


@dataclasses.dataclass(frozen=True)
class PPOLossConfig:
    """PPO's clipped surrogate with the clip range ``[1 - epsilon_low, 1 + epsilon_high]``;
    ``clip_ratio_c`` (> 1) turns on dual-clip, ``delta`` (> 1) caps the unclipped ratio (TRL's
    two-sided GRPO), ``importance`` is ``token`` or ``sequence`` (GSPO's ratios)."""

    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    clip_ratio_c: float | None = None
    delta: float | None = None
    importance: str = "token"

    def __post_init__(self):
        _check_clip(self.epsilon_low, self.epsilon_high, "epsilon_low", "epsilon_high")
        _check(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            f"clip_ratio_c must be > 1 for dual-clip PPO (or None), got {self.clip_ratio_c}",
        )
        _check(
            self.delta is None or self.delta > 1.0, f"delta must be > 1 (or None), got {self.delta}"
        )
        check_choice("importance", self.importance, IMPORTANCE_LEVELS)


@dataclasses.dataclass(frozen=True)
class GRPOLossConfig(PPOLossConfig):
    """TRL's GRPO loss: PPO's clip at ``epsilon = 0.2`` both sides (``delta``: TRL's cap)."""


@dataclasses.dataclass(frozen=True)
class DAPOLossConfig(PPOLossConfig):
    """DAPO's clip-higher (Yu et al. 2025): ``epsilon_low = 0.2``, ``epsilon_high = 0.28``."""

    epsilon_high: float = 0.28


@dataclasses.dataclass(frozen=True)
class GSPOLossConfig(PPOLossConfig):
    """GSPO (Zheng et al. 2025): sequence-level ratios, clipped at ``1 - 3e-4`` / ``1 + 4e-4``."""

    epsilon_low: float = 3e-4
    epsilon_high: float = 4e-4
    importance: str = "sequence"


@dataclasses.dataclass(frozen=True)
class CISPOLossConfig:
    """CISPO (MiniMax-M1): the detached IS weight clipped to ``[1 - epsilon_low, 1 + epsilon_high]``.

    Defaults: no lower bound (``epsilon_low = 1``: the weight is >= 0 anyway) and a cap of 5
    (TRL's recommended ``epsilon_high = 5.0``, which TRL uses as the absolute cap)."""

    epsilon_low: float = 1.0
    epsilon_high: float = 4.0

    def __post_init__(self):
        _check_clip(self.epsilon_low, self.epsilon_high, "epsilon_low", "epsilon_high")


@dataclasses.dataclass(frozen=True)
class ReinforceLossConfig:
    """REINFORCE has nothing to configure."""


@dataclasses.dataclass(frozen=True)
class ImportanceSamplingLossConfig:
    """Truncated importance sampling ``-min(r, cap) A``; ``cap = 2`` (TIS's usual cap; None: no cap)."""

    cap: float | None = 2.0

    def __post_init__(self):
        _check(self.cap is None or self.cap > 0.0, f"cap must be > 0 (or None), got {self.cap}")


@dataclasses.dataclass(frozen=True)
class ConservativePPOLossConfig:
    """PPO's clip (symmetric ``epsilon``) plus ``coef * max(0, KL_t - kl_threshold)^2``, ``KL_t``
    the ``kl_estimator`` (``relax.objectives.kl.KL_ESTIMATORS``) of the per-token KL to the old policy."""

    epsilon: float = 0.2
    kl_threshold: float = 0.02
    coef: float = 10.0
    kl_estimator: str = "k3"

    def __post_init__(self):
        _check_clip(self.epsilon, self.epsilon, "epsilon", "epsilon")
        _check(self.kl_threshold >= 0.0, f"kl_threshold must be >= 0, got {self.kl_threshold}")
        _check(self.coef >= 0.0, f"coef must be >= 0, got {self.coef}")
        check_choice("KL estimator", self.kl_estimator, (*KL_ESTIMATORS, *KL_ALIASES))


Out = tuple[Array, dict[str, Any]]


def clipped_loss(logp, old_logp, advantages, mask, config: PPOLossConfig) -> Out:
    """``ppo_clip`` with the config's clip range, dual-clip, cap and importance level (ppo, grpo,
    dapo and gspo: the same loss with different defaults)."""
    return ppo_clip(
        logp,
        old_logp,
        advantages,
        mask,
        epsilon_low=config.epsilon_low,
        epsilon_high=config.epsilon_high,
        delta=config.delta,
        clip_ratio_c=config.clip_ratio_c,
        importance=config.importance,
    )


def cispo_loss(logp, old_logp, advantages, mask, config: CISPOLossConfig) -> Out:
    return cispo(
        logp,
        old_logp,
        advantages,
        mask,
        epsilon_low=config.epsilon_low,
        epsilon_high=config.epsilon_high,
    )


def reinforce_loss(logp, old_logp, advantages, mask, config: ReinforceLossConfig) -> Out:
    del old_logp, config  # on-policy: no ratio
    return reinforce(logp, advantages, mask)


def importance_sampling_loss(
    logp, old_logp, advantages, mask, config: ImportanceSamplingLossConfig
) -> Out:
    return truncated_importance_sampling(logp, old_logp, advantages, mask, cap=config.cap)


def conservative_ppo_loss(
    logp, old_logp, advantages, mask, config: ConservativePPOLossConfig
) -> Out:
    """``ppo_clip`` + ``conservative_penalty(kl_estimate(logp, old_logp))`` per valid token.

    Metrics besides ``ppo_clip``'s: ``kl_old`` (mean per-token KL estimate to the old policy),
    ``kl_old_max`` (declared ``max``), ``kl_over_threshold`` (fraction of valid tokens past the
    threshold) and ``kl_penalty`` (mean per-token penalty)."""
    per_token, metrics = ppo_clip(
        logp, old_logp, advantages, mask, epsilon_low=config.epsilon, epsilon_high=config.epsilon
    )
    m = jnp.asarray(mask).astype(bool)
    kl = kl_estimate(logp, old_logp, config.kl_estimator, mask=m)
    penalty = jnp.where(
        m, conservative_penalty(kl, threshold=config.kl_threshold, coef=config.coef), 0.0
    )
    metrics = {
        **metrics,
        "kl_old": masked_mean(kl, m),
        "kl_old_max": Metric(jnp.where(m.any(), jnp.max(jnp.where(m, kl, -jnp.inf)), 0.0), "max"),
        "kl_over_threshold": masked_mean((kl > config.kl_threshold).astype(jnp.float32), m),
        "kl_penalty": masked_mean(penalty, m),
    }
    return per_token + penalty, metrics


POLICY_LOSSES: dict[str, type] = {
    "ppo": PPOLossConfig,
    "grpo": GRPOLossConfig,
    "dapo": DAPOLossConfig,
    "gspo": GSPOLossConfig,
    "cispo": CISPOLossConfig,
    "reinforce": ReinforceLossConfig,
    "importance_sampling": ImportanceSamplingLossConfig,
    "conservative_ppo": ConservativePPOLossConfig,
}

LOSS_FUNCTIONS: dict[str, Callable[..., Out]] = {
    "ppo": clipped_loss,
    "grpo": clipped_loss,
    "dapo": clipped_loss,
    "gspo": clipped_loss,
    "cispo": cispo_loss,
    "reinforce": reinforce_loss,
    "importance_sampling": importance_sampling_loss,
    "conservative_ppo": conservative_ppo_loss,
}


def _check_name(name: str) -> None:
    check_choice("policy loss", name, tuple(POLICY_LOSSES))


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A named policy loss and its config: ``loss(logp, old_logp, advantages, mask) -> (per_token, metrics)``."""

    name: str
    config: Any

    def __post_init__(self):
        _check_name(self.name)
        cls = POLICY_LOSSES[self.name]
        if type(self.config) is not cls:
            raise TypeError(
                f"policy loss {self.name!r} takes a {cls.__name__}, got {type(self.config).__name__}"
            )

    def __call__(self, logp, old_logp, advantages, mask) -> Out:
        return LOSS_FUNCTIONS[self.name](logp, old_logp, advantages, mask, self.config)


def loss_name(config: Any) -> str:
    """The registry name of a loss config (its exact class: ``DAPOLossConfig`` is ``dapo``)."""
    for name, cls in POLICY_LOSSES.items():
        if type(config) is cls:
            return name
    raise TypeError(
        f"{type(config).__name__} is not a policy loss config; valid: "
        + ", ".join(cls.__name__ for cls in POLICY_LOSSES.values())
    )


def as_policy_loss(config: Any) -> PolicyLoss:
    """The ``PolicyLoss`` of a loss config (an algorithm config's ``policy_loss`` field)."""
    return PolicyLoss(loss_name(config), config)


# An algorithm config's ``policy_loss`` field: one of the configs, chosen on the command line as
# ``<prefix>.policy-loss:NAME`` (or ``--<prefix>.policy-loss NAME``, ``relax.algorithms.cli.flags``) with
# its own typed options ``--<prefix>.policy-loss.FIELD``.
LossConfig = Union[  # noqa: UP007 (a Union built from a tuple has no `|` spelling)
    tuple(Annotated[cls, tyro.conf.subcommand(name)] for name, cls in POLICY_LOSSES.items())
]


def policy_loss(name: str, **overrides) -> PolicyLoss:
    """The loss ``name`` (a key of ``POLICY_LOSSES``) with its default config, ``overrides`` replacing fields.

    An unknown name, or a field the loss's config does not have, is a ``ValueError`` listing the
    valid ones."""
    _check_name(name)
    cls = POLICY_LOSSES[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        valid = ", ".join(fields) if fields else "none (it takes no options)"
        raise ValueError(
            f"policy loss {name!r} has no option {', '.join(map(repr, unknown))}; valid: {valid}"
        )
    return PolicyLoss(name, cls(**overrides))
