"""Mixture-of-experts checkpoints (Qwen3-MoE, Mixtral, Qwen2-MoE) <-> transformers.

Tiny random models are built with transformers, saved as safetensors (one tensor per expert:
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1``)
and loaded by relax, and the reverse; float32 logits agree on a plain and a left-padded batch,
greedy generation gives transformers' tokens, and the config (experts, top-k and its
renormalisation, dense layers from ``mlp_only_layers`` / ``decoder_sparse_step``, the shared
expert) round-trips. The cases cover a dense layer between sparse ones (the dense MLP's tensors
on it only, the experts' on the others), an all-sparse model with a sliding window, Mixtral's
expert width ``intermediate_size``, and Qwen2-MoE's shared expert with and without q/k/v biases.
Router weights are drawn with std 0.3 (not transformers' 0.02), and every test checks that the
top-k choices are decisive (no near-ties that float32 noise could flip).

The tests without transformers check the error paths (a missing, misplaced or misshapen expert
tensor names its file and name), the config spellings and ``relax.plan.depth`` on MoE configs.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_hf import assert_bit_exact

from relax.models import ModelConfig, family_config
from relax.models.config.families import FAMILIES
from relax.models.decoder.transformer import LayerStack, Transformer
from relax.models.hf.checkpoint import (
    HFFormatError,
    config_from_hf,
    config_to_hf,
    load_pretrained,
    read_config,
    save_pretrained,
)
from relax.plan import depth

try:
    import torch
    import transformers
    from test_hf_parity import _batches, _hf_logits, _relax_logits
    from test_rollout_parity import N_NEW, PAD, _hf_generate, _pick_stop_id, _prompts
except ImportError:  # the tests that need transformers are skipped
    transformers = None

needs_transformers = pytest.mark.skipif(transformers is None, reason="needs torch and transformers")

ATOL = 1e-5
MARGIN = 1e-4  # the least gap between the k-th and (k+1)-th router logit of any token (float32 noise: ~1e-6)
ROUTER_STD = (
    0.3  # router weights' std (transformers initialises 0.02): logits of std ~2, rarely near-tied
)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
HF_BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters=ROPE,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    router_aux_loss_coef=0.001,
)
QWEN_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)

# name: (transformers config class, its overrides, the relax ModelConfig fields they mean)
CASES = {
    "qwen3_moe_dense_layer_normalised": (
        "Qwen3MoeConfig",
        dict(QWEN_EXPERTS, mlp_only_layers=[1], norm_topk_prob=True),
        dict(family="qwen3_moe", **QWEN_EXPERTS, dense_layers=(1,), norm_topk_prob=True),
    ),
    "qwen3_moe_all_sparse_unnormalised_window": (
        "Qwen3MoeConfig",
        dict(
            QWEN_EXPERTS,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            use_sliding_window=True,
            sliding_window=5,
        ),
        dict(family="qwen3_moe", **QWEN_EXPERTS | dict(num_experts_per_tok=3), sliding_window=5),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2),
        dict(
            family="mixtral",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
        ),
    ),
    "qwen2_moe_shared_dense_layer": (
        "Qwen2MoeConfig",
        dict(QWEN_EXPERTS, shared_expert_intermediate_size=24, mlp_only_layers=[2]),
        dict(
            family="qwen2_moe",
            **QWEN_EXPERTS,
            shared_expert_size=24,
            dense_layers=(2,),
            qkv_bias=True,
        ),
    ),
    "qwen2_moe_shared_no_bias_tied": (
        "Qwen2MoeConfig",
        dict(
            QWEN_EXPERTS,
            shared_expert_intermediate_size=24,
            norm_topk_prob=True,
            qkv_bias=False,
            tie_word_embeddings=True,
        ),
        dict(
            family="qwen2_moe",
            **QWEN_EXPERTS,
            shared_expert_size=24,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
    ),
}


def expected_config(case: str) -> ModelConfig:
    """The relax config the case's transformers config means."""
    fields = dict(CASES[case][2])
    return family_config(fields.pop("family"), **BASE, **fields)


