"""Hugging Face directories without torch: config parsing, save/load round trips, every error path."""

import dataclasses
import json
import math
import os
import re
import struct
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from relax.models import ModelConfig, RopeScaling, cast, init
from relax.models.config.families import get_family
from relax.models.hf import checkpoint as hf_mod
from relax.models.hf.checkpoint import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    save_pretrained,
)

SHORT, LONG = (
    tuple(1.0 + 0.1 * i for i in range(8)),
    tuple(2.0 + 0.3 * i for i in range(8)),
)  # head_dim 16: 8 each
# Phi-3 LongRoPE with an explicit factor 4 (transformers' attention factor sqrt(1 + ln 4 / ln 128))
LONGROPE = RopeScaling(
    "longrope",
    4.0,
    original_max_position=128,
    short_factor=SHORT,
    long_factor=LONG,
    attention_factor=math.sqrt(1 + math.log(4.0) / math.log(128)),
)
TINY = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)
FAMILIES = {
    "llama2_mha_untied": dict(family="llama", num_kv_heads=4),
    "llama3_gqa_tied": dict(
        family="llama",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
        eos_token_id=(2, 5),
    ),
    "llama_bias_linear_rope": dict(
        family="llama",
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        rope_scaling=RopeScaling("linear", 2.0),
    ),
    "mistral_gqa_window": dict(family="mistral", num_kv_heads=1, sliding_window=5),
    "qwen2_gqa_tied": dict(
        family="qwen2", qkv_bias=True, tie_word_embeddings=True, bos_token_id=None
    ),
    "qwen2_mha_window": dict(family="qwen2", num_kv_heads=4, qkv_bias=True, sliding_window=4),
    "qwen3_gqa_head_dim": dict(family="qwen3", qk_norm=True, head_dim=24, pad_token_id=0),
    "qwen3_mha_bias_tied": dict(
        family="qwen3",
        num_kv_heads=4,
        qk_norm=True,
        qkv_bias=True,
        o_bias=True,
        tie_word_embeddings=True,
    ),
    "gemma3_mixed_tied": dict(
        family="gemma3_text",
        **get_family("gemma3_text").traits,
        tie_word_embeddings=True,
        sliding_window=4,
        layer_types=("sliding", "full"),
        rope_theta=1e6,
        rope_local_theta=1e4,
        query_pre_attn_scalar=24.0,
        pad_token_id=0,
    ),
    "phi3_gqa_window": dict(family="phi3", sliding_window=5, pad_token_id=0),
    "phi3_longrope_tied": dict(
        family="phi3", num_kv_heads=4, tie_word_embeddings=True, rope_scaling=LONGROPE
    ),
}


def tiny(name: str, **kw) -> ModelConfig:
    return ModelConfig(**{**TINY, **FAMILIES[name], **kw})


def random_model(cfg: ModelConfig, seed: int = 0):
    """init()'s pytree filled from NumPy (no XLA compiles): weights and biases N(0, 0.1), norm
    weights identity + N(0, 0.3), identity 1 (0 for "1+w" norms; unit norms would hide a swapped norm)."""
    rng = np.random.default_rng(seed)
    identity = 0.0 if cfg.norm_weight == "1+w" else 1.0

    def fill(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        name = jax.tree_util.keystr(path)
        return jnp.asarray(identity + 0.3 * noise if "norm" in name else 0.1 * noise)

    return jax.tree_util.tree_map_with_path(
        fill, jax.eval_shape(lambda: init(cfg, jax.random.key(0)))
    )


def assert_bit_exact(a, b):
    assert a.config == b.config
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))


