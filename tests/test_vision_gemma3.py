"""Gemma 3 with images (relax.models.vision.siglip, .gemma3, .gemma3_checkpoint) against
transformers' ``Gemma3ForConditionalGeneration`` on a tiny random model (float32, eval).

The model: 2 text layers (sliding window 3, then full), 4 soft tokens per image, so an image's
block of 4 tokens is longer than the window (the sliding layers' AND(window, OR(causal, block))
rule is visible); a 2-layer SigLIP tower on 32 x 32 images of 8 x 8 patches (a 4 x 4 grid
pooled 2 x 2), with the pooling head transformers adds by default (skipped on load). Every
weight is random, norms and biases off identity, the projector's weight too (transformers
initialises it to zeros). Prompts are laid out as Gemma3Processor does: ``<boi>``, the image
tokens, ``<eoi>``; ``token_type_ids`` are 1 on image tokens.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

import relax.models.decoder.transformer as tfm  # noqa: E402
from relax.models.decoder.prompt_inputs import prompt_embeddings, prompt_hidden_states  # noqa: E402
from relax.models.hf.config import HFFormatError  # noqa: E402
from relax.models.vision.gemma3 import gemma3_prompt_inputs, image_features, vlm_logits  # noqa: E402
from relax.models.vision.gemma3_checkpoint import gemma3_config_from_hf, load_gemma3, save_gemma3  # noqa: E402
from relax.models.vision.siglip import SiglipConfig, init_siglip, siglip_forward  # noqa: E402

pytestmark = pytest.mark.parity

ATOL = 2e-4  # logits (float32: what we get is ~3e-6)
BOI, EOI, IMG, MM = 120, 121, 122, 4
IMAGE = [BOI] + [IMG] * MM + [EOI]
# 0, 2 and 1 images; different lengths, so the batch is left-padded
ROWS = [[5, 6, 7, 8, 9, 10, 11], [5, *IMAGE, 10, 11, *IMAGE, 12], [7, 8, *IMAGE, 30, 31]]
IMAGE_ROWS = [1, 1, 2]


def _hf_model(tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Gemma3Config(
        text_config=dict(
            vocab_size=128,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=3,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            max_position_embeddings=128,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        mm_tokens_per_image=MM,
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMG,
        tie_word_embeddings=tie,
    )
    m = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for _, p in m.named_parameters():
            if p.ndim == 1:  # norms (1 + w and LayerNorm) and biases off identity / zero
                p.add_(0.3 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    return m


def _batch(rows=ROWS):
    t = max(map(len, rows))
    ids, mask = np.zeros((len(rows), t), np.int64), np.zeros((len(rows), t), np.int64)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :], mask[i, t - len(r) :] = r, 1
    return ids, mask


def _pixels(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 32, 32, generator=g) * 2 - 1


def _hf_logits(m, ids, mask, pix, *, positions=True):
    kw = dict(position_ids=torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))) if positions else {}
    with torch.no_grad():
        return m(
            input_ids=torch.tensor(ids),
            pixel_values=pix,
            attention_mask=torch.tensor(mask),
            token_type_ids=torch.tensor((ids == IMG).astype(np.int64)),
            **kw,
        ).logits.numpy()


def _relax_logits(model, vision, ids, mask, pix, rows):
    pv = None if pix is None else jnp.asarray(pix.numpy())
    return np.asarray(
        vlm_logits(model, vision, jnp.asarray(ids), jnp.asarray(mask), pv, jnp.asarray(rows))
    )


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    m = _hf_model()
    path = tmp_path_factory.mktemp("gemma3") / "hf"
    m.save_pretrained(path)
    model, vision = load_gemma3(path)
    ids, mask = _batch()
    pix = _pixels(3)
    return dict(
        m=m,
        path=path,
        model=model,
        vision=vision,
        ids=ids,
        mask=mask,
        pix=pix,
        ref=_hf_logits(m, ids, mask, pix),
    )


def _diff(a, b, mask):
    return float(np.abs(a - b)[mask.astype(bool)].max())


# ----------------------------------------------------------------------------- forward


def test_image_features_match_transformers(tied):
    pix = _pixels(3, seed=1)
    with torch.no_grad():
        want = tied["m"].model.get_image_features(pix).pooler_output.numpy()
    got = np.asarray(image_features(tied["vision"], jnp.asarray(pix.numpy())))
    assert got.shape == (3, MM, 32)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_logits_match_transformers_left_padded_batch(tied):
    """Rows of 0, 2 and 1 images in one left-padded batch (transformers given the positions
    of the valid tokens, as generate computes them)."""
    got = _relax_logits(
        tied["model"], tied["vision"], tied["ids"], tied["mask"], tied["pix"], IMAGE_ROWS
    )
    assert _diff(got, tied["ref"], tied["mask"]) < ATOL


@pytest.mark.parametrize("row", [0, 1, 2])
def test_logits_match_transformers_one_row(tied, row):
    """Each row alone, unpadded, transformers with its default positions (0 images: pixel_values None)."""
    ids, mask = _batch([ROWS[row]])
    n = IMAGE_ROWS.count(row)
    pix = _pixels(n, seed=2) if n else None
    want = _hf_logits(tied["m"], ids, mask, pix, positions=False)
    got = _relax_logits(tied["model"], tied["vision"], ids, mask, pix, [0] * n)
    assert _diff(got, want, mask) < ATOL


def test_the_mask_rules_are_live(tied):
    """Without the image blocks, or with the window not cutting them, the logits move far beyond
    the tolerance: the parity tests above see the mask."""
    model, vision, ids, mask = (
        tied["model"],
        tied["vision"],
        jnp.asarray(tied["ids"]),
        jnp.asarray(tied["mask"]),
    )
    pix = jnp.asarray(tied["pix"].numpy())

    def logits(m, blocks=True):
        inputs = gemma3_prompt_inputs(m, vision, ids, mask, pix)
        pos = tfm.positions_from_mask(mask)
        attend = tfm.full_attention(m, pos, mask.astype(bool), inputs.blocks if blocks else None)
        h, _, _ = tfm.run_layers(
            m,
            prompt_embeddings(m, ids, inputs),
            pos,
            lambda *a: (attend(*a)[0], None),
            rope=inputs.rope,
        )
        return np.asarray(tfm.project(m, h))

    assert _diff(logits(model), tied["ref"], tied["mask"]) < ATOL
    assert _diff(logits(model, blocks=False), tied["ref"], tied["mask"]) > 1e-2
    wide = dataclasses.replace(model, config=dataclasses.replace(model.config, sliding_window=64))
    assert _diff(logits(wide), tied["ref"], tied["mask"]) > 1e-2


def _hf_greedy(tied, steps):
    """transformers' cached greedy ``generate`` of the batch: the new tokens ``[b, steps]``."""
    ids, mask = tied["ids"], tied["mask"]
    with torch.no_grad():
        out = tied["m"].generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=tied["pix"],
            token_type_ids=torch.tensor((ids == IMG).astype(np.int64)),
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=None,
        )
    return out[:, ids.shape[1] :].numpy()


