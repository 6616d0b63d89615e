"""Batched G-completion sampling with a prefix-shared KV cache (docs/architecture.md, "The sampler").

Each prompt is prefilled once; its keys/values are stored ONCE per prompt (per layer
``[P, Hkv, D, Lp]`` keys, ``[P, Hkv, Lp, D]`` values) while each completion has its own cache
(``[P*G, Hkv, D, N]`` / ``[P*G, Hkv, N, D]``, in blocks of ``cache_chunk`` slots). A decode
step attends to the shared prompt (the G completions folded into the query rows, so it is one
dense matmul per KV head) and to the filled blocks of the completion's own cache, into which
the step's key/value was just written, and merges the unnormalised partial softmaxes exactly
(``relax.models.attention.blocks.merge_stats``). Keys are stored transposed so the
score product is a plain matmul. Prefill computes logits only at the last prompt position.
Prefill and the decode loop are one jitted program: one ``lax.while_loop`` per cache block,
each stopping early when every sequence has hit a stop id; with ``RolloutConfig.compactions``
the loops run again in phases of fewer rows as rows finish (``relax.rollout.compaction``).

Buffers are per layer and the decode loop runs the layers as a Python loop over per-layer
(fused q/k/v and gate/up) weights: nothing stacked is sliced per step, and every cache is
updated in place.

On a mesh (traced under ``jax.set_mesh``) the layout is explicit (``relax.models.config.sharding.
DecodeLayout``): before the loop the fused weights and the embedding are laid out once, whole
along the model width (an FSDP-sharded width is gathered there, not at every step) and split
over ``tensor`` by heads, MLP units and vocabulary, a sparse layer's experts over ``expert``;
inside the loop every cache, activation and loop buffer is pinned to rows over the batch axes
(data, expert, fsdp) and heads over ``tensor``, so the step has no collective beyond those the
layout implies (a sparse layer's: its token exchange over ``expert``).

The layer code is the model's own (``transformer.run_layers``): the sampler only supplies
the attention, so its log-probs equal the trainer's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from relax.models.adapters.operations import merge_lora
from relax.models.attention.decode import (
    pallas_available,
    pallas_decode_attention,
    reference_decode_attention,
)
from relax.models.config.layer_kinds import layer_window
from relax.models.config.sharding import DecodeLayout, ambient_batch_shards, decode_layout
from relax.models.decoder.layer import FusedLayer
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
from relax.models.forward.routes import Routes, route_dtype
from relax.models.layers.rope import rotary
from relax.rollout.compaction import COMPACTED_BLOCKS, compaction_sizes, keep_rows
from relax.rollout.sampling import SamplingConfig, sample, uniform_table

DEFAULT_BUCKETS = tuple(2**i for i in range(4, 17))
DECODE_ATTENTION = ("xla", "pallas", "pallas_interpret")


class Rollout(eqx.Module):
    """G completions of P prompts. ``mask`` is 1 up to and including the stop token."""

    tokens: Int[Array, "p g n"]
    mask: Int[Array, "p g n"]
    logprobs: Float[Array, "p g n"]
    lengths: Int[Array, "p g"]
    finished: Bool[Array, "p g"]
    routes: Routes | None = None  # a mixture of experts' choices (RolloutConfig.record_routes)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """What the compiled sampler is specialised on (a new value compiles a new program)."""

    num_generations: int
    max_new_tokens: int
    sampling: SamplingConfig = SamplingConfig()
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS
    cache_chunk: int = 64  # completion-cache block: a step reads only the blocks filled so far
    max_segments: int = 16
    """At most this many cache blocks (one compiled decode loop each, the s-th reading s blocks, so
    the program grows with their square): a long budget gets blocks of ``ceil(N / max_segments)``."""
    decode_attention: str = "xla"
    """The decode step's attention: "xla" (XLA's fusions, the default everywhere), "pallas" (one
    Pallas Triton kernel per step and layer, ``relax.models.attention.decode``; GPU only, opt-in
    until measured) or "pallas_interpret" (the same kernel run by Pallas' interpreter: any
    backend, for tests)."""
    merge_adapters: bool = True
    """With LoRA: decode on ``W + s A B`` merged into the per-rollout fused weights (a copy made
    anyway, so no extra memory), not the adapters run beside them: fewer, wider matmuls
    (RESULTS.md compares the two)."""
    compactions: int = 3
    """Times the decode batch may halve as its rows finish (``relax.rollout.compaction``): from
    ``B`` rows to ``B/2`` once at most ``B/2`` still run, then to ``B/4``, ``B/8``; each phase adds
    decode loops to the program (0: never compact; the loops once)."""
    record_routes: bool = False
    """A mixture-of-experts model records each token's experts at every sparse layer in the
    rollout (``Rollout.routes``, for routing replay: ``relax.models.forward.routes``); no effect on a
    dense model."""

    def __post_init__(self):
        if self.num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {self.num_generations}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.compactions < 0:
            raise ValueError(f"compactions must be >= 0, got {self.compactions}")
        if self.cache_chunk < 1 or self.max_segments < 1:
            raise ValueError(
                f"cache_chunk and max_segments must be >= 1, got {self.cache_chunk}, {self.max_segments}"
            )
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
            )
        if not self.prompt_buckets or list(self.prompt_buckets) != sorted(set(self.prompt_buckets)):
            raise ValueError(
                f"prompt_buckets must be increasing and non-empty, got {self.prompt_buckets}"
            )


def block_size(cfg: RolloutConfig) -> int:
    """Completion-cache slots per block: ``cache_chunk``, or more when the budget would otherwise
    need more than ``max_segments`` blocks."""
    return max(cfg.cache_chunk, -(-cfg.max_new_tokens // cfg.max_segments))


def block_sizes(cfg: RolloutConfig) -> list[int]:
    """Slots of each completion-cache block (the last one may be shorter): one decode loop each."""
    n = cfg.max_new_tokens
    chunk = min(block_size(cfg), n)
    return [min(chunk, n - i) for i in range(0, n, chunk)]


def cache_bytes(config, prompts: int, prompt_len: int, cfg: RolloutConfig, dtype) -> int:
    """Bytes of the KV caches ``generate_program`` keeps over the whole batch: per layer, keys and values
    of each prompt once (``[P, Hkv, Lp, D]``) and of each of its G completions
    (``[P*G, Hkv, N, D]``), in the model's compute ``dtype``."""
    slots = prompts * prompt_len + prompts * cfg.num_generations * cfg.max_new_tokens
    return (
        2
        * config.num_layers
        * slots
        * config.num_kv_heads
        * config.head_dim
        * jnp.dtype(dtype).itemsize
    )