IDS = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 9)), jnp.int32)


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_round_trip_is_bit_exact(name, tmp_path):
    model = random_model(tiny(name))
    save_pretrained(model, tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    back = load_pretrained(tmp_path / "m")
    assert_bit_exact(model, back)
    forward = jax.jit(lambda m: m(IDS))
    assert np.array_equal(np.asarray(forward(model)), np.asarray(forward(back)))
    # The file is standard safetensors, in transformers' names and [out, in] layout (fused
    # families: q, k, v concatenated on the output axis in one tensor).
    rec = get_family(model.config.family)
    qkv = rec.weights["wq"]
    with safe_open(tmp_path / "m" / "model.safetensors", framework="numpy") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        wq = f.get_tensor(f"model.layers.1.{qkv}")
    fields = rec.tensors()[qkv]
    assert fields == (("wq", "wk", "wv") if rec.model_type == "phi3" else ("wq",))
    np.testing.assert_array_equal(
        wq, np.concatenate([np.asarray(getattr(model.layers, f)[1]) for f in fields], -1).T
    )
    assert ("lm_head.weight" in names) == (not model.config.tie_word_embeddings)
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == model.config.o_bias
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == model.config.qk_norm


@pytest.mark.parametrize("name", ["llama3_gqa_tied", "qwen3_gqa_head_dim"])
def test_bfloat16_round_trip(name, tmp_path):
    model = cast(random_model(tiny(name)), param_dtype=jnp.bfloat16)
    save_pretrained(model, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    back = load_pretrained(tmp_path)
    assert back.embed.dtype == jnp.bfloat16 and back.layers.wq.dtype == jnp.bfloat16
    assert_bit_exact(model, back)
    with safe_open(tmp_path / "model.safetensors", framework="flax") as f:  # an independent reader
        np.testing.assert_array_equal(
            np.asarray(f.get_tensor("model.norm.weight")), np.asarray(model.norm)
        )
    up = load_pretrained(tmp_path, param_dtype=jnp.float32)
    assert up.embed.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(up.embed), np.asarray(model.embed, np.float32))


def test_save_dtype_casts(tmp_path):
    model = random_model(tiny("qwen2_gqa_tied"))
    save_pretrained(model, tmp_path, dtype=jnp.bfloat16)
    assert_bit_exact(cast(model, param_dtype=jnp.bfloat16), load_pretrained(tmp_path))


def test_sharded_round_trip_and_resave(tmp_path):
    model = random_model(tiny("llama2_mha_untied"))
    save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert not (tmp_path / "model.safetensors").exists()
    total = 0
    for s in shards:
        with safe_open(tmp_path / s, framework="numpy") as f:
            size = sum(f.get_tensor(k).nbytes for k in f.keys())
        total += size
        assert size <= 40_000 or len(list(safe_open(tmp_path / s, framework="numpy").keys())) == 1
    assert index["metadata"]["total_size"] == total
    assert_bit_exact(model, load_pretrained(tmp_path))
    # Saving unsharded into the same directory removes the stale shards and index.
    save_pretrained(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert_bit_exact(model, load_pretrained(tmp_path))


def test_existing_directory_keeps_other_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{}")
    save_pretrained(random_model(tiny("qwen2_gqa_tied")), tmp_path)
    save_pretrained(random_model(tiny("qwen2_gqa_tied")), tmp_path / "fresh")
    (tmp_path / "plain").mkdir()
    assert os.stat(tmp_path / "fresh").st_mode == os.stat(tmp_path / "plain").st_mode  # not 0700
    assert (tmp_path / "tokenizer.json").read_text() == "{}"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
    assert not [p for p in os.listdir(tmp_path / "fresh") if p.startswith(".")]


def test_crash_while_writing_leaves_old_checkpoint(tmp_path, monkeypatch):
    old, new = (
        random_model(tiny("llama2_mha_untied")),
        random_model(tiny("llama2_mha_untied"), seed=5),
    )
    save_pretrained(old, tmp_path / "m")

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_mod, "write_safetensors", boom)
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(new, tmp_path / "m")
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(new, tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path)) == ["m"]  # no half-written directory, no staging left
    assert_bit_exact(old, load_pretrained(tmp_path / "m"))


def test_crash_while_replacing_never_looks_valid(tmp_path, monkeypatch):
    model = random_model(tiny("llama2_mha_untied"))
    save_pretrained(model, tmp_path, max_shard_bytes=40_000)
    real = os.replace
    calls = []

    def flaky(src, dst):
        if ".saving-" not in str(dst):  # a staged file moved into place (not a write into staging)
            calls.append(dst)
            if len(calls) == 2:
                raise OSError("power cut")
        real(src, dst)

    monkeypatch.setattr(hf_mod.os, "replace", flaky)
    with pytest.raises(OSError, match="power cut"):
        save_pretrained(random_model(tiny("llama2_mha_untied"), seed=3), tmp_path)
    with pytest.raises(HFFormatError, match="config.json: missing config.json"):
        load_pretrained(tmp_path)


# ----------------------------------------------------------------------------- config layouts


def test_config_round_trips_through_hf_dict():
    for name in FAMILIES:
        cfg = tiny(name)
        d = json.loads(json.dumps(config_to_hf(cfg, jnp.float32)))
        assert config_from_hf(d, source="x/config.json") == cfg, name


