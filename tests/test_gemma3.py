"""Gemma 3 through the one model description: the config's traits and per-layer kinds, the scanned
layers, the prefix-shared training forward and the sampler against the full forward, and the
Hugging Face config.json reader/writer. (Logits, checkpoints and greedy generation against
transformers: tests/test_hf_parity.py, tests/test_rollout_parity.py.)"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_reference import forward as np_forward

from relax.models import ModelConfig, RopeScaling, family_config, init, token_logprobs
from relax.models.config.families import FAMILIES
from relax.models.decoder.transformer import embed
from relax.models.forward.forward_pass import ForwardPass, resolve_attention
from relax.models.forward.prefix_shared import completion_logprobs, completion_rope
from relax.models.hf.config import HFFormatError, config_from_hf, config_to_hf
from relax.rollout import sampler as rollout

# sliding (window 3, RoPE base 1e4), full (base 1e6, linear x8), sliding; scores q.k / sqrt(12)
CFG = family_config(
    "gemma3_text",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    sliding_window=3,
    layer_types=("sliding", "full", "sliding"),
    rope_theta=1e6,
    rope_local_theta=1e4,
    rope_scaling=RopeScaling("linear", 8.0),
    query_pre_attn_scalar=12.0,
    tie_word_embeddings=True,
)


def _model(cfg=CFG, std=0.3):
    """Random weights, and norm weights off their identity (0 for ``1 + w`` norms)."""
    m = init(cfg, jax.random.key(0), std=std)
    keys = iter(jax.random.split(jax.random.key(1), 16))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            x + 0.3 * jax.random.normal(next(keys), x.shape)
            if "norm" in jax.tree_util.keystr(path)
            else x
        ),
        m,
    )


def _prompts(p, lp, lengths, seed=0):
    rng = np.random.default_rng(seed)
    ids, mask = np.zeros((p, lp), np.int32), np.zeros((p, lp), np.int32)
    for i, n in enumerate(lengths):
        ids[i, lp - n :] = rng.integers(3, CFG.vocab_size, n)
        mask[i, lp - n :] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


# ----------------------------------------------------------------------------- the description


def test_description_traits_and_kinds():
    assert FAMILIES["gemma3_text"].traits == {
        k: getattr(CFG, k) for k in FAMILIES["gemma3_text"].traits
    }
    assert CFG.sliding_layers == (True, False, True) and CFG.has_window
    assert CFG.attn_scale == 12.0**-0.5
    assert (
        CFG.norm_weight,
        CFG.sandwich_norms,
        CFG.qk_norm,
        CFG.activation,
        CFG.scale_embeddings,
    ) == ("1+w", True, True, "gelu_tanh", True)
    assert {"attn_out_norm", "mlp_out_norm", "q_norm", "k_norm"} <= set(CFG.layer_shapes())
    llama = family_config(
        "llama",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=2,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
    )
    assert llama == ModelConfig(
        **{
            k: getattr(llama, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
            )
        }
    )
    assert (
        llama.sliding_layers == (False, False) and llama.attn_scale is None and not llama.has_window
    )
    mistral = ModelConfig(**{**llama.__dict__, "family": "mistral", "sliding_window": 4})
    assert mistral.sliding_layers == (True, True) and mistral.has_window
    m = init(CFG, jax.random.key(0))
    assert (
        float(jnp.abs(m.layers.mlp_out_norm).max()) == 0.0 and float(jnp.abs(m.norm).max()) == 0.0
    )  # identity
    with pytest.raises(ValueError, match="layer_types must be a tuple"):
        ModelConfig(**{**CFG.__dict__, "layer_types": ("sliding", "full")})
    with pytest.raises(ValueError, match="norm_weight"):
        ModelConfig(**{**CFG.__dict__, "norm_weight": "w+1"})


def test_layers_scan_once_with_their_kinds():
    """Mixed kinds: one scan over the L layers with a [L] bool of kinds; uniform kinds: no kinds at all."""

    def scanned_bools(cfg):
        jaxpr = jax.make_jaxpr(lambda m, x: m(x))(
            init(cfg, jax.random.key(0)), jnp.zeros((1, 4), jnp.int32)
        )
        (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        assert scan.params["length"] == 3
        xs = scan.invars[scan.params["num_consts"] + scan.params["num_carry"] :]
        return [v.aval.shape for v in xs if v.aval.dtype == jnp.bool_]

    assert scanned_bools(CFG) == [(3,)]
    assert scanned_bools(ModelConfig(**{**CFG.__dict__, "layer_types": ("sliding",) * 3})) == []


def test_window_local_rope_and_scalar_change_the_logits():
    """Each Gemma trait is live (so the parity tests would see it wrong)."""
    ids = jax.random.randint(jax.random.key(3), (1, 12), 0, CFG.vocab_size)
    base = np.asarray(_model()(ids))
    np.testing.assert_allclose(base, np_forward(_model(), ids), atol=1e-4, rtol=1e-4)
    for change in (
        dict(layer_types=("full",) * 3),
        dict(rope_local_theta=1e6),
        dict(query_pre_attn_scalar=8.0),
        dict(sliding_window=6),
    ):
        other = np.asarray(_model(ModelConfig(**{**CFG.__dict__, **change}))(ids))
        assert np.abs(other - base).max() > 1e-3, change


def test_embeddings_scaled_in_their_dtype():
    """``sqrt(3072) = 55.4256`` rounds to 55.5 in bfloat16, as transformers' Gemma 3 does."""
    cfg = family_config(
        "gemma3_text",
        vocab_size=4,
        hidden_size=3072,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
        layer_types=("full",),
        rope_local_theta=1e4,
        query_pre_attn_scalar=8.0,
    )
    m = init(cfg, jax.random.key(0), param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)
    got = embed(m, jnp.asarray([[1]]))
    np.testing.assert_array_equal(
        np.asarray(got[0, 0], np.float32), np.asarray(m.embed[1] * jnp.bfloat16(55.5), np.float32)
    )


