"""Red team for the loaders: a hostile ``config.json``, safetensors header, tokenizer config or jsonl
data line fails fast (seconds) with an error naming the file and the field or line, never a stall
or a bare ``RecursionError``.

The attacks are real: a 2-layer checkpoint on disk with ``config.json`` edited to 1,000,000 or
20,000 layers (the red team's 400 s and 20 s loads), to sizes that contradict the tensors and
to negative or absurd values; JSON nested 100,000 and 10,000,000 deep, NaN, 1e400, integers of
5,000 digits, raw NUL bytes. The depth scan is checked against a character-by-character reference,
the layout's time against its own at a quarter of the layers (linear: ~4x; the old per-layer tuple
rebuild made it ~15x), and the axes the shape errors name against ``ModelConfig.layer_shapes``.
"""

import gc
import json
import random
import re
import shutil
import struct
import time

import jax.numpy as jnp
import numpy as np
import pytest

from relax.data.files import read_records
from relax.models import ModelConfig, family_config
from relax.models.decoder.transformer import LayerStack, Transformer
from relax.models.hf import bounded_json
from relax.models.hf.checkpoint import HFFormatError, load_pretrained, read_config, save_pretrained
from relax.models.hf.layout import layout
from relax.models.hf.validate import AXES, symbols
from relax.text.files import TokenizerFormatError
from relax.text.files import read_json as read_tokenizer_json

BOUND_S = 5.0  # every hostile load fails within this (the red team's took 20 s and 400 s)
SIZES = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, dense_layers=(1,))


