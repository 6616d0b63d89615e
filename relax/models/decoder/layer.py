"""One pre-norm decoder layer: its parameters (stacked on ``[L]``, or one layer's with q/k/v
and gate/up fused), RMSNorm, and the layer body every forward runs.

The body reads the architecture's traits from ``ModelConfig`` (norm style, sandwich norms,
q/k norms, activation, biases) and hands attention to a hook::

    attend(q, k, v, layer_input, sliding) -> (out, layer_output)

``sliding`` is the layer's kind (``relax.models.config.layer_kinds``): a static bool, or a traced flag
when kinds differ across a scan. The plain forward, the sampler and the trainer differ only in
the hook, so sampler and trainer log-probs agree by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.config.layer_kinds import Kind, scanned_kinds
from relax.models.config.model import MOE_FIELDS, ModelConfig
from relax.models.config.sharding import (
    LOGICAL_AXES,
    gathered,
    path_name,
    rows_over_batch,
)
from relax.models.decoder.taps import tap
from relax.models.layers.lora import Adapters, adapted
from relax.models.layers.matmul import matmul
from relax.models.layers.quantized import is_quantized, quantized_matmul
from relax.models.layers.rope import Rotary, apply_rope, layer_rotary
from relax.models.moe import experts as moe
from relax.models.moe.expert_parallel import experts_ffn

if TYPE_CHECKING:
    from relax.models.decoder.transformer import Transformer

Attend = Callable[[Array, Array, Array, Any, Kind], tuple[Array, Any]]


class LayerStack(eqx.Module):
    """All decoder layers' parameters, each with a leading ``[L]`` axis (None: absent trait)."""

    attn_norm: Float[Array, "L D"]
    wq: Float[Array, "L D Hq_hd"]
    wk: Float[Array, "L D Hk_hd"]
    wv: Float[Array, "L D Hk_hd"]
    wo: Float[Array, "L Hq_hd D"]
    mlp_norm: Float[Array, "L D"]
    w_gate: Float[Array, "L D F"] | None = None  # None: every layer is sparse (the experts below)
    w_up: Float[Array, "L D F"] | None = None
    w_down: Float[Array, "L F D"] | None = None
    bq: Float[Array, "L Hq_hd"] | None = None
    bk: Float[Array, "L Hk_hd"] | None = None
    bv: Float[Array, "L Hk_hd"] | None = None
    bo: Float[Array, "L D"] | None = None
    q_norm: Float[Array, "L hd"] | None = None
    k_norm: Float[Array, "L hd"] | None = None
    b_gate: Float[Array, "L F"] | None = None
    b_up: Float[Array, "L F"] | None = None
    b_down: Float[Array, "L D"] | None = None
    attn_out_norm: Float[Array, "L D"] | None = None
    mlp_out_norm: Float[Array, "L D"] | None = None
    lora: Adapters | None = (
        None  # low-rank adapters (relax.models.layers.lora), stacked as the weights they adapt
    )
    # a mixture of experts (relax.models.moe.experts) on the Ls sparse layers (the dense MLP's weights
    # above are then stacked on the Ld = L - Ls dense layers: ModelConfig.layer_count)
    router: Float[Array, "Ls D E"] | None = None
    expert_gate: Float[Array, "Ls E D Fe"] | None = None
    expert_up: Float[Array, "Ls E D Fe"] | None = None
    expert_down: Float[Array, "Ls E Fe D"] | None = None
    shared_gate: Float[Array, "Ls D Fs"] | None = None
    shared_up: Float[Array, "Ls D Fs"] | None = None
    shared_down: Float[Array, "Ls Fs D"] | None = None
    shared_router: Float[Array, "Ls D 1"] | None = None


