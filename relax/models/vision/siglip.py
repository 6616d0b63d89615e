"""The SigLIP vision tower (transformers' ``SiglipVisionModel``, Gemma 3's ``vision_tower``).

Images ``[n, C, H, W]`` (channels first, as a processor gives them) become ``[n, P, D]`` patch
states, ``P = floor(H/p) floor(W/p)`` patches of ``p x p`` pixels in row-major order (the last
``H mod p`` rows and ``W mod p`` columns are not read, as transformers' stride-``p`` conv)::

    x = patches(pixels) W_patch + b_patch + pos          (the stride-p conv as one matmul)
    per layer:  x = x + Attn(LN_1(x)) W_o + b_o;  x = x + act(LN_2(x) W_1 + b_1) W_2 + b_2
    out = LN_post(x)

``Attn``: bidirectional multi-head attention (q/k/v with biases, scores ``q.k / sqrt(hd)``),
``LN``: LayerNorm with weight and bias (statistics in float32), ``act``: the config's
``hidden_act``. The layers' parameters are stacked on a leading ``[L]`` axis and run as one
``lax.scan`` (one compile however deep). The pooling head (``vision_use_head``) is not part of
it: Gemma 3 reads the last hidden states.

Weights are stored ``[in, out]``; ``to_hf`` / ``from_hf`` convert at transformers' names
(``embeddings.patch_embedding.weight`` ``[D, C, p, p]``, ``encoder.layers.{i}.self_attn.q_proj.weight``
``[out, in]``, ...), relative to the tower's prefix in a checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from relax.models.attention import blocks as attn
from relax.models.decoder.layer import linear
from relax.models.hf.reader import ConfigReader, HFFormatError

__all__ = [
    "ACTIVATIONS",
    "SiglipConfig",
    "SiglipLayers",
    "SiglipVision",
    "from_hf",
    "hf_shapes",
    "init_siglip",
    "layer_norm",
    "siglip_config_from_hf",
    "siglip_config_to_hf",
    "siglip_forward",
    "to_hf",
]


def _gelu_tanh(x):
    return jax.nn.gelu(x, approximate=True)


# transformers' hidden_act name -> the function (gelu_new and gelu_pytorch_tanh: the same tanh form)
ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
}


@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """A ``SiglipVisionConfig`` (``config.json``'s ``vision_config``); defaults are transformers'."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_layers: int = 12
    num_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    hidden_act: str = "gelu_pytorch_tanh"
    layer_norm_eps: float = 1e-6

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}"
            )
        if self.image_size < self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} is smaller than patch_size={self.patch_size}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid(self) -> int:
        """Patches per side of an image."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid**2

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch, ``C p p``."""
        return self.num_channels * self.patch_size**2


_HF_FIELDS = {  # SiglipConfig field -> (config.json name, transformers' default)
    "hidden_size": ("hidden_size", 768),
    "intermediate_size": ("intermediate_size", 3072),
    "num_layers": ("num_hidden_layers", 12),
    "num_heads": ("num_attention_heads", 12),
    "num_channels": ("num_channels", 3),
    "image_size": ("image_size", 224),
    "patch_size": ("patch_size", 16),
}


def siglip_config_from_hf(d: Any, source: str, prefix: str = "vision_config.") -> SiglipConfig:
    """A :class:`SiglipConfig` from a parsed ``vision_config`` dict (absent fields: transformers'
    defaults); errors name ``source`` and the field (``prefix`` + its name)."""
    r = ConfigReader(d if isinstance(d, dict) else {}, source)
    if not isinstance(d, dict):
        raise r.fail(prefix.rstrip("."), f"must be an object, got {d!r}")
    fields = {f: r.int_(n, dv, prefix=prefix, lo=1, hi=2**20) for f, (n, dv) in _HF_FIELDS.items()}
    act = r.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise r.fail(
            prefix + "hidden_act", f"= {act!r} is not supported; supported: {sorted(ACTIVATIONS)}"
        )
    eps = r.float_("layer_norm_eps", 1e-6, prefix=prefix)
    if eps <= 0:
        raise r.fail(prefix + "layer_norm_eps", f"must be > 0, got {eps!r}")
    try:
        return SiglipConfig(**fields, hidden_act=act, layer_norm_eps=eps)
    except ValueError as e:
        raise HFFormatError(f"{source}: {prefix.rstrip('.')}: {e}") from None


def siglip_config_to_hf(c: SiglipConfig) -> dict:
    """The ``vision_config`` transformers builds ``c`` from (no pooling head)."""
    return {
        "model_type": "siglip_vision_model",
        **{n: getattr(c, f) for f, (n, _) in _HF_FIELDS.items()},
        "hidden_act": c.hidden_act,
        "layer_norm_eps": c.layer_norm_eps,
        "attention_dropout": 0.0,
        "vision_use_head": False,
    }