@pytest.mark.slow
def test_greedy_decoding_matches_generate(tied):
    """Greedy tokens from re-running the full forward equal transformers' cached generate."""
    steps = 5
    ids, mask, pix = tied["ids"], tied["mask"], tied["pix"]
    want = _hf_greedy(tied, steps)
    assert want.shape == (3, steps)
    for _ in range(steps):
        logits = _relax_logits(tied["model"], tied["vision"], ids, mask, pix, IMAGE_ROWS)
        nxt = logits[:, -1].argmax(-1)
        ids, mask = (
            np.concatenate([ids, nxt[:, None]], 1),
            np.concatenate([mask, np.ones((3, 1), np.int64)], 1),
        )
    np.testing.assert_array_equal(ids[:, -steps:], want)


# ----------------------------------------------------------------------------- checkpoints


def test_save_loads_in_transformers(tied, tmp_path):
    save_gemma3(tied["model"], tied["vision"], tmp_path / "out")
    m2, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not any(info.values()), info
    got = _hf_logits(m2.eval(), tied["ids"], tied["mask"], tied["pix"])
    np.testing.assert_array_equal(got, tied["ref"])  # the same weights, bit for bit
    # and relax reads its own save back exactly
    model, vision = load_gemma3(tmp_path / "out")
    for a, b in zip(
        jax.tree.leaves((model, vision)), jax.tree.leaves((tied["model"], tied["vision"]))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_untied_head_both_ways(tmp_path):
    m = _hf_model(tie=False, seed=3)
    m.save_pretrained(tmp_path / "hf")
    assert "language_model.lm_head.weight" in load_file(tmp_path / "hf" / "model.safetensors")
    model, vision = load_gemma3(tmp_path / "hf")
    assert model.lm_head is not None and not model.config.tie_word_embeddings
    ids, mask = _batch(ROWS[2:])
    pix = _pixels(1)
    want = _hf_logits(m, ids, mask, pix)
    assert _diff(_relax_logits(model, vision, ids, mask, pix, [0]), want, mask) < ATOL
    save_gemma3(model, vision, tmp_path / "out")
    m2, info = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "out", output_loading_info=True
    )
    assert not any(info.values()), info
    np.testing.assert_array_equal(_hf_logits(m2.eval(), ids, mask, pix), want)


