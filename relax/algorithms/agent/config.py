"""The multi-turn part of an agent run (``AgentConfig``) and the trajectories' sampler it sets up
(``rollout_config``). The losses are GRPO's and PPO's own (``relax.algorithms.grpo.loss``,
``relax.algorithms.ppo.loss``): an agent trains them on the policy's tokens of a trajectory."""

from __future__ import annotations

import dataclasses

from relax.environments.rollout import AgentRolloutConfig
from relax.rollout.generation import GenerationConfig
from relax.rollout.turns import OBSERVATION_CHUNK, TurnConfig


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """The multi-turn part of a run: ``max_turns`` policy turns of at most ``max_turn_tokens``
    sampled tokens each (the whole trajectory, observations included, in the algorithm's
    ``max_new_tokens``); ``per_turn``: per-turn advantages (GRPO, ``advantages.turn_grpo``);
    ``compact_below`` and ``min_rows``: as ``AgentRolloutConfig``; ``observation_chunk``: an
    observation is prefilled this many tokens at a time (``relax.rollout.turns.TurnConfig``)."""

    max_turns: int = 3
    max_turn_tokens: int = 32
    per_turn: bool = False
    compact_below: float = 0.5
    min_rows: int = 8
    observation_chunk: int = OBSERVATION_CHUNK


def rollout_config(
    agent: AgentConfig, generation: GenerationConfig, *, eos_ids: tuple[int, ...], pad_id: int
) -> AgentRolloutConfig:
    """The trajectories' sampler: ``generation``'s completions per row, sampling controls and
    budget (the whole trajectory, observations included), turns of ``agent.max_turn_tokens``.
    The multi-turn sampler runs the model's own weights: an 8-bit ``sampler_precision`` is refused."""
    if generation.quantized:
        raise ValueError(
            f"sampler_precision {generation.sampler_precision}: the agent trainer's multi-turn "
            "sampler (relax.rollout.turns) runs the model's own weights; 8-bit samplers are "
            "single-turn (GRPO, PPO)"
        )
    turns = TurnConfig(
        num_generations=generation.num_generations,
        max_tokens=generation.max_new_tokens,
        max_turn_tokens=agent.max_turn_tokens,
        sampling=generation.sampling,
        eos_ids=eos_ids,
        pad_id=pad_id,
        observation_chunk=agent.observation_chunk,
    )
    return AgentRolloutConfig(
        turns=turns,
        max_turns=agent.max_turns,
        compact_below=agent.compact_below,
        min_rows=agent.min_rows,
    )