V4_LLAMA3 = {  # as written by transformers 4.4x for Llama 3.1
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,
}


def _as_v5(d):
    d = dict(d)
    params = dict(d.pop("rope_scaling") or {"rope_type": "default"})
    params["rope_theta"] = d.pop("rope_theta")
    d["rope_parameters"] = params
    d["dtype"] = d.pop("torch_dtype")
    return d


def test_both_config_layouts_parse_the_same():
    v4 = config_from_hf(V4_LLAMA3, source="config.json")
    assert v4.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert v4.rope_theta == 500000.0 and v4.head_dim == 128 and v4.num_kv_heads == 8
    assert v4.eos_token_id == (128001, 128008, 128009)
    assert config_from_hf(_as_v5(V4_LLAMA3), source="config.json") == v4
    # older "type" key, and "default" meaning no scaling
    old = {**V4_LLAMA3, "rope_scaling": {"type": "linear", "factor": 4.0}}
    assert config_from_hf(old, source="c").rope_scaling == RopeScaling("linear", 4.0)
    assert config_from_hf(_as_v5(old), source="c").rope_scaling == RopeScaling("linear", 4.0)
    plain = {**V4_LLAMA3, "rope_scaling": None}
    assert config_from_hf(plain, source="c").rope_scaling is None
    assert config_from_hf(_as_v5(plain), source="c") == config_from_hf(plain, source="c")
    # llama3 without original_max_position_embeddings falls back to max_position_embeddings
    rs = {
        k: v
        for k, v in V4_LLAMA3["rope_scaling"].items()
        if k != "original_max_position_embeddings"
    }
    assert (
        config_from_hf(
            {**V4_LLAMA3, "rope_scaling": rs}, source="c"
        ).rope_scaling.original_max_position
        == 131072
    )


def _minimal(model_type, **kw):
    return {
        "model_type": model_type,
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        **kw,
    }


def test_family_defaults_match_transformers():
    llama = config_from_hf(_minimal("llama"), source="c")
    assert (llama.num_kv_heads, llama.head_dim, llama.rope_theta, llama.rope_scaling) == (
        4,
        16,
        10000.0,
        None,
    )
    assert (llama.bos_token_id, llama.eos_token_id, llama.tie_word_embeddings) == (1, 2, False)
    assert not (llama.qkv_bias or llama.o_bias or llama.mlp_bias or llama.qk_norm)
    biased = config_from_hf(_minimal("llama", attention_bias=True), source="c")
    assert biased.qkv_bias and biased.o_bias and not biased.mlp_bias
    mistral = config_from_hf(_minimal("mistral", num_key_value_heads=2), source="c")
    assert mistral.sliding_window == 4096  # transformers' default when the field is absent
    assert (
        config_from_hf(
            _minimal("mistral", num_key_value_heads=2, sliding_window=None), source="c"
        ).sliding_window
        is None
    )
    with pytest.raises(
        HFFormatError, match=r"c: field 'num_key_value_heads' = 8 \(transformers' mistral default"
    ):
        config_from_hf(_minimal("mistral"), source="c")
    assert (
        config_from_hf(_minimal("mistral", num_key_value_heads=None), source="c").num_kv_heads == 4
    )
    qwen2 = config_from_hf(_minimal("qwen2", num_key_value_heads=2, sliding_window=8), source="c")
    assert (
        qwen2.qkv_bias
        and not qwen2.o_bias
        and qwen2.sliding_window is None
        and qwen2.bos_token_id is None
    )
    qwen3 = config_from_hf(_minimal("qwen3", num_key_value_heads=2), source="c")
    assert (
        qwen3.qk_norm and qwen3.head_dim == 128 and not qwen3.qkv_bias
    )  # Qwen3Config.head_dim = 128
    assert (
        config_from_hf(_minimal("qwen3", num_key_value_heads=2, head_dim=None), source="c").head_dim
        == 16
    )
    q3b = config_from_hf(_minimal("qwen3", num_key_value_heads=2, attention_bias=True), source="c")
    assert q3b.qkv_bias and q3b.o_bias
    # only architectures, no model_type
    d = _minimal("qwen2", num_key_value_heads=2)
    del d["model_type"]
    assert (
        config_from_hf({**d, "architectures": ["Qwen2ForCausalLM"]}, source="c").family == "qwen2"
    )


