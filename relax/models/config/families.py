"""One record per supported model family: everything relax knows that is specific to it.

A :class:`FamilyRecord` holds a family's Hugging Face names (``model_type``, the causal-LM,
sequence- and token-classification architectures), its fixed layer traits (read by
``relax.models.config.model.family_config`` and checked on save), how its ``config.json`` spells the
fields that differ between families (biases, sliding windows, RoPE, mixture-of-experts fields;
interpreted by ``relax.models.hf.config`` and ``relax.models.hf.moe``), the defaults transformers
gives absent fields, and the tensor name of every layer parameter (``relax.models.hf.checkpoint``; several
parameters under one name are one fused tensor, a name with ``{e}`` is one tensor per expert).
The LoRA/PEFT module of each adapted weight is derived from the tensor names.

``FAMILIES`` is the registry, keyed by ``model_type``. Adding a family is adding its record
here (and its tests); nothing else names families.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = [
    "ADAPTABLE_FIELDS",
    "BY_ARCHITECTURE",
    "FAMILIES",
    "LINEAR_FIELDS",
    "MOE_LINEAR_FIELDS",
    "TRANSPOSED",
    "FamilyRecord",
    "get_family",
]

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


# ----------------------------------------------------------------------------- records

_LLAMA_WEIGHTS = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "wk": "self_attn.k_proj.weight",
    "bk": "self_attn.k_proj.bias",
    "wv": "self_attn.v_proj.weight",
    "bv": "self_attn.v_proj.bias",
    "wo": "self_attn.o_proj.weight",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "b_gate": "mlp.gate_proj.bias",
    "w_up": "mlp.up_proj.weight",
    "b_up": "mlp.up_proj.bias",
    "w_down": "mlp.down_proj.weight",
    "b_down": "mlp.down_proj.bias",
}

LLAMA = FamilyRecord(
    "llama",
    "LlamaForCausalLM",
    "LlamaForSequenceClassification",
    "LlamaForTokenClassification",
    weights=_LLAMA_WEIGHTS,
    biases="attention_bias",
    mlp_bias=True,
    hf_extra={"pretraining_tp": 1},
    hf_defaults=dict(
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    notes="the reference: pre-norm RMSNorm (w), SwiGLU, RoPE (default / linear / llama3 scaling)",
)

MISTRAL = FamilyRecord(
    "mistral",
    "MistralForCausalLM",
    "MistralForSequenceClassification",
    "MistralForTokenClassification",
    weights=_LLAMA_WEIGHTS,
    window="all",
    hf_defaults=dict(
        num_key_value_heads=8,
        head_dim=None,
        max_position_embeddings=4096 * 32,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=4096,
    ),
    notes="Llama without biases, with a sliding window on every layer (default 4096)",
)

QWEN2 = FamilyRecord(
    "qwen2",
    "Qwen2ForCausalLM",
    "Qwen2ForSequenceClassification",
    "Qwen2ForTokenClassification",
    weights=_LLAMA_WEIGHTS,
    biases="qkv",
    window="qwen",
    hf_defaults=dict(
        num_key_value_heads=32,
        head_dim=None,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
    ),
    notes="Llama with q/k/v biases (no o bias); optional sliding window (all layers or none)",
)

QWEN3 = FamilyRecord(
    "qwen3",
    "Qwen3ForCausalLM",
    "Qwen3ForSequenceClassification",
    "Qwen3ForTokenClassification",
    weights=_LLAMA_WEIGHTS,
    qk_norm=True,
    biases="attention_bias",
    window="qwen",
    hf_defaults=dict(
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
    ),
    notes="Llama with per-head q/k RMSNorm before RoPE; optional sliding window as Qwen2's",
)

GEMMA3_TEXT = FamilyRecord(
    "gemma3_text",
    "Gemma3ForCausalLM",
    "Gemma3TextForSequenceClassification",
    None,
    weights={
        **_LLAMA_WEIGHTS,
        "attn_out_norm": "post_attention_layernorm.weight",
        "mlp_norm": "pre_feedforward_layernorm.weight",
        "mlp_out_norm": "post_feedforward_layernorm.weight",
    },
    norm_weight="1+w",
    sandwich_norms=True,
    qk_norm=True,
    activation="gelu_tanh",
    scale_embeddings=True,
    activation_field="hidden_activation",
    biases="attention_bias",
    window="layer_types",
    local_rope=True,
    query_pre_attn_scalar=True,
    refused={
        "attn_logit_softcapping": (
            (None,),
            "= {value!r}: logit softcapping is not supported (Gemma 3 has none: null)",
        ),
        "final_logit_softcapping": (
            (None,),
            "= {value!r}: logit softcapping is not supported (Gemma 3 has none: null)",
        ),
        "use_bidirectional_attention": (
            (None, False),
            "= true is not supported (causal attention only)",
        ),
    },
    hf_extra=dict(
        attn_logit_softcapping=None, final_logit_softcapping=None, use_bidirectional_attention=False
    ),
    hf_defaults=dict(
        num_key_value_heads=4,
        head_dim=256,
        max_position_embeddings=131072,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=True,
        sliding_window=4096,
        query_pre_attn_scalar=256,
        rope_theta=1_000_000.0,
        rope_local_theta=10_000.0,
    ),
    notes="(1+w) norms, sandwich norms, q/k norms, GeGLU (tanh), embeddings times sqrt(D), scores "
    "/ sqrt(query_pre_attn_scalar), sliding and full layers with their own RoPE bases",
)

PHI3 = FamilyRecord(
    "phi3",
    "Phi3ForCausalLM",
    "Phi3ForSequenceClassification",
    "Phi3ForTokenClassification",
    weights={
        "attn_norm": "input_layernorm.weight",
        "wq": "self_attn.qkv_proj.weight",
        "wk": "self_attn.qkv_proj.weight",  # fused: q, k, v rows
        "wv": "self_attn.qkv_proj.weight",
        "wo": "self_attn.o_proj.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "w_gate": "mlp.gate_up_proj.weight",
        "w_up": "mlp.gate_up_proj.weight",  # fused: gate, then up rows
        "w_down": "mlp.down_proj.weight",
    },
    window="all",
    rope_types=("default", "longrope"),
    rope_aliases={"su": "longrope", "yarn": "longrope"},
    hf_defaults=dict(
        num_key_value_heads=None,
        head_dim=None,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=32000,
        pad_token_id=32000,
        sliding_window=None,
    ),
    notes="Llama's layer (RMSNorm w, SwiGLU, no biases) with q/k/v fused in one qkv_proj and gate/up "
    "in one gate_up_proj; optional sliding window on every layer; RoPE default or LongRoPE "
    "(short/long factor lists, cos/sin times an attention factor); residual dropout (training "
    "only in transformers, never in relax)",
)

# ----------------------------------------------------------------------------- mixtures of experts

_EXPERTS = {
    "router": "mlp.gate.weight",
    "expert_gate": "mlp.experts.{e}.gate_proj.weight",
    "expert_up": "mlp.experts.{e}.up_proj.weight",
    "expert_down": "mlp.experts.{e}.down_proj.weight",
}
_ROUTER_NAMES = dict(
    num_experts_per_tok=("num_experts_per_tok",),
    output_router_logits=("output_router_logits",),
    router_aux_loss_coef=("router_aux_loss_coef",),
    router_z_loss_coef=("router_z_loss_coef",),
)
_QWEN_MOE_NAMES = dict(
    _ROUTER_NAMES,
    moe_intermediate_size=("moe_intermediate_size",),
    norm_topk_prob=("norm_topk_prob",),
)

QWEN3_MOE = FamilyRecord(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeForSequenceClassification",
    "Qwen3MoeForTokenClassification",
    weights={**_LLAMA_WEIGHTS, **_EXPERTS},
    qk_norm=True,
    biases="attention_bias",
    window="flag",
    moe="qwen",
    moe_names=dict(_QWEN_MOE_NAMES, num_experts=("num_local_experts", "num_experts")),
    moe_fixed=dict(shared_expert_size=0),
    hf_defaults=dict(
        num_key_value_heads=4,
        head_dim=None,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        sliding_window=4096,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    notes="Qwen3's attention (q/k norms); the MLP of every layer not in mlp_only_layers (and on the "
    "decoder_sparse_step) is a softmax top-k mixture of SwiGLU experts (top-k renormalised with "
    "norm_topk_prob); a sliding window, when use_sliding_window, on every layer; no head_dim default "
    "(hidden / heads)",
)

MIXTRAL = FamilyRecord(
    "mixtral",
    "MixtralForCausalLM",
    "MixtralForSequenceClassification",
    "MixtralForTokenClassification",
    weights={k: v for k, v in _LLAMA_WEIGHTS.items() if not k.startswith(("w_", "b_"))}
    | {
        "router": "block_sparse_moe.gate.weight",
        "expert_gate": "block_sparse_moe.experts.{e}.w1.weight",
        "expert_up": "block_sparse_moe.experts.{e}.w3.weight",
        "expert_down": "block_sparse_moe.experts.{e}.w2.weight",
    },
    window="all",
    moe="all",
    moe_names=dict(
        _ROUTER_NAMES,
        num_experts=("num_local_experts",),
        moe_intermediate_size=("intermediate_size",),
    ),
    moe_fixed=dict(norm_topk_prob=True, shared_expert_size=0),
    hf_extra={"router_jitter_noise": 0.0},
    hf_defaults=dict(
        num_key_value_heads=8,
        head_dim=None,
        max_position_embeddings=4096 * 32,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=None,
        num_experts=8,
        num_experts_per_tok=2,
    ),
    notes="Mistral's attention (no biases, optional window on every layer); every MLP a mixture of "
    "SwiGLU experts of width intermediate_size (w1 gate, w3 up, w2 down), top-k always "
    "renormalised; router_jitter_noise is training-only in transformers: any value accepted, "
    "never applied, written as 0",
)

QWEN2_MOE = FamilyRecord(
    "qwen2_moe",
    "Qwen2MoeForCausalLM",
    "Qwen2MoeForSequenceClassification",
    "Qwen2MoeForTokenClassification",
    weights={
        **_LLAMA_WEIGHTS,
        **_EXPERTS,
        "shared_gate": "mlp.shared_expert.gate_proj.weight",
        "shared_up": "mlp.shared_expert.up_proj.weight",
        "shared_down": "mlp.shared_expert.down_proj.weight",
        "shared_router": "mlp.shared_expert_gate.weight",
    },
    biases="qkv_bias",
    window="qwen",
    qwen_sliding="even_below_max",
    moe="qwen",
    moe_names=dict(
        _QWEN_MOE_NAMES,
        num_experts=("num_experts",),
        shared_expert_size=("shared_expert_intermediate_size",),
    ),
    hf_defaults=dict(
        num_key_value_heads=16,
        head_dim=None,
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        qkv_bias=True,
        num_experts=60,
        num_experts_per_tok=4,
        moe_intermediate_size=1408,
        shared_expert_size=5632,
    ),
    notes="Qwen2's attention (q/k/v biases, as the qkv_bias flag says); sparse layers as Qwen3-MoE's, "
    "plus a shared SwiGLU expert on every token, scaled by sigmoid(x shared_expert_gate)",
)

FAMILIES: dict[str, FamilyRecord] = {
    r.model_type: r
    for r in (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA3_TEXT, PHI3, QWEN3_MOE, MIXTRAL, QWEN2_MOE)
}
"""The supported families by ``model_type`` (``ModelConfig.family``)."""

BY_ARCHITECTURE: dict[str, tuple[str, str]] = {
    arch: (kind, name) for name, rec in FAMILIES.items() for arch, kind in rec.architectures.items()
}
"""Every architecture name of every family -> (its kind, the family's ``model_type``)."""


def get_family(name: str) -> FamilyRecord:
    """The record of family ``name``; ``ValueError`` listing the valid names otherwise."""
    if name not in FAMILIES:
        raise ValueError(f"family={name!r}; valid: {tuple(FAMILIES)}")
    return FAMILIES[name]
