"""The mixture-of-experts MLP: top-k routing, tokens sorted by expert through grouped matmuls.

For a sparse layer's input ``x`` (one row per token)::

    p = softmax(x Wr)                                   [T, E]   (float32, as transformers)
    S = top_k(p)          or the replayed experts       [T, k]
    w_j = p[S_j]          (/ sum_j p[S_j] with norm_topk_prob; Mixtral always)
    y = sum_j w_j FFN_{S_j}(x),   FFN_e(x) = (act(x Wg_e) * x Wu_e) Wd_e
    y += sigmoid(x Ws) FFN_shared(x)                    (Qwen2-MoE's shared expert)

The ``T k`` (token, choice) pairs are sorted by expert and run through three grouped matmuls
(``grouped_matmul``: ``jax.lax.ragged_dot`` on accelerators, expert-aligned tiles on CPU, whose
``ragged_dot`` is a dense product over every expert): each pair costs one expert's FFN, nothing
is computed for experts a token does not use, and nothing is dropped (no capacity limit, as the
Hugging Face reference). Prefill, decode and training run this same code.

Routing replay: given recorded experts (``replay``, -1 where none was recorded) a layer uses them
instead of its own top-k, with its own probabilities at them as weights (so the router still
gets gradients); it reports how many tokens' own top-k set differs from the experts used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.choices import check_choice
from relax.models.config.model import ModelConfig
from relax.passes import current_backend

ROUTING_REPLAY = ("none", "sampler")

__all__ = [
    "MoEConfig",
    "Routed",
    "RouterStats",
    "grouped_matmul",
    "load_balance_loss",
    "route",
    "router_z_loss",
    "router_loss",
    "routing_metrics",
    "sparse_ffn",
]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """How a trainer treats a mixture-of-experts model (no effect on a dense one).

    ``routing_replay``: ``"sampler"`` records each token's experts in the rollout (prompt and
    completion, every sparse layer; ``relax.models.forward.routes``) and the old-policy, reference and
    update forwards use them; ``"none"`` lets every forward route for itself.
    ``aux_loss_coef``: the load-balancing loss's weight (None: the checkpoint's
    ``router_aux_loss_coef`` where its ``output_router_logits`` is set, as transformers trains it,
    else 0); ``z_loss_coef``: the router z-loss's (None: the checkpoint's ``router_z_loss_coef``).
    """

    routing_replay: Literal["none", "sampler"] = "sampler"
    aux_loss_coef: float | None = None
    z_loss_coef: float | None = None

    def __post_init__(self):
        check_choice("routing_replay", self.routing_replay, ROUTING_REPLAY)
        for name in ("aux_loss_coef", "z_loss_coef"):
            v = getattr(self, name)
            if v is not None and not v >= 0:
                raise ValueError(f"moe.{name} must be >= 0, got {v}")

    @property
    def replays(self) -> bool:
        return self.routing_replay == "sampler"

    def coefficients(self, config: ModelConfig) -> tuple[float, float]:
        """``(load balance, z-loss)`` weights for ``config``'s model (0, 0 for a dense one)."""
        if not config.num_experts:
            return 0.0, 0.0
        aux = (
            (config.router_aux_loss_coef if config.output_router_logits else 0.0)
            if self.aux_loss_coef is None
            else self.aux_loss_coef
        )
        z = config.router_z_loss_coef if self.z_loss_coef is None else self.z_loss_coef
        return aux, z


class RouterStats(eqx.Module):
    """One sparse layer's routing, summed over the valid tokens of a forward (stacked ``[Ls]`` over
    the sparse layers; two forwards' stats add)::

        assigned[e]     top-k choices of expert e
        probability[e]  sum of p[e]
        z               sum of logsumexp(x Wr)^2
        tokens          valid tokens
        compared        valid tokens with recorded experts (a sampler's: ``relax.models.forward.routes``)
        differ          of those, the tokens whose own top-k set is not the recorded set
    """

    assigned: Float[Array, "*l e"]
    probability: Float[Array, "*l e"]
    z: Float[Array, "*l"]
    tokens: Float[Array, "*l"]
    compared: Float[Array, "*l"]
    differ: Float[Array, "*l"]

    def __add__(self, other: RouterStats) -> RouterStats:
        return jax.tree.map(jnp.add, self, other)


class Routed(eqx.Module):
    """What a sparse layer reports: each token's experts (its own or the replayed) and its stats."""

    experts: Int[Array, "b t k"]
    stats: RouterStats


