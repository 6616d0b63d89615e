"""Qwen2.5-VL's vision transformer (transformers' ``Qwen2_5_VisionTransformerPretrainedModel``).

The processor cuts each image into ``T x H x W`` patches of ``C x tp x p x p`` pixels (``tp``
frames, ``p x p`` pixels), flattened to ``pixel_values [N, C*tp*p*p]``, rows in merge-block order:
the ``m x m`` patches that the merger joins into one token are consecutive
(``(t, h/m, w/m, m, m)`` raster order). Several images are one ``[sum T*H*W, P]`` array with
their ``grid_thw``. Then::

    x = pixel_values W_patch                         (the Conv3d, kernel = stride: one matmul)
    per block:  x += Attn(N1(x)) W_o + b_o;  x += (silu(N2(x) W_g + b_g) * (N2(x) W_u + b_u)) W_d + b_d
    out = GELU(N_q(x) viewed [N/m^2, m^2 D] W_1 + b_1) W_2 + b_2     (the patch merger)

with ``N`` RMSNorms (eps 1e-6) and 2-D rotary positions: a patch at (h, w) of its frame rotates
its ``head_dim`` by ``[h f, w f, h f, w f]``, ``f = theta^(-2i/(head_dim/2))``, ``i < head_dim/4``.

Attention never crosses a frame. The layers listed in ``fullatt_block_indexes`` attend over the
whole frame; the others inside windows of ``window_size`` pixels (``window_size / (m p)`` merged
tokens a side; windows at the right and bottom edges are smaller). transformers permutes the
patches into window order, attends over each window's contiguous run and permutes back; here
the patches stay in place and each attention layer gathers its segments (the windows, or the
frames of a full layer) into a padded ``[segments, longest, ...]`` batch, attends inside each,
and gathers the outputs back (``Segments``, host tables from ``grid_thw``, static per batch):
the same outputs, since everything but attention acts per token and the merger's ``m x m``
groups stay together in both, at the cost of the windows' attention (``N x window``), not the
image's (``N x N``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float

from relax.models.attention import blocks as attn
from relax.models.decoder.layer import rms_norm
from relax.models.hf.reader import ConfigReader
from relax.models.layers.rope import CosSin, apply_rope
from relax.models.vision.mrope import Grid, sectioned_angles

__all__ = [
    "QwenVisionConfig",
    "QwenVision",
    "VisionBlocks",
    "VisionMerger",
    "Segments",
    "grid_tables",
    "init_qwen_vision",
    "segment_attention",
    "segments",
    "vision_forward",
]

NORM_EPS = 1e-6  # transformers' Qwen2_5_VLRMSNorm(eps=1e-6) in every vision block and ln_q
# transformers' ``ACT2FN`` names a vision_config may give -> the function
_ACTIVATIONS = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "relu": jax.nn.relu,
}


@dataclasses.dataclass(frozen=True)
class QwenVisionConfig:
    """``config.json``'s ``vision_config`` (defaults: transformers 5.23's ``Qwen2_5_VLVisionConfig``).
    ``tokens_per_second`` (video timing) is kept for the round trip only."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    tokens_per_second: int = 4

    def __post_init__(self):
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(
                f"vision hidden_size {self.hidden_size} / num_heads {self.num_heads} must be a "
                "head_dim divisible by 4 (2-D rotary: h and w halves, each rotate-half)"
            )
        if self.window_size // self.spatial_merge_size // self.patch_size < 1:
            raise ValueError(
                f"vision window_size {self.window_size} is less than one merged token "
                f"(spatial_merge_size {self.spatial_merge_size} x patch_size {self.patch_size})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"vision hidden_act {self.hidden_act!r} is not supported; supported: "
                f"{list(_ACTIVATIONS)}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """``C * tp * p * p``: one row of ``pixel_values``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def window_tokens(self) -> int:
        """A window's side in merged tokens."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @classmethod
    def from_hf(cls, d: dict, source: str) -> QwenVisionConfig:
        """From a parsed ``vision_config`` (``source`` names the file in errors, which are
        ``HFFormatError`` naming ``vision_config.<field>``)."""
        r, pre, dflt = ConfigReader(d, source), "vision_config.", cls()
        rope = r.get("rope_parameters", None) or {}
        ints = {
            f.name: r.int_(f.name, getattr(dflt, f.name), prefix=pre, lo=1)
            for f in dataclasses.fields(cls)
            if f.type == "int"
        }
        full = r.get("fullatt_block_indexes", list(dflt.fullatt_block_indexes))
        if not isinstance(full, (list, tuple)) or not all(
            isinstance(i, int) and 0 <= i < ints["depth"] for i in full
        ):
            raise r.fail(pre + "fullatt_block_indexes", f"must list layers < depth, got {full!r}")
        act = r.get("hidden_act", dflt.hidden_act)
        try:
            return cls(
                **ints,
                fullatt_block_indexes=tuple(full),
                hidden_act=act,
                rope_theta=r.float_(
                    "rope_theta", dflt.rope_theta, d=rope, prefix=pre + "rope_parameters."
                ),
            )
        except ValueError as e:
            raise r.fail(pre[:-1], str(e)) from None

    def to_hf(self) -> dict:
        """The ``vision_config`` transformers writes."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d.pop("rope_theta")
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        d["rope_parameters"] = {"rope_theta": self.rope_theta, "rope_type": "axial"}
        return {"model_type": "qwen2_5_vl_vision", "initializer_range": 0.02, **d}


class VisionBlocks(eqx.Module):
    """Every block's parameters stacked on ``[L]``; weights ``[in, out]``."""

    norm1: Float[Array, "L D"]
    qkv: Float[Array, "L D 3D"]
    qkv_bias: Float[Array, "L 3D"]
    proj: Float[Array, "L D D"]
    proj_bias: Float[Array, "L D"]
    norm2: Float[Array, "L D"]
    gate: Float[Array, "L D F"]
    gate_bias: Float[Array, "L F"]
    up: Float[Array, "L D F"]
    up_bias: Float[Array, "L F"]
    down: Float[Array, "L F D"]
    down_bias: Float[Array, "L D"]


class VisionMerger(eqx.Module):
    """The patch merger: ``ln_q`` ``[D]``, then ``[m^2 D] -> [m^2 D] -> [out]``."""

    ln_q: Float[Array, " D"]
    fc1: Float[Array, "M M"]
    fc1_bias: Float[Array, " M"]
    fc2: Float[Array, "M O"]
    fc2_bias: Float[Array, " O"]


class QwenVision(eqx.Module):
    """The vision tower: ``patch_embed`` ``[C*tp*p*p, D]`` (the Conv3d's weight flattened), the
    stacked blocks and the merger. ``dtype``: the compute dtype of the activations and matmul
    operands (accumulated in float32), whatever the parameters' dtype (a bfloat16 checkpoint
    computed in float32 is transformers' ``from_pretrained(..., dtype=torch.float32)``)."""

    patch_embed: Float[Array, "P D"]
    blocks: VisionBlocks
    merger: VisionMerger
    config: QwenVisionConfig = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, default=jnp.float32)