def build(cfg: ModelConfig) -> Transformer:
    """A model of ``cfg`` filled from NumPy (no XLA compiles)."""
    rng = np.random.default_rng(0)
    draw = lambda shape: jnp.asarray(0.1 * rng.standard_normal(shape), jnp.float32)  # noqa: E731
    v, d = cfg.vocab_size, cfg.hidden_size
    return Transformer(
        embed=draw((v, d)),
        layers=LayerStack(**{f: draw(s) for f, s in cfg.stacked_shapes().items()}),
        norm=draw((d,)),
        lm_head=None if cfg.tie_word_embeddings else draw((v, d)),
        config=cfg,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-layer Llama and a 2-layer Qwen3-MoE (4 experts; layer 1 dense) on disk."""
    root = tmp_path_factory.mktemp("checkpoints")
    save_pretrained(build(family_config("llama", **SIZES)), root / "llama")
    save_pretrained(build(family_config("qwen3_moe", **SIZES, **MOE)), root / "moe")
    return root


def edited(saved, tmp_path, name: str, **fields):
    """A copy of checkpoint ``name`` whose ``config.json`` has ``fields`` set."""
    d = tmp_path / name
    shutil.copytree(saved / name, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **fields}))
    return d


def fails_fast(call, error, match: str):
    """``call()`` raises ``error`` matching ``match`` within ``BOUND_S`` seconds."""
    start = time.perf_counter()
    with pytest.raises(error, match=match):
        call()
    assert time.perf_counter() - start < BOUND_S


# ----------------------------------------------------------------------------- config.json alone


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(num_hidden_layers=1_000_000),
            r"'num_hidden_layers' must be at most 10000, got 1000000",
        ),
        (dict(num_hidden_layers=20_000), r"'num_hidden_layers' must be at most 10000, got 20000"),
        (dict(num_hidden_layers=1e300), r"'num_hidden_layers' must be at most 10000, got 1e\+300$"),
        (dict(num_hidden_layers=-3), r"'num_hidden_layers' must be >= 1, got -3"),
        (dict(num_hidden_layers=0), r"'num_hidden_layers' must be >= 1, got 0"),
        (dict(vocab_size=10**9), r"'vocab_size' must be at most 100000000, got 1000000000"),
        (dict(vocab_size=-1), r"'vocab_size' must be >= 1, got -1"),
        (dict(hidden_size=0), r"'hidden_size' must be >= 1"),
        (dict(intermediate_size=10**12), r"'intermediate_size' must be at most"),
        (dict(num_attention_heads=0), r"'num_attention_heads' must be >= 1"),
        (dict(num_key_value_heads=0), r"'num_key_value_heads' must be >= 1"),
        (dict(head_dim=-16), r"'head_dim' must be >= 1, got -16"),
        (
            dict(max_position_embeddings=2**30),
            r"'max_position_embeddings' must be at most 16777216",
        ),
        (dict(max_position_embeddings=0), r"'max_position_embeddings' must be >= 1"),
        (
            dict(rope_theta=0, rope_parameters=None),
            r"'rope_theta' = 0.0 must be positive and within float32's range",
        ),
        (
            dict(rope_parameters=dict(rope_type="default", rope_theta=-1e4)),
            r"'rope_parameters\.rope_theta' = -10000.0 must be positive",
        ),
        (
            dict(rope_theta=1e39, rope_parameters=None),
            r"'rope_theta' = 1e\+39 must be positive and within float32",
        ),
        (dict(rms_norm_eps=-1e-6), r"'rms_norm_eps' = -1e-06 must be positive"),
        (dict(rms_norm_eps=1e-50), r"'rms_norm_eps' = 1e-50 must be positive"),
        (
            dict(rope_scaling=dict(rope_type="linear", factor=0.0)),
            r"'rope_scaling\.factor' = 0\.0 must be positive",
        ),
        (
            dict(
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=8.0,
                    low_freq_factor=4.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=64,
                )
            ),
            r"'rope_scaling\.low_freq_factor' = 4\.0 must be positive and below high_freq_factor",
        ),
    ],
)
def test_absurd_config_values_are_refused_from_the_config(saved, tmp_path, fields, match):
    d = edited(saved, tmp_path, "llama", **fields)
    fails_fast(lambda: load_pretrained(d), HFFormatError, rf"{d}/config\.json: field {match}")


def test_expert_count_and_window_pattern_bounds(saved, tmp_path):
    d = edited(saved, tmp_path, "moe", num_local_experts=10**6)
    fails_fast(
        lambda: load_pretrained(d),
        HFFormatError,
        r"config\.json: field 'num_local_experts' must be at most 65536, got 1000000",
    )
    gemma = json.loads((saved / "llama" / "config.json").read_text())
    gemma.update(model_type="gemma3_text", architectures=None, sliding_window_pattern=0)
    gemma.pop("layer_types", None)  # then every sliding_window_pattern-th layer is full
    (tmp_path / "config.json").write_text(json.dumps(gemma))
    fails_fast(
        lambda: read_config(tmp_path / "config.json"),
        HFFormatError,
        r"config\.json: field 'sliding_window_pattern' must be >= 1, got 0",
    )


# ----------------------------------------------------------------------------- config vs checkpoint


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(num_hidden_layers=5000),
            r"config\.json: field 'num_hidden_layers' = 5000, but \S+model\.safetensors holds "
            r"layers 0\.\.1 only, no tensor of layer 2",
        ),
        (
            dict(num_hidden_layers=3),
            r"config\.json: field 'num_hidden_layers' = 3, but .* no tensor of layer 2",
        ),
        (
            dict(num_hidden_layers=1),
            r"model\.safetensors: unexpected tensor 'model\.layers\.1\.\S+' \(layer 1; \S+config\.json "
            r"field 'num_hidden_layers' = 1: layers 0\.\.0\)",
        ),
        (
            dict(vocab_size=98),
            r"config\.json: field 'vocab_size' = 98, but tensor 'model\.embed_tokens\.weight' in "
            r"\S+model\.safetensors has 97 rows",
        ),
        (
            dict(hidden_size=128),
            r"config\.json: field 'hidden_size' = 128, but tensor 'model\.embed_tokens\.weight' .* "
            r"has 64 columns",
        ),
        (
            dict(num_attention_heads=8),
            r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.q_proj\.weight' has shape "
            r"\[64, 64\], expected \[128, 64\] from \S+config\.json: axis 0 is 'num_attention_heads' "
            r"× 'head_dim' = 8 × 16 = 128",
        ),
        (
            dict(num_key_value_heads=4),
            r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \[32, 64\], expected \[64, 64\] "
            r".*axis 0 is 'num_key_value_heads' × 'head_dim' = 4 × 16 = 64",
        ),
        (
            dict(head_dim=8),
            r"'model\.layers\.0\.self_attn\.q_proj\.weight' has shape \[64, 64\], expected \[32, 64\] "
            r".*axis 0 is 'num_attention_heads' × 'head_dim' = 4 × 8 = 32",
        ),
        (
            dict(intermediate_size=95),
            r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \[96, 64\], expected \[95, 64\] "
            r".*axis 0 is 'intermediate_size' = 95",
        ),
    ],
)
def test_config_contradicting_the_checkpoint_names_field_and_tensor(saved, tmp_path, fields, match):
    d = edited(saved, tmp_path, "llama", **fields)
    fails_fast(lambda: load_pretrained(d), HFFormatError, match)


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(num_local_experts=6),
            r"config\.json: field 'num_local_experts' \(alias 'num_experts'\) = 6, but "
            r"\S+model\.safetensors holds experts 0\.\.3 only, no tensor of expert 4",
        ),
        (
            dict(num_local_experts=3),
            r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.experts\.3\.\S+' "
            r"\(expert 3; \S+config\.json field 'num_local_experts' \(alias 'num_experts'\) = 3: "
            r"experts 0\.\.2\)",
        ),
        (
            dict(moe_intermediate_size=17),
            r"'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight' has shape \[16, 64\], "
            r"expected \[17, 64\] .*axis 0 is 'moe_intermediate_size' = 17",
        ),
        (  # 10,000 layers, each looked up in a 10,000-entry mlp_only_layers: < 1 s, then named
            dict(num_hidden_layers=10_000, mlp_only_layers=list(range(9_999, -1, -1))),
            r"config\.json: field 'num_hidden_layers' = 10000, but \S+model\.safetensors holds "
            r"layers 0\.\.1 only",
        ),
        (  # layer 1 is dense: its MLP is checked too
            dict(intermediate_size=90),
            r"'model\.layers\.1\.mlp\.gate_proj\.weight' has shape \[96, 64\], expected \[90, 64\] "
            r".*axis 0 is 'intermediate_size' = 90",
        ),
    ],
)
def test_expert_count_and_widths_against_the_checkpoint(saved, tmp_path, fields, match):
    d = edited(saved, tmp_path, "moe", **fields)
    fails_fast(lambda: load_pretrained(d), HFFormatError, match)


def test_the_checkpoints_load_unedited(saved):
    """The checks refuse nothing that matches: both checkpoints load."""
    assert load_pretrained(saved / "llama").config.num_layers == 2
    assert load_pretrained(saved / "moe").config.dense_layers == (1,)


def test_layout_time_is_linear_in_layers():
    """4x the layers take < 7x the time (linear ~4x; the old per-layer rebuild of a tuple over
    every layer took ~15x at these sizes)."""

    def seconds(layers: int) -> float:
        cfg = ModelConfig(**{**SIZES, "num_layers": layers})
        best = float("inf")
        gc.disable()  # a collection's cost scales with every live object, not the layout's work
        try:
            for _ in range(2):
                start = time.perf_counter()
                slots = layout(cfg, with_head=True)
                best = min(best, time.perf_counter() - start)
        finally:
            gc.enable()
        assert len(slots) == 9 * layers + 3
        return best

    small, large = seconds(1500), seconds(6000)
    assert large < 7 * small, (small, large)


@pytest.mark.parametrize(
    "cfg",
    [
        family_config("llama", **SIZES, qkv_bias=True, o_bias=True, mlp_bias=True),
        family_config("qwen3", **SIZES),
        family_config(
            "gemma3_text",
            **SIZES,
            layer_types=("sliding", "full"),
            rope_local_theta=1e4,
            query_pre_attn_scalar=16.0,
            sliding_window=4,
        ),
        family_config("qwen2_moe", **SIZES, **MOE, shared_expert_size=8, qkv_bias=True),
    ],
    ids=["llama_biases", "qwen3", "gemma3", "qwen2_moe_shared"],
)
def test_error_axes_are_the_layer_shapes(cfg):
    """The axes a shape error names (``AXES``) make up ``ModelConfig.layer_shapes``, field by field."""
    value = {k: v for k, (_, v) in symbols(cfg).items()}
    shapes = cfg.layer_shapes()
    assert {f: tuple(value[a] for a in AXES[f]) for f in shapes} == shapes
    assert set(AXES) == set(LayerStack.__dataclass_fields__) - {"lora"}


# ----------------------------------------------------------------------------- JSON files


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize(
    "text, match",
    [
        (
            '{"model_type": "llama", "x": ' + _deep(100_000) + "}",
            r"arrays/objects nested deeper than 128 levels: line 1 column 157 \(char 156\)\)",
        ),
        (
            '{"model_type": "llama",\n "rms_norm_eps": NaN}',
            r"NaN is not JSON \(no NaN or Infinity\): line 2 column 18",
        ),
        ('{"model_type": "llama", "rope_theta": 1e400}', r"number 1e400 is beyond float64's range"),
        (
            '{"vocab_size": ' + "9" * 5000 + "}",
            r"an integer of more than 4300 digits: line 1 column 16",
        ),
        ('{"model_type": "llama"\x00}', r"Expecting ',' delimiter: line 1 column 23"),
    ],
    ids=["deep", "nan", "1e400", "long_int", "nul"],
)
def test_config_json_beyond_bounds_names_file_and_line(saved, tmp_path, text, match):
    d = tmp_path / "llama"
    shutil.copytree(saved / "llama", d)
    (d / "config.json").write_text(text)
    fails_fast(
        lambda: load_pretrained(d), HFFormatError, rf"{d}/config\.json: not valid JSON \({match}"
    )


def _header_file(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_safetensors_header_deep_or_negative(saved, tmp_path):
    d = tmp_path / "llama"
    shutil.copytree(saved / "llama", d)
    weights = d / "model.safetensors"
    _header_file(weights, b'{"a": ' + _deep(100_000).encode() + b"}")
    fails_fast(
        lambda: load_pretrained(d),
        HFFormatError,
        r"model\.safetensors: corrupt safetensors header \(arrays/objects nested deeper than 128",
    )
    # [-2, -3] holds "6" elements: the byte count alone would pass it, the reshape then fail
    entry = {"dtype": "F32", "shape": [-2, -3], "data_offsets": [0, 24]}
    _header_file(weights, json.dumps({"model.norm.weight": entry}).encode(), bytes(24))
    fails_fast(
        lambda: load_pretrained(d),
        HFFormatError,
        r"tensor 'model\.norm\.weight': malformed header entry .* must be non-negative integers",
    )
    weights.write_bytes(struct.pack("<Q", 2**40) + bytes(16))
    fails_fast(
        lambda: load_pretrained(d),
        HFFormatError,
        r"header length 1099511627776 exceeds the format's limit",
    )


def test_tokenizer_config_too_deep(tmp_path):
    path = tmp_path / "tokenizer_config.json"
    path.write_text('{"bos_token": ' + _deep(100_000) + "}")
    fails_fast(
        lambda: read_tokenizer_json(path),
        TokenizerFormatError,
        rf"{path} is not valid JSON: arrays/objects nested deeper than 128 levels: line 1 column 142",
    )


GOOD = '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n'


@pytest.mark.parametrize(
    "line, match",
    [
        (
            _deep(100_000),
            r"JSON beyond relax's bounds: arrays/objects nested deeper than 128 levels \(column 129\)",
        ),
        (
            '{"a": ' * 100_000 + "1" + "}" * 100_000,
            r"JSON beyond relax's bounds: arrays/objects nested deeper than 128 levels \(column 769\)",
        ),
        ('{"prompt": "x", "n": [1, 2', r"invalid JSON: Expecting ',' delimiter \(column 27\)"),
        ("[1, 2]", r"expected a JSON object, got list"),
        (
            '{"n": ' + "9" * 5000 + "}",
            r"JSON beyond relax's bounds: an integer of more than 4300 digits \(column 7\)",
        ),
        (
            '{"reward": 1e400}',
            r"JSON beyond relax's bounds: number 1e400 is beyond float64's range \(column 12\)",
        ),
        ('{"reward": NaN}', r"JSON beyond relax's bounds: NaN is not JSON"),
        ('{"prompt": "a\x00b"}', r"invalid JSON: Invalid control character at \(column 14\)"),
        ("\x00", r"invalid JSON: Expecting value \(column 1\)"),
    ],
    ids=[
        "deep_array",
        "deep_object",
        "invalid",
        "not_object",
        "long_int",
        "1e400",
        "nan",
        "nul_in_string",
        "nul",
    ],
)
def test_jsonl_line_beyond_bounds_names_file_and_line(tmp_path, line, match):
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + line + "\n")
    fails_fast(lambda: read_records(path), ValueError, rf"^{path}: line 3: {match}")


def test_ten_million_deep_line_within_bounds(tmp_path):
    """10,000,000 brackets (10 MB on one line): named in well under the bound, not a crash."""
    path = tmp_path / "data.jsonl"
    path.write_text(GOOD + "[" * 10_000_000 + "\n")
    fails_fast(
        lambda: read_records(path), ValueError, rf"^{path}: line 3: .*nested deeper than 128"
    )


def test_escaped_nul_and_depth_128_are_data(tmp_path):
    """What is within the bounds still loads: an escaped NUL in a string, nesting of exactly 128."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"prompt": "a\\u0000b", "x": ' + _deep(127) + "}\n")
    (row,) = read_records(path)
    assert row.record["prompt"] == "a\x00b"
    assert bounded_json.loads(_deep(128)) is not None