def bucket_length(length: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= length:
            return b
    raise ValueError(
        f"prompt length {length} is longer than the largest prompt bucket {buckets[-1]}"
    )


def validate(model: Transformer, prompt_ids, prompt_mask, cfg: RolloutConfig) -> np.ndarray:
    """Host-side checks before anything is compiled; returns the prompt lengths."""
    ids, mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    if ids.ndim != 2 or ids.shape != mask.shape:
        raise ValueError(
            f"prompt_ids {ids.shape} and prompt_mask {mask.shape} must both be [P, Lp]"
        )
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"prompt_ids must be integers, got {ids.dtype}")
    lengths = mask.astype(bool).sum(axis=1)
    empty = np.nonzero(lengths == 0)[0]
    if empty.size:
        raise ValueError(f"prompt rows {empty.tolist()} are empty (all-zero prompt_mask)")
    c = model.config
    bad = np.nonzero((ids < 0) | (ids >= c.vocab_size))
    if bad[0].size:
        raise ValueError(
            f"prompt_ids[{bad[0][0]}, {bad[1][0]}] = {ids[bad][0]} is outside the vocabulary [0, {c.vocab_size})"
        )
    longest = int(lengths.max())
    if longest > c.max_position_embeddings:
        raise ValueError(
            f"prompt row {int(lengths.argmax())} has {longest} tokens, longer than the "
            f"model's context ({c.max_position_embeddings})"
        )
    bucket_length(ids.shape[1], cfg.prompt_buckets)
    if longest + cfg.max_new_tokens > c.max_position_embeddings:
        raise ValueError(
            f"max_new_tokens={cfg.max_new_tokens} after a {longest}-token prompt overflows the "
            f"model's context of {c.max_position_embeddings} positions"
        )
    for e in cfg.eos_ids:
        if not 0 <= e < c.vocab_size:
            raise ValueError(f"stop id {e} is outside the vocabulary [0, {c.vocab_size})")
    if not 0 <= cfg.pad_id < c.vocab_size:
        raise ValueError(f"pad_id {cfg.pad_id} is outside the vocabulary [0, {c.vocab_size})")
    return lengths