class GridTables(NamedTuple):
    """Host tables of one batch's images: each patch's (h, w) in its frame ``[N, 2]``, its frame's
    and its window's segment ids ``[N]``."""

    positions: np.ndarray
    frames: np.ndarray
    windows: np.ndarray


def grid_tables(config: QwenVisionConfig, grid: Grid) -> GridTables:
    """The ``GridTables`` of images ``grid`` (``(t, h, w)`` patches each), patches in the
    processor's merge-block order (module docstring)."""
    m, v = config.spatial_merge_size, config.window_tokens
    pos, frames, windows = [], [], []
    frame_id = window_id = 0
    for t, h, w in grid:
        if h % m or w % m:
            raise ValueError(f"image grid (t, h, w) = {(t, h, w)} is not a multiple of merge {m}")
        hh, ww = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = lambda a: a.reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)  # noqa: E731
        pos.append(np.tile(np.stack([blocks(hh), blocks(ww)], -1), (t, 1)))
        # merged token (bh, bw) lies in window (bh // v, bw // v) of its frame
        bh, bw = np.meshgrid(np.arange(h // m), np.arange(w // m), indexing="ij")
        per_frame = (bh // v) * -(-(w // m) // v) + bw // v  # [h/m, w/m]
        n_win = int(per_frame.max()) + 1
        for f in range(t):
            frames.append(np.full(h * w, frame_id + f))
            windows.append(np.repeat(per_frame.reshape(-1) + window_id + f * n_win, m * m))
        frame_id, window_id = frame_id + t, window_id + t * n_win
    return GridTables(
        np.concatenate(pos).astype(np.int32),
        np.concatenate(frames).astype(np.int32),
        np.concatenate(windows).astype(np.int32),
    )


class Segments(NamedTuple):
    """Attention segments as a padded batch: ``index [S, L]`` the patches of each segment (in
    order; padding points at patch 0), ``valid [S, L]`` which are real, ``back [N]`` each patch's
    place in the flattened ``[S * L]`` batch."""

    index: np.ndarray
    valid: np.ndarray
    back: np.ndarray


def segments(ids: np.ndarray) -> Segments:
    """The ``Segments`` of per-patch segment ids ``ids [N]`` (each segment's patches in order)."""
    order = np.argsort(ids, kind="stable")
    _, starts, counts = np.unique(ids[order], return_index=True, return_counts=True)
    width = int(counts.max())
    slot = np.arange(len(ids)) - np.repeat(starts, counts)  # rank inside its segment
    seg = np.repeat(np.arange(len(counts)), counts)
    index = np.zeros((len(counts), width), np.int32)
    valid = np.zeros((len(counts), width), bool)
    index[seg, slot], valid[seg, slot] = order, True
    back = np.empty(len(ids), np.int32)
    back[order] = seg * width + slot
    return Segments(index, valid, back)


def vision_rope(config: QwenVisionConfig, positions: np.ndarray) -> CosSin:
    """The 2-D rotary tables ``[N, head_dim]`` of patch positions ``[N, 2]`` (module docstring)."""
    half = config.head_dim // 2
    inv = (
        1.0
        / (
            np.float32(config.rope_theta)
            ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))
        )
    ).astype(np.float32)
    axis = np.repeat([0, 1], inv.shape[0])
    return sectioned_angles(jnp.asarray(positions.T), np.concatenate([inv, inv]), axis)


def _linear(x: Array, w: Array, b: Array | None) -> Array:
    y = jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)
    return y if b is None else y + b.astype(x.dtype)


