"""Multi-turn decoding with the KV cache carried across turns (docs/architecture.md, "Multi-turn rollouts").

A trajectory is its prompt followed by ``N`` slots holding, in the order they happened, the tokens
the policy sampled and the observation tokens its environment returned. Three jitted programs
move a batch of trajectories forward, and the host runs the environments between them:

- ``start``: each prompt prefilled once; its keys/values are shared by the G trajectories of its
  group (``[P, Hkv, D, Lp]`` keys, as in ``relax.rollout.sampler``);
- ``decode_turn``: one turn of every active trajectory, until its stop token or its turn / total
  budget. Every sampled token is fed onto the trajectory's own cache (the stop token too: the
  next turn reads it), so nothing is ever prefilled twice;
- ``append``: an observation's tokens (tokenized once by the host) prefilled onto the cache.

A new turn reads the cache the previous turns left; the logits at every slot equal those of a
forward over the whole conversation (tested). Trajectories are ragged: row ``b`` has filled
``length[b]`` slots, writes are per-row scatters, and each row masks its own cache. ``compact``
keeps only the rows still running (the prompt keys then gathered per row), so a trajectory that
finished stops costing compute.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.adapters.operations import merge_lora
from relax.models.attention import blocks as attn
from relax.models.config.layer_kinds import layer_window
from relax.models.decoder.transformer import (
    LayerRoutes,
    Transformer,
    embed,
    full_attention,
    fuse_layers,
    positions_from_mask,
    project,
    run_layers,
)
from relax.models.forward.routes import route_dtype
from relax.rollout.sampler import DEFAULT_BUCKETS
from relax.rollout.sampling import SamplingConfig, sample_tokens

OBSERVATION_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class TurnConfig:
    """What the multi-turn programs are specialised on. ``max_tokens``: slots per trajectory after
    the prompt (sampled and observation tokens); ``max_turn_tokens``: tokens sampled per turn;
    ``eos_ids``: the tokens that end a turn; observations are appended ``observation_chunk``
    tokens at a time (one ``append`` program, whatever an observation's length)."""

    num_generations: int
    max_tokens: int
    max_turn_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    observation_chunk: int = OBSERVATION_CHUNK
    merge_adapters: bool = True  # as RolloutConfig.merge_adapters

    def __post_init__(self):
        sizes = (
            self.num_generations,
            self.max_tokens,
            self.max_turn_tokens,
            self.observation_chunk,
        )
        if min(sizes) < 1:
            raise ValueError(
                "num_generations, max_tokens, max_turn_tokens and observation_chunk must be >= 1, "
                f"got {sizes}"
            )
        if not self.eos_ids:
            raise ValueError("a multi-turn rollout needs eos_ids: the tokens that end a turn")


class TurnState(eqx.Module):
    """Trajectories in flight. ``Pk`` prompt rows hold the prompt keys/values (``Pk = P``, or one
    per row after ``compact``); row ``b`` reads prompt row ``b // (B // Pk)``."""

    prompt_k: list  # per layer [Pk, Hkv, D, Lp]
    prompt_v: list  # per layer [Pk, Hkv, Lp, D]
    prompt_pos: Int[Array, "pk lp"]
    prompt_valid: Bool[Array, "pk lp"]
    prompt_len: Int[Array, " pk"]
    cache_k: list  # per layer [B, Hkv, D, N]
    cache_v: list  # per layer [B, Hkv, N, D]
    tokens: Int[Array, "b n"]
    logprobs: Float[Array, "b n"]  # the sampler's log-prob of each sampled token, 0 elsewhere
    sampled: Bool[Array, "b n"]  # True where the policy sampled the token
    length: Int[Array, " b"]  # filled slots
    last_h: Float[
        Array, "b d"
    ]  # final hidden state at the last filled slot (its logits draw the next token)
    keys: Array  # [B] PRNG keys: the draw at slot t is uniform(fold_in(keys[b], t))
    # a mixture of experts' choices of every fed token (relax.models.forward.routes; [.., 0]: dense model)
    prompt_routes: Int[Array, "pk lp l k"]
    routes: Int[Array, "b n l k"]  # -1 at slots not filled

    @property
    def group(self) -> int:
        return self.tokens.shape[0] // self.prompt_len.shape[0]


def _row_keys(keys, b: int):
    if keys.shape != (b,):
        raise ValueError(f"{keys.shape[0]} keys for {b} trajectories (P x G): one key each")
    return keys


def start_state(model: Transformer, prompt_ids, prompt_mask, key, cfg: TurnConfig) -> TurnState:
    """The state before the first turn: each prompt prefilled once, ``G`` empty trajectories per
    prompt (``start`` jits it). ``key``: one key, split into the ``P x G`` trajectories' keys, or
    those keys ``[P x G]`` themselves (e.g. this process's share of a larger batch's split)."""
    c, g, n = model.config, cfg.num_generations, cfg.max_tokens
    b = prompt_ids.shape[0] * g
    pos = positions_from_mask(prompt_mask)
    h, (pk, pv), routed = run_layers(
        model,
        embed(model, prompt_ids),
        pos,
        full_attention(model, pos, prompt_mask.astype(bool)),
        routes=LayerRoutes(prompt_mask.astype(bool)),
    )
    zeros = lambda shape: [jnp.zeros(shape, model.dtype) for _ in range(c.num_layers)]  # noqa: E731
    ls, k, rdt = c.num_sparse_layers, max(1, c.num_experts_per_tok), route_dtype(c.num_experts)
    prompt_routes = (
        jnp.zeros(prompt_ids.shape + (0, k), rdt)
        if routed is None
        else jnp.moveaxis(routed.experts, 0, 2).astype(rdt)
    )
    return TurnState(
        prompt_k=[jnp.swapaxes(pk[i], -1, -2) for i in range(c.num_layers)],
        prompt_v=[pv[i] for i in range(c.num_layers)],
        prompt_pos=pos,
        prompt_valid=prompt_mask.astype(bool),
        prompt_len=jnp.sum(prompt_mask.astype(jnp.int32), axis=1),
        cache_k=zeros((b, c.num_kv_heads, c.head_dim, n)),
        cache_v=zeros((b, c.num_kv_heads, n, c.head_dim)),
        tokens=jnp.full((b, n), cfg.pad_id, jnp.int32),
        logprobs=jnp.zeros((b, n), jnp.float32),
        sampled=jnp.zeros((b, n), bool),
        length=jnp.zeros((b,), jnp.int32),
        last_h=jnp.repeat(h[:, -1], g, axis=0),
        keys=jax.random.split(key, b) if key.ndim == 0 else _row_keys(key, b),
        prompt_routes=prompt_routes,
        routes=jnp.full((b, n, ls, k), -1, rdt),
    )


def _attend(model: Transformer, s: TurnState, slots, writes):
    """Attention of ``M`` new tokens per row (at ``slots [B, M]``) over [shared prompt | own cache].

    Each new key/value is written at ``writes`` first (slot ``N``: dropped), then row ``b``'s query
    at slot ``t`` sees cache slots ``<= t`` (within the layer's window). Queries are grouped per KV
    head as rows ``(m, r)``; for the prompt block the G rows of a group are folded together
    (``attention.shared_prefix_attention``) and the unnormalised blocks merged exactly."""
    c = model.config
    hk, r, g = c.num_kv_heads, c.q_per_kv, s.group
    b, m = slots.shape
    rows = jnp.arange(b)[:, None]
    q_pos = jnp.repeat(s.prompt_len, g)[:, None] + slots  # [B, M]
    row_pos, row_slot = jnp.repeat(q_pos, r, axis=1), jnp.repeat(slots, r, axis=1)  # [B, M*R]
    n = s.tokens.shape[1]
    pd = model.precision.probs_dtype(model.dtype)

    def attend(q, k, v, layer_input, sliding):
        window = layer_window(c, sliding)
        pk, pv, ck, cv = layer_input
        d = q.shape[-1]
        qg = q.reshape(b, m, hk, r, d).transpose(0, 2, 1, 3, 4).reshape(b, hk, m * r, d)
        allowed_p = s.prompt_valid[:, None, None, :]
        if window is not None:
            folded = row_pos.reshape(-1, g * m * r)  # [Pk, G*M*R]: rows (g, m, r) of a group
            allowed_p = (
                allowed_p & ((folded[:, :, None] - s.prompt_pos[:, None, :]) < window)[:, None]
            )
        blocks = [
            attn.shared_prefix_attention(
                qg, pk, pv, allowed_p, g, k_transposed=True, scale=c.attn_scale, probs_dtype=pd
            )
        ]
        ck = ck.at[rows, :, :, writes].set(k.astype(ck.dtype), mode="drop")  # k: [B, M, Hkv, D]
        cv = cv.at[rows, :, writes, :].set(v.astype(cv.dtype), mode="drop")
        kv_slot = jnp.arange(n)
        allowed = kv_slot[None, None, :] <= row_slot[:, :, None]
        if window is not None:
            allowed = allowed & (row_slot[:, :, None] - kv_slot[None, None, :] < window)
        blocks.append(
            attn.block_stats(
                qg, ck, cv, allowed[:, None], k_transposed=True, scale=c.attn_scale, probs_dtype=pd
            )
        )
        out = (
            attn.merge_stats(blocks)
            .reshape(b, hk, m, r, d)
            .transpose(0, 2, 1, 3, 4)
            .reshape(b, m, hk * r, d)
        )
        return out.astype(q.dtype), (ck, cv)

    return q_pos, attend


def _extend(
    model: Transformer, layers, s: TurnState, ids: Int[Array, "b m"], count: Int[Array, " b"]
):
    """Feed ``ids[b, :count[b]]`` at slots ``length[b]...``: ``(hidden [B, M, D], cache_k, cache_v,
    the slots written (N: none), routes)``, ``routes`` with the fed tokens' experts recorded."""
    n = s.tokens.shape[1]
    j = jnp.arange(ids.shape[1])[None, :]
    slots = s.length[:, None] + j
    fed = j < count[:, None]
    writes = jnp.where(fed, slots, n)
    q_pos, attend = _attend(model, s, slots, writes)
    inputs = [
        (pk, pv, ck, cv) for pk, pv, ck, cv in zip(s.prompt_k, s.prompt_v, s.cache_k, s.cache_v)
    ]
    h, new_kv, routed = run_layers(
        model, embed(model, ids), q_pos, attend, inputs, layers=layers, routes=LayerRoutes(fed)
    )
    routes = s.routes
    if routed is not None:  # [Ls, B, M, k] -> the written slots of [B, N, Ls, k]
        chosen = jnp.moveaxis(routed.experts, 0, 2).astype(routes.dtype)
        routes = routes.at[jnp.arange(ids.shape[0])[:, None], writes].set(chosen, mode="drop")
    return h, [kv[0] for kv in new_kv], [kv[1] for kv in new_kv], writes, routes


def fused_decode_layers(model: Transformer, cfg: TurnConfig):
    """The per-layer fused weights ``decode_turn`` and ``append`` read (adapters merged unless
    ``cfg.merge_adapters`` is off); ``fused_layers`` jits it."""
    return fuse_layers(merge_lora(model) if cfg.merge_adapters else model)


def _decode_turn(
    model: Transformer, s: TurnState, active: Bool[Array, " b"], cfg: TurnConfig, layers=None
):
    """One turn of each ``active`` row: ``(state, stopped [B], sampled [B])``. A row samples until a
    stop token (``stopped``), ``max_turn_tokens`` or a full cache; every token is fed. ``layers``:
    ``fused_layers(model, cfg)`` computed once for a whole rollout (None: fused here, per call)."""
    layers, n = fused_decode_layers(model, cfg) if layers is None else layers, s.tokens.shape[1]
    eos = jnp.asarray(cfg.eos_ids, jnp.int32)
    rows = jnp.arange(s.tokens.shape[0])

    def cond(carry):
        return jnp.any(carry[1])

    def body(carry):
        s, alive, stopped, count = carry
        u = 1.0 - jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), ()))(
            s.keys, s.length
        )
        tok, lp = sample_tokens(project(model, s.last_h), u, cfg.sampling)
        h, ck, cv, writes, routes = _extend(model, layers, s, tok[:, None], alive.astype(jnp.int32))
        at = writes[:, 0]
        s = dataclasses.replace(
            s,
            cache_k=ck,
            cache_v=cv,
            routes=routes,
            tokens=s.tokens.at[rows, at].set(tok, mode="drop"),
            logprobs=s.logprobs.at[rows, at].set(lp, mode="drop"),
            sampled=s.sampled.at[rows, at].set(True, mode="drop"),
            length=s.length + alive,
            last_h=jnp.where(alive[:, None], h[:, 0], s.last_h),
        )
        hit = alive & jnp.isin(tok, eos)
        count = count + alive
        alive = alive & ~hit & (count < cfg.max_turn_tokens) & (s.length < n)
        return s, alive, stopped | hit, count

    zeros = jnp.zeros_like(active)
    s, _, stopped, count = jax.lax.while_loop(
        cond, body, (s, active & (s.length < n), zeros, jnp.zeros(active.shape, jnp.int32))
    )
    return s, stopped, count