def _prefill(model: Transformer, ids, mask):
    """Head-major prompt K/V ``[L, P, Hkv, Lp, D]``, last-position logits (the only ones needed)
    and the sparse layers' experts of every prompt token ``[P, Lp, Ls, k]`` (None: dense)."""
    pos = positions_from_mask(mask)
    attend = full_attention(model, pos, mask.astype(bool))
    h, (pk, pv), routed = run_layers(
        model, embed(model, ids), pos, attend, routes=LayerRoutes(mask.astype(bool))
    )
    experts = None if routed is None else jnp.moveaxis(routed.experts, 0, 2)
    return pk, pv, project(model, h[:, -1]), experts


# logical dims of the fused weights on a mesh (the rest, norms, output biases, a sparse layer's
# router and shared expert, replicated); a sparse layer's experts split over ``expert`` (their
# units over ``tensor``), as the expert-parallel step reads them (relax.models.moe.expert_parallel)
_FUSED_DIMS = {
    "wqkv": (None, "heads"),
    "bqkv": ("heads",),
    "wo": ("heads", None),
    "w_gate_up": (None, "mlp"),
    "b_gate_up": ("mlp",),
    "w_down": ("mlp", None),
    "expert_gate": ("experts", None, "expert_mlp"),
    "expert_up": ("experts", None, "expert_mlp"),
    "expert_down": ("experts", "expert_mlp", None),
}


def _place_layer(layout: DecodeLayout, p: FusedLayer) -> FusedLayer:
    """One fused layer in the decode layout (adapters left where they are)."""

    def place(name):
        x = getattr(p, name)
        if name == "lora" or not eqx.is_array(
            x
        ):  # adapters, absent biases, the static group counts
            return x
        return layout.constrain(x, *_FUSED_DIMS.get(name, (None,) * x.ndim))

    return FusedLayer(**{f.name: place(f.name) for f in dataclasses.fields(p)})


def _place_model(layout: DecodeLayout, model: Transformer) -> Transformer:
    """The embedding (and untied head) whole along the width, rows over the vocabulary axis."""
    head = lambda x: None if x is None else layout.constrain(x, "vocab", None)
    return dataclasses.replace(model, embed=head(model.embed), lm_head=head(model.lm_head))


def _attention_kernel(kind: str, layout: DecodeLayout, num_gen: int, scale: float | None):
    """``fn(q, pk, pv, prompt_allowed, own_k, own_v, own_allowed)`` of ``RolloutConfig.decode_attention``;
    on a mesh the Pallas kernel runs per shard (rows over the batch axes, KV heads over tensor)."""
    if kind == "xla":
        return functools.partial(reference_decode_attention, num_gen=num_gen, scale=scale)
    if kind == "pallas" and not pallas_available(jax.default_backend()):
        raise ValueError(
            f"decode_attention='pallas' needs a CUDA GPU (backend: {jax.default_backend()}); "
            "use 'xla', or 'pallas_interpret' to run the kernel in Pallas' interpreter"
        )
    kernel = functools.partial(
        pallas_decode_attention, num_gen=num_gen, scale=scale, interpret=kind == "pallas_interpret"
    )
    if not layout.sharded:
        return kernel
    heads = layout.spec("batch", "heads")
    in_specs = (heads, heads, heads, layout.spec("batch"), heads, heads, layout.spec())
    return jax.shard_map(kernel, in_specs=in_specs, out_specs=heads, check_vma=False)


