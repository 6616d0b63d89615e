"""The shape of a model family's record (``FamilyRecord``) and the layer fields it speaks of: which
``LayerStack`` fields are torch ``Linear`` weights (transposed between Hugging Face's layout and
relax's), which LoRA can adapt, and the fixed layer traits. The records themselves, one per
family, are ``relax.models.config.families``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

# The LayerStack fields that are torch ``Linear`` weights (stored [out, in] by Hugging Face,
# [in, out] by relax), in the order LoRA targets them.
LINEAR_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# The mixture-of-experts fields (``relax.models.config.model.MOE_FIELDS``), every one a torch ``Linear``
# weight too (per expert for ``expert_*``: HF [out, in] per expert, relax [E, in, out]).
MOE_LINEAR_FIELDS = (
    "router",
    "expert_gate",
    "expert_up",
    "expert_down",
    "shared_gate",
    "shared_up",
    "shared_down",
    "shared_router",
)
TRANSPOSED = LINEAR_FIELDS + MOE_LINEAR_FIELDS  # the fields transposed between the two layouts
# The linear weights LoRA can adapt: the seven above and a shared expert's (its MLP and its gate).
# Not the experts nor the router: transformers holds those as fused parameters, not ``Linear``
# modules, so PEFT does not adapt them either.
ADAPTABLE_FIELDS = LINEAR_FIELDS + ("shared_gate", "shared_up", "shared_down", "shared_router")
EXPERT = "{e}"  # in a tensor name: one tensor per expert, ``{e}`` its index
TRAIT_FIELDS = ("norm_weight", "sandwich_norms", "qk_norm", "activation", "scale_embeddings")


def _frozen(d: Mapping) -> Mapping:
    """A read-only copy of ``d`` (a record's tables cannot change after it is built)."""
    return MappingProxyType(dict(d))


@dataclasses.dataclass(frozen=True)
class FamilyRecord:
    """Everything family-specific about one Hugging Face model family.

    Names: ``model_type``; ``causal_lm`` / ``sequence_classification`` / ``token_classification``,
    the transformers architectures (None: transformers has no such class).

    Fixed traits (``relax.models.config.model.ModelConfig``'s fields of the same names; ``activation``
    is the default, the config's ``activation_field`` may name another).

    ``config.json`` spelling, each a choice ``relax.models.hf.config`` implements once:

    - ``biases``: ``"attention_bias"`` (one flag for q/k/v and o), ``"qkv"`` (q/k/v always
      biased, o never), ``"qkv_bias"`` (q/k/v as the ``qkv_bias`` flag says, o never: Qwen2-MoE),
      ``"none"``; ``mlp_bias``: whether the config has an ``mlp_bias`` flag.
    - ``window``: ``"none"``; ``"all"`` (``sliding_window`` on every layer, null: none);
      ``"qwen"`` (``use_sliding_window`` + ``max_window_layers`` / ``layer_types``, all or no
      layers); ``"flag"`` (``sliding_window`` on every layer when ``use_sliding_window``:
      Qwen3-MoE); ``"layer_types"`` (per-layer ``layer_types`` or ``sliding_window_pattern``).
    - ``qwen_sliding``: for a ``"qwen"`` window whose file has no ``layer_types``, the layers
      that slide: ``"from_max"`` (``i >= max_window_layers``: Qwen2, Qwen3) or
      ``"even_below_max"`` (even ``i < max_window_layers``: Qwen2-MoE).
    - ``local_rope``: the sliding layers have their own RoPE base (``rope_parameters`` per layer
      type, ``rope_local_base_freq``); ``query_pre_attn_scalar``: the config has that field.
    - ``rope_types``: the RoPE scaling kinds read and written (``"default"``: none);
      ``rope_aliases``: older names of them (``rope_type`` -> kind).
    - ``refused``: field -> (allowed values, the error's tail after ``field``, formatted with
      ``value``); ``hf_extra``: constant fields written on save.

    Mixture of experts (``relax.models.hf.moe``; ``ModelConfig``'s ``num_experts`` ... fields):

    - ``moe``: ``"none"`` (dense); ``"qwen"`` (layer ``i`` sparse unless in ``mlp_only_layers``
      or ``(i + 1) % decoder_sparse_step != 0``, and only with ``num_experts > 0``); ``"all"``
      (every layer sparse, ``num_experts >= 1``: Mixtral).
    - ``moe_names``: ``ModelConfig`` MoE field -> its ``config.json`` names (the first is
      written; the first present, not null, is read). A name that is also a ``ModelConfig``
      field (Mixtral's expert width ``intermediate_size``) must agree with it on save; a family
      that names ``shared_expert_size`` has a shared expert on every sparse layer (width >= 1).
    - ``moe_fixed``: the MoE fields the family fixes (absent from its config; checked on save).

    ``hf_defaults``: what transformers (5.23) gives the fields relax reads when a file leaves them
    out (None for ``num_key_value_heads`` / ``head_dim``: ``num_attention_heads`` / ``hidden // heads``);
    the MoE fields' are keyed by their ``ModelConfig`` names.

    ``weights``: LayerStack field -> tensor name under ``model.layers.{i}.``. Linear weights
    (``TRANSPOSED``) are transposed; fields sharing one name are one fused tensor, the fields
    concatenated along the output axis in this mapping's order (split on load, fused on save); a
    name with ``{e}`` (``EXPERT``) is one tensor per expert ``e`` (stacked on relax's ``[E]`` axis).
    A layer holds the dense MLP's tensors or the experts', as ``ModelConfig.sparse_layers`` says.

    ``notes``: how the family differs from Llama (documentation).
    """

    model_type: str
    causal_lm: str
    sequence_classification: str | None
    token_classification: str | None
    weights: Mapping[str, str]
    hf_defaults: Mapping[str, Any]
    norm_weight: str = "w"
    sandwich_norms: bool = False
    qk_norm: bool = False
    activation: str = "silu"
    scale_embeddings: bool = False
    activation_field: str = "hidden_act"
    biases: str = "none"
    mlp_bias: bool = False
    window: str = "none"
    local_rope: bool = False
    query_pre_attn_scalar: bool = False
    qwen_sliding: str = "from_max"
    moe: str = "none"
    moe_names: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    moe_fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rope_types: tuple[str, ...] = ("default", "linear", "llama3")
    rope_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    refused: Mapping[str, tuple[tuple, str]] = dataclasses.field(default_factory=dict)
    hf_extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    notes: str = ""

    def __post_init__(self):
        for name in (
            "weights",
            "hf_defaults",
            "rope_aliases",
            "refused",
            "hf_extra",
            "moe_names",
            "moe_fixed",
        ):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def traits(self) -> dict[str, Any]:
        """The fixed layer traits as ``ModelConfig`` keyword arguments."""
        return {k: getattr(self, k) for k in TRAIT_FIELDS}

    @property
    def architectures(self) -> dict[str, str]:
        """Architecture name -> its kind (``"causal"``, ``"sequence"``, ``"token"``)."""
        named = (
            ("causal", self.causal_lm),
            ("sequence", self.sequence_classification),
            ("token", self.token_classification),
        )
        return {arch: kind for kind, arch in named if arch is not None}

    def tensors(self) -> dict[str, tuple[str, ...]]:
        """Tensor name (under ``model.layers.{i}.``) -> the LayerStack fields it holds, in order."""
        out: dict[str, tuple[str, ...]] = {}
        for field, name in self.weights.items():
            out[name] = out.get(name, ()) + (field,)
        return out

    @property
    def lora_modules(self) -> dict[str, str]:
        """Adaptable weight field (``ADAPTABLE_FIELDS``) -> its Hugging Face module path under
        ``model.layers.{i}.`` (PEFT's); the family's fields only (Mixtral has no dense MLP, only
        Qwen2-MoE a shared expert)."""
        return {
            f: self.weights[f].removesuffix(".weight")
            for f in ADAPTABLE_FIELDS
            if f in self.weights
        }

    @property
    def fused_lora_modules(self) -> dict[str, tuple[str, ...]]:
        """The modules that hold several linear weights (one PEFT adapter for all of them)."""
        shared: dict[str, tuple[str, ...]] = {}
        for field, module in self.lora_modules.items():
            shared[module] = shared.get(module, ()) + (field,)
        return {m: fs for m, fs in shared.items() if len(fs) > 1}
