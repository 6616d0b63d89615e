"""Losses: policy gradients, aggregation, KL and entropy terms (and, from their modules, value and preference losses)."""

from relax.losses.aggregation import AGGREGATION_MODES, TRL_LOSS_TYPES, aggregate, resolve_mode
from relax.losses.kl import (
    KL_ESTIMATORS,
    conservative_penalty,
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_penalty_reward,
)
from relax.losses.policy import IMPORTANCE_LEVELS, cispo, ppo_clip, reinforce, truncated_importance_weight
from relax.losses.preference import bradley_terry_loss, distillation_loss, dpo_loss, orpo_loss
from relax.losses.value import clipped_value_loss