def _decode_attend(
    model: Transformer,
    layout: DecodeLayout,
    kernel,
    num_gen: int,
    q_pos,
    prompt_pos,
    prompt_valid,
    t,
    seg: int,
    chunk: int,
):
    """Attention of one new token per completion over [shared prompt | own cache incl. itself].

    ``q`` arrives as ``[P*G, 1, Hq, D]`` and is grouped ``[P*G, Hkv, R, D]``; ``kernel``
    (``_attention_kernel``) folds the G completions of a prompt into the query rows against the
    prompt's single copy of its keys ``[P, Hkv, D, Lp]``. The completion cache is a list of blocks
    of ``chunk`` slots; during segment ``seg`` (steps ``seg*chunk <= t < (seg+1)*chunk``) blocks
    before ``seg`` are full, block ``seg`` is being filled and later blocks are not read at all.
    Each layer masks by its own window (the decode loop runs the layers with static kinds).
    """
    c = model.config
    hk, r = c.num_kv_heads, c.q_per_kv

    def attend(q, k, v, layer_input, sliding):
        window = layer_window(c, sliding)
        pk, pv, ck, cv = layer_input
        b, _, hq, d = q.shape
        p = b // num_gen
        qg = layout.constrain(
            q.reshape(b, hk, r, d), "batch", "heads", None, None
        )  # rows of a KV head: its R heads
        k, v = (layout.constrain(x.reshape(b, hk, d), "batch", "heads", None) for x in (k, v))
        allowed_p = prompt_valid
        if window is not None:
            qpos_p = q_pos.reshape(p, num_gen)[:, 0]
            allowed_p = allowed_p & ((qpos_p[:, None] - prompt_pos) < window)
        # this step's key/value go into block seg first (in place, before it is read)
        ck, cv = list(ck), list(cv)
        ck[seg] = jax.lax.dynamic_update_index_in_dim(
            ck[seg], k.astype(ck[seg].dtype), t - seg * chunk, axis=3
        )
        cv[seg] = jax.lax.dynamic_update_index_in_dim(
            cv[seg], v.astype(cv[seg].dtype), t - seg * chunk, axis=2
        )
        ck, cv = (
            [layout.constrain(x, "batch", "heads", None, None) for x in xs] for xs in (ck, cv)
        )
        own_allowed = []
        for blk in range(seg + 1):
            slots = blk * chunk + jnp.arange(cv[blk].shape[2])
            allowed = slots <= t
            own_allowed.append(allowed if window is None else allowed & (t - slots < window))
        out = kernel(
            qg, pk, pv, allowed_p, tuple(ck[: seg + 1]), tuple(cv[: seg + 1]), tuple(own_allowed)
        )
        return out.reshape(b, 1, hq, d).astype(q.dtype), (tuple(ck), tuple(cv))

    return attend


class _Rows(NamedTuple):
    """What the decode loops of one compaction phase read per row (``relax.rollout.compaction``):
    the rows' places in the ``[B, N]`` outputs (None: all rows, in order), their prompts' keys and
    values (``[P, ...]`` shared by ``num_gen`` rows each, or one copy per row once compacted),
    prompt positions and validity, first decode position, RoPE tables and uniform draws."""

    index: Int[Array, " b"] | None
    num_gen: int
    prompt_kv: list
    prompt_pos: Int[Array, "p lp"]
    prompt_valid: Bool[Array, "p lp"]
    q_pos_base: Int[Array, " b"]
    rope_table: Any
    u: Float[Array, "b n"]


