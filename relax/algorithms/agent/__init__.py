"""Multi-turn tool-use RL: GRPO / PPO on trajectories of environments (``relax.algorithms.agent.step``)."""

from relax.algorithms.agent.config import AgentConfig, rollout_config
from relax.algorithms.agent.evaluate import EVAL_STREAM, HeldOut
from relax.algorithms.agent.run import (
    BAR_KEYS,
    BUILTIN_MAX_NEW_TOKENS,
    AgentRunConfig,
    RowIterator,
    check_budget,
)
from relax.algorithms.agent.step import (
    drop_errored,
    make_agent_grpo_step,
    make_agent_ppo_step,
    make_agent_rollout,
    success_metrics,
    trajectory_metrics,
)

__all__ = [
    "AgentConfig",
    "AgentRunConfig",
    "BAR_KEYS",
    "BUILTIN_MAX_NEW_TOKENS",
    "EVAL_STREAM",
    "HeldOut",
    "RowIterator",
    "check_budget",
    "drop_errored",
    "make_agent_grpo_step",
    "make_agent_ppo_step",
    "make_agent_rollout",
    "rollout_config",
    "success_metrics",
    "trajectory_metrics",
]
