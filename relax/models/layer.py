"""One pre-norm decoder layer: its parameters (stacked on ``[L]``, or one layer's with q/k/v
and gate/up fused), RMSNorm, and the layer body every forward runs.

The body reads the architecture's traits from ``ModelConfig`` (norm style, sandwich norms,
q/k norms, activation, biases) and hands attention to a hook::

    attend(q, k, v, layer_input, sliding) -> (out, layer_output)

``sliding`` is the layer's kind (``relax.models.layer_kinds``): a static bool, or a traced flag
when kinds differ across a scan. The plain forward, the sampler and the trainer differ only in
the hook, so sampler and trainer log-probs agree by construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.models.config import ModelConfig
from relax.models.layer_kinds import Kind
from relax.models.lora import Adapters, adapted
from relax.models.matmul import matmul
from relax.models.rope import Rotary, apply_rope, layer_rotary

if TYPE_CHECKING:
    from relax.models.transformer import Transformer

Attend = Callable[[Array, Array, Array, Any, Kind], tuple[Array, Any]]


class LayerStack(eqx.Module):
    """All decoder layers' parameters, each with a leading ``[L]`` axis (None: absent trait)."""

    attn_norm: Float[Array, "L D"]
    wq: Float[Array, "L D Hq_hd"]
    wk: Float[Array, "L D Hk_hd"]
    wv: Float[Array, "L D Hk_hd"]
    wo: Float[Array, "L Hq_hd D"]
    mlp_norm: Float[Array, "L D"]
    w_gate: Float[Array, "L D F"]
    w_up: Float[Array, "L D F"]
    w_down: Float[Array, "L F D"]
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
    lora: Adapters | None = None  # low-rank adapters (relax.models.lora), stacked on [L] too


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
    w_gate_up: Float[Array, "D F2"]
    w_down: Float[Array, "F D"]
    bqkv: Float[Array, " QKV"] | None = None
    bo: Float[Array, " D"] | None = None
    q_norm: Float[Array, " hd"] | None = None
    k_norm: Float[Array, " hd"] | None = None
    b_gate_up: Float[Array, " F2"] | None = None
    b_down: Float[Array, " D"] | None = None
    attn_out_norm: Float[Array, " D"] | None = None
    mlp_out_norm: Float[Array, " D"] | None = None
    lora: Adapters | None = None  # this layer's adapters, unmerged (``fuse_layers(merge=False)``)
    qkv_groups: int = eqx.field(static=True, default=1)
    mlp_groups: int = eqx.field(static=True, default=1)


def rms_norm(x: Float[Array, "... d"], weight: Float[Array, " d"], eps: float, style: str = "w") -> Float[Array, "... d"]:
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


def linear(x, w, b, dtype):
    # a 2-D matmul: XLA:CPU runs ``[b, t, i] x [i, o]`` as a 3-D dot ~1.5x slower (fwd and bwd)
    y = matmul(x.reshape(-1, x.shape[-1]), w.astype(dtype)).reshape(*x.shape[:-1], w.shape[-1])
    return y if b is None else y + b.astype(dtype)


def _qkv(p: LayerStack | FusedLayer, h, dt, c: ModelConfig):
    if isinstance(p, FusedLayer):
        lead, n = h.shape[:-1], p.qkv_groups
        qkv = linear(h, p.wqkv, p.bqkv, dt).reshape(*lead, n, -1)
        qd, kd = c.num_heads * c.head_dim // n, c.num_kv_heads * c.head_dim // n
        q, k, v = (x.reshape(*lead, -1) for x in (qkv[..., :qd], qkv[..., qd:qd + kd], qkv[..., qd + kd:]))
    else:
        q, k, v = linear(h, p.wq, p.bq, dt), linear(h, p.wk, p.bk, dt), linear(h, p.wv, p.bv, dt)
    return adapted(p.lora, "wq", h, q, dt), adapted(p.lora, "wk", h, k, dt), adapted(p.lora, "wv", h, v, dt)


def _gate_up(p: LayerStack | FusedLayer, h, dt):
    if isinstance(p, FusedLayer):
        gu = linear(h, p.w_gate_up, p.b_gate_up, dt).reshape(*h.shape[:-1], p.mlp_groups, -1)
        f = gu.shape[-1] // 2
        gate, up = gu[..., :f].reshape(*h.shape[:-1], -1), gu[..., f:].reshape(*h.shape[:-1], -1)
    else:
        gate, up = linear(h, p.w_gate, p.b_gate, dt), linear(h, p.w_up, p.b_up, dt)
    return adapted(p.lora, "w_gate", h, gate, dt), adapted(p.lora, "w_up", h, up, dt)


