"""Objectives: advantages, policy losses (and their registry, ``registry``), aggregation, KL and
entropy terms, the value loss, preference losses, reference-model rules (``reference``) and the
sampler-vs-trainer mismatch metrics (``mismatch``)."""

from relax.objectives.aggregation import AGGREGATION_MODES, TRL_LOSS_TYPES, aggregate, resolve_mode
from relax.objectives.kl import (
    KL_ESTIMATORS,
    conservative_penalty,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_penalty_reward,
)
from relax.objectives.policy import (
    IMPORTANCE_LEVELS,
    cispo,
    ppo_clip,
    reinforce,
    truncated_importance_sampling,
    truncated_importance_weight,
)
from relax.objectives.preference import (
    bradley_terry_loss,
    distillation_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)
from relax.objectives.value import clipped_value_loss

__all__ = [
    "AGGREGATION_MODES",
    "IMPORTANCE_LEVELS",
    "KL_ESTIMATORS",
    "TRL_LOSS_TYPES",
    "aggregate",
    "bradley_terry_loss",
    "cispo",
    "clipped_value_loss",
    "conservative_penalty",
    "distillation_loss",
    "dpo_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_estimate",
    "kl_penalty_reward",
    "kto_loss",
    "kto_reference_point",
    "orpo_loss",
    "ppo_clip",
    "reinforce",
    "resolve_mode",
    "simpo_loss",
    "truncated_importance_sampling",
    "truncated_importance_weight",
]