def _compact(
    rows: _Rows, bufs, finished, ck, cv, size: int, g: int, layout: DecodeLayout, merge: int
):
    """The next phase's ``size`` rows (``keep_rows``): their output buffers and caches gathered
    (every ``merge`` consecutive cache blocks joined into one); prompts become per row."""
    keep = keep_rows(finished, size)
    index = keep if rows.index is None else rows.index[keep]
    by_row = lambda x: jnp.take(x, keep, axis=0)  # noqa: E731
    by_prompt = (lambda x: jnp.take(x, index // g, axis=0)) if rows.num_gen > 1 else by_row  # noqa: E731
    heads = lambda x: layout.constrain(x, "batch", "heads", None, None)  # noqa: E731
    join = (
        lambda blocks, axis: tuple(  # noqa: E731
            heads(by_row(jnp.concatenate(blocks[i : i + merge], axis=axis)))
            for i in range(0, len(blocks), merge)
        )
    )
    ck = [join(blocks, 3) for blocks in ck]  # keys [b, Hkv, D, slots]
    cv = [join(blocks, 2) for blocks in cv]  # values [b, Hkv, slots, D]
    kv = [(heads(by_prompt(k)), heads(by_prompt(v))) for k, v in rows.prompt_kv]
    row = lambda x: layout.constrain(x, "batch", *(None,) * (x.ndim - 1))  # noqa: E731
    nxt = _Rows(
        index=row(index),
        num_gen=1,
        prompt_kv=kv,
        prompt_pos=row(by_prompt(rows.prompt_pos)),
        prompt_valid=row(by_prompt(rows.prompt_valid)),
        q_pos_base=row(by_row(rows.q_pos_base)),
        rope_table=jax.tree.map(lambda x: row(by_row(x)), rows.rope_table),
        u=row(by_row(rows.u)),
    )
    return nxt, tuple(row(by_row(x)) for x in bufs), row(by_row(finished)), ck, cv


def _write_back(out, index, bufs):
    """A phase's output buffers (tokens, log-probs, mask, routes of its rows) into the ``[B, ...]``
    outputs ``out`` at rows ``index`` (None: every row, in order: the buffers are the outputs)."""
    if index is None:
        return bufs
    return tuple(o.at[index].set(b) for o, b in zip(out, bufs))


def generate_program(
    model: Transformer, prompt_ids, prompt_mask, key, cfg: RolloutConfig
) -> Rollout:
    """The sampler's traced program: what ``compiled_generate`` jits, and what a larger jitted stage
    (e.g. the online algorithms' rollout) calls inside its own program."""
    c = model.config
    p, _ = prompt_ids.shape
    g, n = cfg.num_generations, cfg.max_new_tokens
    b = p * g
    dtype = model.dtype
    layout = decode_layout(c)
    rows = lambda x: layout.constrain(
        x, "batch", *(None,) * (x.ndim - 1)
    )  # a loop buffer: rows split
    pk, pv, logits0, prompt_experts = _prefill(model, prompt_ids, prompt_mask)
    record = cfg.record_routes and prompt_experts is not None
    rdt = route_dtype(c.num_experts)
    # experts of completion token t, recorded when it is fed (step t) by a running row: the last
    # token (and anything after it) never is: -1
    routes = jnp.full(
        (b, n, c.num_sparse_layers, c.num_experts_per_tok) if record else (b, 0), -1, rdt
    )
    prompt_len = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
    keys = jax.random.split(key, b)
    eos = jnp.asarray(cfg.eos_ids if cfg.eos_ids else (-1,), jnp.int32)

    def draw(logits, step, u):
        return sample(
            logits, jax.lax.dynamic_index_in_dim(u, step, axis=1, keepdims=False), cfg.sampling
        )

    # Per-layer buffers and parameters: the decode loop indexes no stacked [L, ...] array,
    # so nothing is sliced (copied) per step and each cache is updated in place.
    # with LoRA: W + s A B merged into the fused copy made here anyway (no extra memory)
    fused = fuse_layers(
        merge_lora(model) if cfg.merge_adapters else model,
        qkv_groups=layout.qkv_groups,
        mlp_groups=layout.mlp_groups,
    )
    layers = [_place_layer(layout, p) for p in fused]
    model = _place_model(layout, model)
    heads = lambda x: layout.constrain(x, "batch", "heads", None, None)
    q_pos_base = jnp.repeat(prompt_len, g)
    # keys are kept transposed, [.., Hkv, D, S]: the decode score product is then a plain matmul;
    # rotary cos/sin of every decode position, [B, N, D] each per RoPE kind, derived once before the
    # loop; one uniform draw per completion and step, derived up front
    phase = _Rows(
        index=None,
        num_gen=g,
        prompt_kv=[(heads(jnp.swapaxes(pk[i], -1, -2)), heads(pv[i])) for i in range(c.num_layers)],
        prompt_pos=positions_from_mask(prompt_mask),
        prompt_valid=prompt_mask.astype(bool),
        q_pos_base=q_pos_base,
        rope_table=rotary(c, q_pos_base[:, None] + jnp.arange(n)[None, :]),
        u=uniform_table(keys, n),
    )
    tok0, lp0 = draw(rows(jnp.repeat(logits0, g, axis=0)), 0, phase.u)
    finished0 = jnp.isin(tok0, eos)
    tokens = jnp.full((b, n), cfg.pad_id, jnp.int32).at[:, 0].set(tok0)
    logps = jnp.zeros((b, n), jnp.float32).at[:, 0].set(lp0)
    mask = jnp.zeros((b, n), jnp.int32).at[:, 0].set(1)
    # Completion caches in blocks of cache_chunk slots, one segment (while_loop) per block: a
    # step reads only the blocks filled so far instead of the whole budget.
    chunk, sizes = min(block_size(cfg), n), block_sizes(cfg)
    ck = [
        tuple(heads(jnp.zeros((b, c.num_kv_heads, c.head_dim, sz), dtype)) for sz in sizes)
        for _ in range(c.num_layers)
    ]
    cv = [
        tuple(heads(jnp.zeros((b, c.num_kv_heads, sz, c.head_dim), dtype)) for sz in sizes)
        for _ in range(c.num_layers)
    ]

    def make_segment(seg: int, ph: _Rows, kernel, next_rows: int, chunk: int):
        end = min((seg + 1) * chunk, n - 1)  # the last step feeds token n-2 and draws token n-1

        def cond(s):
            t, _, finished, *_ = s
            if not next_rows:
                return (t < end) & ~jnp.all(finished)
            return (t < end) & (jnp.sum(~finished) > next_rows)  # compact once the running rows fit

        def body(s):
            t, (tokens, logps, mask, routes), finished, ck, cv = s  # this phase's rows
            cur = jax.lax.dynamic_index_in_dim(tokens, t, axis=1, keepdims=True)  # [b, 1]
            q_pos = (ph.q_pos_base + t)[:, None]
            attend = _decode_attend(
                model,
                layout,
                kernel,
                ph.num_gen,
                q_pos,
                ph.prompt_pos,
                ph.prompt_valid,
                t,
                seg,
                chunk,
            )
            inputs = [(pk_, pv_, ck_, cv_) for (pk_, pv_), ck_, cv_ in zip(ph.prompt_kv, ck, cv)]
            rope = jax.tree.map(
                lambda x: jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1), ph.rope_table
            )
            h, new_kv, routed = run_layers(
                model,
                rows(embed(model, cur)),
                q_pos,
                attend,
                inputs,
                layers=layers,
                rope=rope,
                routes=LayerRoutes(~finished[:, None]),
            )
            ck, cv = [kv[0] for kv in new_kv], [kv[1] for kv in new_kv]
            logits = layout.constrain(
                project(model, rows(h[:, 0])), "batch", "vocab"
            )  # the head split by rows
            tok, lp = draw(rows(logits), t + 1, ph.u)  # gathered whole for the draw
            alive = ~finished
            if record:  # [Ls, b, 1, k] -> slot t of [b, N, Ls, k]
                step_routes = jnp.where(
                    alive[:, None, None], jnp.moveaxis(routed.experts[:, :, 0], 0, 1), -1
                )
                routes = rows(
                    jax.lax.dynamic_update_index_in_dim(routes, step_routes.astype(rdt), t, axis=1)
                )
            tokens = jax.lax.dynamic_update_index_in_dim(
                tokens, jnp.where(alive, tok, cfg.pad_id), t + 1, axis=1
            )
            logps = jax.lax.dynamic_update_index_in_dim(
                logps, jnp.where(alive, lp, 0.0), t + 1, axis=1
            )
            mask = jax.lax.dynamic_update_index_in_dim(mask, alive.astype(jnp.int32), t + 1, axis=1)
            finished = finished | (alive & jnp.isin(tok, eos))
            return t + 1, (rows(tokens), rows(logps), rows(mask), routes), rows(finished), ck, cv

        return cond, body

    state = (jnp.int32(0), (rows(tokens), rows(logps), rows(mask), routes), rows(finished0), ck, cv)
    # without stop ids every row runs to the budget: nothing to compact
    counts = compaction_sizes(b, cfg.compactions if cfg.eos_ids else 0, ambient_batch_shards())
    merge = -(
        -len(sizes) // COMPACTED_BLOCKS
    )  # a compacted phase's blocks: this many of phase 0's each
    out = None  # the [B, N] outputs, written back from each phase's rows when it ends
    for k, size in enumerate(counts):
        if k:  # the running rows fit in ``size``: gather them (relax.rollout.compaction)
            t, bufs, finished, ck, cv = state
            out = _write_back(out, phase.index, bufs)
            phase, bufs, finished, ck, cv = _compact(
                phase, bufs, finished, ck, cv, size, g, layout, merge if k == 1 else 1
            )
            state = (t, bufs, finished, ck, cv)
        kernel = _attention_kernel(cfg.decode_attention, layout, phase.num_gen, c.attn_scale)
        next_rows = counts[k + 1] if k + 1 < len(counts) else 0
        width = chunk if k == 0 else chunk * merge
        for seg in range(len(ck[0])):
            if seg * width < n - 1:
                state = jax.lax.while_loop(
                    *make_segment(seg, phase, kernel, next_rows, width), state
                )
    tokens, logps, mask, routes = (rows(x) for x in _write_back(out, phase.index, state[1]))
    finished = jnp.any(
        (mask > 0) & jnp.isin(tokens, eos), axis=1
    )  # a row ends at its first stop id
    shape = (p, g, n)
    recorded = (
        None
        if not record
        else Routes(
            prompt=prompt_experts.astype(rdt), completion=routes.reshape(p, g, n, *routes.shape[2:])
        )
    )
    return Rollout(
        tokens=tokens.reshape(shape),
        mask=mask.reshape(shape),
        logprobs=logps.reshape(shape),
        lengths=jnp.sum(mask, axis=1).reshape(p, g),
        finished=finished.reshape(p, g),
        routes=recorded,
    )


@functools.lru_cache(maxsize=64)
def compiled_generate(cfg: RolloutConfig):
    """The jitted sampler for one config (jax caches one executable per input shape)."""
    return jax.jit(functools.partial(generate_program, cfg=cfg))


def pad_to_bucket(prompt_ids, prompt_mask, buckets: tuple[int, ...], pad_id: int):
    """Left-pad the prompt buffers to their length bucket so nearby lengths share a compile."""
    lp = prompt_ids.shape[1]
    target = bucket_length(lp, buckets)
    if target == lp:
        return jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_mask, jnp.int32)
    extra = target - lp
    ids = jnp.pad(jnp.asarray(prompt_ids, jnp.int32), ((0, 0), (extra, 0)), constant_values=pad_id)
    mask = jnp.pad(jnp.asarray(prompt_mask, jnp.int32), ((0, 0), (extra, 0)))
    return ids, mask


