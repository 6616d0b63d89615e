"""The training forward with the prompt shared by its G completions (Prefix Grouper).

Each prompt runs through the layers once; at every layer its keys/values (head-major,
``[P, Hkv, Lp, D]``) are attended by all G completions of the group, with the G completions
folded into the query rows, and merged exactly with the completions' own causal block::

    o = merge( attn(q_c, K_prompt, V_prompt), attn(q_c, K_c, V_c; causal) )

so prompt compute is done once instead of G times and gradients flow back into the prompt
positions through ``K_prompt, V_prompt``. Logits exist only where a completion token is
predicted: from the last prompt position (first completion token) and from completion
positions ``0..N-2``; they are never materialised beyond a chunk of rows.

The completion attention has two implementations of the same function (``attention``):
``"group"`` (``relax.models.attention.group``: the prompt part once per group, a loop over
groups; fastest on CPU) and ``"dense"`` (``relax.models.attention.dense``: one fused causal
attention per completion over [prompt; completion], cuDNN's flash attention on GPU, 5x the
group kernel there). ``"auto"`` takes ``"dense"`` where cuDNN can run it (GPU, 16-bit dtype, no
sliding window) and ``"group"`` elsewhere.

The layers run as one ``lax.scan``; where their kinds differ (Gemma 3's sliding and full layers)
the kinds are scanned with them and each layer picks its window and RoPE tables
(``relax.models.config.layer_kinds``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.attention.dense import fused_attention_available, prefix_dense_attention
from relax.models.attention.group import prefix_group_attention
from relax.models.config.layer_kinds import layer_kind, layer_window
from relax.models.config.model import ModelConfig
from relax.models.config.sharding import ambient_batch_shards
from relax.models.decoder.layer import RouteIn, scan_layers
from relax.models.decoder.logprobs import logprobs_and_entropy_from_hidden, logprobs_from_hidden
from relax.models.decoder.prompt_inputs import PromptInputs, prompt_embeddings
from relax.models.decoder.transformer import (
    Transformer,
    embed,
    final_norm,
    full_attention,
    layer_forward,
    positions_from_mask,
)
from relax.models.forward.binned import binned_hidden, binned_logprobs
from relax.models.forward.completion_packing import CompletionBins
from relax.models.forward.forward_pass import DEFAULT_PASS, REMAT_POLICIES, ForwardPass
from relax.models.forward.routes import Routes
from relax.models.layers.rope import Rotary, rotary
from relax.models.moe.experts import RouterStats


class CompletionRope(NamedTuple):
    """Rotary ``(cos, sin)`` tables of a batch's prompt positions and completion positions; the
    ``*_local`` ones are the sliding layers' own RoPE (None for a model with one RoPE)."""

    prompt: tuple[Float[Array, "p lp d"], Float[Array, "p lp d"]]
    completion: tuple[Float[Array, "p g n d"], Float[Array, "p g n d"]]
    prompt_local: tuple[Float[Array, "p lp d"], Float[Array, "p lp d"]] | None = None
    completion_local: tuple[Float[Array, "p g n d"], Float[Array, "p g n d"]] | None = None


class CompletionRows(NamedTuple):
    """The completion rows the layers run over, ``[P, G, N]`` padded: tokens, absolute
    positions (prompt length + index in the completion), which slots hold a token."""

    tokens: Int[Array, "p g n"]
    positions: Int[Array, "p g n"]
    valid: Bool[Array, "p g n"]


def padded_rows(
    prompt_mask: Int[Array, "p lp"],
    completions: Int[Array, "p g n"],
    completion_mask: Int[Array, "p g n"],
) -> CompletionRows:
    """The rows of completions padded to the budget: token ``t`` at ``prompt length + t``."""
    _, g, n = completions.shape
    return CompletionRows(
        completions, _completion_positions(prompt_mask, g, n), completion_mask.astype(bool)
    )


def completion_rope(
    config: ModelConfig,
    prompt_mask: Int[Array, "p lp"],
    num_generations: int,
    num_tokens: int,
    prompt: PromptInputs | None = None,
) -> CompletionRope:
    """The rotary tables ``completion_logprobs`` uses: left-padded prompts at positions
    ``0..len-1`` (``positions_from_mask``), completion token ``t`` at ``len + t`` (``[P, G, N]``);
    with ``prompt`` (an image prompt's inputs) its own tables, completion token ``t`` at
    ``prompt.next_position + t``.

    Compute them once, outside any loop that calls ``completion_logprobs`` (micro-batches,
    epochs), and pass them as its ``rope``: XLA:CPU fuses ``cos``/``sin`` into every consumer
    and, with the layer loop unrolled, recomputes them per head and per layer (rotary fusions
    ~8x slower than with the tables read from memory; a loop boundary keeps them materialised).
    """
    return _rope_at(
        config,
        prompt_mask,
        _completion_positions(prompt_mask, num_generations, num_tokens),
        prompt,
    )