class FusedLayer(eqx.Module):
    """One layer's parameters with q/k/v and gate/up fused along the output axis, so a decode
    step issues two wide matmuls instead of five narrow ones (``fuse_layers``).

    The fused columns come in ``qkv_groups`` / ``mlp_groups`` equal blocks, each holding whole
    heads or MLP units, so that a tensor-parallel shard holds one block (1: plain concatenation)::

        wqkv:      [D, n, (Hq + 2 Hkv) hd / n]: block i = [q heads | k heads | v heads] of shard i
        w_gate_up: [D, n, 2 F / n]:             block i = [gate units | up units] of shard i
    """

    attn_norm: Float[Array, " D"]
    wqkv: Float[Array, "D QKV"]
    wo: Float[Array, "Hq_hd D"]
    mlp_norm: Float[Array, " D"]
    w_gate_up: Float[Array, "D F2"] | None  # None on a sparse layer (its experts below)
    w_down: Float[Array, "F D"] | None
    bqkv: Float[Array, " QKV"] | None = None
    bo: Float[Array, " D"] | None = None
    q_norm: Float[Array, " hd"] | None = None
    k_norm: Float[Array, " hd"] | None = None
    b_gate_up: Float[Array, " F2"] | None = None
    b_down: Float[Array, " D"] | None = None
    attn_out_norm: Float[Array, " D"] | None = None
    mlp_out_norm: Float[Array, " D"] | None = None
    lora: Adapters | None = None  # this layer's adapters, unmerged (``fuse_layers(merge=False)``)
    router: Float[Array, "D E"] | None = None
    expert_gate: Float[Array, "E D Fe"] | None = None
    expert_up: Float[Array, "E D Fe"] | None = None
    expert_down: Float[Array, "E Fe D"] | None = None
    shared_gate: Float[Array, "D Fs"] | None = None
    shared_up: Float[Array, "D Fs"] | None = None
    shared_down: Float[Array, "Fs D"] | None = None
    shared_router: Float[Array, "D 1"] | None = None
    qkv_groups: int = eqx.field(static=True, default=1)
    mlp_groups: int = eqx.field(static=True, default=1)


def rms_norm(
    x: Float[Array, "... d"], weight: Float[Array, " d"], eps: float, style: str = "w"
) -> Float[Array, "... d"]:
    """RMSNorm, the statistic in float32, ``x̂ = x / sqrt(mean(x^2) + eps)``::

    "w":    w * x̂      (x̂ cast to x.dtype first, the product in x.dtype: Llama, Qwen)
    "1+w":  (1 + w) * x̂  (in float32, then cast to x.dtype: Gemma)
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if style == "1+w":
        return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def norm(c: ModelConfig, x: Array, weight: Array) -> Array:
    """The model's RMSNorm (its ``rms_norm_eps`` and ``norm_weight`` style)."""
    return rms_norm(x, weight, c.rms_norm_eps, c.norm_weight)


def activation(c: ModelConfig, x: Array) -> Array:
    """``silu(x) = x sigmoid(x)`` or ``gelu_tanh(x) = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``."""
    return jax.nn.silu(x) if c.activation == "silu" else jax.nn.gelu(x, approximate=True)


def linear(x, w, b, dtype, out=None):
    """``x W + b``: operands in ``dtype``, accumulated in float32, the result in ``out`` (None: ``dtype``)."""
    out = dtype if out is None else out
    # a 2-D matmul: XLA:CPU runs ``[b, t, i] x [i, o]`` as a 3-D dot ~1.5x slower (fwd and bwd)
    flat = x.reshape(-1, x.shape[-1]).astype(dtype)
    product = quantized_matmul if is_quantized(w) else matmul  # an 8-bit sampler's weight
    y = product(flat, w.astype(dtype), out).reshape(*x.shape[:-1], w.shape[-1])
    return y if b is None else y + b.astype(out)


def _qkv(p: LayerStack | FusedLayer, h, dt, c: ModelConfig, out):
    h = h.astype(dt)
    if isinstance(p, FusedLayer):
        lead, n = h.shape[:-1], p.qkv_groups
        qkv = linear(h, p.wqkv, p.bqkv, dt, out).reshape(*lead, n, -1)
        qd, kd = c.num_heads * c.head_dim // n, c.num_kv_heads * c.head_dim // n
        q, k, v = (
            x.reshape(*lead, -1)
            for x in (qkv[..., :qd], qkv[..., qd : qd + kd], qkv[..., qd + kd :])
        )
    else:
        q, k, v = (linear(h, w, b, dt, out) for w, b in ((p.wq, p.bq), (p.wk, p.bk), (p.wv, p.bv)))
    return (
        adapted(p.lora, "wq", h, q, dt),
        adapted(p.lora, "wk", h, k, dt),
        adapted(p.lora, "wv", h, v, dt),
    )


def _gate_up(p: LayerStack | FusedLayer, h, dt, out):
    h = h.astype(dt)
    if isinstance(p, FusedLayer):
        gu = linear(h, p.w_gate_up, p.b_gate_up, dt, out).reshape(*h.shape[:-1], p.mlp_groups, -1)
        f = gu.shape[-1] // 2
        gate, up = gu[..., :f].reshape(*h.shape[:-1], -1), gu[..., f:].reshape(*h.shape[:-1], -1)
    else:
        gate, up = linear(h, p.w_gate, p.b_gate, dt, out), linear(h, p.w_up, p.b_up, dt, out)
    return adapted(p.lora, "w_gate", h, gate, dt), adapted(p.lora, "w_up", h, up, dt)


