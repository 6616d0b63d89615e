"""Low-rank adapters (LoRA) on the decoder's linear layers, as an equinox pytree.

A target weight ``W [in, out]`` (stored ``[in, out]``, stacked on the layers that have it: ``[L]``,
or a mixture of experts' shared expert on its sparse layers ``[Ls]``) gets two factors,
``A [in, r]`` and ``B [r, out]``, and the layer computes, without ever forming ``W + s A B``::

    y = x W + s * drop(x) A B,      s = alpha / r      (rsLoRA: s = alpha / sqrt(r))

``drop`` is inverted dropout with rate ``dropout`` on the adapter branch's input, only in a
training forward (when the adapters carry a ``dropout_key``). ``B`` starts at zero, so a fresh
adapter is exactly the base model. The names follow Hugging Face's module names (``q_proj`` ...
``down_proj``, ``shared_expert_gate``, or ``all-linear``; ``gate_proj`` means the dense MLP's and a
shared expert's, as PEFT matches module names) and the factors are PEFT's ``lora_A`` / ``lora_B``
transposed (``relax.models.adapters.peft``). The adapters live in ``LayerStack.lora``, so every forward
(plain, sampler, prefix-shared trainer) runs them through the same layer code;
``relax.models.adapters.operations`` adds, removes, merges and partitions them on a ``Transformer``.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from relax.choices import check_choice
from relax.models.config.family_record import ADAPTABLE_FIELDS

# target name -> the LayerStack weight fields it names: Hugging Face's module names (the last part
# of ``FamilyRecord.lora_modules``' paths), the same for every family; each adapts its weights
# apart, also where a checkpoint fuses some (relax.models.adapters.peft). ``gate_proj`` names the dense
# MLP's ``mlp.gate_proj`` and a shared expert's ``mlp.shared_expert.gate_proj``, as in PEFT.
TARGETS = {
    "q_proj": ("wq",),
    "k_proj": ("wk",),
    "v_proj": ("wv",),
    "o_proj": ("wo",),
    "gate_proj": ("w_gate", "shared_gate"),
    "up_proj": ("w_up", "shared_up"),
    "down_proj": ("w_down", "shared_down"),
    "shared_expert_gate": ("shared_router",),
}
INITS = ("default", "gaussian")
DTYPES = ("float32", "bfloat16", "base")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Adapters on the targeted linear layers; ``rank == 0`` means none (the whole model trains).

    ``init``: ``"default"`` draws ``A`` Kaiming-uniform, ``U(-1/sqrt(in), 1/sqrt(in))``, as PEFT's
    default, ``"gaussian"`` draws ``A`` normal with standard deviation ``1/r`` (PEFT's); ``B = 0``
    either way. ``dtype``: the
    adapters' parameter dtype (``"base"``: the base weights'); float32 adapters over a bfloat16
    base keep small updates that bfloat16 would round away. The forward runs in the model's
    compute dtype either way.
    """

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all-linear",)
    init: str = "default"
    use_rslora: bool = False
    dtype: str = "float32"
    vision: bool = False
    """Adapt a vision-language model's tower too: every linear layer of it (PEFT's all-linear
    there; ``relax.models.adapters.tower``), which then trains through its adapters."""

    def __post_init__(self):
        check_choice("init", self.init, INITS)
        if self.vision and not self.enabled:
            raise ValueError("lora vision: adapters on the tower need a rank > 0 (--lora.rank)")
        check_choice("dtype", self.dtype, DTYPES)
        if self.rank < 0:
            raise ValueError(f"lora rank={self.rank} must be >= 0 (0: no adapters)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora dropout={self.dropout} must be in [0, 1)")
        self.fields()  # checks the target names

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """``s = alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def fields(self) -> tuple[str, ...]:
        """The ``LayerStack`` weight fields the targets name, in ``ADAPTABLE_FIELDS`` order (a
        model adapts those it has: ``relax.models.adapters.operations.adapter_fields``)."""
        names = set(self.target_modules)
        if "all-linear" in names:
            names = (names - {"all-linear"}) | set(TARGETS)
        unknown = sorted(names - set(TARGETS))
        if unknown or not names:
            raise ValueError(
                f"lora target_modules {list(self.target_modules)}: unknown {unknown}; "
                f"choose from {list(TARGETS)} or 'all-linear'"
            )
        named = {f for m in names for f in TARGETS[m]}
        return tuple(f for f in ADAPTABLE_FIELDS if f in named)


class LoRAWeights(eqx.Module):
    """One target's factors, stacked over its weight's layers: ``a [L, in, r]``, ``b [L, r, out]``."""

    a: Float[Array, "L i r"]
    b: Float[Array, "L r o"]


class Adapters(eqx.Module):
    """The adapters of every targeted weight (None: not adapted), the static ``alpha``, rsLoRA
    flag and dropout rate, and ``dropout_key`` ``[L]`` (one key per layer) inside a training
    forward only."""

    wq: LoRAWeights | None = None
    wk: LoRAWeights | None = None
    wv: LoRAWeights | None = None
    wo: LoRAWeights | None = None
    w_gate: LoRAWeights | None = None
    w_up: LoRAWeights | None = None
    w_down: LoRAWeights | None = None
    shared_gate: LoRAWeights | None = None  # a shared expert's, stacked on the sparse layers [Ls]
    shared_up: LoRAWeights | None = None
    shared_down: LoRAWeights | None = None
    shared_router: LoRAWeights | None = None
    dropout_key: Array | None = None
    alpha: float = eqx.field(static=True, default=16.0)
    use_rslora: bool = eqx.field(static=True, default=False)
    dropout: float = eqx.field(static=True, default=0.0)

    @property
    def rank(self) -> int:
        return next(iter(self.weights().values())).a.shape[-1]

    @property
    def scale(self) -> float:
        """``s = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def weights(self) -> dict[str, LoRAWeights]:
        """The adapted fields and their factors, in ``ADAPTABLE_FIELDS`` order."""
        found = {f: getattr(self, f) for f in ADAPTABLE_FIELDS}
        return {f: w for f, w in found.items() if w is not None}