def _rope_at(config: ModelConfig, prompt_mask, c_pos, inputs: PromptInputs | None = None):
    """The tables of the prompts and of completion slots at sequence positions ``c_pos``
    (``[P, G, N]``); with ``inputs`` the prompt's own and ``c_pos`` moved to start at its
    ``next_position``."""
    if inputs is None:
        prompt = rotary(config, positions_from_mask(prompt_mask))
    else:
        p_len = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
        prompt = inputs.rope
        c_pos = c_pos + (inputs.next_position - p_len)[:, None, None]
    completion = rotary(config, c_pos)
    return CompletionRope(prompt.full, completion.full, prompt.local, completion.local)


def _completion_positions(prompt_mask: Int[Array, "p lp"], g: int, n: int) -> Int[Array, "p g n"]:
    """Completion token ``t`` of every completion of a prompt sits at ``prompt length + t``."""
    p_len = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
    return p_len[:, None, None] + jnp.broadcast_to(jnp.arange(n), (g, n))


def shared_hidden(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    completions: Int[Array, "p g n"],
    completion_mask: Int[Array, "p g n"],
    layers: ForwardPass,
    rope: CompletionRope | None,
) -> tuple[Float[Array, "p lp d"], Float[Array, "pg n d"]]:
    """Final-norm hidden states of prompts ``[P, Lp, D]`` and padded completions ``[P*G, N, D]``
    (``layers``: a resolved ``ForwardPass``, ``ForwardPass.resolved``)."""
    hp, hc, _ = rows_hidden(
        model,
        prompt_ids,
        prompt_mask,
        padded_rows(prompt_mask, completions, completion_mask),
        layers,
        rope,
    )
    return hp, hc