def _is_router(name: str) -> bool:
    """A router weight (transformers' ``mlp.gate.weight`` / ``block_sparse_moe.gate.weight``; relax's
    ``router``), not the shared expert's ``shared_expert_gate`` / ``shared_router``."""
    return name.endswith(".gate.weight") or name.endswith(".router")


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A relax model of ``cfg`` from NumPy: weights N(0, 0.1), routers N(0, ROUTER_STD) (decisive top-k),
    norm weights 1 + N(0, 0.3); built from ``stacked_shapes`` (each field on the layers that have it)."""
    rng = np.random.default_rng(seed)
    draw = lambda shape, std, mean=0.0: jnp.asarray(
        mean + std * rng.standard_normal(shape), jnp.float32
    )  # noqa: E731
    std = lambda name: ROUTER_STD if name == "router" else 0.1  # noqa: E731
    fields = {
        name: draw(shape, 0.3, 1.0) if name.endswith("norm") else draw(shape, std(name))
        for name, shape in cfg.stacked_shapes().items()
    }
    D, V = cfg.hidden_size, cfg.vocab_size
    return Transformer(
        embed=draw((V, D), 0.1),
        layers=LayerStack(**fields),
        norm=draw((D,), 0.3, 1.0),
        lm_head=None if cfg.tie_word_embeddings else draw((V, D), 0.1),
        config=cfg,
    )


# ----------------------------------------------------------------------------- without transformers


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_round_trip(case):
    """read -> write -> read gives the same config; the written fields are the family's spelling."""
    cfg = expected_config(case)
    d = json.loads(json.dumps(config_to_hf(cfg, jnp.float32)))
    assert config_from_hf(d, source="config.json") == cfg
    rec = FAMILIES[cfg.family]
    assert (
        d[rec.moe_names["num_experts"][0]] == cfg.num_experts
        and d["num_experts_per_tok"] == cfg.num_experts_per_tok
    )
    if rec.moe == "qwen":
        assert (d["mlp_only_layers"], d["decoder_sparse_step"]) == (list(cfg.dense_layers), 1)
        assert (
            d["moe_intermediate_size"] == cfg.moe_intermediate_size
            and d["norm_topk_prob"] == cfg.norm_topk_prob
        )
    else:  # Mixtral: the experts' width is intermediate_size; no dense layers, always renormalised
        assert (
            "mlp_only_layers" not in d
            and "norm_topk_prob" not in d
            and d["router_jitter_noise"] == 0.0
        )
    assert "router_z_loss_coef" not in d  # written only when set
    z = dataclasses.replace(cfg, router_z_loss_coef=0.01, output_router_logits=True)
    assert config_from_hf(config_to_hf(z, jnp.float32), source="config.json") == z


