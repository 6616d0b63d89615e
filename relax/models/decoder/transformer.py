"""One decoder-only transformer for every supported family (``relax.models.config.model``).

Parameters are plain arrays in an ``equinox.Module``; the per-layer ones are stacked on a
leading ``[L]`` axis so a deep model is one ``lax.scan`` (one compile, not one per layer).
Weights are stored ``[in, out]`` (JAX convention); ``relax.models.hf.checkpoint`` transposes at the
Hugging Face boundary. The embedding and ``lm_head`` are ``[V, D]`` so a tied head is the
embedding itself.

Attention is a hook (``relax.models.decoder.layer``): the layer body computes normalised, rotated
``q, k, v`` and hands them to ``attend(q, k, v, layer_input, sliding) -> (out, layer_output)``.
The plain forward plugs in masked causal attention; the sampler plugs in prefix-shared cached
attention; the trainer plugs in prefix-shared training attention. All of them run the same
layer code, so sampler and trainer log-probs agree by construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.models.attention import blocks as attn
from relax.models.config.layer_kinds import layer_kind, layer_window, select
from relax.models.config.model import ModelConfig
from relax.models.config.precision import Precision
from relax.models.decoder.layer import (
    Attend,
    FusedLayer,
    LayerStack,
    RouteIn,
    fuse_layers,
    layer_forward,
    norm,
    rms_norm,
    scan_layers,
)
from relax.models.decoder.taps import tap
from relax.models.layers.quantized import is_quantized, quantized_einsum
from relax.models.layers.rope import Rotary, rotary
from relax.models.moe.experts import Routed

__all__ = [
    "Attend",
    "FusedLayer",
    "LayerRoutes",
    "LayerStack",
    "Transformer",
    "cast",
    "embed",
    "final_norm",
    "full_attention",
    "fuse_layers",
    "hidden_states",
    "init",
    "layer_forward",
    "positions_from_mask",
    "project",
    "rms_norm",
    "run_layers",
]


class LayerRoutes(NamedTuple):
    """The sparse layers' inputs of one forward: the valid rows ``[b, t]`` (their routing
    statistics count only these; None: all), the experts a sampler recorded ``[Ls, b, t, k]``
    (-1: none; None: nothing recorded) and whether to ``replay`` them (else only compared)."""

    valid: Array | None = None
    recorded: Int[Array, "Ls b t k"] | None = None
    replay: bool = True


class Transformer(eqx.Module):
    """Decoder-only LM. ``model(input_ids, attention_mask) -> logits [B, T, V]`` (float32).
    ``dtype``: the compute dtype (matmul operands); ``precision``: what stays float32 besides
    (``relax.models.config.precision``), the same for every forward of this model."""

    embed: Float[Array, "V D"]
    layers: LayerStack
    norm: Float[Array, " D"]
    lm_head: Float[Array, "V D"] | None
    config: ModelConfig = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, default=jnp.float32)
    precision: Precision = eqx.field(static=True, default=Precision())

    @property
    def head(self) -> Float[Array, "V D"]:
        return self.embed if self.lm_head is None else self.lm_head

    def __call__(
        self, input_ids: Int[Array, "b t"], attention_mask: Array | None = None
    ) -> Float[Array, "b t v"]:
        h = hidden_states(self, input_ids, attention_mask)
        return project(self, h)


def init(
    config: ModelConfig,
    key: Array,
    *,
    param_dtype=jnp.float32,
    dtype=jnp.float32,
    std: float = 0.02,
) -> Transformer:
    """Random weights ``N(0, std)``, identity norms (scales 1, or 0 for ``"1+w"`` norms); biases
    ``N(0, std)`` too (so tests see them).

    Args:
        config: the architecture (``ModelConfig``): sizes, layers, norms, tied embeddings.
        key: the PRNG key of the weights.
        param_dtype: the parameters' dtype (default float32).
        dtype: the compute dtype (default float32).
        std: the standard deviation of the random weights (default 0.02).

    Returns:
        A ``Transformer``: ``embed`` ``[V D]``, the stacked layers, ``norm`` ``[D]``, and
            ``lm_head`` ``[V D]`` (None when ``config.tie_word_embeddings``).
    """
    c = config
    D = c.hidden_size
    keys = iter(jax.random.split(key, max(24, len(c.stacked_shapes()) + 2)))

    def normal(*shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(param_dtype)

    def identity_norm(*shape):
        return (jnp.zeros if c.norm_weight == "1+w" else jnp.ones)(shape, param_dtype)

    layers = LayerStack(
        **{
            name: (identity_norm if name.endswith("norm") else normal)(*shape)
            for name, shape in c.stacked_shapes().items()
        }
    )
    return Transformer(
        embed=normal(c.vocab_size, D),
        layers=layers,
        norm=identity_norm(D),
        lm_head=None if c.tie_word_embeddings else normal(c.vocab_size, D),
        config=c,
        dtype=dtype,
    )


def cast(
    model: Transformer, *, param_dtype=None, dtype=None, precision: Precision | None = None
) -> Transformer:
    """The same model with parameters, compute dtype and/or precision policy changed."""
    if param_dtype is not None:
        model = jax.tree.map(
            lambda x: x.astype(param_dtype) if eqx.is_inexact_array(x) else x, model
        )
    if dtype is not None:
        model = dataclasses.replace(model, dtype=dtype)
    if precision is not None:
        model = dataclasses.replace(model, precision=precision)
    return model


def positions_from_mask(mask: Array) -> Int[Array, "b t"]:
    """Position of each token among its row's valid tokens (left padding gets position 0)."""
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def final_norm(model: Transformer, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """The final RMSNorm of the residual stream, in the compute dtype (the heads' operand)."""
    return tap("final_norm", norm(model.config, tap("residual_out", x), model.norm)).astype(
        model.dtype
    )


def run_layers(
    model: Transformer,
    x: Float[Array, "b t D"],
    positions: Int[Array, "b t"],
    attend: Attend,
    layer_inputs: Any = None,
    *,
    layers: list[FusedLayer] | None = None,
    remat: bool = False,
    rope: Rotary | None = None,
    routes: LayerRoutes | None = None,
) -> tuple[Float[Array, "b t D"], Any, Routed | None]:
    """Embedded inputs through every layer and the final norm: ``(h, attend's outputs, routed)``.

    By default the stacked ``model.layers`` run as one ``lax.scan`` (compiles once however
    deep the model; one per run of dense or sparse layers, ``relax.models.decoder.layer.scan_layers``),
    with the layers' kinds scanned alongside when they differ (``relax.models.config.layer_kinds``);
    ``layer_inputs`` is then a pytree with a leading ``[L]`` axis (or None) and the per-layer
    outputs of ``attend`` come back stacked on ``[L]``. With ``layers`` (from ``fuse_layers``)
    the layers run as a Python loop, each with its static kind, ``layer_inputs`` and the outputs
    are lists: the decode loop uses this so that each layer's cache is its own buffer, updated in
    place, instead of a slice that ``scan`` copies at every step. ``remat`` recomputes each layer
    in the backward pass. ``rope``: the RoPE tables of ``positions`` when the caller has them
    already (the decode loop reads them from a table built before the loop: computed in the
    step, XLA recomputes the transcendentals inside every layer's q and k fusions).
    ``routes``: the valid rows and recorded experts of the sparse layers (``LayerRoutes``);
    ``routed`` is their ``Routed`` reports stacked ``[Ls]`` (None for a dense model).
    """
    c = model.config
    rope = rotary(c, positions) if rope is None else rope
    routes = LayerRoutes() if routes is None else routes

    def run(h, p, li, sliding, recorded, remat=False):
        f = lambda h, p, li, rec: layer_forward(
            model,
            p,
            h,
            rope,
            attend,
            li,
            sliding,  # noqa: E731
            RouteIn(routes.valid, rec, routes.replay),
        )
        return (jax.checkpoint(f) if remat else f)(h, p, li, recorded)

    if layers is None:

        def body(h, xs):
            h, out, routed = run(h, xs[0], xs[2], layer_kind(c, xs[1]), xs[3])
            return h, (out, routed)

        policy = jax.checkpoint_policies.nothing_saveable if remat else None
        x, outputs, routed = scan_layers(
            model, body, x, layer_inputs, routes.recorded, remat=policy
        )
        return final_norm(model, x), outputs, routed
    inputs = [None] * len(layers) if layer_inputs is None else layer_inputs
    outputs, routed, s = [], [], 0
    for p, sliding, sparse, li in zip(layers, c.sliding_layers, c.sparse_layers, inputs):
        recorded = None if routes.recorded is None or not sparse else routes.recorded[s]
        x, out, r = run(x, p, li, sliding, recorded, remat)
        s += sparse
        outputs.append(out)
        routed.append(r)
    routed = [r for r in routed if r is not None]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *routed) if routed else None
    return final_norm(model, x), outputs, stacked


