"""VinePPO's Monte-Carlo state values (Kazemnejad et al. 2024): no critic; the value of the
state before completion token ``t`` is the mean score of ``K`` completions re-sampled from it.

For every sampled completion and every branch point ``t_j = j * vine_every < length``, the
prefix ``prompt + tokens[:t_j]`` becomes a new prompt; the prefix-shared sampler decodes its
``K = vine_rollouts`` branches from ONE prefill of it (the K branches share its KV cache, as
G completions share a prompt's), each branch cut to the original budget ``N - t_j``, and the
reward functions score ``tokens[:t_j] + branch``::

    V(s_{t_j}) = mean_k score(prompt, tokens[:t_j] + branch_k)          (``mc_values`` [P, G, J])
    A_t = V(s_{t_{j+1}}) - V(s_{t_j})   for every t_j <= t < t_{j+1}      (``step_advantages``)

where the state after the completion's last step is terminal, its value the completion's own
score: every token of a step gets the step's advantage (VinePPO's credit assignment; with
``vine_every = 1`` it is ``relax.objectives.advantages.vineppo_advantages``).

Cost per iteration: ``P * G * ceil(N / vine_every)`` extra prefills of at most ``Lp + N`` tokens
and ``K`` times as many decodes of ``N`` tokens, all scored on the host.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.algorithms.ppo.batch import PPOBatch
from relax.compose import Stage, WithHost, stage
from relax.rewards.functions import as_reward_functions, score_groups
from relax.rollout.sampler import RolloutConfig, generate_with

VINE_STREAM = 0x7105  # the branches' key: fold_in(state.key, VINE_STREAM)


def branch_prompts(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    tokens: np.ndarray,
    lengths: np.ndarray,
    every: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Left-padded prefixes ``prompt + tokens[:t_j]`` ``[P*G*J, Lp + N]`` (with their mask) and the
    branch points ``t_j`` ``[J]``; rows are ordered (p, g, j)."""
    p, g, n = tokens.shape
    points = np.arange(0, n, every)
    width = prompt_ids.shape[1] + n
    ids = np.zeros((p, g, len(points), width), np.int32)
    mask = np.zeros_like(ids)
    for i in range(p):
        prompt = prompt_ids[i][prompt_mask[i] > 0]
        for k in range(g):
            for j, t in enumerate(points):
                row = np.concatenate([prompt, tokens[i, k, : min(t, lengths[i, k])]])
                ids[i, k, j, width - len(row) :] = row
                mask[i, k, j, width - len(row) :] = 1
    return ids.reshape(-1, width), mask.reshape(-1, width), points


def make_mc_values(
    cfg,
    rcfg: RolloutConfig,
    reward_fns,
    decode,
    *,
    on_error: str = "raise",
    timeout_s: float | None = None,
) -> Stage:
    """Host stage adding ``mc_values`` ``[P, G, J]`` (module docstring) to the batch; a batch
    of image prompts is refused (``ValueError``: the branches' prefixes are text)."""
    fns = as_reward_functions(reward_fns)
    branch_cfg = RolloutConfig(
        num_generations=cfg.vine_rollouts,
        max_new_tokens=rcfg.max_new_tokens,
        sampling=rcfg.sampling,
        eos_ids=rcfg.eos_ids,
        pad_id=rcfg.pad_id,
        prompt_buckets=rcfg.prompt_buckets,
    )

    def mc_values(state, batch: WithHost) -> tuple[Any, WithHost]:
        scored, host = batch.device, batch.host
        if scored.images is not None:
            raise ValueError(
                "VinePPO branches from text prefixes (prompt + tokens[:t]): image prompts "
                "(Prompts.images) take PPO's critic, advantage='gae'"
            )
        tokens, mask = np.asarray(scored.tokens), np.asarray(scored.mask)
        lengths = np.asarray(scored.lengths)
        p, g, n = tokens.shape
        ids, pmask, points = branch_prompts(
            np.asarray(scored.prompt_ids),
            np.asarray(scored.prompt_mask),
            tokens,
            lengths,
            cfg.vine_every,
        )
        key = jax.random.fold_in(state.key, VINE_STREAM)
        branches = generate_with(state.policy, ids, pmask, key, branch_cfg)
        j, k = len(points), cfg.vine_rollouts
        done = np.minimum(
            points[None, None, :], lengths[..., None]
        )  # tokens already in each prefix
        full, full_mask = _joined(
            tokens,
            mask,
            done,
            np.asarray(branches.tokens).reshape(p, g, j, k, n),
            np.asarray(branches.mask).reshape(p, g, j, k, n),
        )
        prompts = [t for t in host.prompts for _ in range(g * j)]
        fields = {
            name: [v for v in vals for _ in range(g * j)] for name, vals in host.fields.items()
        }
        total, _, _, _ = score_groups(
            fns,
            decode,
            prompts,
            fields,
            full.reshape(p * g * j, k, n),
            full_mask.reshape(p * g * j, k, n),
            on_error=on_error,
            timeout_s=timeout_s,
        )
        values = (
            np.nanmean(np.where(np.isfinite(total), total, np.nan), axis=-1)
            if total.size
            else total
        )
        values = np.nan_to_num(values.reshape(p, g, j), nan=0.0)
        return state, batch.replace(
            device=PPOBatch.of(scored, mc_values=jnp.asarray(values, jnp.float32))
        )

    return stage(mc_values, jit=False, name="mc_values", updates_state=False)


def _joined(tokens, mask, done, branch_tokens, branch_mask):
    """``tokens[:t_j] + branch[:N - t_j]`` per (p, g, j, k), right-padded to ``N``."""
    p, g, n = tokens.shape
    j, k = branch_tokens.shape[2:4]
    out = np.zeros((p, g, j, k, n), np.int32)
    out_mask = np.zeros_like(out)
    for idx in np.ndindex(p, g, j):
        d = int(done[idx])
        out[idx][:, :d] = tokens[idx[:2]][:d]
        out_mask[idx][:, :d] = mask[idx[:2]][:d]
        out[idx][:, d:] = branch_tokens[idx][:, : n - d]
        out_mask[idx][:, d:] = branch_mask[idx][:, : n - d]
    return out, out_mask


def step_advantages(
    values: Float[Array, "p g j"],
    lengths: Int[Array, "p g"],
    terminal: Float[Array, "p g"],
    *,
    every: int,
    n: int,
) -> Float[Array, "p g n"]:
    """``A_t = V(s_{t_{j+1}}) - V(s_{t_j})`` for the tokens of step ``j`` (``t_j = j * every``), the
    value after the last step (``t_{j+1} >= length``) being ``terminal``; 0 past ``length``."""
    starts = jnp.arange(values.shape[-1]) * every
    inside = (
        starts[1:] < lengths[..., None]
    )  # [P, G, J-1]: the next step starts inside the completion
    after = jnp.where(inside, values[..., 1:], terminal[..., None])
    after = jnp.concatenate([after, terminal[..., None]], axis=-1)
    adv = (after - values)[..., jnp.arange(n) // every]
    return jnp.where(jnp.arange(n) < lengths[..., None], adv, 0.0)


def branch_cost(p: int, g: int, n: int, every: int, rollouts: int) -> dict[str, int]:
    """Extra prefills and decoded sequences VinePPO adds per iteration (for the docs and metrics)."""
    points = math.ceil(n / every)
    return {"prefills": p * g * points, "decoded_sequences": p * g * points * rollouts}