def layer_forward(model: Transformer, p: LayerStack | FusedLayer, x: Float[Array, "b t D"], rope: Rotary,
                  attend: Attend, layer_input: Any, sliding: Kind) -> tuple[Array, Any]:
    """One decoder layer on unstacked parameters ``p``; ``rope``: the tables of every RoPE kind
    (the layer reads its own kind's)::

        h = N(x);  q, k = RoPE(Nq?(h Wq + bq)), RoPE(Nk?(h Wk + bk));  v = h Wv + bv
        a = attend(q, k, v) Wo + bo;               x = x + (N_ao(a) if sandwich_norms else a)
        m = act(N(x) Wg + bg) * (N(x) Wu + bu);    y = m Wd + bd
        x = x + (N_mo(y) if sandwich_norms else y)

    with ``N`` the model's RMSNorm (``attn_norm``, then ``mlp_norm``) and ``act`` its activation.
    Each product with a weight that has an adapter adds ``s drop(x) A B`` (``relax.models.lora``).
    """
    c, dt = model.config, model.dtype
    b, t, _ = x.shape
    h = norm(c, x, p.attn_norm)
    q, k, v = _qkv(p, h, dt, c)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q, k = norm(c, q, p.q_norm), norm(c, k, p.k_norm)
    cos, sin = layer_rotary(rope, sliding)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, layer_output = attend(q, k, v, layer_input, sliding)
    o = o.reshape(b, t, -1).astype(dt)
    a = adapted(p.lora, "wo", o, linear(o, p.wo, p.bo, dt), dt)
    x = x + (norm(c, a, p.attn_out_norm) if c.sandwich_norms else a)
    h = norm(c, x, p.mlp_norm)
    gate, up = _gate_up(p, h, dt)
    m = activation(c, gate) * up
    y = adapted(p.lora, "w_down", m, linear(m, p.w_down, p.b_down, dt), dt)
    x = x + (norm(c, y, p.mlp_out_norm) if c.sandwich_norms else y)
    return x, layer_output


def fuse_layers(model: Transformer, *, qkv_groups: int = 1, mlp_groups: int = 1) -> list[FusedLayer]:
    """Per-layer parameters with fused q/k/v and gate/up weights (built once, e.g. per rollout),
    their columns in ``qkv_groups`` / ``mlp_groups`` blocks (``FusedLayer``: one per tensor shard);
    adapters (``relax.models.lora``) stay unmerged and run beside the fused weights (the sampler
    merges them first when ``RolloutConfig.merge_adapters``)."""
    L = model.layers
    qkv = lambda q, k, v: None if q is None else blocks((q, k, v), qkv_groups)
    gate_up = lambda g, u: None if g is None else blocks((g, u), mlp_groups)
    fused = FusedLayer(attn_norm=L.attn_norm, wqkv=qkv(L.wq, L.wk, L.wv), wo=L.wo, mlp_norm=L.mlp_norm,
                       w_gate_up=gate_up(L.w_gate, L.w_up), w_down=L.w_down, bqkv=qkv(L.bq, L.bk, L.bv), bo=L.bo,
                       q_norm=L.q_norm, k_norm=L.k_norm, b_gate_up=gate_up(L.b_gate, L.b_up), b_down=L.b_down,
                       attn_out_norm=L.attn_out_norm, mlp_out_norm=L.mlp_out_norm, lora=L.lora,
                       qkv_groups=qkv_groups, mlp_groups=mlp_groups)
    return [jax.tree.map(lambda a: a[i], fused) for i in range(model.config.num_layers)]


def blocks(parts: tuple[Array, ...], n: int) -> Array:
    """Concatenate ``parts`` along the last axis in ``n`` blocks, block i = [part_j's i-th n-th, ...]::

        [..., a], [..., b] -> [..., n, a/n + b/n] flattened   (n = 1: plain concatenation)
    """
    lead = parts[0].shape[:-1]
    split = [x.reshape(*lead, n, x.shape[-1] // n) for x in parts]
    return jnp.concatenate(split, axis=-1).reshape(*lead, -1)
