"""The online batch, one type per phase: ``Prompts -> Sampled -> Scored -> Advantaged``, and
the rows a policy loss reads (``LossRows``). Host-only values ride beside it in a ``HostRecord``
(``relax.compose.WithHost``): jitted stages never see them.

    step input     WithHost(Prompts, HostRecord(prompts, fields))
    rollout        Prompts    -> Sampled     (the sampler; multi-turn: the environments too)
    score_start    Sampled    -> Scored      (stop strings cut; text decoded; pool started)
    pack           Scored.packed             (completions packed across groups into bins)
    reference      Scored.ref_logprobs, ref_is_policy
    score_finish   Scored.rewards, reward_parts; HostRecord.reward_info
    proximal       Scored.prox_logprobs
    advantage      Scored     -> Advantaged  (GRPO's GRPOBatch, PPO's PPOBatch extend it)
    update         Advantaged -> relax.train.update.Updated(batch, metrics, health)

Every phase is an ``equinox.Module`` that extends the one before (``Phase.of(previous,
**new_fields)``), so a stage reads ``batch.tokens`` whatever phase it is given. A field that a
run does not fill (no reference model, no packing, single-turn) is ``None``: an empty pytree,
so it costs nothing in a jitted program and is not sliced by the update. Shapes: ``p`` prompts,
``g`` completions per prompt, ``lp`` prompt tokens, ``n`` the completion budget.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, TypeVar

import equinox as eqx
from jaxtyping import Array, Bool, Float, Int

from relax.compose import WithHost
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.forward.completion_packing import CompletionBins
from relax.models.forward.prefix_shared import CompletionRope
from relax.models.forward.routes import Routes
from relax.models.layers.rope import Rotary
from relax.models.vision.families import Pixels

P = TypeVar("P", bound="Phase")


class Phase(eqx.Module):
    """The base of the batch types: ``of`` builds a later phase from an earlier one."""

    @classmethod
    def of(cls: type[P], previous: Phase, **fields: Any) -> P:
        """``cls`` with ``previous``'s fields (those ``cls`` has) and ``fields`` on top."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
        kept = {
            f.name: getattr(previous, f.name)
            for f in dataclasses.fields(previous)
            if f.name in names
        }
        return cls(**{**kept, **fields})

    def replace(self: P, **fields: Any) -> P:
        """A copy with ``fields`` replaced."""
        return dataclasses.replace(self, **fields)


class Prompts(Phase):
    """A step's input on the device.

    ``prompt_ids`` / ``prompt_mask``: the prompts, left-padded to a bucket length ``lp``.
    ``images``: image prompts' inputs to the layers (``relax.models.decoder.prompt_inputs``: the
    image features, computed once per prompt, their RoPE and attention), read by the sampler and
    every training forward; None: text prompts. ``pixels``: the images themselves, when the
    policy's vision tower trains (``--train-vision``): the sampler and the update compute the
    features from the state's tower (``relax.algorithms.online.vision``), and ``images`` holds
    the initial tower's (the reference's).
    """

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    images: PromptInputs | None = eqx.field(default=None, kw_only=True)
    pixels: Pixels | None = eqx.field(default=None, kw_only=True)


class Sampled(Prompts):
    """The sampled completions (``relax.algorithms.online.stages.make_rollout``).

    ``tokens`` / ``mask``: the completions, right-padded to the budget ``n`` (multi-turn: the
    sampled and the observation tokens in order; ``mask`` is every filled slot, what the
    trainer's forward attends). ``old_logprobs``: the sampler's log-probs of ``tokens``, the old
    policy's. ``lengths``: sampled tokens per completion; ``finished``: it ended (EOS, a stop
    string, the episode), not truncated at the budget. ``policy_version``: the ``state.step`` of
    the weights that sampled it (with partial rollouts, ``relax.rollout.partial``: its oldest
    token's; ``token_versions`` is then each sampled token's, ``-1`` elsewhere).
    Multi-turn trajectories (``relax.environments.rollout``) also fill ``sampled_mask`` (the
    policy's own tokens: the loss, the KL and the advantages), ``turn_rewards`` (per-turn rewards)
    and ``turn_index`` (each token's turn). ``routes``: a mixture-of-experts sampler's expert
    choices, for routing replay (``relax.models.forward.routes``; None: not recorded).
    """

    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    old_logprobs: Float[Array, "p g n"]
    lengths: Int[Array, "p g"]
    finished: Bool[Array, "p g"]
    policy_version: Int[Array, "p g"]
    sampled_mask: Int[Array, "p g n"] | None = None
    turn_rewards: Float[Array, "p g t"] | None = None
    turn_index: Int[Array, "p g n"] | None = None
    routes: Routes | None = None
    token_versions: Int[Array, "p g n"] | None = None

    @property
    def policy_tokens(self) -> Int[Array, "p g n"]:
        """The tokens the policy sampled: ``sampled_mask`` for trajectories, else ``mask``."""
        return self.mask if self.sampled_mask is None else self.sampled_mask


