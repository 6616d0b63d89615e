"""Stages every online algorithm shares: ``rollout`` (the prefix-shared sampler), ``score``
(reward functions on the host), ``reference`` (cached reference log-probs) and ``proximal``
(the trainer's log-probs before the update, for off-policy corrections); and the trainer's
log-probs of a micro-batch of prompt groups (``train_logprobs``).

Every sample carries ``policy_version``: the ``state.step`` of the weights that sampled it. A
synchronous step samples and updates at one version; the pipeline (``relax.train.pipeline``)
updates on samples up to its staleness bound older."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.online.batch import LossRows, Prompts, Sampled, Scored
from relax.algorithms.online.vision import policy_images
from relax.compose import Stage, WithHost, compose, stage
from relax.data.completion_layout import PackingConfig, pack_bins
from relax.models.forward.completion_packing import CompletionBins
from relax.models.forward.config import ForwardConfig
from relax.models.forward.forward_pass import attention_probs_bytes, resolve_attention
from relax.models.forward.prefix_shared import completion_logprobs
from relax.models.moe.experts import router_loss
from relax.passes import Passes
from relax.rewards.functions import (
    RewardFunction,
    as_reward_functions,
    combine_checked,
    score_groups,
    start_score_groups,
)
from relax.rewards.pool import RewardPool
from relax.rewards.token_rewards import TokenRewardFunction, score_tokens
from relax.rollout.partial import PartialRequest, PartialRollouts
from relax.rollout.sampler import RolloutConfig, generate_program
from relax.text.stop_strings import truncate_at_stop_strings
from relax.train.state import TrainState, reference_is_policy, reference_model
from relax.train.update import forward_groups
from relax.train.vision_tower import tower_is_initial

ROLLOUT_STREAM = (
    0x5EED  # the rollout's key: fold_in(state.key, ROLLOUT_STREAM); the update splits state.key
)


def make_rollout(rcfg: RolloutConfig) -> Stage:
    """G completions per prompt with the prefix-shared sampler; its log-probs are the old policy's."""

    def rollout(state: TrainState, batch: Prompts) -> tuple[TrainState, Sampled]:
        # the state is read, not changed: the update advances the key once per iteration
        key = jax.random.fold_in(state.key, ROLLOUT_STREAM)
        images = policy_images(state, batch)  # a trained tower's features: the state's
        r = generate_program(
            state.policy, batch.prompt_ids, batch.prompt_mask, key, rcfg, prompt=images
        )
        return state, Sampled.of(
            batch,
            tokens=r.tokens,
            mask=r.mask,
            old_logprobs=r.logprobs,
            lengths=r.lengths,
            finished=r.finished,
            policy_version=sample_versions(state, r.lengths),
            routes=r.routes,
        )

    # the rewards (a host stage) run next: if they raise, the caller's state is untouched
    return stage(rollout, name="rollout", updates_state=False, placement="sampler")


def make_partial_rollout(partial: PartialRollouts) -> Stage:
    """The host stage of partial rollouts (``relax.rollout.partial``): a ``PartialRequest`` ->
    the complete batch of its update, a ``Sampled`` batch with ``token_versions`` beside its host record.
    Its keys are ``make_rollout``'s, folded with each call's index."""

    def rollout(state: TrainState, request: PartialRequest) -> tuple[TrainState, WithHost]:
        c = state.policy.config
        if c.num_experts:
            raise ValueError(
                "partial rollouts do not record a mixture of experts' routes yet: run --async.partial 1"
            )
        key = jax.random.fold_in(state.key, ROLLOUT_STREAM)
        done = partial.produce(state.policy, int(state.step), key, request)
        sampled = done.versions >= 0
        oldest = np.where(sampled, done.versions, np.iinfo(np.int32).max).min(-1)
        out = Sampled(
            prompt_ids=jnp.asarray(done.prompt_ids),
            prompt_mask=jnp.asarray(done.prompt_mask),
            tokens=jnp.asarray(done.tokens),
            mask=jnp.asarray(done.mask),
            old_logprobs=jnp.asarray(done.logprobs),
            lengths=jnp.asarray(done.lengths),
            finished=jnp.asarray(done.finished),
            policy_version=jnp.asarray(oldest, jnp.int32),
            token_versions=jnp.asarray(done.versions),
        )
        return state, WithHost(out, done.record.replace(partial=dict(partial.last)))

    # on separate sampler devices (relax.parallel) the sampler's copy of the weights samples
    return stage(rollout, jit=False, name="rollout", updates_state=False, placement="sampler")


def sample_versions(state: TrainState, like: jax.Array) -> jax.Array:
    """``state.step`` for every sample (``like``'s shape, e.g. ``[P, G]``): the policy version."""
    return jnp.full(like.shape, state.step, jnp.int32)


