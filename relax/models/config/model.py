"""Model configuration: one frozen dataclass describing a decoder-only transformer.

Every supported architecture is a point in the same space of traits, and the layer code reads
the traits, never the family name (``family`` names the Hugging Face ``model_type``, whose
record in ``relax.models.config.families`` says everything else about it):

=========================  ======  =======  =====  =====  ===========  ========
trait                      llama   mistral  qwen2  qwen3  gemma3_text  phi3
=========================  ======  =======  =====  =====  ===========  ========
``norm_weight``            w       w        w      w      1+w          w
``sandwich_norms``         no      no       no     no     yes          no
``qk_norm``                no      no       no     yes    yes          no
``activation`` (default)   silu    silu     silu   silu   gelu_tanh    silu
``scale_embeddings``       no      no       no     no     yes          no
``query_pre_attn_scalar``  -       -        -      -      yes          -
sliding window             -       all      all/-  all/-  layer_types  all/-
``rope_local_theta``       -       -        -      -      sliding      -
RoPE scaling               linear, llama3 (all but phi3)               longrope
=========================  ======  =======  =====  =====  ===========  ========

The mixture-of-experts families share these layers: ``qwen3_moe`` is Qwen3's, ``mixtral``
Mistral's, ``qwen2_moe`` Qwen2's (its q/k/v biases behind a ``qkv_bias`` flag), each with its MLPs
a mixture of experts (``num_experts`` and the fields after it; ``relax.models.moe.experts``).
(A family's record holds the first five rows, ``FamilyRecord.traits``; ``family_config``
applies them. Phi-3 stores q/k/v and gate/up as fused tensors: a file-format difference only,
``relax.models.hf.checkpoint`` splits them.) Per-layer differences are one static tuple, ``sliding_layers``:
a sliding layer attends through ``sliding_window`` and, when ``rope_local_theta`` is set,
rotates with its own RoPE base.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax.numpy as jnp

from relax.models.config.families import FAMILIES, get_family
from relax.models.config.family_record import MOE_LINEAR_FIELDS

NormWeight = Literal["w", "1+w"]
Activation = Literal["silu", "gelu_tanh"]
LayerType = Literal["full", "sliding"]
DENSE_MLP_FIELDS = ("w_gate", "w_up", "w_down", "b_gate", "b_up", "b_down")
MOE_FIELDS = MOE_LINEAR_FIELDS  # every mixture-of-experts field is a torch ``Linear`` weight
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``kind="llama3"`` is Llama 3.1's piecewise rescaling of the inverse frequencies
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position``);
    ``kind="linear"`` divides every inverse frequency by ``factor`` (positions / factor);
    ``kind="longrope"`` is Phi-3's LongRoPE: inverse frequency ``i`` divided by
    ``short_factor[i]`` and cos/sin multiplied by ``attention_factor`` (transformers'
    ``sqrt(1 + ln(factor) / ln(original_max_position))`` unless the config gives one, ``factor``
    being its ``max_position_embeddings / original_max_position_embeddings`` unless given).
    transformers switches to ``long_factor`` for sequences longer than ``original_max_position``;
    relax's tables are static, so a longrope model runs at most that many positions
    (``ModelConfig.max_position_embeddings <= original_max_position``) and ``long_factor`` is
    only kept to be written back.
    """

    kind: Literal["llama3", "linear", "longrope"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (module docstring: the traits per family).

    Sizes: ``vocab_size``, ``hidden_size`` (D), ``intermediate_size`` (F), ``num_layers`` (L),
    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``max_position_embeddings``.

    Layer traits (defaults: Llama):

    - ``norm_weight``: every RMSNorm scales ``x̂ = x / sqrt(mean(x^2) + rms_norm_eps)`` by ``w``
      (``"w"``) or by ``1 + w`` in float32 (``"1+w"``, Gemma).
    - ``sandwich_norms``: the attention and MLP outputs are RMS-normalised (``attn_out_norm``,
      ``mlp_out_norm``) before their residual add (Gemma 2/3).
    - ``qk_norm``: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    - ``activation``: the gated MLP's ``act(x Wg) * (x Wu)``: ``"silu"`` (SwiGLU) or
      ``"gelu_tanh"`` (GeGLU with the tanh approximation).
    - ``qkv_bias`` / ``o_bias`` / ``mlp_bias``: biases of the projections.
    - ``scale_embeddings``: embeddings times ``sqrt(D)`` (rounded to the embedding dtype).
    - ``query_pre_attn_scalar``: scores are ``q.k / sqrt(query_pre_attn_scalar)``; None:
      ``/ sqrt(head_dim)``.

    Positions and windows: RoPE with base ``rope_theta`` and ``rope_scaling``;
    ``sliding_window`` W (keys with ``pos_q - pos_k < W``) on the layers ``layer_types`` marks
    ``"sliding"`` (None: on every layer), and those layers' RoPE base ``rope_local_theta``
    (unscaled; None: the same RoPE as the full layers).

    Mixture of experts (``num_experts`` E > 0; ``relax.models.moe.experts``): the MLP of every layer not in
    ``dense_layers`` routes each token to its top ``num_experts_per_tok`` experts of width
    ``moe_intermediate_size`` (their router probabilities renormalised to sum 1 with
    ``norm_topk_prob``), plus a gated shared expert of width ``shared_expert_size`` when that is
    > 0 (Qwen2-MoE). ``output_router_logits`` / ``router_aux_loss_coef`` / ``router_z_loss_coef``
    are the checkpoint's training settings: trainers add ``coef * load_balance`` when the first is
    set (as transformers does) and the z-loss when its coefficient is > 0, unless told otherwise.

    ``family`` is the Hugging Face ``model_type`` written back on save.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    family: str = "llama"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    norm_weight: NormWeight = "w"
    sandwich_norms: bool = False
    activation: Activation = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[LayerType, ...] | None = None
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_size: int = 0
    dense_layers: tuple[int, ...] = ()
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"ModelConfig.family={self.family!r}; valid: {tuple(FAMILIES)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig.sliding_window must be >= 1, got {self.sliding_window}")
        for name, valid in (("norm_weight", ("w", "1+w")), ("activation", ("silu", "gelu_tanh"))):
            if getattr(self, name) not in valid:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; valid: {valid}")
        if self.query_pre_attn_scalar is not None and not self.query_pre_attn_scalar > 0:
            raise ValueError(
                f"ModelConfig.query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}"
            )
        if self.layer_types is not None and (
            not isinstance(self.layer_types, tuple)
            or len(self.layer_types) != self.num_layers
            or any(t not in ("full", "sliding") for t in self.layer_types)
        ):
            raise ValueError(
                f"ModelConfig.layer_types must be a tuple of 'full'/'sliding' for each of the "
                f"{self.num_layers} layers, got {self.layer_types!r}"
            )
        if self.rope_scaling is not None:
            self._check_rope(self.rope_scaling)
        if self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        """Raise ``ValueError`` for a top-k outside ``1..num_experts``, an expert width below 1, or
        dense layer indices outside the model."""
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"ModelConfig.num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"1..num_experts={self.num_experts}"
            )
        if self.moe_intermediate_size < 1:
            raise ValueError(
                f"ModelConfig.moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}"
            )
        if (
            not isinstance(self.dense_layers, tuple)
            or list(self.dense_layers) != sorted(set(self.dense_layers))
            or any(not 0 <= i < self.num_layers for i in self.dense_layers)
        ):
            raise ValueError(
                f"ModelConfig.dense_layers must be increasing layer indices in 0..{self.num_layers - 1}, "
                f"got {self.dense_layers!r}"
            )

    def _check_rope(self, s: RopeScaling) -> None:
        """Raise ``ValueError`` for a scaling of unknown kind, longrope fields on another kind, a
        factor list not of ``head_dim/2`` entries, or a longrope context past its original length."""
        if s.kind not in ("llama3", "linear", "longrope"):
            raise ValueError(
                f"ModelConfig.rope_scaling.kind={s.kind!r}; valid: ('llama3', 'linear', 'longrope')"
            )
        if s.kind != "longrope":
            if s.attention_factor != 1.0 or s.short_factor is not None or s.long_factor is not None:
                raise ValueError(
                    f"ModelConfig.rope_scaling: attention_factor and short/long factors are "
                    f"longrope's, not {s.kind!r}'s"
                )
            return
        half = self.head_dim // 2
        for name in ("short_factor", "long_factor"):
            v = getattr(s, name)
            if not isinstance(v, tuple) or len(v) != half:
                raise ValueError(
                    f"ModelConfig.rope_scaling.{name} must be a tuple of head_dim/2 = {half} "
                    f"numbers, got {v!r}"
                )
        if self.max_position_embeddings > s.original_max_position:
            raise ValueError(
                f"ModelConfig.max_position_embeddings={self.max_position_embeddings} exceeds the longrope "
                f"original_max_position={s.original_max_position}: transformers switches to long_factor past "
                "it, which relax's static RoPE tables cannot follow (they use short_factor)"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it is a sliding layer: its ``layer_types`` entry, or, without
        ``layer_types``, whether the model has a ``sliding_window`` at all."""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(t == "sliding" for t in self.layer_types)

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether its MLP is a mixture of experts (``relax.models.moe.experts``): every layer
        not in ``dense_layers`` of a model with experts."""
        dense = set(self.dense_layers)  # a membership test per layer: linear in the layers
        return tuple(self.num_experts > 0 and i not in dense for i in range(self.num_layers))

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    def layer_indices(self, field: str) -> tuple[int, ...]:
        """The layers a ``LayerStack`` field is stacked on, in order: every layer for attention and
        norms, the dense layers for the dense MLP's weights, the sparse layers for the experts'
        (MOE_FIELDS)."""
        if field in MOE_FIELDS:
            return tuple(i for i, s in enumerate(self.sparse_layers) if s)
        if field in DENSE_MLP_FIELDS:
            return tuple(i for i, s in enumerate(self.sparse_layers) if not s)
        return tuple(range(self.num_layers))

    def layer_count(self, field: str) -> int:
        """The leading axis of a ``LayerStack`` field: how many layers it is on."""
        return len(self.layer_indices(field))

    @property
    def has_window(self) -> bool:
        """Whether some layer attends through a sliding window."""
        return self.sliding_window is not None and any(self.sliding_layers)

    @property
    def attn_scale(self) -> float | None:
        """The score scale ``query_pre_attn_scalar^-1/2``; None for the kernels' ``head_dim^-1/2``."""
        q = self.query_pre_attn_scalar
        return None if q is None else q**-0.5

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-layer parameter shapes (no ``[L]`` axis) of the ``LayerStack`` fields this config
        has, in one fixed order: the one definition init, the HF loader and ``num_params`` use."""
        D, F, hd = self.hidden_size, self.intermediate_size, self.head_dim
        qd, kd = self.num_heads * hd, self.num_kv_heads * hd
        s = dict(
            attn_norm=(D,),
            wq=(D, qd),
            wk=(D, kd),
            wv=(D, kd),
            wo=(qd, D),
            mlp_norm=(D,),
            w_gate=(D, F),
            w_up=(D, F),
            w_down=(F, D),
        )
        if self.qkv_bias:
            s.update(bq=(qd,), bk=(kd,), bv=(kd,))
        if self.o_bias:
            s.update(bo=(D,))
        if self.qk_norm:
            s.update(q_norm=(hd,), k_norm=(hd,))
        if self.mlp_bias:
            s.update(b_gate=(F,), b_up=(F,), b_down=(D,))
        if self.sandwich_norms:
            s.update(attn_out_norm=(D,), mlp_out_norm=(D,))
        if self.num_experts:
            E, Fe, Fs = self.num_experts, self.moe_intermediate_size, self.shared_expert_size
            s.update(
                router=(D, E), expert_gate=(E, D, Fe), expert_up=(E, D, Fe), expert_down=(E, Fe, D)
            )
            if Fs:
                s.update(
                    shared_gate=(D, Fs),
                    shared_up=(D, Fs),
                    shared_down=(Fs, D),
                    shared_router=(D, 1),
                )
        return {k: v for k, v in s.items() if self.layer_count(k)}

    def stacked_shapes(self) -> dict[str, tuple[int, ...]]:
        """``layer_shapes`` with each field's leading layer axis (``layer_count``)."""
        return {k: (self.layer_count(k), *v) for k, v in self.layer_shapes().items()}

    def num_params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        layers = sum(math.prod(shape) for shape in self.stacked_shapes().values())
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + layers + d + head

    def num_active_params(self) -> int:
        """Parameters a token uses: ``num_params`` less the experts it is not routed to."""
        unused = sum(
            math.prod(s) * (self.num_experts - self.num_experts_per_tok) // max(1, self.num_experts)
            for k, s in self.stacked_shapes().items()
            if k.startswith("expert_")
        )
        return self.num_params() - unused


def family_config(family: str, **fields) -> ModelConfig:
    """A :class:`ModelConfig` of ``family`` with that family's traits (its record's ``traits``,
    ``relax.models.config.families``); ``fields`` give the sizes and may override any trait."""
    return ModelConfig(family=family, **{**get_family(family).traits, **fields})


def small_config(**overrides) -> ModelConfig:
    """The benchmark's "small" CPU config (Llama architecture, 4 layers, vocab 4096)."""
    base = dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        head_dim=32,
        max_position_embeddings=2048,
    )
    base.update(overrides)
    return ModelConfig(**base)
