"""relax <-> Hugging Face transformers parity: the same checkpoint gives the same logits.

Tiny random models of every supported family are built with transformers, saved as
safetensors, loaded by relax (and the reverse), and their float32 logits compared, also on a
left-padded batch. Norm weights and biases are randomised: unit norms and zero biases hide bugs.
The Gemma 3 cases mix sliding and full layers (windows shorter than the 12-token batch, local and
global RoPE bases, linear scaling on the global one) and scale scores by a
``query_pre_attn_scalar`` other than ``head_dim``. The Phi-3 cases store q/k/v and gate/up fused
(split on load, fused on save) and use LongRoPE (per-frequency short factors, cos/sin scaled by
the attention factor).
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import random_model  # noqa: E402

from relax.models import ModelConfig, RopeScaling, family_config  # noqa: E402
from relax.models.config.families import FAMILIES  # noqa: E402
from relax.models.hf.checkpoint import (  # noqa: E402
    HFFormatError,
    config_from_hf,
    load_pretrained,
    save_pretrained,
)

pytestmark = pytest.mark.parity

ATOL = 2e-4
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}
SHORT = [1.0, 1.3, 1.1, 2.0, 1.7, 3.0, 2.2, 4.0]  # head_dim 16: 8 LongRoPE factors each
LONG = [2.0, 3.5, 4.0, 6.0, 5.0, 9.0, 8.0, 12.0]
LONGROPE = {
    "rope_type": "longrope",
    "short_factor": SHORT,
    "long_factor": LONG,
    "rope_theta": 10000.0,
}

# name: (config class, overrides, max_shard_size for HF's save or None)
CASES = {
    "llama2_mha_untied": ("LlamaConfig", dict(num_key_value_heads=4), None),
    "llama_bias_gqa_tied": (
        "LlamaConfig",
        dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
        None,
    ),
    "llama3_gqa_tied": (
        "LlamaConfig",
        dict(num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)),
        None,
    ),
    "llama_linear_rope": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        None,
    ),
    "mistral_gqa_window_sharded": (
        "MistralConfig",
        dict(num_key_value_heads=1, sliding_window=5),
        "40KB",
    ),
    "qwen2_gqa_tied": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True), None),
    "qwen2_all_layers_window": (
        "Qwen2Config",
        dict(num_key_value_heads=2, use_sliding_window=True, sliding_window=4, max_window_layers=0),
        None,
    ),
    "qwen3_gqa_head_dim": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=24), None),
    "qwen3_mha_bias_tied": (
        "Qwen3Config",
        dict(num_key_value_heads=4, head_dim=16, attention_bias=True, tie_word_embeddings=True),
        "30KB",
    ),
    # layers sliding, sliding, full, sliding (sliding_window_pattern 3)
    "gemma3_pattern_tied": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            sliding_window_pattern=3,
            query_pre_attn_scalar=24,
        ),
        None,
    ),
    "gemma3_layer_types_linear_rope_bias_untied": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=5,
            query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            attention_bias=True,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            rope_local_base_freq=100.0,
        ),
        "40KB",
    ),
    # Phi-3: fused qkv_proj / gate_up_proj; transformers' Phi3Config has pad/eos 32000 by default
    "phi3_gqa_window_sharded": (
        "Phi3Config",
        dict(num_key_value_heads=2, sliding_window=5, pad_token_id=0, eos_token_id=2),
        "40KB",
    ),
    # LongRoPE within the original length (128 = max): short factors, attention factor from the explicit factor 4
    "phi3_longrope_mha_tied": (
        "Phi3Config",
        dict(
            num_key_value_heads=4,
            tie_word_embeddings=True,
            pad_token_id=0,
            original_max_position_embeddings=128,
            rope_parameters={**LONGROPE, "factor": 4.0},
        ),
        None,
    ),
}


def _randomise(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    identity = (
        0.0 if model.config.model_type.startswith("gemma") else 1.0
    )  # Gemma's norms scale by 1 + w
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(identity + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model.eval()


def _hf_model(case):
    cls_name, overrides, _ = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides})
    torch.manual_seed(0)
    return _randomise(transformers.AutoModelForCausalLM.from_config(cfg))


def _batches(vocab):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (2, 12), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[1, :1] = 0
    return ids, mask


def _hf_logits(model, ids, mask=None):
    kw = {}
    if mask is not None:
        kw = dict(
            attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0)),
        )
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids), **kw).logits.float().numpy()


@jax.jit
def _relax_forward(model, ids, mask):
    return model(ids, mask)


def _relax_logits(model, ids, mask=None):
    mask = np.ones_like(ids) if mask is None else mask
    return np.asarray(
        _relax_forward(model, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32))
    )


def _assert_same_logits(hf_model, relax_model, vocab):
    ids, mask = _batches(vocab)
    np.testing.assert_allclose(
        _relax_logits(relax_model, ids), _hf_logits(hf_model, ids), atol=ATOL, rtol=0
    )
    valid = mask.astype(bool)
    got, want = _relax_logits(relax_model, ids, mask), _hf_logits(hf_model, ids, mask)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_checkpoint_loads_with_same_logits(case, tmp_path):
    hf = _hf_model(case)
    shard = CASES[case][2]
    kw = {} if shard is None else dict(max_shard_size=shard)
    hf.save_pretrained(tmp_path, safe_serialization=True, **kw)
    if shard is not None:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_pretrained(tmp_path)
    assert model.config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head is None) == hf.config.tie_word_embeddings
    _assert_same_logits(hf, model, hf.config.vocab_size)
    # transformers 5.x's own config.json (rope_parameters, dtype) parses to the same config.
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    assert config_from_hf(hf.config.to_dict(), source="to_dict") == model.config


def _gemma_config(o) -> ModelConfig:
    n = o["num_hidden_layers"]
    types = o.get("layer_types") or [
        "sliding_attention" if (i + 1) % o["sliding_window_pattern"] else "full_attention"
        for i in range(n)
    ]
    rs, bias = o.get("rope_scaling"), o.get("attention_bias", False)
    return family_config(
        "gemma3_text",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=n,
        num_heads=4,
        num_kv_heads=o["num_key_value_heads"],
        head_dim=o["head_dim"],
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        rope_scaling=None if rs is None else RopeScaling("linear", rs["factor"]),
        rope_local_theta=o.get("rope_local_base_freq", 1e4),
        tie_word_embeddings=o.get("tie_word_embeddings", True),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=o["sliding_window"],
        layer_types=tuple(t.split("_")[0] for t in types),
        query_pre_attn_scalar=float(o["query_pre_attn_scalar"]),
        bos_token_id=1,
        eos_token_id=(2, 3),
    )


def _phi3_config(o) -> ModelConfig:
    rope, scaling = o.get("rope_parameters"), None
    if rope is not None:
        scaling = RopeScaling(
            "longrope",
            rope["factor"],
            original_max_position=o["original_max_position_embeddings"],
            short_factor=tuple(rope["short_factor"]),
            long_factor=tuple(rope["long_factor"]),
            attention_factor=math.sqrt(1 + math.log(rope["factor"]) / math.log(128)),
        )
    return family_config(
        "phi3",
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=o["num_key_value_heads"],
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_scaling=scaling,
        tie_word_embeddings=o.get("tie_word_embeddings", False),
        sliding_window=o.get("sliding_window"),
        bos_token_id=1,
        eos_token_id=(2, 3),
        pad_token_id=0,
    )


def _relax_model(case):
    cls_name, o, _ = CASES[case]
    if cls_name == "Gemma3TextConfig":
        return random_model(_gemma_config(o), 0)
    if cls_name == "Phi3Config":
        return random_model(_phi3_config(o), 0)
    family = {
        "LlamaConfig": "llama",
        "MistralConfig": "mistral",
        "Qwen2Config": "qwen2",
        "Qwen3Config": "qwen3",
    }[cls_name]
    rope = o.get("rope_parameters")
    scaling = None
    if rope is not None and rope["rope_type"] == "llama3":
        scaling = RopeScaling(
            "llama3",
            rope["factor"],
            rope["low_freq_factor"],
            rope["high_freq_factor"],
            rope["original_max_position_embeddings"],
        )
    elif rope is not None:
        scaling = RopeScaling("linear", rope["factor"])
    bias = o.get("attention_bias", False)
    window = o.get("sliding_window") if family == "mistral" or o.get("use_sliding_window") else None
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=o["num_key_value_heads"],
        head_dim=o.get("head_dim", 16),
        family=family,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=rope["rope_theta"] if rope else 10000.0,
        rope_scaling=scaling,
        tie_word_embeddings=o.get("tie_word_embeddings", False),
        qkv_bias=bias or family == "qwen2",
        o_bias=bias,
        mlp_bias=o.get("mlp_bias", False),
        qk_norm=family == "qwen3",
        sliding_window=window,
        bos_token_id=1,
        eos_token_id=(2, 3),
    )
    return random_model(cfg, 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_relax_checkpoint_loads_in_transformers(case, tmp_path):
    model = _relax_model(case)
    shard = CASES[case][2]
    save_pretrained(model, tmp_path, max_shard_bytes=None if shard is None else 40_000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert (
        type(hf).__name__ == json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    )
    assert config_from_hf(hf.config.to_dict(), source="to_dict") == model.config
    assert hf.generation_config.eos_token_id == [2, 3]
    _assert_same_logits(hf, model, model.config.vocab_size)


@pytest.mark.parametrize("case", ["llama3_gqa_tied", "qwen3_gqa_head_dim"])
def test_bfloat16_checkpoint_both_ways(case, tmp_path):
    """relax writes bfloat16 safetensors that torch reads bit for bit, and reads torch's."""
    model = _relax_model(case)
    save_pretrained(model, tmp_path / "relax", dtype=jnp.bfloat16)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "relax", dtype=torch.bfloat16)
    back = load_pretrained(tmp_path / "relax")
    assert back.embed.dtype == jnp.bfloat16
    emb = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(emb, np.asarray(back.embed, np.float32))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    again = load_pretrained(tmp_path / "hf")
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(again)):
        assert a.dtype == b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    _assert_same_logits(hf.float(), back, model.config.vocab_size)