class RouteIn(NamedTuple):
    """What a sparse layer reads besides its input: which rows are real tokens (for its routing
    statistics; None: all), the experts a sampler recorded (``[b, t, k]``, -1: none; None: none)
    and whether to ``replay`` them (else they are only compared with the layer's own choice)."""

    valid: Bool[Array, "b t"] | None = None
    recorded: Int[Array, "b t k"] | None = None
    replay: bool = True


def _shared_expert(
    model: Transformer, p: LayerStack | FusedLayer, x: Float[Array, "n D"], out
) -> Float[Array, "n D"]:
    """A shared expert on every token, with its adapters: ``sigmoid(x W_r) (act(x W_g) * x W_u) W_d``."""
    c, dt, ad = model.config, model.dtype, p.lora
    x = x.astype(dt)
    proj = lambda field, a: adapted(ad, field, a, linear(a, getattr(p, field), None, dt, out), dt)  # noqa: E731
    shared = activation(c, proj("shared_gate", x)) * proj("shared_up", x)
    return jax.nn.sigmoid(proj("shared_router", x)) * proj("shared_down", shared.astype(dt))


def _mlp(model: Transformer, p: LayerStack | FusedLayer, h, route: RouteIn | None):
    """The gated MLP (``_gate_up`` / ``w_down``), or on a sparse layer the experts
    (``relax.models.moe.experts``) and their ``Routed`` report; the result in the precision
    policy's activation dtype (the experts' own products in the compute dtype)."""
    c, dt = model.config, model.dtype
    out = model.precision.activation_dtype(dt)
    if p.router is None:
        gate, up = _gate_up(p, h, dt, out)
        m = tap("mlp_act", activation(c, gate) * up).astype(dt)
        return adapted(p.lora, "w_down", m, linear(m, p.w_down, p.b_down, dt, out), dt), None
    lead, x = h.shape[:-1], h.reshape(-1, h.shape[-1]).astype(dt)
    route = RouteIn() if route is None else route
    k = c.num_experts_per_tok
    logits = linear(x, p.router, None, dt, out)
    recorded = None if route.recorded is None else route.recorded.reshape(-1, k)
    weights, experts, own = moe.route(
        logits, k, normalize=c.norm_topk_prob, replay=recorded if route.replay else None
    )
    cast = lambda w: w.astype(dt)  # noqa: E731
    y = experts_ffn(
        x,
        experts,
        weights.astype(dt),
        cast(p.expert_gate),
        cast(p.expert_up),
        cast(p.expert_down),
        lambda a: activation(c, a),
    ).astype(out)
    if p.shared_gate is not None:
        y = y + _shared_expert(model, p, x, out)
    valid = None if route.valid is None else route.valid.reshape(-1)
    stats = moe.routed_stats(logits, experts, own, valid, recorded)
    return y.reshape(*lead, -1), moe.Routed(experts.reshape(*lead, k), stats)


def layer_forward(
    model: Transformer,
    p: LayerStack | FusedLayer,
    x: Float[Array, "b t D"],
    rope: Rotary,
    attend: Attend,
    layer_input: Any,
    sliding: Kind,
    route: RouteIn | None = None,
) -> tuple[Array, Any, moe.Routed | None]:
    """One decoder layer on unstacked parameters ``p``; ``rope``: the tables of every RoPE kind
    (the layer reads its own kind's)::

        h = N(x);  q, k = RoPE(Nq?(h Wq + bq)), RoPE(Nk?(h Wk + bk));  v = h Wv + bv
        a = attend(q, k, v) Wo + bo;               x = x + (N_ao(a) if sandwich_norms else a)
        m = act(N(x) Wg + bg) * (N(x) Wu + bu);    y = m Wd + bd     (a sparse layer: its experts)
        x = x + (N_mo(y) if sandwich_norms else y)

    with ``N`` the model's RMSNorm (``attn_norm``, then ``mlp_norm``) and ``act`` its activation.
    Each product with a weight that has an adapter adds ``s drop(x) A B`` (``relax.models.layers.lora``).
    Dtypes follow ``model.precision`` (``relax.models.config.precision``): ``x`` in its residual
    dtype, products' operands in ``model.dtype`` (``q, k, v`` handed to ``attend`` too), their
    results in its activation dtype.
    Returns the output, ``attend``'s layer output and, on a sparse layer, its ``Routed`` report
    (``route``: its valid rows and replayed experts), else None.
    """
    c, dt = model.config, model.dtype
    out = model.precision.activation_dtype(dt)
    x = tap("residual_in", x.astype(model.precision.residual_dtype(dt)))
    b, t, _ = x.shape
    h = tap("attn_norm", norm(c, x, p.attn_norm))
    q, k, v = _qkv(p, h, dt, c, out)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = norm(c, q, p.q_norm), norm(c, k, p.k_norm)
    cos, sin = layer_rotary(rope, sliding)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q, k, v = (tap(n, a).astype(dt) for n, a in (("q", q), ("k", k), ("v", v)))
    o, layer_output = attend(q, k, v, layer_input, sliding)
    o = tap("attention", o.reshape(b, t, -1)).astype(dt)
    a = tap("attn_proj", adapted(p.lora, "wo", o, linear(o, p.wo, p.bo, dt, out), dt))
    x = x + (norm(c, a, p.attn_out_norm) if c.sandwich_norms else a).astype(x.dtype)
    y, routed = _mlp(model, p, tap("mlp_norm", norm(c, tap("residual_mid", x), p.mlp_norm)), route)
    y = tap("mlp", y)
    x = x + (norm(c, y, p.mlp_out_norm) if c.sandwich_norms else y).astype(x.dtype)
    return x, layer_output, routed