# ----------------------------------------------------------------------------- trainer and sampler


@pytest.mark.slow  # make test-all; the property: test_train.py (windows: [4]), Gemma 3's trainer log-probs: below
def test_prefix_shared_forward_equals_full_sequence():
    """The trainer's forward (scan with per-layer kinds, prompt shared by G completions, traced
    windows in the group attention) equals the plain forward on [prompt | completion], values and
    gradients, in every mode the update uses."""
    model = _model()
    p, g, n, lp = 2, 3, 6, 7
    ids, pm = _prompts(p, lp, [7, 4])
    comp = jax.random.randint(jax.random.key(1), (p, g, n), 0, CFG.vocab_size)
    cm = np.ones((p, g, n), np.int32)
    cm[0, 1, 4:] = 0
    cm = jnp.asarray(cm)
    full = jnp.concatenate([jnp.repeat(ids, g, 0), comp.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), cm.reshape(p * g, n)], 1)
    assert resolve_attention("auto", model) == "group"
    with pytest.raises(ValueError, match="no sliding window"):
        resolve_attention("dense", model)

    def shared(m, how: ForwardPass, rope=None):
        return completion_logprobs(m, ids, pm, comp, cm, how, temperature=0.7, rope=rope)

    direct = lambda m: token_logprobs(m, full, fmask, temperature=0.7)[:, lp - 1 :].reshape(p, g, n)
    want = direct(model)
    masked = lambda x: np.where(cm, x, 0)
    rope = completion_rope(CFG, pm, g, n)
    assert rope.prompt_local is not None and rope.completion_local is not None
    for how, tables in ((ForwardPass(), None), (ForwardPass(groups_per_pass=1), rope)):
        np.testing.assert_allclose(
            masked(shared(model, how, tables)), masked(want), atol=1e-5, err_msg=str(how)
        )
    w = jax.random.normal(jax.random.key(2), (p, g, n)) * cm
    g_direct = jax.grad(lambda m: jnp.sum(w * direct(m)))(model)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(g_direct))
    for how in (ForwardPass(), ForwardPass(unroll=True, save_attention=True)):
        g_shared = jax.grad(lambda m: jnp.sum(w * shared(m, how)))(model)
        chex.assert_trees_all_close(g_shared, g_direct, atol=1e-5 * scale, rtol=1e-4)


