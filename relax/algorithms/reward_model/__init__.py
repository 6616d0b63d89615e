"""Reward-model training: Bradley-Terry on preference pairs (TRL's ``RewardTrainer``).

``RewardModelConfig`` (``config.py``), the pair loss for ``relax.train.update`` (``loss.py``) and
the step ``make_reward_model_step`` with its state ``init_reward_model_state`` (``step.py``). The
model is ``relax.models.heads.reward_model.RewardModel``; ``relax.rewards.model.reward_model_reward``
makes a trained one a reward for GRPO / PPO."""

from relax.algorithms.reward_model.config import RewardModelConfig
from relax.algorithms.reward_model.loss import (
    make_loss,
    pair_metrics,
    pair_normalizers,
    pair_rewards,
)
from relax.algorithms.reward_model.run import RewardModelRunConfig
from relax.algorithms.reward_model.step import (
    evaluate_pairs,
    init_reward_model_state,
    make_reward_model_step,
    pair_data,
)

__all__ = [
    "RewardModelConfig",
    "RewardModelRunConfig",
    "evaluate_pairs",
    "init_reward_model_state",
    "make_loss",
    "make_reward_model_step",
    "pair_data",
    "pair_metrics",
    "pair_normalizers",
    "pair_rewards",
]