# ----------------------------------------------------------------------------- dense and sparse layers


class LayerSegment(NamedTuple):
    """A run of consecutive layers of one MLP kind: layers ``start:stop``, ``sparse`` or dense,
    the first being the ``first``-th layer of its kind."""

    start: int
    stop: int
    sparse: bool
    first: int


def segments(config: ModelConfig) -> tuple[LayerSegment, ...]:
    """The model's layers as runs of one MLP kind (one run for a dense model or an all-sparse one)."""
    out, kinds = [], config.sparse_layers
    for i, sparse in enumerate(kinds):
        if out and out[-1].sparse == sparse:
            out[-1] = out[-1]._replace(stop=i + 1)
        else:
            out.append(LayerSegment(i, i + 1, sparse, sum(1 for s in kinds[:i] if s == sparse)))
    return tuple(out)


def segment_params(stack: LayerStack, config: ModelConfig, seg: LayerSegment) -> LayerStack:
    """The parameters of ``seg``'s layers, each field stacked on them (the other kind's None)."""
    if len(segments(config)) == 1:
        return stack
    n = seg.stop - seg.start

    def part(name, a):  # a field's array, or an adapter's factors (stacked as the field they adapt)
        if a is None:
            return None
        if name in ("lora", "dropout_key"):
            return adapters_part(a) if name == "lora" else a[seg.start : seg.stop]
        if config.layer_count(name) == config.num_layers:
            return jax.tree.map(lambda x: x[seg.start : seg.stop], a)
        if (name in MOE_FIELDS) != seg.sparse:
            return None
        return jax.tree.map(lambda x: x[seg.first : seg.first + n], a)

    def adapters_part(ad):
        return dataclasses.replace(
            ad,
            **{
                f.name: part(f.name, getattr(ad, f.name))
                for f in dataclasses.fields(ad)
                if not f.metadata.get("static", False)
            },
        )

    return LayerStack(
        **{f.name: part(f.name, getattr(stack, f.name)) for f in dataclasses.fields(stack)}
    )


def concat_layers(parts: list[Any]) -> Any:
    """Per-segment outputs stacked on their layers, concatenated into one stack (None: none)."""
    parts = [x for x in parts if x is not None]
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)


def gathered_layer(p: LayerStack, config: ModelConfig) -> LayerStack:
    """One layer's parameters (a ``scan_layers`` step's slice, unstacked) with every weight whose
    model width is split over ``fsdp`` gathered whole for the layer's use, its gradient
    reduce-scattered back (``relax.models.config.sharding.gathered``): one all-gather per weight
    and layer in the forward (again in a rematerialised backward), one reduce-scatter in the
    backward. Unchanged off a mesh with an ``fsdp`` axis. The training forwards' layout is the
    one propagation already chose (their activation all-reduces came from the output head's
    chunks, ``relax.models.decoder.logprobs``); the rollout's prefill is what it changes."""

    def leaf(path, x):
        logical = LOGICAL_AXES.get("layers." + path_name(path))
        if logical is None or getattr(x, "ndim", -1) != len(logical) - 1:
            return x
        return gathered(x, logical[1:], config.head_dim)

    return jax.tree_util.tree_map_with_path(leaf, p)


