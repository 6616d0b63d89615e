"""Advantage estimators: GRPO / Dr.GRPO, RLOO, REINFORCE++, GAE, Monte-Carlo and k-step returns, VinePPO.

Conventions shared by every function here:

- Outcome rewards are ``[P, G]``: P prompts x G completions. ``NaN`` marks a missing reward (a
  failed reward call, a filtered sample): it is excluded from every statistic and its advantage
  is exactly 0.
- Token arrays are ``[N, T]`` (or ``[P, G, T]``) with an explicit ``mask`` of the same shape (bool
  or 0/1). Masked positions never contribute, whatever they hold, and the outputs are exactly 0
  there. Interior masked tokens (e.g. tool-output tokens inside a multi-turn completion) are
  skipped: the recursions carry their state straight through them, as verl's GAE does.
- Statistics are accumulated in at least float32 (bfloat16 inputs give float32 outputs; float64
  stays float64).
- Nothing here calls ``stop_gradient``: advantages and returns are targets, and the losses treat
  them as constants (they never differentiate through them).
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from relax.masked import at_least_float32, masked_mean, masked_var, masked_whiten, token_inputs

GRPO_SCALES = ("group", "batch", "none")


def _outcome(rewards: Float[Array, "p g"]) -> tuple[Array, Array, Array, Array]:
    """``(r with NaN -> 0, valid, n_valid [P,1], informative)`` for a ``[P, G]`` reward array.

    ``informative`` marks valid rewards of groups with at least two valid rewards that are not
    all identical; every other entry gets advantage exactly 0 (not eps-noise).
    """
    chex.assert_rank(
        rewards, 2, custom_message=f"rewards must be [P, G], got shape {jnp.shape(rewards)}"
    )
    r = at_least_float32(rewards)
    valid = ~jnp.isnan(r)
    r0 = jnp.where(valid, r, 0.0)
    n = valid.sum(axis=-1, keepdims=True)
    hi = jnp.max(jnp.where(valid, r0, -jnp.inf), axis=-1, keepdims=True)
    lo = jnp.min(jnp.where(valid, r0, jnp.inf), axis=-1, keepdims=True)
    return r0, valid, n, valid & (n > 1) & (hi > lo)


def grpo(
    rewards: Float[Array, "p g"], *, scale: str = "group", eps: float = 1e-4
) -> Float[Array, "p g"]:
    """Group-relative advantages ``A_ij = (r_ij - mean_j r_ij) / (std + eps)``.

    ``scale`` (TRL's ``scale_rewards``):

    - ``"group"``: ``std`` = unbiased (ddof=1) std of prompt i's valid rewards (GRPO).
    - ``"batch"``: ``std`` = unbiased std of all valid rewards of the batch (around the batch
      mean); the mean is still the group's (TRL's ``scale_rewards="batch"``).
    - ``"none"``: no division, ``A_ij = r_ij - mean_j r_ij`` (Dr.GRPO; verl's
      ``norm_adv_by_std_in_grpo=False``).

    ``eps = 1e-4`` is TRL's constant (verl uses 1e-6). Missing (NaN) rewards are excluded and get
    0. Groups whose valid rewards are all identical, or that have a single valid reward, get
    exactly 0; verl instead returns ``r / (1 + eps)`` for a single-sample group (mean 0, std 1).
    Example: one group ``[1, 0, 0, 1]`` gives ``+-0.5 / (sqrt(1/3) + 1e-4) = +-0.8658754``.
    """
    if scale not in GRPO_SCALES:
        raise ValueError(f"unknown GRPO scale {scale!r}; valid: {', '.join(GRPO_SCALES)}")
    r0, valid, _, informative = _outcome(rewards)
    centred = r0 - masked_mean(r0, valid, axis=-1)[:, None]
    if scale == "none":
        return jnp.where(informative, centred, 0.0)
    if scale == "group":
        std = jnp.sqrt(masked_var(r0, valid, axis=-1))[:, None]
    else:
        std = jnp.sqrt(masked_var(r0, valid))
    return jnp.where(informative, centred / jnp.where(informative, std + eps, 1.0), 0.0)


def turn_grpo(
    turn_rewards: Float[Array, "p g k"],
    turn_index: Int[Array, "p g t"],
    mask: Bool[Array, "p g t"],
    *,
    eps: float = 1e-4,
) -> Float[Array, "p g t"]:
    """Per-turn GRPO advantages of multi-turn trajectories: each token of turn ``k`` gets its turn's
    reward-to-go against the group's baseline of whole-trajectory returns::

        R_k = sum_{j >= k} r_j,    A_t = (R_{turn(t)} - mean_g R_0) / (std_g R_0 + eps)

    so a turn is credited with the rewards that follow it, not those before it; with a reward on
    the last turn only it is ``grpo`` broadcast to the tokens. A trajectory whose return is NaN
    (a failed environment) and an all-equal group get 0, as in ``grpo``; so do masked tokens.
    """
    chex.assert_rank([turn_rewards, turn_index, mask], 3)
    r = at_least_float32(turn_rewards)
    to_go = jnp.flip(jnp.cumsum(jnp.flip(jnp.where(jnp.isnan(r), 0.0, r), -1), -1), -1)  # [P, G, K]
    total = jnp.where(jnp.any(jnp.isnan(r), -1), jnp.nan, to_go[..., 0])
    r0, valid, _, informative = _outcome(total)
    mean = masked_mean(r0, valid, axis=-1)[:, None]
    std = jnp.sqrt(masked_var(r0, valid, axis=-1))[:, None]
    adv = (to_go - mean[..., None]) / jnp.where(informative, std + eps, 1.0)[..., None]
    per_token = jnp.take_along_axis(adv, jnp.clip(turn_index, 0, r.shape[-1] - 1), axis=-1)
    keep = jnp.asarray(mask).astype(bool) & (turn_index >= 0) & informative[..., None]
    return jnp.where(keep, per_token, 0.0)


def rloo(rewards: Float[Array, "p g"]) -> Float[Array, "p g"]:
    """Leave-one-out baseline: ``A_ij = r_ij - (1 / (n_i - 1)) sum_{k != j} r_ik``.

    ``n_i`` counts the valid (non-NaN) rewards of prompt i; missing rewards are excluded from the
    baseline and get 0. Equal to verl's ``compute_rloo_outcome_advantage`` (``r n/(n-1) -
    mean n/(n-1)``) except that a group with a single valid reward, or with identical rewards,
    gets exactly 0 (verl keeps the raw reward for a single-sample group).
    Example: ``[1, 0, 0, 0]`` gives ``[1, -1/3, -1/3, -1/3]``.
    """
    r0, _, n, informative = _outcome(rewards)
    baseline = (r0.sum(axis=-1, keepdims=True) - r0) / jnp.maximum(n - 1, 1)
    return jnp.where(informative, r0 - baseline, 0.0)


def broadcast_to_tokens(adv: Float[Array, "*b"], mask: Bool[Array, "*b t"]) -> Float[Array, "*b t"]:
    """Per-sequence values to per-token values: ``out[..., t] = adv[...] if mask[..., t] else 0``."""
    adv = jnp.asarray(adv)
    shapes = f"mask must be adv's shape + [T]: adv={adv.shape}, mask={jnp.shape(mask)}"
    chex.assert_rank(mask, adv.ndim + 1, custom_message=shapes)
    chex.assert_equal_shape_prefix([adv, mask], adv.ndim, custom_message=shapes)
    return jnp.where(jnp.asarray(mask).astype(bool), at_least_float32(adv)[..., None], 0.0)


def whiten(
    x: Float[Array, "*s"], mask: Bool[Array, "*s"], shift_mean: bool = True
) -> Float[Array, "*s"]:
    """verl's ``masked_whiten``: ``(x - mu) / sqrt(var + 1e-8)`` over all valid entries.

    ``mu`` is the masked mean and ``var`` the unbiased (ddof=1) masked variance, as verl computes
    them; ``shift_mean=False`` adds ``mu`` back. Differences from verl: masked entries of the
    result are 0, and fewer than two valid entries give ``var = 0`` instead of raising.
    """
    return masked_whiten(x, mask, shift_mean=shift_mean)


def _reverse_scan(step, init, *xs: Array) -> Array:
    """Run ``step`` right to left over the time axis of ``[N, T]`` arrays; returns ``[N, T]``."""
    _, out = lax.scan(step, init, tuple(x.T for x in xs), reverse=True)
    return out.T


def mc_returns(
    token_rewards: Float[Array, "n t"], mask: Bool[Array, "n t"], gamma: float = 1.0
) -> Float[Array, "n t"]:
    """Monte-Carlo return to go ``G_t = r_t + gamma G_{t+1}`` over valid tokens (VinePPO, REINFORCE).

    A reverse ``lax.scan``; ``G`` after the last valid token is 0 and masked tokens are skipped
    (their reward is ignored and the return passes through them undiscounted).
    """
    r, m = token_inputs(mask, token_rewards=token_rewards)

    def step(carry, x):
        r_t, m_t = x
        g = r_t + gamma * carry
        return jnp.where(m_t, g, carry), jnp.where(m_t, g, 0.0)

    return _reverse_scan(step, jnp.zeros(r.shape[:1], r.dtype), r, m)


def reinforce_pp(
    token_rewards: Float[Array, "n t"], mask: Bool[Array, "n t"], *, gamma: float = 1.0
) -> Float[Array, "n t"]:
    """REINFORCE++ advantages: ``A = whiten(G)`` with ``G = mc_returns(r, mask, gamma)``.

    The whitening statistics are over all valid tokens of the batch (verl's
    ``compute_reinforce_plus_plus_outcome_advantage``). verl returns ``(advantages, returns)``;
    this returns the advantages only (the returns are ``mc_returns``). verl resets the running
    return at any masked token while here interior masked tokens are skipped; with right padding
    the two agree.
    """
    return whiten(mc_returns(token_rewards, mask, gamma), mask)


def reinforce_pp_baseline(
    rewards: Float[Array, "p g"], mask: Bool[Array, "p g t"]
) -> Float[Array, "p g t"]:
    """REINFORCE++-baseline: ``A_ijt = whiten(r_ij - mean_k r_ik)`` broadcast to valid tokens.

    The group mean is subtracted per prompt, the result is broadcast to the completion's valid
    tokens and whitened over all valid tokens of the batch (verl's
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``). Differences from verl: missing
    (NaN) rewards get 0 and their tokens are left out of the whitening statistics; a group with a
    single valid reward is centred to 0 (verl leaves its raw reward, i.e. subtracts mean 0), so
    that no un-baselined reward enters a batch of centred ones.
    """
    chex.assert_rank(mask, 3, custom_message=f"mask must be [P, G, T], got {jnp.shape(mask)}")
    r0, valid, n, _ = _outcome(rewards)
    chex.assert_equal_shape_prefix(
        [r0, mask], 2, custom_message=f"rewards={r0.shape}, mask={jnp.shape(mask)}"
    )
    centred = jnp.where(valid & (n > 1), r0 - masked_mean(r0, valid, axis=-1)[:, None], 0.0)
    tokens = jnp.asarray(mask).astype(bool) & valid[..., None]
    return whiten(broadcast_to_tokens(centred, tokens), tokens)


def gae(
    rewards: Float[Array, "n t"],
    values: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    gamma: float,
    lam: float,
) -> tuple[Float[Array, "n t"], Float[Array, "n t"]]:
    """Generalised advantage estimation (Schulman et al. 2016), a masked reverse ``lax.scan``.

    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``,
    ``returns_t = A_t + V_t``. ``V_{t+1}`` and ``A_{t+1}`` are those of the next *valid* token
    (verl's ``compute_gae_advantage_return`` carries them through masked tokens the same way), and
    both are 0 after the last valid token, so padding never propagates. Unlike verl the
    advantages are not whitened here (compose with ``whiten``), and masked outputs are 0.
    """
    r, v, m = token_inputs(mask, rewards=rewards, values=values)

    def step(carry, x):
        next_v, next_a = carry
        r_t, v_t, m_t = x
        a = r_t + gamma * next_v - v_t + gamma * lam * next_a
        return (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a, next_a)), jnp.where(m_t, a, 0.0)

    zeros = jnp.zeros(r.shape[:1], r.dtype)
    adv = _reverse_scan(step, (zeros, zeros), r, v, m)
    return adv, jnp.where(m, adv + v, 0.0)


def _compact(x: Array, order: Array) -> Array:
    return jnp.take_along_axis(x, order, axis=-1)


def truncated_returns(
    token_rewards: Float[Array, "n t"],
    values: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    gamma: float,
    k: int,
) -> Float[Array, "n t"]:
    """k-step bootstrapped returns ``R_t = sum_{i<k} gamma^i r_{t+i} + gamma^k V_{t+k}``.

    Steps count valid tokens (masked tokens are skipped); rewards and values beyond the last valid
    token are 0, so ``k >= T`` gives ``mc_returns``. Computed in O(1) ops for any static ``k``:
    valid tokens are moved to the front of each row (a stable sort), then
    ``R_t = G_t - gamma^k G_{t+k} + gamma^k V_{t+k}`` with ``G = mc_returns``, then moved back.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a Python int >= 1, got {k!r}")
    r, v, m = token_inputs(mask, token_rewards=token_rewards, values=values)
    order = jnp.argsort(~m, axis=-1, stable=True)
    rc, vc, mc = _compact(r, order), _compact(v, order), _compact(m, order)
    g = mc_returns(rc, mc, gamma)
    shift = min(k, r.shape[-1])

    def ahead(x):  # x[t + k], 0 past the end
        return jnp.pad(x[:, shift:], ((0, 0), (0, shift)))

    gk = jnp.asarray(gamma, g.dtype) ** k
    out = jnp.where(mc, g - gk * ahead(g) + gk * ahead(vc), 0.0)
    return _compact(out, jnp.argsort(order, axis=-1))


def vineppo_advantages(
    mc_values: Float[Array, "n t"],
    mask: Bool[Array, "n t"],
    *,
    terminal_values: Float[Array, " n"],
) -> Float[Array, "n t"]:
    """VinePPO advantages ``A_t = V(s_{t+1}) - V(s_t)`` from Monte-Carlo value estimates.

    Convention: ``mc_values[:, t] = V(s_t)``, the MC estimate (mean outcome reward of rollouts
    resampled from the state) of the state *before* token t is emitted, i.e. prompt plus
    completion tokens ``< t``. ``V(s_{t+1})`` is the value of the next valid token's state;
    after the last valid token it is ``terminal_values`` (the completion's own outcome reward,
    or 0 for a truncated completion you do not want to credit). This is VinePPO's
    ``r_t + gamma V(s_{t+1}) - V(s_t)`` with gamma = 1 and the outcome reward as the terminal
    state's value. When values are estimated only at step boundaries, give every token of a step
    the value of its step's first state.
    """
    v, m = token_inputs(mask, mc_values=mc_values)
    chex.assert_shape(terminal_values, v.shape[:1], custom_message="terminal_values must be [N]")

    def step(next_v, x):
        v_t, m_t = x
        return jnp.where(m_t, v_t, next_v), jnp.where(m_t, next_v - v_t, 0.0)

    return _reverse_scan(step, at_least_float32(terminal_values).astype(v.dtype), v, m)
