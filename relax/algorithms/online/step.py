"""One online step for GRPO, PPO and the multi-turn agent trainer::

    step = make_online_step(algorithm, parts)
         = compose(rollout, [scoring], [reference], [proximal], advantage, [after_advantage], update)

An algorithm brings its ``OnlineParts``: what it samples (``GenerationConfig``) and how its
forwards run (``ForwardConfig``), whether it needs a reference model, its optimizer steps per
update, its advantage stage and its update (policy loss, reference rule, critic), and host
stages of its own after the rewards (VinePPO's Monte-Carlo values). The caller brings its
``StepParts``: the reward functions and what they need (decode, stop tokens, error policy,
timeout, worker pool) and the schedule (passes, off-policy correction, pipelined, partial
rollouts). The factory decides the rest once: the sampler's config, the scoring stages
(``relax.algorithms.online.stages.make_scoring``: the reward pool overlaps the reference
forward), the packing, the reference and proximal stages (``needs_proximal_pass``: an off-policy
correction of a multi-step update), the order the pipeline runs (``pipelined``). A multi-turn
rollout (``OnlineParts.rollout``) scores its own trajectories (the environments' rewards): it
replaces the sampler and the scoring.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

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
    padded completions), the bins a multiple of ``minibatches``; ``host_after``: host stages
    after the rewards; ``rollout``: a rollout that scores its own samples (a multi-turn one;
    None: the prefix-shared sampler and the ``StepParts``' reward functions);
    ``after_advantage``: stages between the advantage and the update."""

    name: str
    generation: GenerationConfig
    forward: ForwardConfig
    needs_reference: bool
    optimizer_steps: int
    advantage: Stage
    make_update: Callable[[Passes, OffPolicyConfig | None], Stage]
    packing: PackingConfig | None = None
    minibatches: int = 1
    host_after: tuple[Stage, ...] = ()
    rollout: Stage | None = None
    after_advantage: tuple[Stage, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What a caller brings to an online step besides the algorithm's config, one object for
    every online step factory (``make_online_step``, ``make_grpo_step``, ``make_ppo_step``, the
    agent trainer's)::

        step = make_grpo_step(cfg, StepParts(reward_fns=[exact], decode=decode, eos_ids=(2,)))

    How samples are scored: ``reward_fns`` on the ``decode``'d text (``decode(tokens, mask) ->
    list[str]``), a turn ending at ``eos_ids``, ``pad_id`` filling; ``on_error``, ``timeout_s``
    and ``pool`` (the reward functions it hosts run in its workers while the device computes the
    reference log-probs) as ``relax.algorithms.online.stages.make_scoring``'s. A rollout that
    scores its own samples (the agent trainer's environments) reads only ``pad_id``.

    How the step is scheduled: ``passes``, the backend's pass layout (None: ``choose_passes()``,
    one device; on a mesh ``choose_passes(batch_shards=...)``); ``off_policy``, the correction of
    stale batches; ``pipelined``, the order ``relax.train.pipeline`` runs; ``partial``, the
    single-turn rollout is partial rollouts' (``relax.rollout.partial``; its sampler config must
    be the step's).

    Attributes:
        reward_fns: the reward functions: ``RewardFunction`` objects or plain callables, run on
            the decoded text, and ``TokenRewardFunction`` objects, run on the token arrays.
            A single-turn step needs at least one; a step whose rollout scores its own samples
            takes none.
        decode: ``decode(tokens, mask) -> list[str]``: the completions' text from numpy
            ``[b n]`` token ids and mask, ``b = p * g``. A single-turn step needs it.
        eos_ids: the tokens that end a completion. Default ``()``: none, every completion runs
            to the budget.
        pad_id: the token that fills the completions after their end (default 0).
        on_error: what a failing reward call does: ``"raise"`` (default) stops the step with a
            ``RewardError``; ``"missing"`` makes its values NaN and counts it.
        timeout_s: the time limit of one reward call, in seconds, raised to what a function
            declares for its rows (``time_bound_s``). None (default): no limit.
        pool: a ``relax.rewards.pool.RewardPool``: the reward functions it hosts run in its
            worker processes. None (default): every function runs in this process.
        passes: the backend's pass layout (``relax.passes.Passes``). None: ``choose_passes()``.
        off_policy: the correction of stale batches
            (``relax.objectives.off_policy.OffPolicyConfig``). None (default): none.
        pipelined: True: the stages in the order ``relax.train.pipeline`` runs them (what reads
            the sampler's weights first). Default False.
        partial: partial rollouts (``relax.rollout.partial.PartialRollouts``) in place of the
            sampler; single-turn and ``pipelined`` only. None (default): the prefix-shared
            sampler.
    """

    reward_fns: Sequence = ()
    decode: Callable[[np.ndarray, np.ndarray], list[str]] | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    on_error: str = "raise"
    timeout_s: float | None = None
    pool: RewardPool | None = None
    passes: Passes | None = None
    off_policy: OffPolicyConfig | None = None
    pipelined: bool = False
    partial: PartialRollouts | None = None


def make_online_step(algorithm: OnlineParts, parts: StepParts) -> Stage:
    """``step(state, batch) -> (state, out)`` of ``algorithm`` with the caller's ``parts``
    (module docstring).

    Single-turn (``algorithm.rollout`` None): the prefix-shared sampler of
    ``algorithm.generation`` and the reward functions of ``parts``. Otherwise the algorithm's
    rollout returns scored samples itself.

    Args:
        algorithm: the algorithm's ``OnlineParts``: its sampler and forward configs, whether it
            needs a reference model, its advantage and update stages, and its own rollout (a
            multi-turn one) or None. Its ``generation.temperature`` must be > 0.
        parts: the caller's ``StepParts``: the reward functions and what they need, and the
            schedule (``passes``, ``off_policy``, ``pipelined``, ``partial``).

    Returns:
        A ``Stage`` named ``algorithm.name``, ``step(state, batch) -> (state, out)``. Single-turn,
            ``batch`` is a ``WithHost(Prompts, HostRecord)``
            (``relax.algorithms.online.batch.step_input``), or with ``parts.partial`` a
            ``PartialRequest``; with its own rollout, what that rollout reads. ``out`` is a
            ``WithHost(Updated, HostRecord)``: the update's ``relax.train.update.Updated`` (the
            batch it trained on, ``metrics``, ``health``) and the host record (single-turn: with the
            decoded completions and ``reward_info``). ``state`` is the ``TrainState`` the algorithm
            trains.
    """
    passes = choose_passes() if parts.passes is None else parts.passes
    temperature = algorithm.generation.temperature
    if temperature <= 0:
        raise ValueError(
            f"{algorithm.name}: temperature must be > 0 to train (the trainer's log-probs are the "
            f"sampler's at that temperature; 0 is greedy decoding), got {temperature}"
        )
    reference = (
        (make_reference(passes, algorithm.forward, temperature=temperature),)
        if algorithm.needs_reference
        else ()
    )
    if algorithm.rollout is None:
        rollout, middle = _single_turn(algorithm, parts, reference, passes)
    else:  # pipelined: the rollout (with its environments) is the producer, the rest the consumer
        _check_scored_rollout(algorithm, parts)
        rollout, middle = algorithm.rollout, reference
    proximal = (
        (make_proximal(passes, algorithm.forward, temperature=temperature),)
        if needs_proximal_pass(parts.off_policy, algorithm.optimizer_steps)
        else ()
    )
    return compose(
        rollout,
        *middle,
        *proximal,
        algorithm.advantage,
        *algorithm.after_advantage,
        algorithm.make_update(passes, parts.off_policy),
        name=algorithm.name,
    )


def _single_turn(
    algorithm: OnlineParts, parts: StepParts, reference: tuple[Stage, ...], passes: Passes
) -> tuple[Stage, tuple[Stage, ...]]:
    """The sampler (or the partial rollouts) and the scoring stages around ``reference``."""
    if parts.decode is None:
        raise ValueError(
            "a single-turn step needs decode (token ids -> text) for its reward functions"
        )
    # a mixture of experts records its routes: replayed by the trainer, or compared (moe/routing_differ)
    rcfg = dataclasses.replace(
        algorithm.generation.rollout(eos_ids=parts.eos_ids, pad_id=parts.pad_id),
        record_routes=True,
    )
    if parts.partial is None:
        rollout = make_rollout(rcfg)
    elif not parts.pipelined or dataclasses.replace(parts.partial.cfg, record_routes=True) != rcfg:
        raise ValueError(
            f"{algorithm.name}: partial rollouts run pipelined, with the step's own sampler config"
        )
    else:
        rollout = make_partial_rollout(parts.partial)
    pack = (
        (make_packing(algorithm.packing, algorithm.forward, passes, algorithm.minibatches),)
        if algorithm.packing is not None
        else ()
    )
    middle = make_scoring(
        parts.reward_fns,
        parts.decode,
        reference=reference,
        pipelined=parts.pipelined,
        host_after=algorithm.host_after,
        pack=pack,
        on_error=parts.on_error,
        timeout_s=parts.timeout_s,
        stop_strings=algorithm.generation.stop_strings,
        pool=parts.pool,
    )
    return rollout, middle


def _check_scored_rollout(algorithm: OnlineParts, parts: StepParts) -> None:
    """A rollout that scores its own samples takes no reward functions, partial rollouts, host
    stages after the rewards or stop strings."""
    if parts.reward_fns or parts.pool is not None:
        raise ValueError(
            f"{algorithm.name}: its rollout scores its own samples; the parts' reward functions "
            "and pool would not run"
        )
    if parts.partial is not None:
        raise ValueError(f"{algorithm.name}: partial rollouts are single-turn")
    if algorithm.host_after:
        raise ValueError(
            f"{algorithm.name}: a rollout that scores its own samples has no host stages after "
            "the rewards"
        )
    if algorithm.generation.stop_strings:
        raise ValueError(
            f"{algorithm.name}: stop_strings cut single-turn completions; a multi-turn rollout ends "
            f"its turns at its own stop tokens (got {algorithm.generation.stop_strings})"
        )