def rows_hidden(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    rows: CompletionRows,
    layers: ForwardPass,
    rope: CompletionRope | None,
    replay: tuple[Array, Array] | None = None,
    prompt: PromptInputs | None = None,
):
    """Final-norm hidden states of prompts ``[P, Lp, D]`` and completion rows ``[P*G, N, D]``, and the
    sparse layers' ``RouterStats`` over both (stacked ``[Ls]``; None for a dense model), the layers
    run as ``layers`` (a resolved ``ForwardPass``) says; ``replay``: the experts recorded on the
    prompt and completion rows (``Routes.replay_rows``), replayed when ``layers.replay_routes``
    (else compared with the layers' own choices); ``prompt``: an image prompt's inputs
    (``PromptInputs``: its embeddings, RoPE and bidirectional blocks; ``rope``, when given, must
    come from ``completion_rope(..., prompt)``)."""
    attention, save_attention = layers.attention, layers.save_attention
    replay_routes = layers.replay_routes
    if attention not in ("group", "dense"):
        raise ValueError(
            f"rows_hidden needs a resolved attention (group | dense), got {attention!r}"
        )
    c = model.config
    p = prompt_ids.shape[0]
    _, g, n = rows.tokens.shape
    b = p * g
    hk, r = c.num_kv_heads, c.q_per_kv

    p_valid = prompt_mask.astype(bool)
    p_pos = positions_from_mask(prompt_mask)
    p_len = jnp.sum(prompt_mask.astype(jnp.int32), axis=1)
    if rope is None:
        rope = _rope_at(c, prompt_mask, rows.positions, prompt)
    p_rope = Rotary(rope.prompt, rope.prompt_local)
    c_rope = jax.tree.map(
        lambda x: x.reshape(b, n, x.shape[-1]), Rotary(rope.completion, rope.completion_local)
    )
    prompt_attend = full_attention(
        model, p_pos, p_valid, None if prompt is None else prompt.blocks
    )  # also returns the prompt's head-major (k, v)

    # one group per loop step on one device; one local group per device per step on a mesh
    # (all groups at once when they do not split evenly over the mesh's batch shards)
    shards = ambient_batch_shards()
    per_step = 1 if shards == 1 else (shards if p % shards == 0 else p)
    query_rows = lambda x: jnp.tile(x.reshape(b, n), (1, r)).reshape(p, g, r * n)  # noqa: E731  rows (r, t) per KV head
    q_pos, k_pos, k_valid = query_rows(rows.positions), rows.positions, rows.valid

    impl = "cudnn" if fused_attention_available(model.dtype) else "xla"  # of the "dense" path

    def completion_attend(pk, pv):
        if attention == "dense":
            return lambda q, k, v, _, __: (
                prefix_dense_attention(
                    q, k, v, pk, pv, p_len, implementation=impl, scale=c.attn_scale
                ),
                None,
            )

        def attend(q, k, v, _, sliding):
            d = q.shape[-1]
            group = lambda x: x.reshape(p, g, n, hk, d).transpose(
                0, 3, 1, 2, 4
            )  # [P, Hkv, G, N, D]
            qg = (
                q.reshape(p, g, n, hk, r, d).transpose(0, 3, 1, 4, 2, 5).reshape(p, hk, g, r * n, d)
            )
            out = prefix_group_attention(
                qg,
                pk,
                pv,
                group(k),
                group(v),
                q_pos,
                p_pos,
                p_valid,
                k_pos,
                k_valid,
                window=layer_window(c, sliding),
                scale=c.attn_scale,
                groups_per_step=per_step,
                save_probabilities=save_attention,
                probs_dtype=model.precision.probs_dtype(model.dtype),
            )
            out = (
                out.reshape(p, hk, g, r, n, d).transpose(0, 2, 4, 1, 3, 5).reshape(b, n, hk * r, d)
            )
            return out.astype(q.dtype), None

        return attend

    p_route = lambda r: RouteIn(p_valid, r, replay_routes)  # noqa: E731
    c_route = lambda r: RouteIn(rows.valid.reshape(b, n), r, replay_routes)  # noqa: E731

    def body(carry, xs):
        xp, xc = carry
        layer, sliding, _, replay = xs[0], layer_kind(c, xs[1]), xs[2], xs[3]
        pr, cr = (None, None) if replay is None else replay
        xp, (pk, pv), p_routed = layer_forward(
            model, layer, xp, p_rope, prompt_attend, None, sliding, p_route(pr)
        )
        xc, _, c_routed = layer_forward(
            model, layer, xc, c_rope, completion_attend(pk, pv), None, sliding, c_route(cr)
        )
        stats = None if p_routed is None else p_routed.stats + c_routed.stats
        return (xp, xc), (None, stats)

    xc0 = embed(model, rows.tokens.reshape(b, n))
    xp0 = (
        embed(model, prompt_ids) if prompt is None else prompt_embeddings(model, prompt_ids, prompt)
    )
    policy = REMAT_POLICIES[layers.remat_policy] if layers.remat else None
    (xp, xc), _, stats = scan_layers(
        model, body, (xp0, xc0), None, replay, unroll=layers.unroll, remat=policy
    )
    return final_norm(model, xp), final_norm(model, xc), stats