class SiglipLayers(eqx.Module):
    """The encoder layers' parameters, each stacked on a leading ``[L]`` axis (weights ``[in, out]``)."""

    ln1_w: Float[Array, "L D"]
    ln1_b: Float[Array, "L D"]
    wq: Float[Array, "L D D"]
    bq: Float[Array, "L D"]
    wk: Float[Array, "L D D"]
    bk: Float[Array, "L D"]
    wv: Float[Array, "L D D"]
    bv: Float[Array, "L D"]
    wo: Float[Array, "L D D"]
    bo: Float[Array, "L D"]
    ln2_w: Float[Array, "L D"]
    ln2_b: Float[Array, "L D"]
    w1: Float[Array, "L D F"]
    b1: Float[Array, "L F"]
    w2: Float[Array, "L F D"]
    b2: Float[Array, "L D"]


class SiglipVision(eqx.Module):
    """The tower: patch embedding ``[C p p, D]`` (rows in the conv weight's ``(c, y, x)`` order),
    position table ``[P, D]``, stacked layers and the final LayerNorm. ``dtype``: the compute dtype
    of the matmul operands (accumulated in float32)."""

    patch_w: Float[Array, "Cpp D"]
    patch_b: Float[Array, " D"]
    pos: Float[Array, "P D"]
    layers: SiglipLayers
    post_w: Float[Array, " D"]
    post_b: Float[Array, " D"]
    config: SiglipConfig = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, default=jnp.float32)


def layer_norm(
    x: Float[Array, "... d"], w: Float[Array, " d"], b: Float[Array, " d"], eps: float
) -> Float[Array, "... d"]:
    """``(x - mean) / sqrt(var + eps) * w + b`` (biased variance), in float32, cast back to ``x``'s dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def patches(pixel_values: Float[Array, "n C H W"], p: int) -> Float[Array, "n P Cpp"]:
    """Non-overlapping ``p x p`` patches, row-major over the grid, each flattened ``(c, y, x)``
    (a remainder of fewer than ``p`` rows or columns at the bottom / right is dropped)."""
    n, c, h, w = pixel_values.shape
    gh, gw = h // p, w // p
    x = pixel_values[:, :, : gh * p, : gw * p].reshape(n, c, gh, p, gw, p)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, gh * gw, c * p * p)


def _layer(v: SiglipVision, x: Float[Array, "n P D"], p: SiglipLayers) -> Float[Array, "n P D"]:
    """One pre-LayerNorm encoder layer on unstacked parameters ``p`` (module docstring)."""
    c, dt = v.config, v.dtype
    n, t, _ = x.shape
    h = layer_norm(x, p.ln1_w, p.ln1_b, c.layer_norm_eps)
    q, k, vv = (
        linear(h, w, b, dt).reshape(n, t, c.num_heads, c.head_dim)
        for w, b in ((p.wq, p.bq), (p.wk, p.bk), (p.wv, p.bv))
    )
    everything = jnp.ones((n, t, t), bool)
    o = attn.attention(
        q, attn.heads_major(k), attn.heads_major(vv), everything, scale=c.head_dim**-0.5
    )
    x = x + linear(o.reshape(n, t, -1), p.wo, p.bo, dt).astype(x.dtype)
    h = layer_norm(x, p.ln2_w, p.ln2_b, c.layer_norm_eps)
    m = ACTIVATIONS[c.hidden_act](linear(h, p.w1, p.b1, dt))
    return x + linear(m, p.w2, p.b2, dt).astype(x.dtype)


def siglip_forward(v: SiglipVision, pixel_values: Float[Array, "n C H W"]) -> Float[Array, "n P D"]:
    """The tower's last hidden states (after ``post_layernorm``), in the compute dtype."""
    c = v.config
    want = (c.num_channels, c.image_size, c.image_size)
    if tuple(pixel_values.shape[1:]) != want:
        raise ValueError(
            f"pixel_values has shape {list(pixel_values.shape)}, expected [n, {', '.join(map(str, want))}]"
        )
    x = linear(patches(pixel_values, c.patch_size), v.patch_w, v.patch_b, v.dtype)
    x = x + v.pos.astype(x.dtype)

    def body(h, p):
        return _layer(v, h, p), None

    x, _ = jax.lax.scan(body, x, v.layers)
    return layer_norm(x, v.post_w, v.post_b, c.layer_norm_eps)


