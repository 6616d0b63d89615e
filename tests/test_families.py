"""Every family record (``relax.models.config.families``) is complete: its choices are ones the readers
implement, its weight map covers every parameter a config of the family can have, and a config
of each variant its record claims (biases, windows, every RoPE kind, experts with dense layers or
without experts) round-trips through
``config.json`` and through a checkpoint; against transformers, its architecture names exist and
transformers reads the written config as relax does."""

import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import assert_bit_exact, random_model

from relax.models import ModelConfig, RopeScaling, family_config
from relax.models.config.families import BY_ARCHITECTURE, FAMILIES
from relax.models.config.family_record import ADAPTABLE_FIELDS, LINEAR_FIELDS, MOE_LINEAR_FIELDS
from relax.models.config.model import MOE_FIELDS
from relax.models.decoder.transformer import LayerStack
from relax.models.hf.checkpoint import load_pretrained, save_pretrained
from relax.models.hf.config import config_from_hf, config_to_hf
from relax.models.layers.lora import TARGETS

SIZES = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=(2, 3),
)
# one example per RoPE scaling kind a record may claim (a new kind needs one here)
SCALINGS = {
    "linear": RopeScaling("linear", 2.0),
    "llama3": RopeScaling("llama3", 8.0, 1.0, 4.0, 32),
    "longrope": RopeScaling(
        "longrope",
        2.0,
        original_max_position=64,
        short_factor=(1.0, 1.5, 2.0, 2.5),
        long_factor=(3.0, 4.0, 5.0, 6.0),
        attention_factor=math.sqrt(1 + math.log(2) / math.log(64)),
    ),
}
# a mixture of experts with every setting away from transformers' defaults (a record's moe_fixed wins)
EXPERTS = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    output_router_logits=True,
    router_aux_loss_coef=0.02,
    router_z_loss_coef=0.001,
)
MOE_CONFIG_FIELDS = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_size",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_z_loss_coef",
)


def experts(rec) -> dict:
    """``EXPERTS`` as family ``rec`` can have them: its fixed fields, Mixtral's expert width
    ``intermediate_size``, Qwen's first layer dense, Qwen2-MoE's shared expert."""
    e = {**EXPERTS, **rec.moe_fixed}
    if rec.moe_names["moe_intermediate_size"] == ("intermediate_size",):
        e["moe_intermediate_size"] = SIZES["intermediate_size"]
    if rec.moe == "qwen":
        e["dense_layers"] = (0,)
    if "shared_expert_size" in rec.moe_names:
        e["shared_expert_size"] = 24
    return e


def variants(name: str) -> dict[str, ModelConfig]:
    """Configs of family ``name`` covering every spelling its record claims."""
    rec, base = FAMILIES[name], dict(SIZES)
    if rec.window == "layer_types":
        base.update(layer_types=("sliding", "full", "sliding"), sliding_window=4)
    if rec.local_rope:
        base.update(rope_local_theta=100.0)
    if rec.query_pre_attn_scalar:
        base.update(query_pre_attn_scalar=12.0)
    if rec.biases in ("qkv", "qkv_bias"):
        base.update(qkv_bias=True)
    dense = dict(base)
    if rec.moe != "none":
        base.update(experts(rec))
    out = {"plain": family_config(name, **base)}
    if rec.biases == "attention_bias" or rec.mlp_bias:
        out["biases"] = family_config(
            name,
            **base,
            qkv_bias=rec.biases != "none",
            o_bias=rec.biases == "attention_bias",
            mlp_bias=rec.mlp_bias,
            tie_word_embeddings=True,
        )
    if rec.biases == "qkv_bias":
        out["no_biases"] = family_config(
            name, **{**base, "qkv_bias": False}, tie_word_embeddings=True
        )
    if rec.moe == "qwen":  # no experts: every layer dense
        out["dense"] = family_config(name, **dense)
    if rec.window in ("all", "qwen", "flag"):
        out["window"] = family_config(name, **base, sliding_window=4)
    for kind in rec.rope_types:
        if kind != "default":
            out[kind] = family_config(name, **base, rope_scaling=SCALINGS[kind], rope_theta=5e4)
    return out


CASES = [(name, v) for name in sorted(FAMILIES) for v in variants(name)]