def test_config_spellings():
    """Qwen3-MoE reads ``num_experts`` as ``num_local_experts``; ``decoder_sparse_step`` and
    ``mlp_only_layers`` together; a file without experts is a dense model; Mixtral's jitter is
    accepted; Qwen2-MoE's absent ``layer_types`` slide the even layers below ``max_window_layers``."""
    d = config_to_hf(expected_config("qwen3_moe_dense_layer_normalised"), jnp.float32)
    alias = {k: v for k, v in d.items() if k != "num_local_experts"} | {"num_experts": 4}
    assert config_from_hf(alias, source="c") == config_from_hf(d, source="c")
    assert (
        config_from_hf({**d, "num_experts": None}, source="c").num_experts == 4
    )  # a null alias: not set
    stepped = config_from_hf(
        {**d, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}, source="c"
    )
    assert stepped.dense_layers == (0, 2, 3, 4) and stepped.sparse_layers == (
        False,
        True,
        False,
        False,
        False,
        True,
    )
    dense = config_from_hf({**d, "num_local_experts": 0}, source="c")
    assert dense.num_experts == 0 and dense.dense_layers == () and "w_gate" in dense.layer_shapes()
    mixtral = config_to_hf(expected_config("mixtral"), jnp.float32)
    assert config_from_hf({**mixtral, "router_jitter_noise": 0.1}, source="c") == expected_config(
        "mixtral"
    )
    q2 = {
        k: v
        for k, v in config_to_hf(
            expected_config("qwen2_moe_shared_dense_layer"), jnp.float32
        ).items()
        if k != "layer_types"
    }
    q2.update(use_sliding_window=True, sliding_window=4)
    assert (
        config_from_hf({**q2, "max_window_layers": 0}, source="c").sliding_window is None
    )  # no layer slides
    with pytest.raises(
        HFFormatError, match="mixed sliding and full"
    ):  # layer 0 slides, 1 and 2 do not
        config_from_hf({**q2, "max_window_layers": 28}, source="c")


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            dict(num_local_experts=0),
            r"c: field 'num_local_experts' must be >= 1, got 0 \(every mixtral layer",
        ),
        (
            dict(num_experts_per_tok=5),
            r"c: ModelConfig.num_experts_per_tok=5 must be in 1..num_experts=4",
        ),
        (
            dict(num_experts_per_tok=None),
            r"c: field 'num_experts_per_tok' must be an integer, got None",
        ),
    ],
)
def test_config_errors_name_the_field(fields, match):
    d = config_to_hf(expected_config("mixtral"), jnp.float32)
    with pytest.raises(HFFormatError, match=match):
        config_from_hf({**d, **fields}, source="c")


def test_qwen_config_errors():
    d = config_to_hf(expected_config("qwen2_moe_shared_dense_layer"), jnp.float32)
    with pytest.raises(
        HFFormatError, match=r"'shared_expert_intermediate_size' must be >= 1 \(every qwen2_moe"
    ):
        config_from_hf({**d, "shared_expert_intermediate_size": 0}, source="c")
    with pytest.raises(HFFormatError, match=r"'decoder_sparse_step' must be >= 1, got 0"):
        config_from_hf({**d, "decoder_sparse_step": 0}, source="c")
    with pytest.raises(HFFormatError, match=r"'mlp_only_layers' must be a list of layer indices"):
        config_from_hf({**d, "mlp_only_layers": "1"}, source="c")


@pytest.mark.parametrize(
    "cfg, match",
    [
        (family_config("llama", **BASE, **QWEN_EXPERTS), r"num_experts=4 \(llama has no experts\)"),
        (
            family_config("mixtral", **BASE),
            r"num_experts=0 \(every mixtral layer is a mixture of experts\)",
        ),
        (
            family_config("mixtral", **BASE, **QWEN_EXPERTS, norm_topk_prob=True),
            r"moe_intermediate_size=16 with intermediate_size=48 \(mixtral has one intermediate_size\)",
        ),
        (
            family_config(
                "mixtral",
                **BASE,
                **QWEN_EXPERTS | dict(moe_intermediate_size=48),
                dense_layers=(1,),
            ),
            r"norm_topk_prob=False \(mixtral has True\); dense_layers=\(1,\) \(every mixtral layer is sparse\)",
        ),
        (
            family_config("qwen3_moe", **BASE, **QWEN_EXPERTS, shared_expert_size=8),
            r"shared_expert_size=8 \(qwen3_moe has 0\)",
        ),
        (
            family_config("qwen2_moe", **BASE, **QWEN_EXPERTS, qkv_bias=True),
            r"shared_expert_size=0 \(qwen2_moe always has a shared expert\)",
        ),
    ],
)
def test_inexpressible_configs_are_refused_on_save(cfg, match):
    with pytest.raises(ValueError, match=match):
        config_to_hf(cfg, jnp.float32)