def init_siglip(
    c: SiglipConfig, key: Array, *, std: float = 0.02, dtype=jnp.float32
) -> SiglipVision:
    """Random weights and biases ``N(0, std)``, LayerNorms ``w = 1 + N(0, std)``, ``b = N(0, std)``."""
    keys = iter(jax.random.split(key, len(_LAYER_TENSORS) + 8))

    def normal(shape, mean=0.0):
        return mean + std * jax.random.normal(next(keys), shape, jnp.float32)

    per = _layer_shapes(c)
    layers = SiglipLayers(
        **{
            f: normal(
                (c.num_layers, *(per[f][::-1] if t else per[f])),
                1.0 if f.startswith("ln") and f.endswith("_w") else 0.0,
            )
            for f, (_, t) in _LAYER_TENSORS.items()
        }
    )
    D = c.hidden_size
    return SiglipVision(
        normal((c.patch_dim, D)),
        normal((D,)),
        normal((c.num_patches, D)),
        layers,
        normal((D,), 1.0),
        normal((D,)),
        c,
        dtype,
    )


# ----------------------------------------------------------------------------- transformers' names

# LayerStack-like field -> (name under encoder.layers.{i}., a torch Linear weight [out, in])
_LAYER_TENSORS = {
    "ln1_w": ("layer_norm1.weight", False),
    "ln1_b": ("layer_norm1.bias", False),
    "wq": ("self_attn.q_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "wk": ("self_attn.k_proj.weight", True),
    "bk": ("self_attn.k_proj.bias", False),
    "wv": ("self_attn.v_proj.weight", True),
    "bv": ("self_attn.v_proj.bias", False),
    "wo": ("self_attn.out_proj.weight", True),
    "bo": ("self_attn.out_proj.bias", False),
    "ln2_w": ("layer_norm2.weight", False),
    "ln2_b": ("layer_norm2.bias", False),
    "w1": ("mlp.fc1.weight", True),
    "b1": ("mlp.fc1.bias", False),
    "w2": ("mlp.fc2.weight", True),
    "b2": ("mlp.fc2.bias", False),
}
_PATCH_W = "embeddings.patch_embedding.weight"
_TOP = {
    "patch_b": "embeddings.patch_embedding.bias",
    "pos": "embeddings.position_embedding.weight",
    "post_w": "post_layernorm.weight",
    "post_b": "post_layernorm.bias",
}


def _layer_shapes(c: SiglipConfig) -> dict[str, tuple[int, ...]]:
    """Each layer field's shape in a checkpoint (a Linear weight ``[out, in]``)."""
    D, F = c.hidden_size, c.intermediate_size
    return {
        f: (F, D)
        if f == "w1"
        else (D, F)
        if f == "w2"
        else (F,)
        if f == "b1"
        else (D, D)
        if t
        else (D,)
        for f, (_, t) in _LAYER_TENSORS.items()
    }


def hf_shapes(c: SiglipConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the tower in a transformers checkpoint (names relative to its prefix) and its shape."""
    D, p = c.hidden_size, c.patch_size
    out = {
        _PATCH_W: (D, c.num_channels, p, p),
        _TOP["patch_b"]: (D,),
        _TOP["pos"]: (c.num_patches, D),
    }
    per = _layer_shapes(c)
    for i in range(c.num_layers):
        out.update(
            {f"encoder.layers.{i}.{name}": per[f] for f, (name, _) in _LAYER_TENSORS.items()}
        )
    out.update({_TOP["post_w"]: (D,), _TOP["post_b"]: (D,)})
    return out


def from_hf(c: SiglipConfig, tensors: dict[str, np.ndarray], *, dtype=jnp.float32) -> SiglipVision:
    """The tower from its transformers tensors (``hf_shapes``' names and shapes, checked by the caller)."""
    layers = SiglipLayers(
        **{
            f: jnp.asarray(
                np.stack(
                    [
                        tensors[f"encoder.layers.{i}.{name}"].T
                        if t
                        else tensors[f"encoder.layers.{i}.{name}"]
                        for i in range(c.num_layers)
                    ]
                )
            )
            for f, (name, t) in _LAYER_TENSORS.items()
        }
    )
    patch_w = tensors[_PATCH_W].reshape(c.hidden_size, c.patch_dim).T
    top = {f: jnp.asarray(tensors[n]) for f, n in _TOP.items()}
    return SiglipVision(patch_w=jnp.asarray(patch_w), layers=layers, config=c, dtype=dtype, **top)


def to_hf(v: SiglipVision) -> dict[str, np.ndarray]:
    """The tower's tensors under transformers' names (relative to its prefix), as ``hf_shapes``."""
    c = v.config
    out = {
        _PATCH_W: np.asarray(v.patch_w).T.reshape(
            c.hidden_size, c.num_channels, c.patch_size, c.patch_size
        )
    }
    out.update(
        {n: np.asarray(getattr(v, f)) for f, n in _TOP.items() if f.startswith(("patch", "pos"))}
    )
    for i in range(c.num_layers):
        for f, (name, t) in _LAYER_TENSORS.items():
            a = np.asarray(getattr(v.layers, f)[i])
            out[f"encoder.layers.{i}.{name}"] = a.T if t else a
    out.update({n: np.asarray(getattr(v, f)) for f, n in _TOP.items() if f.startswith("post")})
    return out
