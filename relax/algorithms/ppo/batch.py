"""PPO's batch types: the advantaged batch with the critic's quantities (``PPOBatch``) and the
rows the value loss reads (``CriticRows``); the phases they extend are ``relax.algorithms.online.batch``'s."""

from __future__ import annotations

from jaxtyping import Array, Float

from relax.algorithms.online.batch import Advantaged, LossRows
from relax.models.forward.prefix_shared import CompletionRope


class PPOBatch(Advantaged):
    """PPO's advantaged batch. ``mc_values``: VinePPO's Monte-Carlo state values ``[p, g, j]``
    (``relax.algorithms.ppo.vine``); ``token_rewards``: ``r_t`` (``relax.algorithms.ppo.step``); ``kl_to_ref``:
    the per-token KL estimate to the reference; ``old_values`` / ``returns`` / ``explained_variance``:
    the critic's values of the sampled states, GAE's returns and how well the first explain the
    second (GAE only); ``rope`` / ``critic_rope``: the rotary tables of the completions for the
    policy and for a separate critic, computed once for the values and both updates."""

    mc_values: Float[Array, "p g j"] | None = None
    token_rewards: Float[Array, "p g n"] | None = None
    kl_to_ref: Float[Array, "p g n"] | None = None
    old_values: Float[Array, "p g n"] | None = None
    returns: Float[Array, "p g n"] | None = None
    explained_variance: Float[Array, ""] | None = None
    rope: CompletionRope | None = None
    critic_rope: CompletionRope | None = None


class CriticRows(LossRows):
    """What the value loss reads besides ``LossRows``: the critic's values of the sampled states
    when they were sampled, GAE's returns, and a separate critic's rotary tables."""

    old_values: Float[Array, "p g n"] | None = None
    returns: Float[Array, "p g n"] | None = None
    critic_rope: CompletionRope | None = None
