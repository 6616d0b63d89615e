"""One decoder-only transformer for Llama 2/3, Mistral, Qwen2 and Qwen3.

Parameters are plain arrays in an ``equinox.Module``; the per-layer ones are stacked on a
leading ``[L]`` axis so a deep model is one ``lax.scan`` (one compile, not one per layer).
Weights are stored ``[in, out]`` (JAX convention); ``relax.models.hf`` transposes at the
Hugging Face boundary. The embedding and ``lm_head`` are ``[V, D]`` so a tied head is the
embedding itself.

Attention is a hook: the layer body computes normalised, rotated ``q, k, v`` and hands them
to ``attend(q, k, v, layer_input) -> (out, layer_output)``. The plain forward plugs in masked
causal attention; the sampler plugs in prefix-shared cached attention; the trainer plugs in
prefix-shared training attention. All of them run this same layer code, so sampler and
trainer log-probs agree by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax.models import attention as attn
from relax.models.config import ModelConfig
from relax.models.matmul import matmul
from relax.models.rope import apply_rope, inverse_frequencies, rope_angles

Attend = Callable[[Array, Array, Array, Any], tuple[Array, Any]]


class LayerStack(eqx.Module):
    """All decoder layers' parameters, each with a leading ``[L]`` axis."""

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


class Transformer(eqx.Module):
    """Decoder-only LM. ``model(input_ids, attention_mask) -> logits [B, T, V]`` (float32)."""

    embed: Float[Array, "V D"]
    layers: LayerStack
    norm: Float[Array, " D"]
    lm_head: Float[Array, "V D"] | None
    config: ModelConfig = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, default=jnp.float32)

    @property
    def head(self) -> Float[Array, "V D"]:
        return self.embed if self.lm_head is None else self.lm_head

    def __call__(self, input_ids: Int[Array, "b t"], attention_mask: Array | None = None) -> Float[Array, "b t v"]:
        h = hidden_states(self, input_ids, attention_mask)
        return project(self, h)


