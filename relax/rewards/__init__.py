"""Rewards: combining reward functions and shaping ``[P, G]`` rewards."""

from relax.rewards.shaping import (
    combine,
    dynamic_sampling_mask,
    group_stats,
    length_shaping,
    overlong_penalty,
)

__all__ = ["combine", "dynamic_sampling_mask", "group_stats", "length_shaping", "overlong_penalty"]