class Scored(Sampled):
    """The sampled batch with what the training forwards and the rewards add before the advantage.

    ``rewards``: the reward functions' weighted sum per completion (NaN: every function failed
    for it); ``reward_parts``: each function's own, by its name. ``packed``: the prompts and
    completions packed across groups into bins for the training forwards
    (``relax.models.forward.completion_packing``; None: padded). ``ref_logprobs``: the
    reference model's log-probs (None: no reference); ``ref_is_policy``: the reference was
    bitwise the sampling policy (its log-probs are the sampler's). ``prox_logprobs``: the
    trainer's log-probs before the update (the proximal policy of an off-policy correction;
    None: not needed).
    """

    rewards: Float[Array, "p g"] | None = None
    reward_parts: dict[str, Float[Array, "p g"]] | None = None
    packed: CompletionBins | None = None
    ref_logprobs: Float[Array, "p g n"] | None = None
    ref_is_policy: Bool[Array, ""] | None = None
    prox_logprobs: Float[Array, "p g n"] | None = None


class Advantaged(Scored):
    """The scored batch with what every policy loss reads: ``advantages`` (per completion
    ``[p, g]`` or per token ``[p, g, n]``) and ``loss_mask`` (the tokens the loss counts)."""

    advantages: Float[Array, "p g"] | Float[Array, "p g n"] | None = None
    loss_mask: Int[Array, "p g n"] | None = None


class LossRows(Phase):
    """What a policy loss reads, every leaf with the prompt axis first (the update slices them
    into micro-batches): ``Advantaged``'s fields of the same names, and ``rope``, the rotary
    tables of the completions computed once for every micro-batch (``completion_rope``; a
    ``Rotary`` of the bins' slots when ``packed``); ``routes``: the sampler's experts to replay
    (None: the forward routes itself). A packed batch's micro-batch holds its bins' completions
    as the rows ``[b, c, N]`` (``relax.algorithms.online.binned``)."""

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    loss_mask: Int[Array, "p g n"]
    old_logprobs: Float[Array, "p g n"]
    advantages: Float[Array, "p g"] | Float[Array, "p g n"]
    ref_logprobs: Float[Array, "p g n"] | None = None
    prox_logprobs: Float[Array, "p g n"] | None = None
    packed: CompletionBins | None = None
    rope: CompletionRope | Rotary | None = None
    routes: Routes | None = None
    images: PromptInputs | None = None


@dataclasses.dataclass(frozen=True)
class HostRecord:
    """What a step keeps on the host, beside its device batch.

    ``prompts``: the prompts' text; ``fields``: their dataset columns (answers, tests), by name;
    ``rows``: the dataset rows themselves (the multi-turn rollout builds its environments from
    them). ``completions``: the decoded completions (``p * g``, after the stop strings).
    ``pending_scores``: the reward pool's scores being computed; ``local_scores``: the in-process
    functions' when they ran early (the pipeline). ``reward_info``: error, timeout and crash counts
    and timings of the reward functions. ``agent``: the multi-turn rollout's host metrics;
    ``partial``: the partial rollouts' (``relax.rollout.partial``).
    """

    prompts: list[str] = dataclasses.field(default_factory=list)
    fields: dict[str, list] = dataclasses.field(default_factory=dict)
    rows: list[dict] | None = None
    completions: list[str] | None = None
    pending_scores: Future | None = None
    local_scores: Any = None
    reward_info: dict = dataclasses.field(default_factory=dict)
    agent: dict[str, float] | None = None
    partial: dict[str, float] | None = None

    def replace(self, **fields: Any) -> HostRecord:
        return dataclasses.replace(self, **fields)


def step_input(
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    prompts: list[str],
    fields: dict[str, list],
    images: PromptInputs | None = None,
    pixels: Pixels | None = None,
) -> WithHost:
    """An online step's input: the prompts on the device (``images``: image prompts' inputs;
    ``pixels``: their images, for a trained tower) and their text and dataset columns beside."""
    return WithHost(
        Prompts(prompt_ids, prompt_mask, images=images, pixels=pixels),
        HostRecord(prompts=list(prompts), fields=dict(fields)),
    )