def init(config: ModelConfig, key: Array, *, param_dtype=jnp.float32, dtype=jnp.float32,
         std: float = 0.02) -> Transformer:
    """Random weights ``N(0, std)``, unit norm scales; biases ``N(0, std)`` too (so tests see them)."""
    c = config
    L, D = c.num_layers, c.hidden_size
    keys = iter(jax.random.split(key, 24))

    def normal(*shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(param_dtype)

    def ones(*shape):
        return jnp.ones(shape, param_dtype)

    layers = LayerStack(**{name: (ones if name.endswith("norm") else normal)(L, *shape)
                           for name, shape in c.layer_shapes().items()})
    return Transformer(
        embed=normal(c.vocab_size, D), layers=layers, norm=ones(D),
        lm_head=None if c.tie_word_embeddings else normal(c.vocab_size, D),
        config=c, dtype=dtype)


def cast(model: Transformer, *, param_dtype=None, dtype=None) -> Transformer:
    """The same model with parameters and/or compute dtype changed."""
    if param_dtype is not None:
        model = jax.tree.map(lambda x: x.astype(param_dtype) if eqx.is_inexact_array(x) else x, model)
    if dtype is not None:
        model = dataclasses.replace(model, dtype=dtype)
    return model


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """``w * (x / sqrt(mean(x^2) + eps))``, the statistic in float32, the result in ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * y.astype(x.dtype)


def positions_from_mask(mask: Array) -> Int[Array, "b t"]:
    """Position of each token among its row's valid tokens (left padding gets position 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _linear(x, w, b, dtype):
    # a 2-D matmul: XLA:CPU runs ``[b, t, i] x [i, o]`` as a 3-D dot ~1.5x slower (fwd and bwd)
    y = matmul(x.reshape(-1, x.shape[-1]), w.astype(dtype)).reshape(*x.shape[:-1], w.shape[-1])
    return y if b is None else y + b.astype(dtype)


class FusedLayer(eqx.Module):
    """One layer's parameters with q/k/v and gate/up concatenated along the output axis, so a
    decode step issues two wide matmuls instead of five narrow ones (``fuse_layers``)."""

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


def _qkv(p: LayerStack | FusedLayer, h, dt, c: ModelConfig):
    if isinstance(p, FusedLayer):
        qkv = _linear(h, p.wqkv, p.bqkv, dt)
        qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return qkv[..., :qd], qkv[..., qd:qd + kd], qkv[..., qd + kd:]
    return _linear(h, p.wq, p.bq, dt), _linear(h, p.wk, p.bk, dt), _linear(h, p.wv, p.bv, dt)


def _gate_up(p: LayerStack | FusedLayer, h, dt):
    if isinstance(p, FusedLayer):
        gu = _linear(h, p.w_gate_up, p.b_gate_up, dt)
        f = gu.shape[-1] // 2
        return gu[..., :f], gu[..., f:]
    return _linear(h, p.w_gate, p.b_gate, dt), _linear(h, p.w_up, p.b_up, dt)


def layer_forward(model: Transformer, p: LayerStack | FusedLayer, x: Float[Array, "b t D"], cos, sin,
                  attend: Attend, layer_input: Any) -> tuple[Array, Any]:
    """One pre-norm decoder layer on unstacked parameters ``p``::

        h = RMSNorm(x);  q, k = RoPE(norm?(h Wq + bq)), RoPE(norm?(h Wk + bk));  v = h Wv + bv
        x = x + attend(q, k, v) Wo + bo
        x = x + (silu(RMSNorm(x) Wg) * (RMSNorm(x) Wu)) Wd
    """
    c, dt = model.config, model.dtype
    b, t, _ = x.shape
    h = rms_norm(x, p.attn_norm, c.rms_norm_eps)
    q, k, v = _qkv(p, h, dt, c)
    q = q.reshape(b, t, c.num_heads, c.head_dim)
    k = k.reshape(b, t, c.num_kv_heads, c.head_dim)
    v = v.reshape(b, t, c.num_kv_heads, c.head_dim)
    if c.qk_norm:
        q = rms_norm(q, p.q_norm, c.rms_norm_eps)
        k = rms_norm(k, p.k_norm, c.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o, layer_output = attend(q, k, v, layer_input)
    x = x + _linear(o.reshape(b, t, -1).astype(dt), p.wo, p.bo, dt)
    h = rms_norm(x, p.mlp_norm, c.rms_norm_eps)
    gate, up = _gate_up(p, h, dt)
    x = x + _linear(jax.nn.silu(gate) * up, p.w_down, p.b_down, dt)
    return x, layer_output


def fuse_layers(model: Transformer) -> list[FusedLayer]:
    """Per-layer parameters with fused q/k/v and gate/up weights (built once, e.g. per rollout)."""
    L = model.layers
    cat = lambda *xs: None if xs[0] is None else jnp.concatenate(xs, axis=-1)
    fused = FusedLayer(attn_norm=L.attn_norm, wqkv=cat(L.wq, L.wk, L.wv), wo=L.wo, mlp_norm=L.mlp_norm,
                       w_gate_up=cat(L.w_gate, L.w_up), w_down=L.w_down, bqkv=cat(L.bq, L.bk, L.bv), bo=L.bo,
                       q_norm=L.q_norm, k_norm=L.k_norm, b_gate_up=cat(L.b_gate, L.b_up), b_down=L.b_down)
    return [jax.tree.map(lambda a: a[i], fused) for i in range(model.config.num_layers)]


def run_layers(model: Transformer, x: Float[Array, "b t D"], positions: Int[Array, "b t"],
               attend: Attend, layer_inputs: Any = None, *, layers: list[FusedLayer] | None = None,
               remat: bool = False, rope: tuple[Array, Array] | None = None) -> tuple[Float[Array, "b t D"], Any]:
    """Embedded inputs through every layer and the final norm.

    By default the stacked ``model.layers`` run as one ``lax.scan`` (compiles once however
    deep the model); ``layer_inputs`` is then a pytree with a leading ``[L]`` axis (or None)
    and the per-layer outputs of ``attend`` come back stacked on ``[L]``. With ``layers`` (from
    ``fuse_layers``) the layers run as a Python loop, ``layer_inputs`` and the outputs are
    lists: the decode loop uses this so that each layer's cache is its own buffer, updated in
    place, instead of a slice that ``scan`` copies at every step. ``remat`` recomputes each
    layer in the backward pass. ``rope``: the ``(cos, sin)`` of ``positions`` when the caller has
    them already (the decode loop reads them from a table built before the loop: computed in the
    step, XLA recomputes the transcendentals inside every layer's q and k fusions).
    """
    cos, sin = rope_angles(inverse_frequencies(model.config), positions) if rope is None else rope

    def body(h, xs):
        p, li = xs
        return layer_forward(model, p, h, cos, sin, attend, li)

    if remat:
        body = jax.checkpoint(body)
    if layers is None:
        x, outputs = jax.lax.scan(body, x, (model.layers, layer_inputs))
    else:
        inputs = [None] * len(layers) if layer_inputs is None else layer_inputs
        outputs = []
        for p, li in zip(layers, inputs):
            x, out = body(x, (p, li))
            outputs.append(out)
    return rms_norm(x, model.norm, model.config.rms_norm_eps), outputs


def embed(model: Transformer, input_ids: Int[Array, "b t"]) -> Float[Array, "b t D"]:
    return jnp.take(model.embed, input_ids, axis=0).astype(model.dtype)


def full_attention(model: Transformer, positions: Array, valid: Array) -> Attend:
    """Causal (optionally sliding-window) attention over the sequence itself; returns head-major (k, v)."""
    allowed = attn.causal_mask(positions, positions, valid, model.config.sliding_window)

    def attend(q, k, v, _):
        k, v = attn.heads_major(k), attn.heads_major(v)
        return attn.attention(q, k, v, allowed), (k, v)

    return attend


def hidden_states(model: Transformer, input_ids: Int[Array, "b t"], attention_mask: Array | None = None,
                  *, remat: bool = False) -> Float[Array, "b t D"]:
    """Final-norm hidden states; positions come from the mask (left padding works)."""
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    valid = attention_mask.astype(bool)
    positions = positions_from_mask(attention_mask)
    attend = full_attention(model, positions, valid)
    attend_no_kv = lambda q, k, v, li: (attend(q, k, v, li)[0], None)
    h, _ = run_layers(model, embed(model, input_ids), positions, attend_no_kv, remat=remat)
    return h


def project(model: Transformer, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """Logits ``h @ head^T`` accumulated in float32."""
    return jnp.einsum("...d,vd->...v", h, model.head.astype(model.dtype),
                      preferred_element_type=jnp.float32)