def test_reads_transformers_5_in_memory_names(tied, tmp_path):
    """``model.language_model.*``, ``model.vision_tower.*``, ``model.multi_modal_projector.*`` and
    a ``lm_head.weight`` equal to the embedding (a tied model's state dict)."""
    d = tmp_path / "sd"
    d.mkdir()
    (d / "config.json").write_text((tied["path"] / "config.json").read_text())
    save_file({k: v.clone() for k, v in tied["m"].state_dict().items()}, d / "model.safetensors")
    model, vision = load_gemma3(d)
    for a, b in zip(
        jax.tree.leaves((model, vision)), jax.tree.leaves((tied["model"], tied["vision"]))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_image_token_count_is_checked_per_row(tied):
    ids, mask = _batch([ROWS[1], [7, 8, BOI, IMG, IMG, IMG, EOI, 30, 31]])
    pix = _pixels(3)
    with pytest.raises(
        ValueError,
        match=r"row 1: 3 image tokens \(id 122\), expected 1 image\(s\) x mm_tokens_per_image 4",
    ):
        _relax_logits(tied["model"], tied["vision"], ids, mask, pix, [0, 0, 1])
    with pytest.raises(ValueError, match="11 image tokens .* in the batch, expected 3"):
        vlm_logits(
            tied["model"],
            tied["vision"],
            jnp.asarray(ids),
            jnp.asarray(mask),
            jnp.asarray(pix.numpy()),
        )


def _rewrite(src, dst, drop=(), change=None):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    sd = {k: v for k, v in sd.items() if k not in drop}
    if change:
        sd[change] = sd[change][:-1]
    save_file(sd, dst / "model.safetensors")


def test_checkpoint_errors_name_file_and_tensor(tied, tmp_path):
    save_gemma3(tied["model"], tied["vision"], tmp_path / "ok")
    fc2 = "vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias"
    _rewrite(tmp_path / "ok", tmp_path / "a", drop=[fc2])
    with pytest.raises(
        HFFormatError, match=f"model.safetensors: missing vision tower tensor '{fc2}'"
    ):
        load_gemma3(tmp_path / "a")
    q = "language_model.model.layers.0.self_attn.q_proj.weight"
    _rewrite(tmp_path / "ok", tmp_path / "b", change=q)
    with pytest.raises(
        HFFormatError, match=rf"model.safetensors: tensor '{q}' has shape \[31, 32\]"
    ):
        load_gemma3(tmp_path / "b")
    proj = "multi_modal_projector.mm_input_projection_weight"
    _rewrite(tmp_path / "ok", tmp_path / "c", change=proj)
    with pytest.raises(
        HFFormatError, match=rf"tensor '{proj}' has shape \[31, 32\], expected \[32, 32\]"
    ):
        load_gemma3(tmp_path / "c")
    norm = "language_model.model.norm.weight"
    _rewrite(tmp_path / "ok", tmp_path / "d", drop=[norm])
    with pytest.raises(HFFormatError, match=f"missing tensor '{norm}'"):
        load_gemma3(tmp_path / "d")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "a" / "config.json").write_text(
        json.dumps({**cfg, "model_type": "llava", "architectures": ["X"]})
    )
    with pytest.raises(
        HFFormatError, match="config.json: field 'model_type' = 'llava'.*not a Gemma 3"
    ):
        load_gemma3(tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text(json.dumps({**cfg, "mm_tokens_per_image": 3}))
    with pytest.raises(HFFormatError, match="config.json: mm_tokens_per_image=3 must be a square"):
        load_gemma3(tmp_path / "a")


def test_config_defaults_are_transformers(tied):
    """A Hub-style config.json leaves most fields out: relax fills transformers' defaults."""
    sparse = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": {"hidden_size": 2560, "model_type": "gemma3_text", "num_hidden_layers": 34},
        "vision_config": {
            "hidden_size": 1152,
            "image_size": 896,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    hf = transformers.Gemma3Config(**json.loads(json.dumps(sparse)))
    text, vc = gemma3_config_from_hf(sparse, "config.json")
    t = hf.text_config
    assert {k: text[k] for k in ("vocab_size", "intermediate_size", "num_attention_heads")} == {
        "vocab_size": t.vocab_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
    }
    assert text["tie_word_embeddings"] is hf.tie_word_embeddings is True
    v = hf.vision_config
    assert (
        vc.vision.intermediate_size,
        vc.vision.num_layers,
        vc.vision.num_heads,
        vc.vision.layer_norm_eps,
    ) == (
        v.intermediate_size,
        v.num_hidden_layers,
        v.num_attention_heads,
        v.layer_norm_eps,
    )
    assert (vc.mm_tokens_per_image, vc.image_token_id, vc.boi_token_id, vc.eoi_token_id) == (
        hf.mm_tokens_per_image,
        hf.image_token_id,
        hf.boi_token_index,
        hf.eoi_token_index,
    )
    assert vc.pool == 4 and vc.vision.grid == 64


def test_siglip_layers_scan_once():
    """However deep the tower, its layers are one ``lax.scan``."""
    c = SiglipConfig(
        hidden_size=16, intermediate_size=24, num_layers=5, num_heads=2, image_size=16, patch_size=8
    )
    v = init_siglip(c, jax.random.key(0))
    jaxpr = jax.make_jaxpr(siglip_forward)(v, jnp.zeros((1, 3, 16, 16)))
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert scan.params["length"] == 5


# ------------------------------------------------ image prompts in the sampler and the trainer


def _inputs(t):
    return gemma3_prompt_inputs(
        t["model"],
        t["vision"],
        jnp.asarray(t["ids"], jnp.int32),
        jnp.asarray(t["mask"], jnp.int32),
        jnp.asarray(t["pix"].numpy()),
    )


def test_prefix_shared_logprobs_match_transformers(tied):
    """The prefix-shared forward over G completions per image prompt (images encoded and the
    prompt run once per group, its image blocks bidirectional) gives transformers' log-probs of
    the whole [prompt; completion] sequences."""
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs

    ids, mask = tied["ids"], tied["mask"]
    p, g, n = ids.shape[0], 2, 3
    tokens = np.random.default_rng(5).integers(3, IMG, (p, g, n))
    got = completion_logprobs(
        tied["model"],
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        jnp.asarray(tokens, jnp.int32),
        jnp.ones((p, g, n), jnp.int32),
        ForwardPass(attention="group"),
        prompt=_inputs(tied),
    )
    full = np.concatenate([np.repeat(ids, g, 0), tokens.reshape(p * g, n)], 1)
    fmask = np.concatenate([np.repeat(mask, g, 0), np.ones((p * g, n), np.int64)], 1)
    per_row = np.bincount(IMAGE_ROWS, minlength=p)
    starts = np.concatenate([[0], np.cumsum(per_row)])
    pix = torch.cat([tied["pix"][starts[r] : starts[r + 1]] for r in range(p) for _ in range(g)])
    logits = torch.tensor(_hf_logits(tied["m"], full, fmask, pix))
    want = torch.log_softmax(logits, -1)[:, ids.shape[1] - 1 : -1]
    want = torch.gather(want, -1, torch.tensor(tokens.reshape(p * g, n, 1)))[..., 0].numpy()
    np.testing.assert_allclose(np.asarray(got).reshape(p * g, n), want, atol=2e-5, rtol=0)


@pytest.mark.slow
def test_sampler_greedy_matches_generate(tied):
    """relax's sampler (each image prompt prefilled once for its G completions) decodes greedily
    what transformers' ``generate`` decodes, and its sampled log-probs are the trainer's."""
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs
    from relax.rollout.config import RolloutConfig
    from relax.rollout.sampler import generate_program
    from relax.rollout.sampling import SamplingConfig

    steps, g = 5, 2
    ids, mask = tied["ids"], tied["mask"]
    want = _hf_greedy(tied, steps)
    model, inputs = tied["model"], _inputs(tied)
    pid, pm = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)

    def sample(temperature, key):
        cfg = RolloutConfig(
            num_generations=g,
            max_new_tokens=steps,
            sampling=SamplingConfig(temperature=temperature),
            eos_ids=(),
            cache_chunk=2,
        )
        return generate_program(model, pid, pm, key, cfg, prompt=inputs)

    greedy = sample(0.0, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(greedy.tokens), np.repeat(want[:, None], g, 1))
    r = sample(1.0, jax.random.key(3))
    train = completion_logprobs(
        model, pid, pm, r.tokens, r.mask, ForwardPass(attention="group"), prompt=inputs
    )
    np.testing.assert_allclose(np.asarray(r.logprobs), np.asarray(train), atol=1e-5, rtol=0)


# ------------------------------------------------ other configs (held-out robustness)

OTHER = {
    # the Hub's 4B file shrunk: a sparse text_config (no layer_types: every 6th layer full),
    # linear RoPE scaling x8 on the full layers, no pooling head, bfloat16 weights computed in
    # float32; 18-pixel images of 4-pixel patches (the conv drops 2 rows and columns)
    "hub_4b_bf16": dict(
        text=dict(num_hidden_layers=7, sliding_window=4, rope_scaling={"rope_type": "linear", "factor": 8.0}),
        vision=dict(image_size=18, patch_size=4, vision_use_head=False),
        mm=4, tie=True, hub=True, bf16=True,
    ),
    # every other layer full, 16 soft tokens pooled 1 x 1 from a 4 x 4 grid, untied, other RoPE
    # bases and scalar
    "pattern_2_untied": dict(
        text=dict(
            num_hidden_layers=3, sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=12,
            rope_theta=5e5, rope_local_base_freq=1e3, num_key_value_heads=2,
        ),
        vision=dict(image_size=16, patch_size=4),
        mm=16, tie=False, hub=False, bf16=False,
    ),
}  # fmt: skip


def _hub_config(path, text, vision):
    """Rewrite a saved ``config.json`` as the Hub's gemma-3-4b-it file (transformers 4.50)."""
    d = json.loads((path / "config.json").read_text())
    d["text_config"] = {"model_type": "gemma3_text", **text}
    d["vision_config"] = {"model_type": "siglip_vision_model", **vision}
    d.update(eos_token_id=[1, 106], torch_dtype="bfloat16", transformers_version="4.50.0.dev0")
    for k in ("dtype", "image_token_id"):
        d.pop(k, None)
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("name", sorted(OTHER))
@pytest.mark.slow
def test_other_configs_match_transformers(name, tmp_path):
    """Configs unlike the module's (layer kinds, RoPE, pooling, image and patch sizes, the Hub's
    sparse layout, bfloat16 weights computed in float32) through ``load_vision_language`` and
    ``encode_images``: logits of rows with images first, adjacent and last equal transformers'
    float32 model, and the sampler decodes what ``generate`` decodes."""
    from relax.data.image_prompts import ImageBatch
    from relax.models.vision.families import encode_images, load_vision_language
    from relax.rollout.config import RolloutConfig
    from relax.rollout.sampler import generate_program
    from relax.rollout.sampling import SamplingConfig

    c = OTHER[name]
    text = dict(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
    )  # fmt: skip
    text.update(c["text"])
    vision = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2)
    vision.update(c["vision"])
    cfg = transformers.Gemma3Config(
        text_config=dict(text),
        vision_config=dict(vision),
        mm_tokens_per_image=c["mm"],
        boi_token_index=BOI,
        eoi_token_index=EOI,
        image_token_index=IMG,
        tie_word_embeddings=c["tie"],
    )
    torch.manual_seed(4)
    m = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in m.named_parameters():
            p.copy_(p + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.2 * torch.randn_like(p))
    (m.to(torch.bfloat16) if c["bf16"] else m).save_pretrained(tmp_path)
    if c["hub"]:
        _hub_config(tmp_path, text, vision)
    m = transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32)
    vl = load_vision_language(tmp_path)
    image = [BOI] + [IMG] * c["mm"] + [EOI]
    ids, mask = _batch([image + [5, 6], [7, *image, *image, 8, 9, 10, 11, 12], [13, 14, *image]])
    s = vision["image_size"]
    pix = torch.rand(4, 3, s, s, generator=torch.Generator().manual_seed(5)) * 2 - 1
    lm = vl.language_model
    inputs = encode_images(vl, lm, ids, mask, ImageBatch(pix.numpy(), ()))
    pid, pm = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    got = np.asarray(tfm.project(lm, prompt_hidden_states(lm, pid, pm, inputs)))
    assert _diff(got, _hf_logits(m.eval(), ids, mask, pix), mask) < ATOL
    with torch.no_grad():
        out = m.generate(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            pixel_values=pix,
            token_type_ids=torch.tensor((ids == IMG).astype(np.int64)),
            max_new_tokens=3,
            do_sample=False,
            eos_token_id=None,
        )
    rollout = RolloutConfig(
        num_generations=1, max_new_tokens=3, sampling=SamplingConfig(temperature=0.0), eos_ids=()
    )
    r = generate_program(lm, pid, pm, jax.random.key(0), rollout, prompt=inputs)
    np.testing.assert_array_equal(np.asarray(r.tokens)[:, 0], out[:, ids.shape[1] :].numpy())
