"""PPO with a critic: per-token KL-shaped rewards, GAE (or VinePPO's Monte-Carlo values), a
clipped value loss, and any policy loss of ``relax.objectives.registry``."""

from relax.algorithms.ppo.batch import CriticRows, PPOBatch
from relax.algorithms.ppo.config import ADVANTAGES, CRITICS, PPOConfig
from relax.algorithms.ppo.loss import (
    make_actor_loss,
    make_critic_loss,
    make_joint_loss,
    policy_terms,
    value_terms,
)
from relax.algorithms.ppo.run import PPORunConfig, make_state
from relax.algorithms.ppo.step import (
    gae_terms,
    kl_token_rewards,
    make_advantage,
    make_ppo_step,
    make_update_stage,
    ppo_parts,
    rope_tables,
    state_values,
    token_rewards,
)
from relax.algorithms.ppo.vine import (
    VINE_STREAM,
    branch_cost,
    branch_prompts,
    make_mc_values,
    step_advantages,
)

__all__ = [
    "ADVANTAGES",
    "CRITICS",
    "CriticRows",
    "PPOBatch",
    "PPOConfig",
    "PPORunConfig",
    "VINE_STREAM",
    "branch_cost",
    "branch_prompts",
    "gae_terms",
    "kl_token_rewards",
    "make_actor_loss",
    "make_advantage",
    "make_critic_loss",
    "make_joint_loss",
    "make_mc_values",
    "make_ppo_step",
    "make_state",
    "make_update_stage",
    "policy_terms",
    "ppo_parts",
    "rope_tables",
    "state_values",
    "step_advantages",
    "token_rewards",
    "value_terms",
]
