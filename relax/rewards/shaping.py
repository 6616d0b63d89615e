"""Reward combination and shaping over ``[P, G]`` arrays (P prompts, G completions per prompt).

A missing reward (a reward function that returned None for a sample) is NaN. Every function here is
pure and jittable; option names are static Python values checked eagerly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.choices import check_choice
from relax.masked import assert_same_shape, masked_mean, masked_std

ALL_MISSING = ("nan", "zero")
LENGTH_SHAPING_MODES = ("linear", "punitive")


def combine(
    values: Float[Array, "f p g"] | Mapping[str, Float[Array, "p g"]],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    *,
    names: Sequence[str] | None = None,
    all_missing: str = "nan",
) -> tuple[Float[Array, "p g"], dict[str, Float[Array, "p g"]]]:
    """Weighted sum of reward functions, skipping missing (NaN) values (TRL ``GRPOTrainer``)::

        total[p, g] = sum over f with v[f, p, g] not NaN of  w_f * v[f, p, g]

    ``values`` is ``[F, P, G]`` (functions named by ``names``, default ``"0".."F-1"``) or a dict
    ``name -> [P, G]``; ``weights`` is a length-F sequence, a dict with exactly the same names, or
    None (all 1, TRL's default ``reward_weights``). Returns ``(total, per_function)`` with the
    unweighted per-function values (NaN kept) for logging.

    A sample where EVERY function is missing gets ``total = NaN`` with ``all_missing="nan"`` (the
    default: it stays visible, and ``dynamic_sampling_mask`` / ``group_stats`` treat it as missing).
    TRL's ``nansum`` gives 0 there (with a warning); ``all_missing="zero"`` reproduces that exactly.

    Being jittable, this checks no values: an inf value, or a weighted sum beyond float32's range,
    gives an inf total. On the host, ``relax.rewards.functions.combine_checked`` raises
    ``RewardError`` naming the functions and the sample instead.
    """
    check_choice("all_missing", all_missing, ALL_MISSING)
    if isinstance(values, Mapping):
        if names is not None:
            raise ValueError("names is only for array values; a dict already names its functions")
        names = list(values)
        if not names:
            raise ValueError("values is an empty dict; need at least one reward function")
        assert_same_shape(**values)
        stacked = jnp.stack([jnp.asarray(values[k]) for k in names])
    else:
        stacked = jnp.asarray(values)
        if stacked.ndim != 3:
            raise ValueError(f"array values must be [F, P, G], got shape {stacked.shape}")
        names = [str(i) for i in range(stacked.shape[0])] if names is None else list(names)
        if len(names) != stacked.shape[0]:
            raise ValueError(f"{len(names)} names for {stacked.shape[0]} reward functions")
    stacked = stacked.astype(jnp.promote_types(stacked.dtype, jnp.float32))
    w = jnp.asarray(_weight_list(names, weights), stacked.dtype)

    present = ~jnp.isnan(stacked)
    total = jnp.sum(jnp.where(present, w[:, None, None] * stacked, 0.0), axis=0)
    if all_missing == "nan":
        total = jnp.where(present.any(axis=0), total, jnp.nan)
    return total, {k: stacked[i] for i, k in enumerate(names)}


def _weight_list(
    names: list[str], weights: Sequence[float] | Mapping[str, float] | None
) -> list[float]:
    if weights is None:
        return [1.0] * len(names)
    if isinstance(weights, Mapping):
        if set(weights) != set(names):
            raise ValueError(
                f"weights names {sorted(weights)} differ from reward names {sorted(names)}"
            )
        return [float(weights[k]) for k in names]
    weights = [float(x) for x in weights]
    if len(weights) != len(names):
        raise ValueError(f"{len(weights)} weights for {len(names)} reward functions")
    return weights


def overlong_penalty(
    lengths: Int[Array, "p g"],
    *,
    max_length: int,
    buffer_length: int,
    penalty_factor: float = 1.0,
) -> Float[Array, "p g"]:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), to be ADDED to the reward::

        L_exp = max_length - buffer_length
        pen(L) = 0                                        L <= L_exp
               = -(L - L_exp) / buffer_length * factor    L_exp < L <= max_length
               = -factor                                  L > max_length

    verl's ``DAPORewardManager`` (``overlong_buffer.len``, ``penalty_factor``, max response length)
    computes ``min(-(L - L_exp) / buffer_length * factor, 0)``, identical for ``L <= max_length``
    (its responses are truncated there); beyond it the paper's constant ``-factor`` is used here.
    TRL's ``get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`` is this with
    ``factor = 1``. ``buffer_length = 0`` is a hard cliff: ``-factor`` iff ``L > max_length``.
    """
    if not 0 <= buffer_length <= max_length:
        raise ValueError(
            f"need 0 <= buffer_length <= max_length, got {buffer_length}, {max_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0, got {penalty_factor}")
    L = jnp.asarray(lengths).astype(jnp.float32)
    if buffer_length == 0:
        return jnp.where(L > max_length, -float(penalty_factor), 0.0)
    over = (L - (max_length - buffer_length)) / buffer_length
    return -jnp.clip(over, 0.0, 1.0) * penalty_factor


def length_shaping(
    rewards: Float[Array, "p g"],
    lengths: Int[Array, "p g"],
    *,
    mode: str = "linear",
    target: float,
    coef: float,
) -> Float[Array, "p g"]:
    """Shape rewards by completion length. The modes differ in whom they touch and how::

        linear:   r - coef * |L - target| / target                       every sample, both sides
        punitive: r * max(0, 1 - coef * (L - target) / target)   if r > 0 and L > target
                  r                                              otherwise

    ``linear`` is a symmetric additive penalty on the relative distance to ``target`` (pulls every
    completion toward ``target``, shortening long and lengthening short ones, correct or not).
    ``punitive`` only discounts CORRECT (``r > 0``) answers that run past ``target``, by a
    multiplicative factor falling linearly to 0 at ``L = target * (1 + 1/coef)``: it never touches
    wrong or short answers and never makes a long correct answer worse than a wrong one (reward
    stays >= 0), so it cannot teach "answer wrongly but briefly". Missing (NaN) rewards stay NaN.
    """
    check_choice("mode", mode, LENGTH_SHAPING_MODES)
    assert_same_shape(rewards=rewards, lengths=lengths)
    if not target > 0:
        raise ValueError(f"target must be > 0, got {target}")
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")
    r = jnp.asarray(rewards)
    r = r.astype(jnp.promote_types(r.dtype, jnp.float32))
    rel = (jnp.asarray(lengths).astype(r.dtype) - target) / target
    if mode == "linear":
        return r - coef * jnp.abs(rel)
    factor = jnp.maximum(0.0, 1.0 - coef * rel)
    return jnp.where((r > 0) & (rel > 0), r * factor, r)


def dynamic_sampling_mask(rewards: Float[Array, "p g"]) -> Bool[Array, " p"]:
    """DAPO dynamic sampling: keep prompt ``p`` iff its valid (non-NaN) rewards are not all equal::

        keep[p] = #valid(p) >= 2  and  max_valid(p) > min_valid(p)

    Groups with fewer than two valid rewards are dropped (no group-relative signal). verl's
    filter (``std > 0 or len == 1``) keeps singleton groups so that ``n=1`` runs are unfiltered;
    here a ``[P, 1]`` batch is all dropped. Equality is exact, as verl's ``np.std(...) > 0``.
    """
    r = jnp.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {r.shape}")
    valid = ~jnp.isnan(r)
    hi = jnp.max(jnp.where(valid, r, -jnp.inf), axis=-1)
    lo = jnp.min(jnp.where(valid, r, jnp.inf), axis=-1)
    return (valid.sum(axis=-1) >= 2) & (hi > lo)


def group_stats(rewards: Float[Array, "p g"]) -> dict[str, Float[Array, ""]]:
    """Scalar reward metrics over valid (non-NaN) entries, TRL's names where TRL logs them::

    reward                mean of valid rewards
    reward_std            mean over groups (with >= 1 valid) of the unbiased in-group std
    frac_reward_zero_std  fraction of groups whose valid rewards are all equal
                          (= 1 - mean(dynamic_sampling_mask))
    frac_reward_missing   fraction of NaN rewards
    """
    r = jnp.asarray(rewards)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [P, G], got shape {r.shape}")
    valid = ~jnp.isnan(r)
    has_any = valid.any(axis=-1)
    group_std = masked_std(r, valid, axis=-1)
    return {
        "reward": masked_mean(r, valid),
        "reward_std": masked_mean(group_std, has_any),
        "frac_reward_zero_std": 1.0 - jnp.mean(dynamic_sampling_mask(r).astype(jnp.float32)),
        "frac_reward_missing": 1.0 - jnp.mean(valid.astype(jnp.float32)),
    }