def test_qwen_sliding_window_rules():
    base = _minimal("qwen2", num_key_value_heads=2, max_position_embeddings=4096)
    every = config_from_hf(
        {**base, "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 0},
        source="c",
    )
    assert every.sliding_window == 512
    lt = config_from_hf(
        {
            **base,
            "use_sliding_window": True,
            "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 2,
        },
        source="c",
    )
    assert lt.sliding_window == 512
    none = config_from_hf(
        {**base, "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 2},
        source="c",
    )  # no layer index >= 2
    assert none.sliding_window is None
    wide = config_from_hf(
        {**base, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
        source="c",
    )  # a window that masks nothing
    assert wide.sliding_window is None
    with pytest.raises(HFFormatError, match=r"dir/config.json: field 'use_sliding_window'.*mixed"):
        config_from_hf(
            {**base, "use_sliding_window": True, "sliding_window": 512, "max_window_layers": 1},
            source="dir/config.json",
        )


PHI3_LONG = {  # microsoft/Phi-3-mini-128k-instruct's shape of config (sizes shrunk, factor lists of head_dim/2)
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "short_factor": list(SHORT), "long_factor": list(LONG)},
    "sliding_window": 262144,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 32000,
    "pad_token_id": 32000,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_phi3_longrope_context_and_factors():
    """A LongRoPE model whose context exceeds its original length is refused (transformers switches
    factor lists there); capped at the original length it reads transformers' short factors and
    attention factor, which the 128k file's ratio (131072 / 4096 = 32) sets."""
    with pytest.raises(
        HFFormatError,
        match=r"^c: field 'max_position_embeddings' = 131072 exceeds "
        r"original_max_position_embeddings = 4096 with longrope.*max_positions=4096",
    ):
        config_from_hf(PHI3_LONG, source="c")
    cfg = config_from_hf(PHI3_LONG, source="c", max_positions=4096)
    assert cfg.max_position_embeddings == 4096 and cfg.sliding_window == 262144
    s = cfg.rope_scaling
    assert (s.kind, s.factor, s.original_max_position, s.short_factor, s.long_factor) == (
        "longrope",
        32.0,
        4096,
        SHORT,
        LONG,
    )
    assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    # written back with the factor explicit, so the capped file means the same model
    d = config_to_hf(cfg, jnp.bfloat16)
    assert d["rope_parameters"]["factor"] == 32.0 and d["original_max_position_embeddings"] == 4096
    assert config_from_hf(json.loads(json.dumps(d)), source="c") == cfg
    # "su" (older name), the RoPE parameters' own original length ignored (Phi3Config's top-level one wins)
    su = {
        **PHI3_LONG,
        "max_position_embeddings": 4096,
        "rope_scaling": {
            **PHI3_LONG["rope_scaling"],
            "type": "su",
            "original_max_position_embeddings": 7,
        },
    }
    assert config_from_hf(su, source="c").rope_scaling == dataclasses.replace(
        s, factor=1.0, attention_factor=1.0
    )
    with pytest.raises(HFFormatError, match=r"max_positions=5000 must be in \[1, 4096\]"):
        config_from_hf(su, source="c", max_positions=5000)


@pytest.mark.parametrize(
    "patch, match",
    [
        (
            dict(partial_rotary_factor=0.75),
            r"field 'partial_rotary_factor' = 0.75 is not supported",
        ),
        (
            dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            r"field 'rope_scaling.rope_type' = 'linear': RoPE scaling type not supported for phi3; supported: \['default', 'longrope'\]",  # noqa: E501
        ),
        (
            dict(
                rope_scaling={
                    "type": "longrope",
                    "short_factor": [1.0] * 7,
                    "long_factor": [1.0] * 8,
                }
            ),
            r"ModelConfig.rope_scaling.short_factor must be a tuple of head_dim/2 = 8",
        ),
        (
            dict(rope_scaling={"type": "longrope", "short_factor": "1", "long_factor": [1.0] * 8}),
            r"field 'rope_scaling.short_factor' must be a list of numbers",
        ),
        (
            dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}),
            r"field 'rope_scaling.long_factor' is required",
        ),
    ],
)
def test_phi3_config_errors_name_the_field(patch, match):
    with pytest.raises(HFFormatError, match=r"^ckpt/config\.json: " + match):
        config_from_hf(
            {**PHI3_LONG, "max_position_embeddings": 4096, **patch}, source="ckpt/config.json"
        )


def test_phi3_defaults_and_what_it_cannot_express():
    phi3 = config_from_hf(_minimal("phi3"), source="c")
    assert (phi3.num_kv_heads, phi3.head_dim, phi3.max_position_embeddings, phi3.rms_norm_eps) == (
        4,
        16,
        4096,
        1e-5,
    )
    assert (phi3.bos_token_id, phi3.eos_token_id, phi3.pad_token_id, phi3.sliding_window) == (
        1,
        32000,
        32000,
        None,
    )
    assert (
        not (phi3.qkv_bias or phi3.o_bias or phi3.mlp_bias or phi3.qk_norm)
        and phi3.rope_scaling is None
    )
    with pytest.raises(ValueError, match=r"Phi3ForCausalLM: attention biases"):
        config_to_hf(tiny("phi3_gqa_window", qkv_bias=True), jnp.float32)
    with pytest.raises(
        ValueError, match=r"rope_scaling kind 'linear' \(phi3 has \['default', 'longrope'\]\)"
    ):
        config_to_hf(tiny("phi3_gqa_window", rope_scaling=RopeScaling("linear", 2.0)), jnp.float32)
    with pytest.raises(
        HFFormatError, match=r"'rope_scaling.rope_type' = 'longrope'.*supported for llama"
    ):
        config_from_hf(
            {**V4_LLAMA3, "rope_scaling": PHI3_LONG["rope_scaling"] | {"rope_type": "longrope"}},
            source="c",
        )
    with pytest.raises(
        ValueError,
        match=r"max_position_embeddings=256 exceeds the longrope original_max_position=128",
    ):
        tiny("phi3_longrope_tied", max_position_embeddings=256)


def test_config_to_hf_rejects_what_transformers_cannot_express():
    with pytest.raises(ValueError, match="qkv_bias=True with o_bias=False"):
        config_to_hf(tiny("llama2_mha_untied", qkv_bias=True), jnp.float32)
    with pytest.raises(ValueError, match="qk_norm"):
        config_to_hf(tiny("llama2_mha_untied", qk_norm=True), jnp.float32)
    with pytest.raises(ValueError, match="sliding_window"):
        config_to_hf(tiny("llama2_mha_untied", sliding_window=8), jnp.float32)


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    "patch, match",
    [
        (
            dict(model_type="gpt2"),
            r"field 'model_type' = 'gpt2' is not supported; supported: .*llama.*qwen3",
        ),
        (
            dict(architectures=["GPT2LMHeadModel"]),
            r"field 'architectures' = \['GPT2LMHeadModel'\] is not supported.*LlamaForCausalLM",
        ),
        (
            dict(architectures=["Qwen2ForCausalLM"]),
            r"field 'architectures'.*disagrees with model_type 'llama'",
        ),
        (
            dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
            r"field 'rope_scaling.rope_type' = 'yarn'.*supported: \['default', 'linear', 'llama3'\]",
        ),
        (
            dict(rope_scaling={"type": "dynamic", "factor": 4.0}),
            r"field 'rope_scaling.type' = 'dynamic'",
        ),
        (
            dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
            r"field 'rope_scaling.low_freq_factor' is required",
        ),
        (dict(hidden_act="gelu"), r"field 'hidden_act' = 'gelu' is not supported"),
        (dict(hidden_size=None), r"field 'hidden_size' must be an integer"),
        (dict(partial_rotary_factor=0.5), r"field 'partial_rotary_factor'"),
        (dict(quantization_config={"quant_method": "gptq"}), r"field 'quantization_config'"),
        (
            dict(num_key_value_heads=3),
            r"field 'num_key_value_heads' = 3 must divide num_attention_heads=32",
        ),
        (dict(tie_word_embeddings="yes"), r"field 'tie_word_embeddings' must be true or false"),
    ],
)
def test_config_errors_name_file_and_field(patch, match):
    with pytest.raises(HFFormatError, match=r"^ckpt/config\.json: " + match):
        config_from_hf({**V4_LLAMA3, **patch}, source="ckpt/config.json")