def test_records_are_well_formed():
    for name, rec in FAMILIES.items():
        assert rec.model_type == name and ModelConfig(**SIZES, family=name).family == name
        assert rec.biases in ("attention_bias", "qkv", "qkv_bias", "none")
        assert rec.window in ("none", "all", "qwen", "flag", "layer_types")
        assert rec.qwen_sliding in ("from_max", "even_below_max") and rec.moe in (
            "none",
            "qwen",
            "all",
        )
        assert rec.biases != "qkv_bias" or "qkv_bias" in rec.hf_defaults  # the flag's default
        assert rec.window not in ("flag", "layer_types") or "sliding_window" in rec.hf_defaults
        if (
            rec.moe != "none"
        ):  # the names of every MoE field it does not fix, defaults for the optional ones
            assert set(rec.moe_names) | set(rec.moe_fixed) == set(MOE_CONFIG_FIELDS), name
            assert {f for f in rec.weights if f in MOE_FIELDS} >= {
                "router",
                "expert_gate",
                "expert_up",
                "expert_down",
            }
        else:
            assert (
                not rec.moe_names and not rec.moe_fixed and not set(rec.weights) & set(MOE_FIELDS)
            ), name
        assert "default" in rec.rope_types and set(rec.rope_types) <= {"default", *SCALINGS}
        assert set(rec.rope_aliases.values()) <= set(rec.rope_types)
        assert rec.causal_lm.endswith("ForCausalLM") and BY_ARCHITECTURE[rec.causal_lm] == (
            "causal",
            name,
        )
        for kind, arch in (
            ("sequence", rec.sequence_classification),
            ("token", rec.token_classification),
        ):
            assert arch is None or BY_ARCHITECTURE[arch] == (kind, name)
        assert set(rec.traits) == {
            "norm_weight",
            "sandwich_norms",
            "qk_norm",
            "activation",
            "scale_embeddings",
        }
        assert rec.notes, f"{name}: say how it differs from Llama"
    # the LoRA targets are the seven linear weights and a shared expert's four, and every family
    # names a module for each it has (not the dense MLP where every layer is a mixture of experts),
    # whose last part is the target name (a fused module excepted: Phi-3's qkv_proj)
    assert {f for fs in TARGETS.values() for f in fs} == set(
        ADAPTABLE_FIELDS
    ) and MOE_LINEAR_FIELDS == MOE_FIELDS
    assert set(LINEAR_FIELDS) < set(ADAPTABLE_FIELDS) and not set(ADAPTABLE_FIELDS) - set(
        LINEAR_FIELDS
    ) - set(MOE_FIELDS)
    for rec in FAMILIES.values():
        always_sparse = {"w_gate", "w_up", "w_down"} if rec.moe == "all" else set()
        shared = {f for f in ADAPTABLE_FIELDS if f.startswith("shared_")} & set(rec.weights)
        assert set(rec.lora_modules) == set(LINEAR_FIELDS) - always_sparse | shared, rec.model_type
        for field, module in rec.lora_modules.items():
            if module not in rec.fused_lora_modules:
                assert field in TARGETS[module.rsplit(".", 1)[-1]], (rec.model_type, field)
    assert set(FAMILIES["qwen2_moe"].lora_modules) == set(ADAPTABLE_FIELDS)


@pytest.mark.parametrize("name, variant", CASES)
def test_weight_map_covers_every_parameter(name, variant):
    cfg, rec = variants(name)[variant], FAMILIES[name]
    shapes = cfg.layer_shapes()
    assert set(shapes) <= set(rec.weights) <= set(LayerStack.__dataclass_fields__) - {"lora"}
    for tensor, fields in rec.tensors().items():
        # a fused tensor holds linear weights only, or biases/norms only, of one input size
        assert len({f in LINEAR_FIELDS for f in fields}) == 1, tensor
        present = [shapes[f] for f in fields if f in shapes]
        assert len({s[:-1] for s in present}) <= 1, tensor
        assert tensor.endswith(".weight") or tensor.endswith(".bias")


@pytest.mark.parametrize("name, variant", CASES)
def test_config_and_checkpoint_round_trip(name, variant, tmp_path):
    cfg = variants(name)[variant]
    d = json.loads(json.dumps(config_to_hf(cfg, jnp.float32)))
    assert d["architectures"] == [FAMILIES[name].causal_lm] and d["model_type"] == name
    assert config_from_hf(d, source="config.json") == cfg
    model = random_model(cfg)
    save_pretrained(model, tmp_path)
    back = load_pretrained(tmp_path)
    assert_bit_exact(model, back)
    ids = jnp.asarray(np.arange(10).reshape(2, 5) % cfg.vocab_size, jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(ids)), np.asarray(back(ids)))


@pytest.mark.parity
@pytest.mark.parametrize("name, variant", CASES)
def test_transformers_reads_the_written_config_as_relax_does(name, variant):
    transformers = pytest.importorskip("transformers")
    cfg = variants(name)[variant]
    d = config_to_hf(cfg, jnp.float32)
    for arch in FAMILIES[name].architectures:
        assert hasattr(transformers, arch), arch
    theirs = transformers.AutoConfig.for_model(d.pop("model_type"), **d).to_dict()
    assert config_from_hf(theirs, source="to_dict") == cfg