def init_adapters(
    cfg: LoRAConfig, shapes: dict[str, tuple[int, int, int]], key: Array, base_dtype
) -> Adapters:
    """Fresh adapters on the weights ``shapes`` gives: field -> ``(layers, in, out)`` (the model's
    ``ModelConfig.stacked_shapes()`` of the fields it adapts)."""
    dtype = base_dtype if cfg.dtype == "base" else jnp.dtype(cfg.dtype)
    weights = {}
    for i, (field, (num_layers, fan_in, fan_out)) in enumerate(shapes.items()):
        k = jax.random.fold_in(key, i)
        shape = (num_layers, fan_in, cfg.rank)
        if cfg.init == "gaussian":
            a = jax.random.normal(k, shape, jnp.float32) / cfg.rank
        else:
            bound = 1.0 / math.sqrt(fan_in)
            a = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
        weights[field] = LoRAWeights(
            a.astype(dtype), jnp.zeros((num_layers, cfg.rank, fan_out), dtype)
        )
    return Adapters(**weights, alpha=cfg.alpha, use_rslora=cfg.use_rslora, dropout=cfg.dropout)


def delta(
    ad: Adapters | None, field: str, x: Float[Array, "... i"], dtype, index: int = 0, out=None
) -> Float[Array, "... o"] | None:
    """``s * drop(x) A B`` of one layer's adapter on ``field`` (None when it has none): the products'
    operands in ``dtype``, accumulated in float32, the result in ``out`` (None: ``dtype``). ``index``
    (the field's place in ``ADAPTABLE_FIELDS``) separates the dropout masks of the targets."""
    w = None if ad is None else getattr(ad, field)
    if w is None:
        return None
    if ad.dropout_key is not None and ad.dropout > 0.0:
        keep = jax.random.bernoulli(
            jax.random.fold_in(ad.dropout_key, index), 1.0 - ad.dropout, x.shape
        )
        x = jnp.where(keep, x / (1.0 - ad.dropout), 0.0).astype(x.dtype)
    flat = x.reshape(-1, x.shape[-1]).astype(dtype)
    xa = jnp.dot(flat, w.a.astype(dtype), preferred_element_type=jnp.float32).astype(dtype)
    y = jnp.dot(xa, w.b.astype(dtype), preferred_element_type=jnp.float32)
    out = dtype if out is None else out
    return (ad.scale * y).astype(out).reshape(*x.shape[:-1], w.b.shape[-1])


def adapted(ad: Adapters | None, field: str, x: Array, y: Array, dtype) -> Array:
    """``y + delta(...)``: the base projection ``y = x W (+ b)`` plus the field's adapter, if any."""
    d = delta(ad, field, x, dtype, ADAPTABLE_FIELDS.index(field), out=y.dtype)
    return y if d is None else y + d


def merged_weight(
    w: Float[Array, "... i o"], lw: LoRAWeights, scale: float
) -> Float[Array, "... i o"]:
    """``W + s A B`` (computed in float32, rounded once to ``W``'s dtype)."""
    ab = jnp.einsum("...ir,...ro->...io", lw.a.astype(jnp.float32), lw.b.astype(jnp.float32))
    return (w.astype(jnp.float32) + scale * ab).astype(w.dtype)
