"""Token rewards: pure, jittable reward functions of the token arrays, scored by ``score_tokens``
inside ``jax.jit`` with no host round trip (host reward functions: ``relax.rewards.functions``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from relax.rewards.functions import check_finite
from relax.rewards.shaping import combine

TokenRewardFn = Callable[
    [Int[Array, "p lp"], Bool[Array, "p lp"], Int[Array, "p g n"], Bool[Array, "p g n"]],
    Float[Array, "p g"],
]


@dataclasses.dataclass(frozen=True)
class TokenRewardFunction:
    """A pure, jittable reward ``fn(prompt_ids, prompt_mask, completion_ids, completion_mask) -> [P, G]``.

    Shapes: ``prompt_ids/mask [P, Lp]``, ``completion_ids/mask [P, G, N]``. NaN marks a missing
    reward; +-inf (in float32) is an error (see ``score_tokens``). ``fn`` must be hashable (plain
    functions and closures are): it is a jit static. ``params``: arrays the reward reads (a
    reward model's weights), a pytree passed as ``fn``'s first argument, ``fn(params,
    prompt_ids, ...)``: an argument of the compiled program, never a constant in it, and laid
    out wherever its arrays are (e.g. sharded over a mesh). None: ``fn`` takes the four arrays.
    """

    fn: TokenRewardFn
    name: str
    weight: float = 1.0
    params: Any = dataclasses.field(default=None, compare=False, repr=False)


def score_tokens(
    reward_fns: Sequence[TokenRewardFunction],
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Bool[Array, "p lp"],
    completion_ids: Int[Array, "p g n"],
    completion_mask: Bool[Array, "p g n"],
    *,
    all_missing: str = "nan",
) -> tuple[Float[Array, "p g"], dict[str, Float[Array, "p g"]]]:
    """Run token rewards in one ``jax.jit`` program and ``combine`` them by weight (see module doc).

    Returns ``(total [P, G], per_function {name: [P, G]})``. A value that is +-inf in float32
    raises ``RewardError`` naming the function and sample, and so does a weighted sum that
    overflows float32 (NaN stays "missing"); this check reads the ``[P, G]`` results on the host.
    Callable inside an outer jit as well, but there the values are traced and NOT checked: check
    the results on the host (``combine_checked``).
    """
    fns = tuple(reward_fns)
    if not fns:
        raise ValueError("need at least one token reward function")
    names = [f.name for f in fns]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate token reward names {names}")
    shapes = (jnp.shape(prompt_ids), jnp.shape(completion_ids))
    if len(shapes[0]) != 2 or len(shapes[1]) != 3:
        raise ValueError(
            f"need prompt_ids [P, Lp] and completion_ids [P, G, N], got {shapes[0]}, {shapes[1]}"
        )
    total, per = scores_program(
        tuple(dataclasses.replace(f, params=None) for f in fns),
        all_missing,
        tuple(f.params for f in fns),
        prompt_ids,
        prompt_mask,
        completion_ids,
        completion_mask,
    )
    if not isinstance(total, jax.core.Tracer):
        with np.errstate(over="ignore"):  # float32 is what the trainer uses (make_score)
            per32 = {k: np.asarray(v, np.float32) for k, v in per.items()}
            total32 = np.asarray(total, np.float32)
        check_finite(per32, total32, {f.name: f.weight for f in fns}, kind="token reward")
    return total, per


@functools.partial(jax.jit, static_argnums=(0, 1))
def scores_program(
    fns, all_missing, params, prompt_ids, prompt_mask, completion_ids, completion_mask
):
    """The program ``score_tokens`` runs: ``fns`` (without their ``params``) and ``all_missing``
    static, each function's ``params`` an argument beside the token arrays."""
    pg = completion_ids.shape[:2]
    vals = {}
    for f, p in zip(fns, params):
        arrays = (prompt_ids, prompt_mask, completion_ids, completion_mask)
        v = jnp.asarray(f.fn(*arrays) if p is None else f.fn(p, *arrays))
        if v.shape != pg:
            raise ValueError(
                f"token reward {f.name!r} returned shape {v.shape}, expected [P, G] = {pg}"
            )
        vals[f.name] = v.astype(jnp.promote_types(v.dtype, jnp.float32))
    return combine(vals, {f.name: f.weight for f in fns}, all_missing=all_missing)


def length_reward(
    *, name: str = "length", weight: float = 1.0, scale: float = 1.0
) -> TokenRewardFunction:
    """Completion length in tokens, scaled: ``r[p, g] = scale * sum_t mask[p, g, t]``.

    With a negative ``weight`` this is a plain length penalty (see ``shaping`` for finer shaping).
    """

    def fn(prompt_ids, prompt_mask, completion_ids, completion_mask):
        return scale * jnp.sum(completion_mask.astype(jnp.float32), axis=-1)

    return TokenRewardFunction(fn, name, weight)


def token_match_reward(
    target_ids: Sequence[int], *, name: str = "token_match", weight: float = 1.0
) -> TokenRewardFunction:
    """Fraction of a fixed target sequence reproduced position by position at the completion start::

        r[p, g] = (1/T) * sum_{t < min(T, N)} mask[p, g, t] * [ids[p, g, t] == target[t]]

    (T = len(target_ids); positions beyond the completion buffer count as misses). A dense toy
    reward: the policy earns 1.0 exactly when it emits ``target_ids`` first.
    """
    target = tuple(int(t) for t in target_ids)
    if not target:
        raise ValueError("target_ids must be non-empty")

    def fn(prompt_ids, prompt_mask, completion_ids, completion_mask):
        m = min(len(target), completion_ids.shape[-1])
        hit = (
            completion_ids[..., :m] == jnp.asarray(target[:m], completion_ids.dtype)
        ) & completion_mask[..., :m]
        return jnp.sum(hit.astype(jnp.float32), axis=-1) / len(target)

    return TokenRewardFunction(fn, name, weight)