def _resave(path, edit):
    """Rewrite ``path``'s weights through ``edit(tensors dict)``."""
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_checkpoint_round_trip_and_tensor_errors(tmp_path):
    """A save -> load round trip is bit-exact; a missing expert, an expert tensor on the dense
    layer (or a dense one on a sparse layer) and a misshapen expert are errors naming the file
    and the tensor."""
    cfg = expected_config("qwen2_moe_shared_dense_layer")
    model = random_model(cfg)
    save_pretrained(model, tmp_path / "m")
    assert_bit_exact(model, load_pretrained(tmp_path / "m"))
    names = set(load_file(tmp_path / "m" / "model.safetensors"))
    assert {
        "model.layers.0.mlp.experts.3.down_proj.weight",
        "model.layers.1.mlp.shared_expert_gate.weight",
        "model.layers.2.mlp.gate_proj.weight",
    } <= names
    assert not {"model.layers.2.mlp.gate.weight", "model.layers.0.mlp.gate_proj.weight"} & names
    file = str(tmp_path / "m" / "model.safetensors")
    cases = [
        (
            lambda t: t.pop("model.layers.1.mlp.experts.2.up_proj.weight"),
            r"missing tensor 'model.layers.1.mlp.experts.2.up_proj.weight' for a qwen2_moe model with 3 layers "
            r"\(2 sparse: 4 experts\)",
        ),
        (
            lambda t: t.update({"model.layers.2.mlp.gate.weight": np.zeros((4, 32), np.float32)}),
            r"unexpected tensor 'model.layers.2.mlp.gate.weight'",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.up_proj.weight": np.zeros((48, 32), np.float32)}
            ),
            r"unexpected tensor 'model.layers.0.mlp.up_proj.weight'",
        ),
        (
            lambda t: t.update(
                {"model.layers.0.mlp.experts.1.down_proj.weight": np.zeros((32, 17), np.float32)}
            ),
            r"tensor 'model.layers.0.mlp.experts.1.down_proj.weight' has shape \[32, 17\], expected \[32, 16\]",
        ),
    ]
    for edit, match in cases:
        save_pretrained(model, tmp_path / "m")
        _resave(tmp_path / "m", edit)
        with pytest.raises(HFFormatError, match=f"{file}: {match}"):
            load_pretrained(tmp_path / "m")


def test_reduced_depth_keeps_the_mlp_kinds():
    """``relax.plan.depth`` truncates an MoE model to its first layers with their MLP kinds, and
    its period counts the MLP kinds with the attention kinds."""
    cfg = family_config(
        "qwen3_moe",
        **BASE | dict(num_layers=24),
        **QWEN_EXPERTS,
        dense_layers=tuple(range(0, 24, 2)),
    )
    assert depth.kinds_period(cfg) == 2 and depth.depths(cfg) == (4, 8)
    low = depth.shallow(cfg, 4)
    assert low.dense_layers == (0, 2) and low.sparse_layers == cfg.sparse_layers[:4]
    first_dense = dataclasses.replace(cfg, dense_layers=(0,))
    assert depth.kinds_period(first_dense) is None and depth.depths(first_dense) is None
    assert depth.shallow(first_dense, 4).dense_layers == (0,)
    assert depth.kinds_period(dataclasses.replace(cfg, dense_layers=())) == 1


# ----------------------------------------------------------------------------- against transformers