def segment_attention(
    q: Float[Array, "N H d"], k: Float[Array, "N H d"], v: Float[Array, "N H d"], seg: Segments
) -> Float[Array, "N H d"]:
    """Each patch attends over the patches of its own segment: softmax(q k^T / sqrt(d)) v inside
    each segment, computed on the padded ``[S, L]`` batch (a padding query sees itself only)."""
    index, valid = jnp.asarray(seg.index), jnp.asarray(seg.valid)
    eye = jnp.eye(index.shape[1], dtype=bool)
    allowed = valid[:, None, :] | eye[None]
    o = attn.attention(q[index], attn.heads_major(k[index]), attn.heads_major(v[index]), allowed)
    return o.reshape(-1, *o.shape[2:])[jnp.asarray(seg.back)]


def _block(
    c: QwenVisionConfig,
    p: VisionBlocks,
    x: Float[Array, "N D"],
    rope: CosSin,
    is_full: Bool[Array, ""],
    frames: Segments,
    windows: Segments,
) -> Float[Array, "N D"]:
    """One block (module docstring) on one layer's parameters: attention over the frames' patches
    when ``is_full``, else over the windows'."""
    n, H, hd = x.shape[0], c.num_heads, c.head_dim
    qkv = _linear(rms_norm(x, p.norm1, NORM_EPS), p.qkv, p.qkv_bias).reshape(n, 3, H, hd)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    o = jax.lax.cond(
        is_full,
        lambda: segment_attention(q, k, v, frames),
        lambda: segment_attention(q, k, v, windows),
    )
    x = x + _linear(o.reshape(n, H * hd), p.proj, p.proj_bias)
    h = rms_norm(x, p.norm2, NORM_EPS)
    act = _ACTIVATIONS[c.hidden_act]
    m = act(_linear(h, p.gate, p.gate_bias)) * _linear(h, p.up, p.up_bias)
    return x + _linear(m, p.down, p.down_bias)


