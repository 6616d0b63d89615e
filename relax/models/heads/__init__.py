"""Models with heads: the critic, the reward model, distillation's divergences."""

from relax.models.heads.critic import (
    Critic,
    ValueHead,
    completion_head_values,
    completion_logprobs_and_values,
    completion_values,
    init_critic,
    init_value_head,
    load_critic,
    save_critic,
    value_architectures,
    values_from_hidden,
)
from relax.models.heads.distill import (
    DEFAULT_CHUNK,
    DIVERGENCES,
    Divergence,
    check_same_vocabulary,
    divergence_from_hidden,
    divergence_rows,
    resolve_divergence,
)
from relax.models.heads.reward_model import (
    RewardModel,
    init_reward_model,
    load_reward_model,
    save_reward_model,
    sequence_rewards,
)

__all__ = [
    "Critic",
    "DEFAULT_CHUNK",
    "DIVERGENCES",
    "Divergence",
    "RewardModel",
    "ValueHead",
    "check_same_vocabulary",
    "completion_head_values",
    "completion_logprobs_and_values",
    "completion_values",
    "divergence_from_hidden",
    "divergence_rows",
    "init_critic",
    "init_reward_model",
    "init_value_head",
    "load_critic",
    "load_reward_model",
    "resolve_divergence",
    "save_critic",
    "save_reward_model",
    "sequence_rewards",
    "value_architectures",
    "values_from_hidden",
]
