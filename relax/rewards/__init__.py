"""Rewards: host reward functions (TRL signature), built-ins, token rewards and shaping."""

from relax.rewards.builtin import (
    BUILTIN_REWARDS,
    exact_match,
    format_reward,
    get_reward,
    numeric_match,
)
from relax.rewards.code_exec import CodeExec
from relax.rewards.functions import RewardError, RewardFunction, score
from relax.rewards.math_answers import MathVerify
from relax.rewards.sandbox import Sandbox, SandboxConfig
from relax.rewards.shaping import (
    combine,
    dynamic_sampling_mask,
    group_stats,
    length_shaping,
    overlong_penalty,
)
from relax.rewards.token_rewards import (
    TokenRewardFunction,
    length_reward,
    score_tokens,
    token_match_reward,
)

__all__ = [
    "BUILTIN_REWARDS",
    "CodeExec",
    "MathVerify",
    "Sandbox",
    "SandboxConfig",
    "RewardError",
    "RewardFunction",
    "TokenRewardFunction",
    "combine",
    "dynamic_sampling_mask",
    "exact_match",
    "format_reward",
    "get_reward",
    "group_stats",
    "length_reward",
    "length_shaping",
    "numeric_match",
    "overlong_penalty",
    "score",
    "score_tokens",
    "token_match_reward",
]