def _at_least_f32(x: Array) -> Array:
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def route(
    logits: Float[Array, "n e"], k: int, *, normalize: bool, replay: Int[Array, "n k"] | None = None
) -> tuple[Float[Array, "n k"], Int[Array, "n k"], Int[Array, "n k"]]:
    """``(weights, experts, own)``: the float32 weights of the experts used, the experts (replayed
    where ``replay >= 0``, else ``own``), and the router's own top-k."""
    probs = jax.nn.softmax(_at_least_f32(logits), axis=-1)
    top, own = jax.lax.top_k(probs, k)
    experts = own
    if replay is not None:
        experts = jnp.where(replay[:, :1] >= 0, replay.astype(own.dtype), own)
        top = jnp.take_along_axis(probs, experts, axis=-1)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts, own


def grouped_matmul(
    x: Float[Array, "m i"], w: Float[Array, "g i o"], sizes: Int[Array, " g"]
) -> Float[Array, "m o"]:
    """``y[r] = x[r] w[g(r)]`` for rows sorted by group, group ``g`` holding ``sizes[g]`` rows;
    rows at or beyond ``sum(sizes)`` belong to no group and give ``y[r] = 0`` (a caller parks
    rows that need no product there, e.g. pairs routed to another device's experts).

    ``jax.lax.ragged_dot`` on accelerators (grouped GEMM kernels), its rows beyond the groups
    masked to 0; on CPU, where XLA lowers ``ragged_dot`` to a dense product over every group,
    each group's rows are padded to whole tiles of a static size (about ``m / 4g``) and each tile
    multiplied by its group's weight: at most ``m + g * tile`` rows of work instead of ``g m``.
    """
    if current_backend() != "cpu":
        y = jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32))
        grouped = jnp.arange(x.shape[0]) < jnp.sum(sizes)
        return jnp.where(grouped[:, None], y, jnp.zeros((), y.dtype))
    return _tiled_matmul(x, w, sizes)


