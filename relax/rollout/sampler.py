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
the attention, so its log-probs equal the trainer's. With ``RolloutConfig.sampler_precision``
int8 / fp8 the per-rollout copy of the weights is 8-bit (``relax.models.layers.quantized``) and
the prompt is prefilled on it too: the log-probs are then those of ``dequantized(model)``.

The public types and host-side helpers live in ``relax.rollout.config`` and the decode loop's
pieces (layout, attention, compaction phases) in ``relax.rollout.decode``; this module assembles
the program and is the sampler's import path for all of them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int

from relax.models.adapters.operations import merge_lora
from relax.models.config.sharding import DecodeLayout, ambient_batch_shards, decode_layout
from relax.models.decoder.prompt_inputs import PromptInputs, prompt_embeddings
from relax.models.decoder.transformer import (
    FusedLayer,
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
from relax.models.layers.quantized import (
    FUSED_WEIGHTS,
    STACKED_WEIGHTS,
    dequantize,
    dequantize_fields,
    quantize,
    quantize_fields,
)
from relax.models.layers.rope import rotary
from relax.rollout.compaction import COMPACTED_BLOCKS, compaction_sizes
from relax.rollout.config import (
    DECODE_ATTENTION,
    DEFAULT_BUCKETS,
    Rollout,
    RolloutConfig,
    block_size,
    block_sizes,
    bucket_length,
    cache_bytes,
    pad_to_bucket,
    validate,
)
from relax.rollout.decode import (
    Rows,
    attention_kernel,
    compact,
    decode_attend,
    place_layer,
    place_model,
    write_back,
)
from relax.rollout.sampling import SamplingConfig, sample_tokens, uniform_table

__all__ = [
    "DECODE_ATTENTION",
    "DEFAULT_BUCKETS",
    "Rollout",
    "RolloutConfig",
    "block_size",
    "block_sizes",
    "bucket_length",
    "cache_bytes",
    "compiled_generate",
    "dequantized",
    "generate",
    "generate_program",
    "generate_with",
    "pad_to_bucket",
    "validate",
]


def _prefill(
    model: Transformer,
    ids,
    mask,
    layers: list[FusedLayer] | None = None,
    prompt: PromptInputs | None = None,
):
    """Head-major prompt K/V ``[L, P, Hkv, Lp, D]`` (with ``layers``, the decode loop's weights: a
    list of ``[P, Hkv, Lp, D]``), last-position logits (the only ones needed) and the sparse
    layers' experts of every prompt token ``[P, Lp, Ls, k]`` (None: dense). ``prompt``: an image
    prompt's inputs (``PromptInputs``: embeddings, RoPE tables, bidirectional blocks)."""
    pos = positions_from_mask(mask)
    valid = mask.astype(bool)
    x, rope, blocks = (
        (embed(model, ids), None, None)
        if prompt is None
        else (prompt_embeddings(model, ids, prompt), prompt.rope, prompt.blocks)
    )
    attend = full_attention(model, pos, valid, blocks)
    h, kv, routed = run_layers(
        model, x, pos, attend, layers=layers, rope=rope, routes=LayerRoutes(valid)
    )
    pk, pv = kv if layers is None else ([k for k, _ in kv], [v for _, v in kv])
    experts = None if routed is None else jnp.moveaxis(routed.experts, 0, 2)
    return pk, pv, project(model, h[:, -1]), experts


def _decode_weights(
    model: Transformer, layout: DecodeLayout, cfg: RolloutConfig
) -> tuple[Transformer, list[FusedLayer]]:
    """The decode loop's weights, laid out once (``place_layer`` / ``place_model``): per-layer fused
    q/k/v and gate/up (with LoRA: ``W + s A B`` merged into this copy when ``cfg.merge_adapters``),
    the embedding and head. With ``cfg.sampler_precision`` int8 / fp8 the fused matrices and the
    head are quantized per output channel (``relax.models.layers.quantized``; the embedding gather
    stays in the model's dtype, a tied head gets its own 8-bit copy)."""
    fused = fuse_layers(
        merge_lora(model) if cfg.merge_adapters else model,
        qkv_groups=layout.qkv_groups,
        mlp_groups=layout.mlp_groups,
    )
    precision = cfg.sampler_precision
    if precision == "model":
        layers = [place_layer(layout, p) for p in fused]
        model = place_model(layout, model)
        return model, layers
    # quantized in the decode layout (each weight whole along its input: its scales are local),
    # one layer after another: a layer is laid out (gathered) only once the previous one is
    # quantized, so one layer's float copy at a time lies beside the 8-bit ones
    model = place_model(layout, model)
    prev = quantize(model.head, precision, model.dtype, contract=-1)
    model = dataclasses.replace(model, lm_head=prev)
    layers = []
    for p in fused:
        p, _ = jax.lax.optimization_barrier((p, prev))
        prev = quantize_fields(place_layer(layout, p), FUSED_WEIGHTS, precision, model.dtype)
        layers.append(prev)
    return model, layers


def dequantized(model: Transformer, precision: str) -> Transformer:
    """The model an int8 / fp8 sampler of ``model`` samples from: each weight it quantizes replaced
    by its ``W^`` (``relax.models.layers.quantized``), the head untied when tied (the embedding
    gather keeps the model's); ``model`` itself for "model". Its forward's log-probs are the
    quantized sampler's (with LoRA: ``merge_lora`` first, as the sampler merges)."""
    if precision == "model":
        return model
    head = dequantize(quantize(model.head, precision, model.dtype, contract=-1))
    layers = dequantize_fields(model.layers, STACKED_WEIGHTS, precision, model.dtype)
    return dataclasses.replace(model, layers=layers, lm_head=head)


def generate_program(
    model: Transformer,
    prompt_ids,
    prompt_mask,
    key,
    cfg: RolloutConfig,
    prompt: PromptInputs | None = None,
) -> Rollout:
    """The sampler's traced program: what ``compiled_generate`` jits, and what a larger jitted stage
    (e.g. the online algorithms' rollout) calls inside its own program. ``prompt``: an image
    prompt's inputs (``relax.models.decoder.prompt_inputs``), prefilled once per prompt; the
    completions' RoPE positions start at its ``next_position``."""
    c = model.config
    p, _ = prompt_ids.shape
    g, n = cfg.num_generations, cfg.max_new_tokens
    b = p * g
    dtype = model.dtype
    layout = decode_layout(c)
    rows = lambda x: layout.constrain(
        x, "batch", *(None,) * (x.ndim - 1)
    )  # a loop buffer: rows split
    quantized = cfg.sampler_precision != "model"
    if quantized:  # prefill on the decode loop's 8-bit weights: one copy, the same numbers
        model, layers = _decode_weights(model, layout, cfg)
    pk, pv, logits0, prompt_experts = _prefill(
        model, prompt_ids, prompt_mask, layers if quantized else None, prompt
    )
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
        return sample_tokens(
            logits, jax.lax.dynamic_index_in_dim(u, step, axis=1, keepdims=False), cfg.sampling
        )

    # Per-layer buffers and parameters: the decode loop indexes no stacked [L, ...] array,
    # so nothing is sliced (copied) per step and each cache is updated in place.
    # with LoRA: W + s A B merged into the fused copy made here anyway (no extra memory)
    if not quantized:
        model, layers = _decode_weights(model, layout, cfg)
    heads = lambda x: layout.constrain(x, "batch", "heads", None, None)
    q_pos_base = jnp.repeat(prompt_len, g)
    rope_base = q_pos_base if prompt is None else jnp.repeat(prompt.next_position, g)
    # keys are kept transposed, [.., Hkv, D, S]: the decode score product is then a plain matmul;
    # rotary cos/sin of every decode position, [B, N, D] each per RoPE kind, derived once before the
    # loop; one uniform draw per completion and step, derived up front
    phase = Rows(
        index=None,
        num_gen=g,
        prompt_kv=[(heads(jnp.swapaxes(pk[i], -1, -2)), heads(pv[i])) for i in range(c.num_layers)],
        prompt_pos=positions_from_mask(prompt_mask),
        prompt_valid=prompt_mask.astype(bool),
        q_pos_base=q_pos_base,
        rope_table=rotary(c, rope_base[:, None] + jnp.arange(n)[None, :]),
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

    def make_segment(seg: int, ph: Rows, kernel, next_rows: int, chunk: int):
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
            attend = decode_attend(
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
            out = write_back(out, phase.index, bufs)
            phase, bufs, finished, ck, cv = compact(
                phase, bufs, finished, ck, cv, size, g, layout, merge if k == 1 else 1
            )
            state = (t, bufs, finished, ck, cv)
        kernel = attention_kernel(
            cfg.decode_attention,
            layout,
            phase.num_gen,
            c.attn_scale,
            model.precision.probs_dtype(model.dtype),
        )
        next_rows = counts[k + 1] if k + 1 < len(counts) else 0
        width = chunk if k == 0 else chunk * merge
        for seg in range(len(ck[0])):
            if seg * width < n - 1:
                state = jax.lax.while_loop(
                    *make_segment(seg, phase, kernel, next_rows, width), state
                )
    tokens, logps, mask, routes = (rows(x) for x in write_back(out, phase.index, state[1]))
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

    Args:
        model: the ``Transformer`` that samples (LoRA adapters are merged for the sampler).
        prompt_ids: int ``[p lp]`` prompt tokens, left-padded; no row may be empty.
        prompt_mask: int ``[p lp]``, 1 at the prompt tokens.
        key: the PRNG key.
        num_generations: completions per prompt (``g``).
        max_new_tokens: the completion budget (``n``).
        temperature: divides the logits (default 1.0); 0 is greedy decoding.
        top_k: keep the ``top_k`` most likely tokens. None (default): no filter.
        top_p: keep the smallest set of most likely tokens whose probability reaches
            ``top_p``. None (default): no filter.
        min_p: keep the tokens with probability at least ``min_p`` times the largest. None
            (default): no filter.
        eos_ids: the token id or ids that end a completion; None: the model config's.
        pad_id: the token after a completion's end (default 0).
        prompt_buckets: the lengths ``lp`` is left-padded up to (the smallest that fits), so
            that nearby lengths share one compiled sampler.
        cache_chunk: slots per block of the completions' KV cache (default 64).

    Returns:
        A ``Rollout``: ``tokens`` and ``mask`` int ``[p g n]`` (``mask`` 1 up to and including the
            stop token), ``logprobs`` float32 ``[p g n]`` (the sampled tokens' log-probs at
            ``temperature``, 1 when greedy, over the whole vocabulary: the filters do not
            renormalise them), ``lengths`` ``[p g]`` (tokens per completion) and ``finished`` bool
            ``[p g]`` (ended at a stop token, not at the budget).
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
    """``generate`` from a ready ``RolloutConfig``: validate on the host, bucket, run.

    Args:
        model: the ``Transformer`` that samples.
        prompt_ids: int ``[p lp]`` prompt tokens, left-padded, checked on the host: no empty
            row, every id in the vocabulary, no prompt longer than the model's context.
        prompt_mask: int ``[p lp]``, 1 at the prompt tokens.
        key: the PRNG key.
        cfg: the sampler's ``RolloutConfig``; one program is compiled per config and prompt
            bucket.

    Returns:
        ``generate``'s ``Rollout``; with ``cfg.record_routes`` on a mixture of experts, also the
            experts it chose (``routes``).
    """
    validate(model, prompt_ids, prompt_mask, cfg)
    ids, mask = pad_to_bucket(prompt_ids, prompt_mask, cfg.prompt_buckets, cfg.pad_id)
    return compiled_generate(cfg)(model, ids, mask, key)