def _hf_model(case, seed=0, std=0.1):
    """The case's transformers model, every weight random (routers with ``ROUTER_STD``: decisive top-k)."""
    cls_name, overrides, _ = CASES[case]
    cfg = getattr(transformers, cls_name)(**{**HF_BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(
                1.0 + 0.3 * noise
                if "norm" in name
                else (ROUTER_STD if _is_router(name) else std) * noise
            )
    return model.eval()


def _assert_decisive(hf, ids, mask, k):
    """Every valid token's k-th router logit exceeds its (k+1)-th by ``MARGIN`` in every sparse
    layer, so float32 noise cannot change which experts relax and transformers pick."""
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            output_router_logits=True,
        )
    assert out.router_logits, "no sparse layer reported its router"
    valid = mask.reshape(-1).astype(bool)
    for logits in out.router_logits:
        top = np.sort(logits.float().numpy().reshape(valid.size, -1), axis=-1)[:, ::-1]
        if k < top.shape[1]:
            assert np.min((top[:, k - 1] - top[:, k])[valid]) > MARGIN


def _assert_same_logits(hf, model):
    ids, mask = _batches(model.config.vocab_size)
    _assert_decisive(hf, ids, mask, model.config.num_experts_per_tok)
    np.testing.assert_allclose(_relax_logits(model, ids), _hf_logits(hf, ids), atol=ATOL, rtol=0)
    valid = mask.astype(bool)
    got, want = _relax_logits(model, ids, mask), _hf_logits(hf, ids, mask)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)


@pytest.mark.parity
@needs_transformers
@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_checkpoint_loads_with_same_logits(case, tmp_path):
    """(a) transformers' checkpoint -> relax: the same logits; (d) its config.json reads as the
    expected config, which writes back to what transformers reads as the same."""
    hf = _hf_model(case)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg = expected_config(case)
    assert read_config(tmp_path) == cfg
    model = load_pretrained(tmp_path)
    assert model.config == cfg
    assert model.layers.expert_gate.shape == (
        cfg.num_sparse_layers,
        4,
        32,
        cfg.moe_intermediate_size,
    )
    _assert_same_logits(hf, model)
    d = config_to_hf(cfg, jnp.float32)
    theirs = transformers.AutoConfig.for_model(d.pop("model_type"), **d).to_dict()
    assert config_from_hf(theirs, source="to_dict") == cfg


@pytest.mark.parity
@needs_transformers
@pytest.mark.parametrize("case", sorted(CASES))
def test_relax_checkpoint_loads_in_transformers(case, tmp_path):
    """(c) relax's save -> transformers: the same logits and config; relax's reload: the same tensors."""
    model = random_model(expected_config(case), seed=1)
    save_pretrained(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == FAMILIES[model.config.family].causal_lm
    assert config_from_hf(hf.config.to_dict(), source="to_dict") == model.config
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert tuple(sparse) == model.config.sparse_layers
    _assert_same_logits(hf, model)
    assert_bit_exact(model, load_pretrained(tmp_path))


@pytest.mark.parity
@needs_transformers
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_greedy_generate_matches_transformers(case, tmp_path):
    """(b) relax's greedy sampler gives ``generate``'s tokens and log-probs on a left-padded
    ragged batch, one row stopping early."""
    from relax.rollout import sampler as rollout

    hf = _hf_model(
        case, std=0.3
    )  # weights of std 0.3: varied continuations, not one token repeated
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_pretrained(tmp_path)
    vocab = model.config.vocab_size
    ids, mask = _prompts(vocab)
    _assert_decisive(hf, ids, mask, model.config.num_experts_per_tok)
    stop = _pick_stop_id(_hf_generate(hf, ids, mask, eos=vocab)[0])
    want, scores = _hf_generate(hf, ids, mask, eos=stop)
    r = rollout.generate(
        model,
        ids.astype(np.int32),
        mask.astype(np.int32),
        key=jax.random.key(0),
        num_generations=1,
        max_new_tokens=N_NEW,
        temperature=0.0,
        eos_ids=(stop,),
        pad_id=PAD,
    )
    toks, rmask, logps = (np.asarray(x)[:, 0] for x in (r.tokens, r.mask, r.logprobs))
    n = want.shape[1]
    assert np.all(toks[:, n:] == PAD) and np.all(rmask[:, n:] == 0)
    np.testing.assert_array_equal(toks[:, :n], want)
    assert np.asarray(r.finished)[0, 0] and rmask[0].sum() < N_NEW, "row 0 must stop early"
    valid = rmask[:, :n].astype(bool)
    np.testing.assert_allclose(logps[:, :n][valid], scores[valid], atol=2e-4, rtol=0)