def _tiled_matmul(x, w, sizes):
    """The CPU ``grouped_matmul``: row ``r`` of group ``g`` goes to tile row ``dest[r]`` (its
    group's tiles start at ``sum_{h<g} ceil(s_h / tile) tile``); a row beyond the groups goes to
    no tile (an index past the buffer, dropped) and reads back 0."""
    m, g = x.shape[0], w.shape[0]
    # about a quarter of the mean group: at most m / 4 rows of padding, 5 g tiles for m >> g
    tile = max(8, 1 << max(0, math.ceil(math.log2(max(1, -(-m // (4 * g)))))))
    n_tiles = -(-m // tile) + g  # sum_g ceil(s_g / tile) <= m / tile + g
    sizes = sizes.astype(jnp.int32)
    padded = -(-sizes // tile) * tile
    ends = jnp.cumsum(padded)
    row_end = jnp.cumsum(sizes)
    rows = jnp.arange(m, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(row_end, rows, side="right"), g - 1)
    dest = (ends - padded)[group] + rows - (row_end - sizes)[group]
    dest = jnp.where(
        rows < row_end[-1], dest, n_tiles * tile + rows
    )  # beyond the groups: past the buffer
    xp = (
        jnp.zeros((n_tiles * tile, x.shape[1]), x.dtype)
        .at[dest]
        .set(x, unique_indices=True, mode="drop")
    )
    tile_group = jnp.minimum(
        jnp.searchsorted(ends, jnp.arange(n_tiles, dtype=jnp.int32) * tile, side="right"), g - 1
    )
    y = jnp.einsum("tri,tio->tro", xp.reshape(n_tiles, tile, -1), w[tile_group])
    return (
        y.reshape(n_tiles * tile, -1).at[dest].get(mode="fill", fill_value=0, unique_indices=True)
    )


def sparse_ffn(
    x: Float[Array, "n d"],
    experts: Int[Array, "n k"],
    weights: Float[Array, "n k"],
    w_gate: Float[Array, "e d f"],
    w_up: Float[Array, "e d f"],
    w_down: Float[Array, "e f d"],
    act: Callable[[Array], Array],
) -> Float[Array, "n d"]:
    """``y[t] = sum_j weights[t, j] FFN_{experts[t, j]}(x[t])`` (module docstring), dropless: the
    ``n k`` pairs sorted by expert (stable), three ``grouped_matmul``\\ s, then un-sorted and summed
    over ``j`` in order. A pair whose expert is ``>= e`` (another device's, ``relax.models.
    expert_parallel``) sorts past every group and contributes 0."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=w_gate.shape[0])
    xs = x[order // k]
    h = act(grouped_matmul(xs, w_gate, sizes)) * grouped_matmul(xs, w_up, sizes)
    out = grouped_matmul(h, w_down, sizes)
    back = (
        jnp.zeros_like(order)
        .at[order]
        .set(jnp.arange(n * k, dtype=order.dtype), unique_indices=True)
    )
    out = out[back].reshape(n, k, -1)
    return jnp.sum(out * weights[..., None].astype(out.dtype), axis=1)


def routed_stats(
    logits: Float[Array, "n e"],
    experts: Int[Array, "n k"],
    own: Int[Array, "n k"],
    valid: Bool[Array, " n"] | None,
    recorded: Int[Array, "n k"] | None,
) -> RouterStats:
    """This forward's ``RouterStats`` of one layer (all rows valid when ``valid`` is None):
    ``experts`` used, the router's ``own`` top-k, the ``recorded`` experts (-1: none) or None."""
    logits = _at_least_f32(logits)
    v = jnp.ones(logits.shape[:1], logits.dtype) if valid is None else valid.astype(logits.dtype)
    probs = jax.nn.softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(experts, logits.shape[-1], dtype=logits.dtype).sum(axis=1)  # [n, E]
    lse = jax.nn.logsumexp(logits, axis=-1)
    if recorded is None:
        compared = differ = jnp.zeros((), logits.dtype)
    else:
        has = v * (recorded[:, 0] >= 0)
        same = jnp.all(jnp.any(recorded[:, :, None] == own[:, None, :], axis=-1), axis=-1)
        compared, differ = jnp.sum(has), jnp.sum(has * ~same)
    return RouterStats(
        assigned=v @ onehot,
        probability=v @ probs,
        z=jnp.sum(v * lse * lse),
        tokens=jnp.sum(v),
        compared=compared,
        differ=differ,
    )


def load_balance_loss(stats: RouterStats) -> Float[Array, ""]:
    """Switch/Mixtral load balancing over all sparse layers, as transformers'
    ``load_balancing_loss_func`` (with the attention mask)::

        E sum_e f_e P_e,  f_e = sum_l assigned[l, e] / sum_l tokens[l],  P_e = sum_l probability[l, e] / sum_l tokens[l]
    """
    n = jnp.maximum(jnp.sum(stats.tokens), 1.0)
    f = jnp.sum(stats.assigned, axis=0) / n
    prob = jnp.sum(stats.probability, axis=0) / n
    return stats.assigned.shape[-1] * jnp.sum(f * prob)


def router_z_loss(stats: RouterStats) -> Float[Array, ""]:
    """ST-MoE's router z-loss, ``mean over layers and valid tokens of logsumexp(x Wr)^2``."""
    return jnp.sum(stats.z) / jnp.maximum(jnp.sum(stats.tokens), 1.0)


def router_loss(
    stats: RouterStats | None, cfg: MoEConfig, config: ModelConfig
) -> tuple[Array, dict[str, Array]]:
    """``aux_coef * load_balance + z_coef * z_loss`` of one forward's stats (0 without experts) and
    its ``routing_metrics``."""
    if stats is None:
        return jnp.float32(0.0), {}
    aux, z = cfg.coefficients(config)
    loss = jnp.float32(0.0)
    if aux:
        loss = loss + aux * load_balance_loss(stats)
    if z:
        loss = loss + z * router_z_loss(stats)
    return loss, routing_metrics(stats)


def routing_metrics(stats: RouterStats) -> dict[str, Array]:
    """Per-forward routing metrics: the fraction of tokens with recorded experts whose own top-k
    set differs from the recorded one (sampler vs this forward; per sparse layer and over all), the
    expert load ``max_e / mean_e assigned`` (the worst layer and the mean over layers), and both
    auxiliary losses."""
    compared = jnp.maximum(stats.compared, 1.0)
    load = jnp.max(stats.assigned, axis=-1) / jnp.maximum(jnp.mean(stats.assigned, axis=-1), 1e-9)
    out = {
        "moe/routing_differ": jnp.sum(stats.differ) / jnp.maximum(jnp.sum(stats.compared), 1.0),
        "moe/load_max_over_mean": jnp.max(load),
        "moe/load_max_over_mean_avg": jnp.mean(load),
        "moe/load_balance_loss": load_balance_loss(stats),
        "moe/router_z_loss": router_z_loss(stats),
    }
    for i, d in enumerate(stats.differ / compared):
        out[f"moe/routing_differ/layer{i}"] = d
    return out
