"""A reward model as a token reward: GRPO / PPO score completions with it on device.

    rm = load_reward_model("out/rm")
    reward_fns = [reward_model_reward(rm, weight=1.0), RewardFunction(exact_match)]
    step = make_grpo_step(cfg, reward_fns, decode, ...)      # relax.algorithms.stages.make_score

``reward_model_reward`` returns a ``TokenRewardFunction``: ``score_tokens`` runs it inside its own
``jax.jit`` on the rollout's arrays (prompts ``[P, Lp]`` left-padded, completions ``[P, G, N]``),
one batched forward of the reward model, no decoding and no host round trip; the score of each
completion is ``relax.models.reward_model.sequence_rewards`` (read at its last valid token).

Hashability: ``score_tokens`` makes the functions a jit static argument, so ``fn`` must be
hashable, and an ``equinox.Module`` holding arrays is not (its fields hash by value). The fn
here is a :class:`RewardModelScorer`, a plain object that holds the reward model and hashes and
compares by identity: the same scorer hits the same compiled program every iteration, and a
new scorer (new weights) compiles anew. ``score_tokens`` hands a fn only the four token arrays,
so the weights are closed over: they enter the compiled program as constants (XLA embeds them;
fine for the small reward models of tests and examples, but a compile of a multi-GB reward model
would carry its weights, and arrays sharded over several hosts cannot be closed over at all).
"""

from __future__ import annotations

import jax.numpy as jnp

from relax.models.reward_model import RewardModel, sequence_rewards
from relax.models.prefix_shared import TRAIN_ATTENTION
from relax.rewards.functions import TokenRewardFunction

__all__ = ["RewardModelScorer", "reward_model_reward"]


class RewardModelScorer:
    """``scorer(prompt_ids, prompt_mask, completion_ids, completion_mask) -> [P, G]`` float32: the
    reward model's ``sequence_rewards``. Hashes and compares by identity (module docstring)."""

    __slots__ = ("model", "groups_per_pass", "attention", "ignore_pad_tokens")

    def __init__(self, model: RewardModel, *, groups_per_pass: int | None = None, attention: str = "auto",
                 ignore_pad_tokens: bool = True):
        if not isinstance(model, RewardModel):
            raise TypeError(f"need a relax.models.reward_model.RewardModel, got {type(model).__name__}")
        if attention not in TRAIN_ATTENTION:
            raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(TRAIN_ATTENTION)}")
        if groups_per_pass is not None and groups_per_pass < 1:
            raise ValueError(f"groups_per_pass must be >= 1 or None, got {groups_per_pass}")
        self.model, self.groups_per_pass, self.attention = model, groups_per_pass, attention
        self.ignore_pad_tokens = ignore_pad_tokens

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __call__(self, prompt_ids, prompt_mask, completion_ids, completion_mask):
        p = prompt_ids.shape[0]
        groups = self.groups_per_pass if self.groups_per_pass is not None and p % self.groups_per_pass == 0 else None
        return sequence_rewards(self.model, jnp.asarray(prompt_ids), jnp.asarray(prompt_mask).astype(jnp.int32),
                                jnp.asarray(completion_ids), jnp.asarray(completion_mask).astype(jnp.int32),
                                ignore_pad_tokens=self.ignore_pad_tokens, attention=self.attention,
                                groups_per_pass=groups)

    def __repr__(self) -> str:
        c = self.model.config
        return (f"RewardModelScorer({c.family}, {c.num_layers} layers, hidden {c.hidden_size}, "
                f"groups_per_pass={self.groups_per_pass})")


def reward_model_reward(model: RewardModel, *, name: str = "reward_model", weight: float = 1.0,
                        groups_per_pass: int | None = None, attention: str = "auto",
                        ignore_pad_tokens: bool = True) -> TokenRewardFunction:
    """A ``TokenRewardFunction`` scoring each completion with ``model`` (``sequence_rewards``).

    ``groups_per_pass``: prompt groups per forward (a ``lax.map`` over slices; e.g. 1 on a CPU,
    where a group's activations stay in cache; ignored when it does not divide P); None: all at
    once. ``attention`` and ``ignore_pad_tokens`` as ``sequence_rewards``'s.
    """
    return TokenRewardFunction(RewardModelScorer(model, groups_per_pass=groups_per_pass, attention=attention,
                                                 ignore_pad_tokens=ignore_pad_tokens), name, weight)