def scan_layers(
    model: Transformer,
    body: Callable,
    carry: Any,
    xs: Any = None,
    sparse_xs: Any = None,
    *,
    unroll: bool | int = 1,
    remat: Callable | None = None,
) -> tuple[Any, Any, moe.Routed | None]:
    """``lax.scan`` of ``body(carry, (layer params, scanned kind, x, sparse x)) -> (carry, (y, routed))``
    over every layer, as one scan per ``LayerSegment`` (one for most models); ``xs`` lead with ``[L]``,
    ``sparse_xs`` with ``[Ls]`` (None on dense layers). Returns the carry, the ``y`` stacked ``[L]``
    and the sparse layers' ``routed`` stacked ``[Ls]`` (None for a dense model). ``remat``: a
    ``jax.checkpoint`` policy to recompute each layer under in the backward (None: none).

    On a mesh the carry (the residual stream, rows first) is kept split by rows over the batch
    axes between layers (``rows_over_batch``), and each step's layer parameters are gathered
    over ``fsdp`` inside the rematerialised step (``gathered_layer``), so only the stored split
    is kept for the backward, never a gathered copy per layer."""
    c = model.config
    kinds = scanned_kinds(c)
    ys, routed = [], []

    def step(carry, xs):
        return body(carry, (gathered_layer(xs[0], c), *xs[1:]))

    if remat is not None:
        step = jax.checkpoint(step, policy=remat)

    def pinned(carry, xs):
        carry, out = step(carry, xs)
        return rows_over_batch(carry), out

    carry = rows_over_batch(carry)
    for seg in segments(c):
        cut = lambda a: jax.tree.map(lambda x: x[seg.start : seg.stop], a)  # noqa: E731
        sx = (
            None
            if not seg.sparse or sparse_xs is None
            else jax.tree.map(lambda x: x[seg.first : seg.first + seg.stop - seg.start], sparse_xs)
        )
        inputs = (
            segment_params(model.layers, c, seg),
            None if kinds is None else kinds[seg.start : seg.stop],
            cut(xs),
            sx,
        )
        carry, (y, r) = jax.lax.scan(pinned, carry, inputs, unroll=unroll)
        ys.append(y)
        routed.append(r)
    return carry, concat_layers(ys), concat_layers(routed)


def fuse_layers(
    model: Transformer, *, qkv_groups: int = 1, mlp_groups: int = 1
) -> list[FusedLayer]:
    """Per-layer parameters with fused q/k/v and gate/up weights (built once, e.g. per rollout),
    their columns in ``qkv_groups`` / ``mlp_groups`` blocks (``FusedLayer``: one per tensor shard);
    adapters (``relax.models.layers.lora``) stay unmerged and run beside the fused weights (the sampler
    merges them first when ``RolloutConfig.merge_adapters``). A sparse layer keeps its experts."""
    c = model.config
    qkv = lambda q, k, v: None if q is None else blocks((q, k, v), qkv_groups)  # noqa: E731
    gate_up = lambda g, u: None if g is None else blocks((g, u), mlp_groups)  # noqa: E731
    out = []
    for seg in segments(c):
        L = segment_params(model.layers, c, seg)
        fused = FusedLayer(
            attn_norm=L.attn_norm,
            wqkv=qkv(L.wq, L.wk, L.wv),
            wo=L.wo,
            mlp_norm=L.mlp_norm,
            w_gate_up=gate_up(L.w_gate, L.w_up),
            w_down=L.w_down,
            bqkv=qkv(L.bq, L.bk, L.bv),
            bo=L.bo,
            q_norm=L.q_norm,
            k_norm=L.k_norm,
            b_gate_up=gate_up(L.b_gate, L.b_up),
            b_down=L.b_down,
            attn_out_norm=L.attn_out_norm,
            mlp_out_norm=L.mlp_out_norm,
            lora=L.lora,
            **{f: getattr(L, f) for f in MOE_FIELDS},
            qkv_groups=qkv_groups,
            mlp_groups=mlp_groups,
        )
        out += [jax.tree.map(lambda a: a[i], fused) for i in range(seg.stop - seg.start)]
    return out


def blocks(parts: tuple[Array, ...], n: int) -> Array:
    """Concatenate ``parts`` along the last axis in ``n`` blocks, block i = [part_j's i-th n-th, ...]::

    [..., a], [..., b] -> [..., n, a/n + b/n] flattened   (n = 1: plain concatenation)
    """
    lead = parts[0].shape[:-1]
    split = [x.reshape(*lead, n, x.shape[-1] // n) for x in parts]
    return jnp.concatenate(split, axis=-1).reshape(*lead, -1)