def on_policy(state: TrainState, batch: Sampled) -> jax.Array:
    """Whether every sample of ``batch`` was drawn by the state's own policy (its version)."""
    return jnp.all(batch.policy_version == state.step)


def make_reference(passes: Passes, forward: ForwardConfig, *, temperature: float) -> Stage:
    """Reference log-probs of the sampled completions (when the state has a reference model),
    cached in the batch as ``ref_logprobs``; a stage of its own so that it can run where the
    reference lives (the trainer devices, see ``relax.parallel``).

    While the reference is bitwise the policy that sampled (``ref_is_policy``, also in the batch
    for the update), its log-probs are not recomputed: they ARE the policy's, the sampler's here
    (so a KL in the reward is exactly 0) and the trainer's own in the loss (``relax.train.update``),
    so the KL term and its gradient are exactly zero whatever the pass layout or mesh. A stale
    batch (sampled by an older version, ``relax.train.pipeline``) is never the policy's own: its
    reference log-probs are recomputed, and so is a batch of a trained vision tower's policy once
    the tower has changed (``relax.algorithms.online.vision``: the reference reads the initial
    tower's features)."""

    def reference(state: TrainState, batch: Scored) -> tuple[TrainState, Scored]:
        ref_model = reference_model(state)
        if ref_model is None:
            return state, batch
        same = (
            reference_is_policy(state, smallest_first=passes.cache_sized)
            & on_policy(state, batch)
            & tower_is_initial(state)
        )

        recompute = lambda: forward_logprobs(
            ref_model, batch, passes, forward, temperature=temperature
        )  # noqa: E731
        ref_logprobs = jax.lax.cond(same, lambda: batch.old_logprobs, recompute)
        return state, batch.replace(ref_logprobs=ref_logprobs, ref_is_policy=same)

    # it changes no state: its program returns the batch alone, and the step does not wait for it
    # before the host stage after it (the reward pool's scoring overlaps it)
    return stage(reference, name="reference", updates_state=False, reads_reference=True)


def forward_logprobs(
    model, batch: Scored, passes: Passes, forward: ForwardConfig, *, temperature: float
) -> jax.Array:
    """``model``'s log-probs ``[P, G, N]`` of the batch's completions, a forward without gradient
    (remat would recompute nothing), in the sampler's log-prob dtype; as many prompt groups (or
    packed bins) per pass as the passes' default micro-batch takes (``Passes.groups_per_pass``,
    ``Passes.bins_per_micro_batch``)."""
    bins = 1 if batch.packed is None else passes.bins_per_micro_batch(batch.packed.ids.shape[-1])
    logp = completion_logprobs(
        model,
        batch.prompt_ids,
        batch.prompt_mask,
        batch.tokens,
        batch.mask,
        forward.pass_(
            differentiated=False,
            groups_per_pass=forward_groups(passes, batch),
            bins_per_pass=bins,
        ),
        temperature=temperature,
        packed=batch.packed,
        routes=batch.routes,
        prompt=batch.images,
    )
    return jax.lax.stop_gradient(logp.astype(batch.old_logprobs.dtype))


def make_proximal(passes: Passes, forward: ForwardConfig, *, temperature: float) -> Stage:
    """The trainer's log-probs of the sampled completions under the state's policy before the
    update, ``prox_logprobs``: the proximal policy of a decoupled off-policy correction
    (``relax.objectives.off_policy``) when the update takes several optimizer steps."""

    def proximal(state: TrainState, batch: Scored) -> tuple[TrainState, Scored]:
        own = batch.replace(images=policy_images(state, batch))  # a trained tower's features
        prox = forward_logprobs(state.policy, own, passes, forward, temperature=temperature)
        return state, batch.replace(prox_logprobs=prox)

    return stage(proximal, name="proximal", updates_state=False)


def make_score(
    reward_fns: Sequence[RewardFunction | TokenRewardFunction | Callable],
    decode: Callable[[np.ndarray, np.ndarray], list[str]],
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
    stop_strings: tuple[str, ...] = (),
    pool: RewardPool | None = None,
) -> Stage:
    """The score as one host stage: ``make_score_stages``'s two halves back to back."""
    start, finish = make_score_stages(
        reward_fns,
        decode,
        on_error=on_error,
        timeout_s=timeout_s,
        stop_strings=stop_strings,
        pool=pool,
    )
    return compose(start, finish, name="score")