def embed(model: Transformer, input_ids: Int[Array, "b t"]) -> Float[Array, "b t D"]:
    """Embedding rows in the residual stream's dtype (``model.precision``); with ``scale_embeddings``
    times ``sqrt(D)`` first, in the wider of the embedding's and the compute dtypes (``sqrt(D)``
    rounded to float32, then to that dtype): transformers' rounding for its model in the compute
    dtype (bfloat16 weights computed in float32 scale in float32)."""
    e = jnp.take(model.embed, input_ids, axis=0)
    if model.config.scale_embeddings:
        e = e.astype(jnp.promote_types(e.dtype, model.dtype))
        e = e * jnp.asarray(np.float32(model.config.hidden_size**0.5)).astype(e.dtype)
    return e.astype(model.precision.residual_dtype(model.dtype))


def full_attention(
    model: Transformer, positions: Array, valid: Array, blocks: Array | None = None
) -> Attend:
    """Causal attention over the sequence itself, through each layer's window (the masks of both
    kinds built once); returns head-major (k, v). ``blocks``: bidirectional blocks
    (``relax.models.decoder.prompt_inputs``: an image's tokens seeing each other both ways)."""
    c = model.config
    probs = model.precision.probs_dtype(model.dtype)

    def mask(sliding):
        window = layer_window(c, sliding)
        allowed = attn.causal_mask(positions, positions, valid, window)
        return (
            allowed
            if blocks is None
            else allowed | attn.block_mask(blocks, positions, valid, window)
        )

    masks = {s: mask(s) for s in set(c.sliding_layers)}

    def attend(q, k, v, _, sliding):
        allowed = (
            masks[sliding]
            if isinstance(sliding, bool)
            else select(sliding, masks[True], masks[False])
        )
        k, v = attn.heads_major(k), attn.heads_major(v)
        return attn.attention(q, k, v, allowed, scale=c.attn_scale, probs_dtype=probs), (k, v)

    return attend


def hidden_states(
    model: Transformer,
    input_ids: Int[Array, "b t"],
    attention_mask: Array | None = None,
    *,
    remat: bool = False,
) -> Float[Array, "b t D"]:
    """Final-norm hidden states; positions come from the mask (left padding works)."""
    if attention_mask is None:
        attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    valid = attention_mask.astype(bool)
    positions = positions_from_mask(attention_mask)
    attend = full_attention(model, positions, valid)
    attend_no_kv = lambda q, k, v, li, sliding: (attend(q, k, v, li, sliding)[0], None)
    h, _, _ = run_layers(model, embed(model, input_ids), positions, attend_no_kv, remat=remat)
    return h


def project(model: Transformer, h: Float[Array, "... D"]) -> Float[Array, "... V"]:
    """Logits ``h @ head^T`` accumulated in float32 (an 8-bit sampler's head: its ``W^``)."""
    einsum = quantized_einsum if is_quantized(model.head) else jnp.einsum
    return einsum(
        "...d,vd->...v", h, model.head.astype(model.dtype), preferred_element_type=jnp.float32
    )