# ----------------------------------------------------------------------------- the depth scan itself


def _reference_position(text: str, max_depth: int) -> int | None:
    """The first bracket deeper than ``max_depth`` outside strings, character by character."""
    depth, inside, escaped = 0, False, False
    for i, ch in enumerate(text):
        if inside:
            escaped, inside = (False, True) if escaped else (ch == "\\", ch != '"')
        elif ch == '"':
            inside = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return i
        elif ch in "]}":
            depth -= 1
    return None


def _token(rng: random.Random) -> str:
    if rng.random() < 0.7:
        return rng.choice("[[{]} ,é")
    parts = ["[", "{", "]", "a", "é", '\\"', "\\\\", '\\\\\\"', "\\u005b"]
    return '"' + "".join(rng.choice(parts) for _ in range(rng.randint(0, 6))) + '"'


@pytest.mark.parametrize("chunk", [2, 5, 1 << 20])
def test_depth_scan_matches_a_reference(monkeypatch, chunk):
    """Random bracket/string soup (escaped quotes and backslashes, multi-byte characters), scanned
    in chunks of ``chunk`` bytes: the first position past depth 4 is the reference's."""
    monkeypatch.setattr(bounded_json, "_CHUNK", chunk)
    rng = random.Random(chunk)
    for _ in range(500):
        text = "".join(_token(rng) for _ in range(rng.randint(0, 30)))
        error = bounded_json.nesting_error(text, 4)
        assert (None if error is None else error.pos) == _reference_position(text, 4), text
    assert re.search("column 5", str(bounded_json.nesting_error("[[[[[", 4)))