def _append(
    model: Transformer,
    s: TurnState,
    ids: Int[Array, "b m"],
    count: Int[Array, " b"],
    cfg: TurnConfig,
    layers=None,
):
    """Prefill ``ids[b, :count[b]]`` (an observation, not sampled) onto each row's cache; ``layers``
    as ``decode_turn``'s."""
    h, ck, cv, writes, routes = _extend(
        model, fused_decode_layers(model, cfg) if layers is None else layers, s, ids, count
    )
    rows = jnp.arange(ids.shape[0])[:, None]
    last = h[rows[:, 0], jnp.maximum(count - 1, 0)]
    return dataclasses.replace(
        s,
        cache_k=ck,
        cache_v=cv,
        routes=routes,
        tokens=s.tokens.at[rows, writes].set(ids, mode="drop"),
        length=s.length + count,
        last_h=jnp.where((count > 0)[:, None], last, s.last_h),
    )


def _compact(s: TurnState, rows: Int[Array, " k"]) -> TurnState:
    """The trajectories ``rows`` only, each with its own copy of its prompt's keys/values."""
    prompt = rows // s.group
    per_row = lambda x: x[rows]  # noqa: E731
    per_prompt = lambda x: x[prompt]  # noqa: E731
    return TurnState(
        prompt_k=list(map(per_prompt, s.prompt_k)),
        prompt_v=list(map(per_prompt, s.prompt_v)),
        prompt_pos=per_prompt(s.prompt_pos),
        prompt_valid=per_prompt(s.prompt_valid),
        prompt_len=per_prompt(s.prompt_len),
        cache_k=list(map(per_row, s.cache_k)),
        cache_v=list(map(per_row, s.cache_v)),
        tokens=per_row(s.tokens),
        logprobs=per_row(s.logprobs),
        sampled=per_row(s.sampled),
        length=per_row(s.length),
        last_h=per_row(s.last_h),
        keys=per_row(s.keys),
        prompt_routes=per_prompt(s.prompt_routes),
        routes=per_row(s.routes),
    )


start = jax.jit(start_state, static_argnames="cfg")
fused_layers = jax.jit(
    fused_decode_layers, static_argnames="cfg"
)  # once per rollout: decode_turn / append read them
decode_turn = jax.jit(_decode_turn, static_argnames="cfg", donate_argnums=1)
append = jax.jit(_append, static_argnames="cfg", donate_argnums=1)
compact = jax.jit(_compact)


def next_logits(model: Transformer, s: TurnState) -> Float[Array, "b v"]:
    """The logits each row draws its next token from (tests compare them with a full forward)."""
    return project(model, s.last_h)