def make_score_stages(
    reward_fns: Sequence[RewardFunction | TokenRewardFunction | Callable],
    decode: Callable[[np.ndarray, np.ndarray], list[str]],
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
    stop_strings: tuple[str, ...] = (),
    pool: RewardPool | None = None,
    local_first: bool = False,
) -> tuple[Stage, Stage]:
    """Host stages ``(score_start, score_finish)``: reward functions score the decoded completions
    (``score_groups``: each prompt's text and dataset fields repeated over its G completions, TRL's
    layout), ``TokenRewardFunction``s run jitted on the token arrays, and all are combined by weight
    (a sample is missing, NaN, only when every function is missing for it).

    ``score_start`` first cuts completions at their first stop string (``relax.text.stop_strings``:
    ``mask``, ``lengths`` and ``finished`` replaced), decodes them, and hands the functions that
    ``pool`` hosts to its workers without waiting; ``score_finish`` runs the others here (in the
    trainer process: e.g. a ``TextRewardModel``, which holds device arrays), then waits for the
    pool and combines. A step that puts device work between the two (the reference log-probs)
    overlaps it with the pool's scoring: JAX dispatches it and returns at once. ``local_first``:
    ``score_start`` also runs the in-process functions, and ``score_finish`` only collects (the
    pipeline runs ``score_start`` while the device updates, and ``score_finish``, which
    ``waits``, later: ``relax.train.pipeline``)."""
    token_fns = tuple(f for f in reward_fns if isinstance(f, TokenRewardFunction))
    host = [f for f in reward_fns if not isinstance(f, TokenRewardFunction)]
    fns = (
        as_reward_functions(host) if host else ()
    )  # token rewards alone (e.g. a reward model) are enough
    if not fns and not token_fns:
        raise ValueError("make_score needs at least one reward function")
    pooled = tuple(f for f in fns if pool is not None and f in pool.reward_fns)
    local = tuple(f for f in fns if f not in pooled)

    def score_start(state, batch: WithHost) -> tuple[TrainState, WithHost]:
        out, host = Scored.of(batch.device), batch.host
        if stop_strings:
            mask, lengths, finished = truncate_at_stop_strings(
                out.tokens, out.mask, out.finished, decode, stop_strings
            )
            out = out.replace(
                mask=jnp.asarray(mask), lengths=jnp.asarray(lengths), finished=jnp.asarray(finished)
            )
        tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
        p, g, n = tokens.shape
        host = host.replace(completions=decode(tokens.reshape(p * g, n), mask.reshape(p * g, n)))
        if pooled:
            host = host.replace(
                pending_scores=start_score_groups(
                    pooled,
                    lambda *_: host.completions,
                    host.prompts,
                    host.fields,
                    tokens,
                    mask,
                    pool=pool,
                    on_error=on_error,
                    timeout_s=timeout_s,
                )
            )
        if local and local_first:
            host = host.replace(local_scores=score_local(out, host))
        return state, WithHost(out, host)

    def score_local(batch: Scored, host):
        return score_groups(
            local,
            lambda *_: host.completions,
            host.prompts,
            host.fields,
            batch.tokens,
            batch.mask,
            on_error=on_error,
            timeout_s=timeout_s,
        )

    def score_finish(state, batch: WithHost) -> tuple[TrainState, WithHost]:
        out, host = batch.device, batch.host
        parts: dict[str, np.ndarray] = {}
        info: dict = {"errors": 0, "timeouts": 0, "crashes": 0}
        runs = []
        if local:
            runs.append(host.local_scores if local_first else score_local(out, host))
        if pooled:
            runs.append(host.pending_scores.result())
        for _, per, run_info, _ in runs:
            parts.update(per)
            info = _merge_info(info, run_info)
        if token_fns:
            _, per = score_tokens(token_fns, out.prompt_ids, out.prompt_mask, out.tokens, out.mask)
            parts.update({k: np.asarray(v, np.float32) for k, v in per.items()})
        weights = {f.name: f.weight for f in (*fns, *token_fns)}
        total = combine_checked(parts, weights, completions=host.completions)
        out = out.replace(
            rewards=jnp.asarray(total, jnp.float32),
            reward_parts={k: jnp.asarray(v) for k, v in parts.items()},
        )
        return state, WithHost(
            out, host.replace(pending_scores=None, local_scores=None, reward_info=info)
        )

    return (
        stage(score_start, jit=False, name="score_start", updates_state=False),
        stage(score_finish, jit=False, name="score_finish", updates_state=False, waits=True),
    )