def test_missing_required_field():
    d = dict(V4_LLAMA3)
    del d["intermediate_size"]
    with pytest.raises(
        HFFormatError, match=r"ckpt/config.json: field 'intermediate_size' is required but missing"
    ):
        config_from_hf(d, source="ckpt/config.json")
    del d["model_type"], d["architectures"]
    with pytest.raises(HFFormatError, match=r"ckpt/config.json: field 'model_type' is required"):
        config_from_hf(d, source="ckpt/config.json")


def test_v5_rope_type_error_names_rope_parameters():
    d = _as_v5({**V4_LLAMA3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(HFFormatError, match=r"field 'rope_parameters.rope_type' = 'yarn'"):
        config_from_hf(d, source="c")


# ----------------------------------------------------------------------------- checkpoint errors


@pytest.fixture
def saved(tmp_path):
    """A tiny untied Llama saved as float32; returns (dir, model)."""
    model = random_model(tiny("llama2_mha_untied"))
    save_pretrained(model, tmp_path)
    return tmp_path, model


def _edit(path, fn):
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_missing_tensor(saved):
    d, _ = saved
    _edit(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    ):
        load_pretrained(d)


def test_missing_lm_head_when_untied(saved):
    d, _ = saved
    _edit(d / "model.safetensors", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(
        HFFormatError, match=r"model\.safetensors: missing tensor 'lm_head\.weight'"
    ):
        load_pretrained(d)


def test_unexpected_tensor(saved):
    d, _ = saved
    _edit(
        d / "model.safetensors",
        lambda t: t.update({"model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}),
    )
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: unexpected tensor 'model\.layers\.2\.input_layernorm\.weight'",
    ):
        load_pretrained(d)


def test_bias_in_a_model_without_bias_is_unexpected(saved):
    d, _ = saved
    _edit(
        d / "model.safetensors",
        lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}),
    )
    with pytest.raises(
        HFFormatError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        load_pretrained(d)


def test_wrong_shape(saved):
    d, _ = saved
    _edit(
        d / "model.safetensors",
        lambda t: t.update(
            {"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}
        ),
    )
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' "
        r"has shape \[32, 64\], expected \[64, 64\]",
    ):
        load_pretrained(d)


def test_fused_tensor_shape_and_presence(tmp_path):
    """Phi-3's fused tensors: a wrong shape names the fused size, a split checkpoint is unexpected."""
    model = random_model(tiny("phi3_gqa_window"))
    save_pretrained(model, tmp_path)
    name = "model.layers.0.self_attn.qkv_proj.weight"  # q 64 + k 32 + v 32 rows
    _edit(
        tmp_path / "model.safetensors", lambda t: t.update({name: np.zeros((96, 64), np.float32)})
    )
    with pytest.raises(
        HFFormatError,
        match=rf"tensor '{re.escape(name)}' has shape \[96, 64\], expected \[128, 64\]",
    ):
        load_pretrained(tmp_path)
    save_pretrained(model, tmp_path)
    _edit(
        tmp_path / "model.safetensors",
        lambda t: t.update({"model.layers.0.mlp.gate_proj.weight": np.zeros((96, 64), np.float32)}),
    )
    with pytest.raises(
        HFFormatError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.gate_proj\.weight'"
    ):
        load_pretrained(tmp_path)
    save_pretrained(model, tmp_path)
    _edit(tmp_path / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.gate_up_proj.weight"))
    with pytest.raises(
        HFFormatError, match=r"missing tensor 'model\.layers\.1\.mlp\.gate_up_proj\.weight'"
    ):
        load_pretrained(tmp_path)


def test_integer_tensor(saved):
    d, _ = saved
    _edit(d / "model.safetensors", lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(
        HFFormatError, match=r"model\.safetensors: tensor 'model\.norm\.weight' has dtype I32"
    ):
        load_pretrained(d)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight_is_refused_naming_the_tensor(saved, value):
    d, _ = saved
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(t):
        t[name] = t[name].copy()
        t[name][3, 5] = value

    _edit(d / "model.safetensors", poison)
    with pytest.raises(
        HFFormatError,
        match=rf"model\.safetensors: tensor '{re.escape(name)}' holds 1 non-finite "
        r"value\(s\) \(the first at index \[3, 5\]",
    ):
        load_pretrained(d)


def test_truncated_file(saved):
    d, _ = saved
    p = d / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: corrupt or truncated safetensors file: tensor '.*' "
        r"data_offsets .* beyond the end",
    ):
        load_pretrained(d)
    p.write_bytes(data[:200])
    with pytest.raises(
        HFFormatError,
        match=r"model\.safetensors: corrupt or truncated safetensors file: header length",
    ):
        load_pretrained(d)
    p.write_bytes(data[:5])
    with pytest.raises(HFFormatError, match=r"model\.safetensors: truncated"):
        load_pretrained(d)
    (n,) = struct.unpack("<Q", data[:8])
    p.write_bytes(data[:8] + b"\xff" * n + data[8 + n :])
    with pytest.raises(HFFormatError, match=r"model\.safetensors: corrupt safetensors header"):
        load_pretrained(d)


def test_index_pointing_at_missing_shard(tmp_path):
    save_pretrained(random_model(tiny("qwen2_gqa_tied")), tmp_path, max_shard_bytes=30_000)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(
        HFFormatError,
        match=rf"model\.safetensors\.index\.json: weight_map points at missing shard '{shard.name}' \(for tensor '",
    ):
        load_pretrained(tmp_path)


def test_index_listing_a_tensor_its_shard_lacks(tmp_path):
    save_pretrained(random_model(tiny("qwen2_gqa_tied")), tmp_path, max_shard_bytes=30_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.q_proj.bias"] = (
        f"model-00001-of-{len(set(index['weight_map'].values())):05d}.safetensors"
    )
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        HFFormatError,
        match=r"model-00001-of-\d+\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.bias' is not in this shard",  # noqa: E501
    ):
        load_pretrained(tmp_path)


def test_missing_config(saved):
    d, _ = saved
    (d / "config.json").unlink()
    with pytest.raises(HFFormatError, match=r"config\.json: missing config\.json"):
        load_pretrained(d)


def test_only_pytorch_bin(saved):
    d, _ = saved
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(
        HFFormatError,
        match=r"no model\.safetensors.*only PyTorch pickle weights \['pytorch_model\.bin'\].*safetensors",
    ):
        load_pretrained(d)
    (d / "pytorch_model.bin").unlink()
    with pytest.raises(
        HFFormatError, match=r"no model\.safetensors or model\.safetensors\.index\.json"
    ):
        load_pretrained(d)


def test_config_error_from_load_names_the_file(saved):
    d, _ = saved
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        HFFormatError, match=rf"{d}/config\.json: field 'rope_scaling\.rope_type' = 'yarn'"
    ):
        load_pretrained(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(HFFormatError, match=r"config\.json: not valid JSON"):
        load_pretrained(d)


# ----------------------------------------------------------------------------- checkpoints in the wild


def test_inv_freq_buffers_are_ignored(saved):
    d, model = saved
    _edit(
        d / "model.safetensors",
        lambda t: t.update(
            {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)}
        ),
    )
    assert_bit_exact(model, load_pretrained(d))


def test_tied_checkpoint_with_lm_head(tmp_path):
    model = random_model(tiny("qwen2_gqa_tied"))
    save_pretrained(model, tmp_path)
    emb = np.asarray(model.embed)
    _edit(tmp_path / "model.safetensors", lambda t: t.update({"lm_head.weight": emb.copy()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bit_exact(model, load_pretrained(tmp_path))  # equal copy: ignored, still tied
    _edit(tmp_path / "model.safetensors", lambda t: t.update({"lm_head.weight": emb * 2}))
    with pytest.warns(
        UserWarning,
        match=r"model\.safetensors: tie_word_embeddings is true but 'lm_head\.weight' differs",
    ):
        untied = load_pretrained(tmp_path)
    assert not untied.config.tie_word_embeddings
    np.testing.assert_array_equal(np.asarray(untied.lm_head), emb * 2)


def test_generation_config_supplies_stop_tokens(saved):
    d, model = saved
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": [2, 7, 9]})
    )
    back = load_pretrained(d)
    assert back.config.eos_ids == (2, 7, 9)
    assert back.config == dataclasses.replace(model.config, eos_token_id=(2, 7, 9))


def test_hand_written_v5_directory_loads(saved):
    """A transformers-5-style config.json (rope_parameters, dtype, no top-level rope_theta)."""
    d, model = saved
    cfg = json.loads((d / "config.json").read_text())
    for k in ("rope_theta", "rope_scaling", "torch_dtype"):
        cfg.pop(k)
    (d / "config.json").write_text(json.dumps(cfg))
    assert_bit_exact(model, load_pretrained(d))


def test_load_dtype_arguments(saved):
    d, model = saved
    m = load_pretrained(d, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    assert m.dtype == jnp.bfloat16 and m.layers.w_up.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(m.embed), np.asarray(model.embed.astype(jnp.bfloat16)))