def completion_logprobs(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    completions: Int[Array, "p g n"],
    completion_mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    temperature: float = 1.0,
    rope: CompletionRope | Rotary | None = None,
    packed: CompletionBins | None = None,
    routes: Routes | None = None,
    prompt: PromptInputs | None = None,
):
    """``log p(completion[t] | prompt, completion[<t])`` for every completion token, ``[P, G, N]``,
    the forward run as ``how`` says (``ForwardPass``: attention, remat, unrolled layers, prompt
    groups per pass, vocabulary chunk; with ``how.with_entropy`` also the entropy of each
    predicted distribution, ``(log-probs, entropies)``; with ``how.router_stats`` also the sparse
    layers' ``RouterStats`` summed over the prompt and completion tokens, ``(values, stats)``,
    None stats for a dense model).

    Prompts are left-padded; completions start right after the prompt's last valid token.
    Values at masked completion positions are finite but meaningless.
    ``rope``: the rotary tables (``completion_rope``; with ``packed`` a ``Rotary`` of the bins'
    slots) when the caller computed them outside its loop.
    ``packed``: the same prompts and completions packed across groups into bins
    (``relax.models.forward.completion_packing``): the layers run over the bins
    (``relax.models.forward.binned``; padding-free) and the values come back in the padded
    ``[P, G, N]`` layout, equal to the padded forward's up to float summation order.
    ``routes`` (a mixture-of-experts model): the experts a sampler recorded (``relax.models.forward.routes``),
    replayed when ``how.replay_routes`` (else only compared with the forward's own: ``RouterStats.differ``).

    Args:
        model: the ``Transformer``.
        prompt_ids: int ``[p lp]`` prompt tokens, left-padded.
        prompt_mask: int ``[p lp]``, 1 at the prompt tokens.
        completions: int ``[p g n]``: ``g`` completions per prompt, right-padded.
        completion_mask: int ``[p g n]``, 1 at the completion tokens.
        how: how the forward runs (``ForwardPass``). Default: ``"auto"`` attention, no remat,
            every prompt group at once, log-probs only.
        temperature: the logits are divided by it (default 1.0).
        rope: the rotary tables from ``completion_rope``. None (default): computed here.
        packed: the same completions packed into bins. None (default): the padded rows.
        routes: a mixture of experts' recorded experts. None (default): the forward routes.
        prompt: an image prompt's inputs (``relax.models.decoder.prompt_inputs``), run once per
            prompt; not with ``packed``. None (default): the text prompt of ``prompt_ids``.

    Returns:
        float32 ``[p g n]`` log-probs; with ``how.with_entropy`` a pair ``(log-probs, entropies)``,
            both ``[p g n]``; with ``how.router_stats`` that value paired with the summed
            ``RouterStats`` (None for a dense model).
    """
    if packed is not None:
        _no_bins_for(prompt)
        out, stats = binned_logprobs(
            model,
            packed,
            how,
            completions.shape[-1],
            temperature=temperature,
            routes=routes,
            rope=rope,
        )
        return (out, stats) if how.router_stats else out
    layers = how.resolved(model)
    run = functools.partial(_completion_logprobs, model, layers=layers, temperature=temperature)
    rows = padded_rows
    xs = (prompt_ids, prompt_mask, completions, completion_mask)
    tiled = how.groups_per_pass is not None and how.groups_per_pass != prompt_ids.shape[0]
    if rope is None and tiled:  # outside the loop over groups (see completion_rope)
        rope = _rope_at(model.config, prompt_mask, rows(*xs[1:]).positions, prompt)
    replay = None if routes is None else routes.replay_rows()
    if replay is not None:  # over_groups splits leaves on a leading [P]
        replay = jax.tree.map(
            lambda x: jnp.moveaxis(
                x.reshape(x.shape[0], prompt_ids.shape[0], -1, *x.shape[2:]), 0, 1
            ),
            replay,
        )
    out, stats = over_groups(
        lambda ids, pm, *rest: run(ids, pm, rows(pm, *rest[:-3]), *rest[-3:]),
        (*xs, rope, replay, prompt),
        groups_per_pass=how.groups_per_pass,
        summed=True,
    )
    return (out, stats) if how.router_stats else out


def over_groups(run, xs: tuple, *, groups_per_pass: int | None, summed: bool = False):
    """``run(*xs)`` over all P prompt groups at once (``groups_per_pass`` None or P), or
    ``groups_per_pass`` groups at a time (a ``lax.map``; it must divide P), the outputs' leading
    ``[P]`` axes put back together. Every leaf of ``xs`` leads with ``[P]`` (None leaves allowed:
    e.g. rotary tables left to ``run``). ``summed``: ``run`` returns ``(per-group outputs, totals)``
    and the totals of the passes are added.

    Pass ``j`` of ``a = P / groups_per_pass`` takes the groups ``j, j + a, j + 2a, ...``: with
    ``[P]`` split over a mesh's batch shards in contiguous blocks, every pass takes its share of
    each shard's groups (``groups_per_pass`` a multiple of the shards), so every device works on
    every pass."""
    p = jax.tree.leaves(xs)[0].shape[0]
    if groups_per_pass is None or groups_per_pass == p:
        return run(*xs)
    if groups_per_pass < 1 or p % groups_per_pass:
        raise ValueError(f"groups_per_pass={groups_per_pass} does not divide the {p} prompt groups")
    a = p // groups_per_pass
    tiles = lambda x: jnp.moveaxis(x.reshape((groups_per_pass, a) + x.shape[1:]), 1, 0)  # noqa: E731
    whole = lambda x: jnp.moveaxis(x, 0, 1).reshape((p,) + x.shape[2:])  # noqa: E731
    out = jax.lax.map(lambda xs: run(*xs), jax.tree.map(tiles, xs))
    if summed:
        return jax.tree.map(whole, out[0]), jax.tree.map(lambda x: x.sum(0), out[1])
    return jax.tree.map(whole, out)