def make_packing(
    packing: PackingConfig, forward: ForwardConfig, passes: Passes, minibatches: int = 1
) -> Stage:
    """A host stage that packs the batch's prompts and completions across groups into bins for
    the training forwards (``relax.models.forward.completion_packing``): ``Scored.packed``, read
    by the reference, proximal and update stages, when ``packing`` applies to the policy's
    resolved ``train_attention`` (else the batch stays padded). The bins' number and size depend
    on the batch's shape only (one layout per prompt bucket), a multiple of ``minibatches`` times
    the devices the batch is split over."""

    def pack(state: TrainState, batch: WithHost) -> tuple[TrainState, WithHost]:
        attention = resolve_attention(forward.train_attention, state.policy)
        if not packing.applies(attention, passes.auto_packs):
            return state, batch
        d = batch.device
        if d.images is not None:  # the bins hold text prompts only: image prompts stay padded
            if packing.mode == "on":
                raise ValueError(
                    "packing mode 'on': image prompts train on padded completions; set "
                    "the trainer's packing mode (--grpo.packing.mode / --ppo.packing.mode) to "
                    "auto or off"
                )
            return state, batch
        if jax.process_count() > 1:  # the bins index a process's batch, not the global one
            if packing.mode == "on":
                raise ValueError(
                    "packing mode 'on': a multi-host run trains on padded completions (the bins "
                    "are built per process); set --grpo.packing.mode auto or off"
                )
            return state, batch
        p, lp = d.prompt_ids.shape
        _, g, n = d.tokens.shape
        block = passes.stream_block
        per = passes.bins_per_micro_batch(packing.slots(lp, n, block=block))  # whole micro-batches
        sizes = packing.sizes(
            p, g, lp, n, block=block, multiple=minibatches * passes.batch_shards * per
        )
        arrays = (d.prompt_ids, d.prompt_mask, d.tokens, d.mask)
        bins = pack_bins(*map(np.asarray, arrays), sizes)
        return state, batch.replace(device=d.replace(packed=jax.tree.map(jnp.asarray, bins)))

    return stage(pack, jit=False, name="pack", updates_state=False)


def packing_metrics(packed: CompletionBins | None) -> dict:
    """``pack_fill`` (real tokens, prompt copies and completions, per slot of the bins that hold
    any) and ``pack_bins`` (those bins) of a packed batch; none for a padded one."""
    if packed is None:
        return {}
    used = packed.num_pairs > 0
    real = jnp.sum((packed.docs > 0) & used[:, None]).astype(jnp.float32)
    bins = jnp.sum(used).astype(jnp.float32)
    return {
        "pack_fill": real / jnp.maximum(bins * packed.docs.shape[1], 1.0),
        "pack_bins": bins,
    }


def make_scoring(
    reward_fns,
    decode,
    *,
    reference: tuple[Stage, ...],
    pipelined: bool,
    host_after: tuple[Stage, ...] = (),
    pack: tuple[Stage, ...] = (),
    **score_kwargs,
) -> tuple[Stage, ...]:
    """The stages between the rollout and the advantage: ``score_start, pack, reference,
    score_finish, host_after`` (the reference forward overlaps the reward pool's scoring; ``pack``
    after the stop strings have cut the completions). ``pipelined`` (``relax.train.pipeline``):
    what reads the sampler's weights first, ``score_start`` (with the in-process reward
    functions), ``score_finish``, ``host_after``; then ``pack`` and the ``reference``, which runs
    with the update, on the models as they are then. ``score_kwargs``: ``make_score_stages``'s."""
    start, finish = make_score_stages(reward_fns, decode, local_first=pipelined, **score_kwargs)
    if pipelined:
        return (start, finish, *host_after, *pack, *reference)
    return (start, *pack, *reference, finish, *host_after)


def _merge_info(a: dict, b: dict) -> dict:
    """Two ``score`` infos as one: counts added, failed names joined, timings kept."""
    out = dict(a)
    for k, v in b.items():
        if isinstance(v, tuple):
            out[k] = tuple(out.get(k, ())) + v
        elif isinstance(v, int) and not k.startswith("time_s/"):
            out[k] = out.get(k, 0) + v
        else:
            out[k] = v
    return out


def train_logprobs(
    policy,
    mb: LossRows,
    passes: Passes,
    forward: ForwardConfig,
    *,
    temperature: float,
    entropy_grad: bool = True,
):
    """Trainer log-probs and entropies ``[P, G, N]`` of a micro-batch's completions (the
    prefix-shared forward run as ``forward`` says, laid out as ``passes`` say; ``mb.rope`` when
    precomputed; over ``mb.packed``'s bins when the batch was packed, ``make_packing``;
    replaying or comparing ``mb.routes`` as ``forward.moe`` says), and a mixture of experts' router loss
    (``relax.models.moe.experts.router_loss``: 0 for a dense model) with its routing metrics."""
    c = policy.config
    probs = None if mb.packed is not None else attention_probs_bytes(c, mb.prompt_ids, mb.tokens)
    how = dataclasses.replace(
        forward.pass_().laid_out(passes, c, probs),
        with_entropy=True,
        entropy_grad=entropy_grad,
        router_stats=True,
    )
    (logp, ent), stats = completion_logprobs(
        policy,
        mb.prompt_ids,
        mb.prompt_mask,
        mb.tokens,
        mb.mask,
        how,
        temperature=temperature,
        rope=mb.rope,
        packed=mb.packed,
        routes=mb.routes,
        prompt=mb.images,
    )
    router, metrics = router_loss(stats, forward.moe, c)
    return logp, ent, router, metrics