@pytest.mark.parametrize(
    "case, scaling_key", [("llama3_gqa_tied", "rope_type"), ("llama_linear_rope", "type")]
)
def test_transformers_4_layout_means_the_same_to_both(case, scaling_key, tmp_path):
    """A 4.x config.json (top-level rope_theta, rope_scaling with 'rope_type' or the old 'type',
    torch_dtype) is read by transformers 5 and by relax as the same model."""
    _hf_model(case).save_pretrained(tmp_path, safe_serialization=True)
    d = json.loads((tmp_path / "config.json").read_text())
    params = d.pop("rope_parameters")
    d["rope_theta"] = params.pop("rope_theta")
    params[scaling_key] = params.pop("rope_type")
    d["rope_scaling"] = params
    d["torch_dtype"] = d.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(d))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = load_pretrained(tmp_path)
    assert model.config.rope_scaling is not None
    _assert_same_logits(hf, model, model.config.vocab_size)


def test_phi3_longrope_past_its_original_length(tmp_path):
    """A LongRoPE context longer than the original length (128 > 32, as Phi-3-mini-128k's 131072 >
    4096): transformers uses the short factors up to 32 tokens and the long ones past it. relax
    refuses the file, and capped at 32 positions gives transformers' logits, with the attention
    factor of the file's ratio (sqrt(1 + ln 4 / ln 32)); a save keeps that model for transformers."""
    cfg = transformers.Phi3Config(
        **{
            **BASE,
            "num_key_value_heads": 2,
            "pad_token_id": 0,
            "original_max_position_embeddings": 32,
            "rope_parameters": dict(LONGROPE),
        }
    )
    torch.manual_seed(0)
    hf = _randomise(transformers.AutoModelForCausalLM.from_config(cfg))
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    with pytest.raises(
        HFFormatError,
        match=r"'max_position_embeddings' = 128 exceeds original_max_position_embeddings "
        r"= 32 with longrope.*max_positions=32",
    ):
        load_pretrained(tmp_path / "hf")
    model = load_pretrained(tmp_path / "hf", max_positions=32)
    assert model.config.max_position_embeddings == 32
    assert model.config.rope_scaling.attention_factor == pytest.approx(
        math.sqrt(1 + math.log(4) / math.log(32))
    )
    _assert_same_logits(hf, model, 128)
    ids, _ = _batches(128)
    plain = dataclasses.replace(model, config=dataclasses.replace(model.config, rope_scaling=None))
    assert not np.allclose(
        _relax_logits(plain, ids), _hf_logits(hf, ids), atol=1e-2
    )  # the scaling matters
    long_ids = np.random.default_rng(1).integers(
        0, 128, (1, 40)
    )  # past 32: transformers' long factors
    assert not np.allclose(_relax_logits(model, long_ids), _hf_logits(hf, long_ids), atol=1e-2)
    save_pretrained(model, tmp_path / "relax")
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "relax", dtype=torch.float32
    ).eval()
    _assert_same_logits(back, model, 128)
    assert config_from_hf(back.config.to_dict(), source="to_dict") == model.config


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_defaults_for_absent_fields_match_transformers(model_type):
    # 32 heads: Qwen's absent num_key_value_heads is 32, Mistral's 8
    minimal = dict(
        model_type=model_type,
        vocab_size=100,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=32,
    )
    ours = config_from_hf(minimal, source="config.json")
    theirs = transformers.AutoConfig.for_model(**minimal).to_dict()
    assert config_from_hf(theirs, source="to_dict") == ours