@pytest.mark.slow
def test_sampler_logprobs_equal_trainer_logprobs():
    """The prefix-shared decode (per-layer windows and RoPE tables, static per layer) samples
    tokens whose log-probs both training forwards reproduce."""
    model = _model()
    p, g, n, lp = 2, 3, 8, 6
    ids, pm = _prompts(p, lp, [6, 2], seed=1)
    r = rollout.generate(
        model,
        ids,
        pm,
        key=jax.random.key(4),
        num_generations=g,
        max_new_tokens=n,
        temperature=0.8,
        eos_ids=(),
        cache_chunk=4,
    )
    assert np.all(np.asarray(r.mask) == 1)
    train = completion_logprobs(model, ids, pm, r.tokens, r.mask, temperature=0.8)
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(train), atol=2e-5, rtol=0)
    full = jnp.concatenate([jnp.repeat(ids, g, 0), r.tokens.reshape(p * g, n)], 1)
    fmask = jnp.concatenate([jnp.repeat(pm, g, 0), r.mask.reshape(p * g, n)], 1)
    plain = token_logprobs(model, full, fmask, temperature=0.8)[:, lp - 1 :].reshape(p, g, n)
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(plain), atol=2e-5, rtol=0)


# ----------------------------------------------------------------------------- config.json

HUB_1B = {  # google/gemma-3-1b-it as written by transformers 4.50 (text-only Gemma3ForCausalLM)
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "cache_implementation": "hybrid",
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "initializer_range": 0.02,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.50.0.dev0",
    "use_cache": True,
    "vocab_size": 262144,
}


def test_hub_config_parses_and_round_trips():
    cfg = config_from_hf(HUB_1B, source="config.json")
    assert cfg.family == "gemma3_text" and cfg.head_dim == 256 and cfg.num_kv_heads == 1
    assert cfg.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(26))
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert (cfg.sliding_window, cfg.query_pre_attn_scalar, cfg.eos_token_id) == (
        512,
        256.0,
        (1, 106),
    )
    assert cfg.tie_word_embeddings and cfg.activation == "gelu_tanh" and cfg.pad_token_id == 0
    # 4B-style global RoPE scaling; the 5.x layout (nested rope_parameters, no top-level thetas)
    scaled = config_from_hf(
        {**HUB_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, source="c"
    )
    assert scaled.rope_scaling == RopeScaling("linear", 8.0) and scaled.rope_local_theta == 1e4
    v5 = config_to_hf(scaled, jnp.bfloat16)
    assert v5["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert v5["query_pre_attn_scalar"] == 256 and v5["hidden_activation"] == "gelu_pytorch_tanh"
    for k in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"):
        v5.pop(k, None)
    assert config_from_hf(v5, source="c") == scaled


@pytest.mark.parametrize(
    "patch, match",
    [
        (
            dict(final_logit_softcapping=30.0),
            r"field 'final_logit_softcapping' = 30.0: logit softcapping is not supported",
        ),
        (dict(attn_logit_softcapping=50.0), r"field 'attn_logit_softcapping' = 50.0"),
        (
            dict(use_bidirectional_attention=True),
            r"field 'use_bidirectional_attention' = true is not supported",
        ),
        (dict(hidden_activation="gelu"), r"field 'hidden_activation' = 'gelu' is not supported"),
        (
            dict(rope_parameters={"rope_type": "default"}),
            r"field 'rope_parameters' must be null or an object of",
        ),
        (
            dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
            r"field 'rope_parameters.sliding_attention.rope_type' = 'linear': the sliding layers' RoPE must be 'default'",  # noqa: E501
        ),
        (dict(layer_types=["sliding_attention"] * 3), r"field 'layer_types' must list"),
    ],
)
def test_config_errors_name_the_field(patch, match):
    with pytest.raises(HFFormatError, match=r"^ckpt/config\.json: " + match):
        config_from_hf({**HUB_1B, **patch}, source="ckpt/config.json")


def test_config_to_hf_rejects_what_gemma3_cannot_express():
    with pytest.raises(ValueError, match=r"sandwich_norms=False \(gemma3_text has True\)"):
        config_to_hf(ModelConfig(**{**CFG.__dict__, "sandwich_norms": False}), jnp.float32)
    with pytest.raises(ValueError, match=r"rope_local_theta=None \(required\)"):
        config_to_hf(ModelConfig(**{**CFG.__dict__, "rope_local_theta": None}), jnp.float32)
    llama = ModelConfig(
        **{
            **CFG.__dict__,
            "family": "llama",
            "norm_weight": "w",
            "sandwich_norms": False,
            "qk_norm": False,
            "scale_embeddings": False,
            "sliding_window": None,
        }
    )
    with pytest.raises(ValueError, match=r"layer_types=.*\(gemma3_text only\)"):
        config_to_hf(llama, jnp.float32)