def generate(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    *,
    key: Array,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    eos_ids: tuple[int, ...] | int | None = None,
    pad_id: int = 0,
    prompt_buckets: tuple[int, ...] = DEFAULT_BUCKETS,
    cache_chunk: int = RolloutConfig.cache_chunk,
) -> Rollout:
    """Sample ``num_generations`` completions of each left-padded prompt.

    ``eos_ids=None`` takes the model config's ``eos_token_id`` (none: run to the budget).
    The same key gives the same tokens; each completion's randomness is its own.
    """
    if eos_ids is None:
        eos_ids = model.config.eos_ids
    elif isinstance(eos_ids, int):
        eos_ids = (eos_ids,)
    cfg = RolloutConfig(
        num_generations=num_generations,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        eos_ids=tuple(int(e) for e in eos_ids),
        pad_id=pad_id,
        prompt_buckets=tuple(prompt_buckets),
        cache_chunk=cache_chunk,
    )
    return generate_with(model, prompt_ids, prompt_mask, key, cfg)


def generate_with(model: Transformer, prompt_ids, prompt_mask, key, cfg: RolloutConfig) -> Rollout:
    """``generate`` from a ready ``RolloutConfig``: validate on the host, bucket, run."""
    validate(model, prompt_ids, prompt_mask, cfg)
    ids, mask = pad_to_bucket(prompt_ids, prompt_mask, cfg.prompt_buckets, cfg.pad_id)
    return compiled_generate(cfg)(model, ids, mask, key)