def _merge(c: QwenVisionConfig, p: VisionMerger, x: Float[Array, "N D"]) -> Float[Array, "n O"]:
    x = rms_norm(x, p.ln_q, NORM_EPS).reshape(-1, c.spatial_merge_size**2 * c.hidden_size)
    return _linear(jax.nn.gelu(_linear(x, p.fc1, p.fc1_bias), approximate=False), p.fc2, p.fc2_bias)


def vision_forward(
    model: QwenVision, pixel_values: Float[Array, "N P"], grid: Grid
) -> Float[Array, "n O"]:
    """The merged image features ``[sum t*h*w / m^2, out_hidden_size]`` of the images ``grid``
    (static ``(t, h, w)`` tuples), in their order. The blocks run as one ``lax.scan``, each
    layer's kind (full or window attention) scanned alongside and choosing its segments."""
    c = model.config
    if pixel_values.shape != (sum(t * h * w for t, h, w in grid), c.patch_dim):
        raise ValueError(
            f"pixel_values has shape {tuple(pixel_values.shape)}, expected "
            f"[sum of t*h*w over grid {list(grid)}, C*tp*p*p = {c.patch_dim}]"
        )
    tables = grid_tables(c, grid)
    x = _linear(pixel_values.astype(model.dtype), model.patch_embed, None)
    rope = vision_rope(c, tables.positions)
    frames, windows = segments(tables.frames), segments(tables.windows)
    full = jnp.asarray([i in c.fullatt_block_indexes for i in range(c.depth)])

    def body(x, layer):
        p, is_full = layer
        return _block(c, p, x, rope, is_full, frames, windows), None

    x, _ = jax.lax.scan(body, x, (model.blocks, full))
    return _merge(c, model.merger, x)


def init_qwen_vision(
    config: QwenVisionConfig, key: jax.Array, *, std: float = 0.02, dtype=jnp.float32
) -> QwenVision:
    """A random tower of ``config``: weights ``N(0, std)``, the RMSNorm scales 1, the biases 0."""
    c, L = config, config.depth
    D, F, O = c.hidden_size, c.intermediate_size, c.out_hidden_size
    M = D * c.spatial_merge_size**2  # the merger's width
    keys = iter(jax.random.split(key, 8))

    def normal(*shape):
        return (std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    ones = lambda *shape: jnp.ones(shape, dtype)  # noqa: E731
    zeros = lambda *shape: jnp.zeros(shape, dtype)  # noqa: E731
    blocks = VisionBlocks(
        norm1=ones(L, D),
        qkv=normal(L, D, 3 * D),
        qkv_bias=zeros(L, 3 * D),
        proj=normal(L, D, D),
        proj_bias=zeros(L, D),
        norm2=ones(L, D),
        gate=normal(L, D, F),
        gate_bias=zeros(L, F),
        up=normal(L, D, F),
        up_bias=zeros(L, F),
        down=normal(L, F, D),
        down_bias=zeros(L, D),
    )
    merger = VisionMerger(
        ln_q=ones(D), fc1=normal(M, M), fc1_bias=zeros(M), fc2=normal(M, O), fc2_bias=zeros(O)
    )
    return QwenVision(
        patch_embed=normal(c.patch_dim, D), blocks=blocks, merger=merger, config=c, dtype=dtype
    )
