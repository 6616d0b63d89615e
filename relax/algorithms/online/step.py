"""One online step for GRPO, PPO and the multi-turn agent trainer::

    step = make_online_step(parts, ...)
         = compose(rollout, [scoring], [reference], [proximal], advantage, [after_advantage], update)

An algorithm brings its ``OnlineParts``: what it samples (``GenerationConfig``) and how its
forwards run (``ForwardConfig``), whether it needs a reference model, its optimizer steps per
update, its advantage stage and its update (policy loss, reference rule, critic), and host
stages of its own after the rewards (VinePPO's Monte-Carlo values). The factory decides the rest
once: the sampler's config, the scoring stages (``relax.algorithms.online.stages.make_scoring``: the
reward pool overlaps the reference forward), the packing, the reference and proximal stages
(``needs_proximal_pass``: an off-policy correction of a multi-step update), the order the
pipeline runs (``pipelined``). A multi-turn rollout scores its own trajectories (the
environments' rewards): it replaces the sampler and the scoring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from relax.algorithms.online.stages import (
    make_packing,
    make_partial_rollout,
    make_proximal,
    make_reference,
    make_rollout,
    make_scoring,
)
from relax.compose import Stage, compose
from relax.data.completion_layout import PackingConfig
from relax.models.forward.config import ForwardConfig
from relax.objectives.off_policy import OffPolicyConfig, needs_proximal_pass
from relax.passes import Passes, choose_passes
from relax.rewards.pool import RewardPool
from relax.rollout.generation import GenerationConfig
from relax.rollout.partial import PartialRollouts


@dataclasses.dataclass(frozen=True)
class OnlineParts:
    """An online algorithm's part of a step (module docstring). ``make_update(passes, off_policy)``:
    the update stage (its loss reads the proximal log-probs when the batch has them);
    ``packing``: the completions packed for the training forwards (None: the algorithm trains on
    padded completions); ``host_after``: host stages after the rewards."""

    name: str
    generation: GenerationConfig
    forward: ForwardConfig
    needs_reference: bool
    optimizer_steps: int
    advantage: Stage
    make_update: Callable[[Passes, OffPolicyConfig | None], Stage]
    packing: PackingConfig | None = None
    host_after: tuple[Stage, ...] = ()


def make_online_step(
    parts: OnlineParts,
    reward_fns: Sequence = (),
    decode: Callable | None = None,
    *,
    eos_ids: tuple[int, ...] = (),
    pad_id: int = 0,
    rollout: Stage | None = None,
    after_advantage: tuple[Stage, ...] = (),
    passes: Passes | None = None,
    on_error: str = "raise",
    timeout_s: float | None = None,
    pool: RewardPool | None = None,
    off_policy: OffPolicyConfig | None = None,
    pipelined: bool = False,
    partial: PartialRollouts | None = None,
) -> Stage:
    """``step(state, batch) -> (state, out)`` of ``parts`` (module docstring).

    Single-turn (``rollout=None``): the prefix-shared sampler of ``parts.generation`` (a turn
    ends at ``eos_ids``; ``pad_id`` fills) and the reward functions ``reward_fns`` on ``decode``'d
    text (``on_error``, ``timeout_s``, ``pool``: ``relax.algorithms.online.stages.make_score_stages``).
    Otherwise ``rollout`` returns scored samples itself. ``passes``: the backend's pass layout
    (default ``choose_passes()``); ``off_policy``: the correction of stale batches;
    ``pipelined``: the order ``relax.train.pipeline`` runs; ``partial``: the single-turn rollout
    is partial rollouts' (``relax.rollout.partial``; its sampler config must be this step's)."""
    passes = choose_passes() if passes is None else passes
    temperature = parts.generation.temperature
    if temperature <= 0:
        raise ValueError(
            f"{parts.name}: temperature must be > 0 to train (the trainer's log-probs are the "
            f"sampler's at that temperature; 0 is greedy decoding), got {temperature}"
        )
    reference = (
        (make_reference(passes, parts.forward, temperature=temperature),)
        if parts.needs_reference
        else ()
    )
    if rollout is None:
        if decode is None:
            raise ValueError(
                "a single-turn step needs decode (token ids -> text) for its reward functions"
            )
        # a mixture of experts records its routes: replayed by the trainer, or compared (moe/routing_differ)
        rcfg = dataclasses.replace(
            parts.generation.rollout(eos_ids=eos_ids, pad_id=pad_id), record_routes=True
        )
        if partial is None:
            rollout = make_rollout(rcfg)
        elif not pipelined or dataclasses.replace(partial.cfg, record_routes=True) != rcfg:
            raise ValueError(
                f"{parts.name}: partial rollouts run pipelined, with the step's own sampler config"
            )
        else:
            rollout = make_partial_rollout(partial)
        pack = (make_packing(parts.packing, parts.forward),) if parts.packing is not None else ()
        middle = make_scoring(
            reward_fns,
            decode,
            reference=reference,
            pipelined=pipelined,
            host_after=parts.host_after,
            pack=pack,
            on_error=on_error,
            timeout_s=timeout_s,
            stop_strings=parts.generation.stop_strings,
            pool=pool,
        )
    else:  # pipelined: the rollout (with its environments) is the producer, the rest the consumer
        if partial is not None:
            raise ValueError(f"{parts.name}: partial rollouts are single-turn")
        if parts.host_after:
            raise ValueError(
                f"{parts.name}: a rollout that scores its own samples has no host stages after "
                "the rewards"
            )
        if parts.generation.stop_strings:
            raise ValueError(
                f"{parts.name}: stop_strings cut single-turn completions; a multi-turn rollout ends "
                f"its turns at its own stop tokens (got {parts.generation.stop_strings})"
            )
        middle = reference
    proximal = (
        (make_proximal(passes, parts.forward, temperature=temperature),)
        if needs_proximal_pass(off_policy, parts.optimizer_steps)
        else ()
    )
    return compose(
        rollout,
        *middle,
        *proximal,
        parts.advantage,
        *after_advantage,
        parts.make_update(passes, off_policy),
        name=parts.name,
    )
