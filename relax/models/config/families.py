"""One record per supported model family: everything relax knows that is specific to it.

A ``FamilyRecord`` (its fields: ``relax.models.config.family_record``) holds a family's Hugging
Face names (``model_type``, the causal-LM, sequence- and token-classification architectures), its
fixed layer traits (read by ``relax.models.config.model.family_config`` and checked on save), how
its ``config.json`` spells the fields that differ between families (biases, sliding windows, RoPE,
mixture-of-experts fields; interpreted by ``relax.models.hf.config`` and ``relax.models.hf.moe``),
the defaults transformers gives absent fields, and the tensor name of every layer parameter
(``relax.models.hf.checkpoint``; several parameters under one name are one fused tensor, a name
with ``{e}`` is one tensor per expert). The LoRA/PEFT module of each adapted weight is derived
from the tensor names.

``FAMILIES`` is the registry, keyed by ``model_type``. Adding a family is adding its record
here (and its tests); nothing else names families.
"""

from __future__ import annotations

from relax.models.config.family_record import FamilyRecord

__all__ = ["BY_ARCHITECTURE", "FAMILIES", "get_family"]

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