def completion_hidden(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    completions: Int[Array, "p g n"],
    completion_mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    rope: CompletionRope | Rotary | None = None,
    packed: CompletionBins | None = None,
    prompt: PromptInputs | None = None,
) -> Float[Array, "p g n d"] | Float[Array, "u s d"]:
    """The final-norm hidden state that predicts each completion token, ``[P, G, N, D]``::

        h[p, g, 0] = hidden(prompt p)[-1]            (its last position: prompts are left-padded)
        h[p, g, t] = hidden(completion g)[t - 1]     (t > 0)

    the rows ``completion_logprobs`` projects onto the vocabulary (and a value head reads: the
    state before token ``t`` is emitted). ``how``, ``rope``, ``packed`` and ``prompt`` as
    ``completion_logprobs``' (its output options unused).
    With ``packed`` the layers run over the bins and the states come in their layout,
    ``[U, S, D]`` (slot ``s`` of bin ``u`` predicts ``packed.ids[u, s]``): compute what is read
    from them there (a value, a log-prob) and bring it back with ``to_padded``.
    """
    if packed is not None:
        _no_bins_for(prompt)
        return binned_hidden(model, packed, how, rope=rope)
    layers = how.resolved(model)
    rows = padded_rows
    xs = (prompt_ids, prompt_mask, completions, completion_mask)
    tiled = how.groups_per_pass is not None and how.groups_per_pass != prompt_ids.shape[0]
    if rope is None and tiled:  # outside the loop over groups (see completion_rope)
        rope = _rope_at(model.config, prompt_mask, rows(*xs[1:]).positions, prompt)

    def run(ids, pm, *rest):
        r = rows(pm, *rest[:-2])
        h, _ = _predicting_hidden(model, ids, pm, r, rest[-2], layers, prompt=rest[-1])
        return h.reshape(r.tokens.shape + h.shape[-1:])

    return over_groups(run, (*xs, rope, prompt), groups_per_pass=how.groups_per_pass)


def _no_bins_for(prompt: PromptInputs | None) -> None:
    if prompt is not None:
        raise ValueError(
            "image prompts (PromptInputs) run over padded rows, not packed bins: "
            "set the packing mode to 'off' or 'auto' for a vision-language model"
        )


def _predicting_hidden(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    rows: CompletionRows,
    rope: CompletionRope | None,
    layers: ForwardPass,
    replay: tuple[Array, Array] | None = None,
    prompt: PromptInputs | None = None,
) -> tuple[Float[Array, "pg n d"], RouterStats | None]:
    """The hidden states that predict each row slot's token, ``[P*G, N, D]``: the prompt's last
    for a completion's first token, else the slot before; and the ``RouterStats`` (``rows_hidden``)."""
    g = rows.tokens.shape[1]
    hp, hc, stats = rows_hidden(model, prompt_ids, prompt_mask, rows, layers, rope, replay, prompt)
    first = jnp.repeat(hp[:, -1:], g, axis=0)  # predicts completion token 0
    h = jnp.concatenate([first, hc[:, :-1]], axis=1)  # [B, N, D]
    return h, stats


def _completion_logprobs(
    model: Transformer,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    rows: CompletionRows,
    rope: CompletionRope | None,
    replay: tuple[Array, Array] | None,
    prompt: PromptInputs | None,
    *,
    layers: ForwardPass,
    temperature: float,
):
    p, g, n = rows.tokens.shape
    if replay is not None:  # [P, Ls, ...] as over_groups split it -> layer-major rows
        replay = tuple(jnp.moveaxis(x, 1, 0).reshape(x.shape[1], -1, *x.shape[3:]) for x in replay)
    h, stats = _predicting_hidden(
        model, prompt_ids, prompt_mask, rows, rope, layers, replay, prompt
    )
    targets = rows.tokens.reshape(p * g, n)
    if layers.with_entropy:
        lp, ent = logprobs_and_entropy_from_hidden(
            model,
            h,
            targets,
            temperature=temperature,
            chunk_size=layers.chunk_size,
            entropy_grad=layers.entropy_grad,
        )
        return (lp.reshape(p, g, n), ent.reshape(p, g, n)), stats
    return logprobs_from_hidden(
        model, h, targets, temperature=temperature, chunk_size=layers.chunk_size
    ).reshape(p, g, n), stats
