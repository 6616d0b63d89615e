"""relax's Qwen2.5-VL against transformers' ``Qwen2_5_VLForConditionalGeneration`` (float32).

A tiny random model (text: 2 layers, hidden 64, head dim 16, ``mrope_section`` [2, 3, 3]; vision:
3 blocks of hidden 32, the middle one full attention, patches of 4 pixels, merge 2, windows of 16
pixels = 2 x 2 merged tokens) with randomised norms and biases. Images of 4x6, 8x8 and 2x2 patches
have 2, 4 and 1 windows. Prompts are built by hand: ``<|vision_start|>``, ``t*h*w/4`` image pad
tokens, ``<|vision_end|>``; pixel values are random arrays in the processor's layout.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from relax.models.decoder.transformer import positions_from_mask  # noqa: E402
from relax.models.hf.config import HFFormatError, config_from_hf  # noqa: E402
from relax.models.layers.rope import rotary  # noqa: E402
from relax.models.vision.mrope import get_rope_index, mrope_rotary  # noqa: E402
from relax.models.vision.qwen2_5_vl import vl_forward  # noqa: E402
from relax.models.vision.qwen2_5_vl_checkpoint import (  # noqa: E402
    load_qwen2_5_vl,
    read_vl_config,
    save_qwen2_5_vl,
    text_config_dict,
)
from relax.models.vision.qwen_vit import vision_forward  # noqa: E402

pytestmark = pytest.mark.parity

ATOL = 1e-5  # float32: the differences are about 2e-6 (logits of magnitude ~4)
IMAGE, START, END = 150, 151, 152
GRIDS = [(1, 4, 6), (1, 8, 8), (1, 2, 2)]
TEXT = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3]},
)
VISION = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=2,
    spatial_merge_size=2,
    window_size=16,
    out_hidden_size=64,
    fullatt_block_indexes=[1],
)


def _config(**top):
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT),
        vision_config=dict(VISION),
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=153,
        **top,
    )


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(_config())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * noise if "norm" in name or "ln_q" in name else 0.1 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def hf_dir(hf, tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def relax_model(hf_dir):
    return load_qwen2_5_vl(hf_dir)


def _pixels(grids, seed=0):
    n = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((n, 3 * 2 * 4 * 4)).astype(np.float32)


def _image(grid):
    t, h, w = grid
    return [START] + [IMAGE] * (t * h * w // 4) + [END]


def _batch(rows):
    """Left-padded ids and mask of token lists."""
    n = max(map(len, rows))
    ids = np.zeros((len(rows), n), np.int64)
    mask = np.zeros((len(rows), n), np.int64)
    for r, row in enumerate(rows):
        ids[r, n - len(row) :], mask[r, n - len(row) :] = row, 1
    return ids, mask


def _prompts():
    """Rows with 0, 1 and 2 images (grids GRIDS[0], then GRIDS[1] and GRIDS[2])."""
    rng = np.random.default_rng(1)
    text = lambda n: rng.integers(3, IMAGE, n).tolist()  # noqa: E731
    rows = [
        text(9),
        text(3) + _image(GRIDS[0]) + text(4),
        text(2) + _image(GRIDS[1]) + text(3) + _image(GRIDS[2]) + text(2),
    ]
    return (*_batch(rows), GRIDS)


def _hf_inputs(ids, mask, grids):
    kw = dict(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
    )
    if grids:
        kw.update(pixel_values=torch.tensor(_pixels(grids)), image_grid_thw=torch.tensor(grids))
    return kw


def _hf_logits(hf, ids, mask, grids):
    with torch.no_grad():
        return hf(**_hf_inputs(ids, mask, grids)).logits.numpy()


def _relax_logits(model, ids, mask, grids):
    pv = _pixels(grids) if grids else None
    return np.asarray(vl_forward(model, ids, mask, pv, grids or None))


@pytest.mark.parametrize(
    "grids",
    [GRIDS[:1], GRIDS, [(2, 4, 6), (1, 2, 2)]],
    ids=["one_image", "three_images", "two_frames"],
)
def test_vision_tower_matches_transformers(hf, relax_model, grids):
    pv = _pixels(grids)
    with torch.no_grad():
        want = hf.model.visual(torch.tensor(pv), grid_thw=torch.tensor(grids)).pooler_output
    got = vision_forward(relax_model.visual, jnp.asarray(pv), tuple(grids))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want.numpy(), atol=1e-5, rtol=0)


def test_rope_index_matches_transformers(hf):
    ids, mask, grids = _prompts()
    want, want_deltas = hf.model.get_rope_index(
        torch.tensor(ids),
        torch.tensor((ids == IMAGE).astype(np.int64)),
        image_grid_thw=torch.tensor(grids),
        attention_mask=torch.tensor(mask),
    )
    got, deltas = get_rope_index(ids, mask, IMAGE, grids, 2)
    np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(deltas, want_deltas.numpy()[:, 0])
    assert deltas[0] == 0 and deltas[1] < 0  # text only; an image's 6 tokens span 3 positions


def test_text_positions_give_the_plain_rotary_tables(relax_model):
    cfg = relax_model.language_model.config
    pos = positions_from_mask(jnp.asarray(_prompts()[1]))
    got = mrope_rotary(cfg, jnp.broadcast_to(pos, (3, *pos.shape)), (2, 3, 3)).full
    want = rotary(cfg, pos).full
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_logits_match_transformers_with_0_1_2_images(hf, relax_model):
    ids, mask, grids = _prompts()
    got, want = _relax_logits(relax_model, ids, mask, grids), _hf_logits(hf, ids, mask, grids)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)
    # text only, no images in the batch at all (transformers' own positions)
    ids0, mask0 = ids[:1, -9:], mask[:1, -9:]
    got0 = _relax_logits(relax_model, ids0, mask0, [])
    with torch.no_grad():
        want0 = hf(input_ids=torch.tensor(ids0)).logits.numpy()
    np.testing.assert_allclose(got0, want0, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_greedy_decoding_matches_generate(hf, relax_model):
    ids, mask, grids = _prompts()
    steps = 4
    with torch.no_grad():
        out = hf.generate(
            **_hf_inputs(ids, mask, grids),
            max_new_tokens=steps,
            do_sample=False,
            pad_token_id=0,
        )
    want = out[:, ids.shape[1] :].numpy()
    for _ in range(steps):  # the full forward again on each longer sequence
        logits = _relax_logits(relax_model, ids, mask, grids)
        nxt = logits[:, -1].argmax(-1)
        ids = np.concatenate([ids, nxt[:, None]], 1)
        mask = np.concatenate([mask, np.ones_like(mask[:, :1])], 1)
    np.testing.assert_array_equal(ids[:, -steps:], want)


def test_relax_save_loads_in_transformers(relax_model, tmp_path):
    save_qwen2_5_vl(relax_model, tmp_path)
    back, info = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids, mask, grids = _prompts()
    got = _relax_logits(relax_model, ids, mask, grids)
    want = _hf_logits(back.eval(), ids, mask, grids)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)
    again = load_qwen2_5_vl(tmp_path)
    assert again.config == relax_model.config
    assert again.language_model.config == relax_model.language_model.config


def test_transformers_save_loads_in_relax(hf, hf_dir):
    d = json.loads((hf_dir / "config.json").read_text())
    assert "text_config" in d and d["text_config"]["model_type"] == "qwen2_5_vl_text"
    model = load_qwen2_5_vl(hf_dir)
    assert model.config.mrope_section == (2, 3, 3)
    assert model.language_model.config.rope_theta == 1e6  # Qwen2_5_VLTextConfig's default
    assert model.language_model.config.family == "qwen2"


def test_in_memory_tensor_names_load_too(hf, tmp_path):
    """A file with transformers' in-memory names (model.language_model.*, model.visual.*); a
    missing vision tensor is an error naming it."""
    from safetensors.torch import save_file

    hf.config.save_pretrained(tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    model = load_qwen2_5_vl(tmp_path)
    ids, mask, grids = _prompts()
    got, want = _relax_logits(model, ids, mask, grids), _hf_logits(hf, ids, mask, grids)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)
    del state["model.visual.merger.mlp.2.bias"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(HFFormatError, match=r"missing vision tensor 'visual.merger.mlp.2.bias'"):
        load_qwen2_5_vl(tmp_path)


def test_absent_fields_take_transformers_defaults():
    minimal = dict(
        model_type="qwen2_5_vl",
        text_config=dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
        ),
    )
    theirs = transformers.Qwen2_5_VLConfig(**minimal).to_dict()
    parse = lambda d: config_from_hf(text_config_dict(d, "c"), source="c")  # noqa: E731
    ours = parse(minimal)
    assert ours == parse(theirs)
    assert (ours.num_kv_heads, ours.rms_norm_eps, ours.rope_theta) == (8, 1e-5, 1e6)
    assert read_vl_config(minimal, "c") == read_vl_config(theirs, "c")
    assert read_vl_config(minimal, "c")[1].fullatt_block_indexes == (7, 15, 23, 31)


def test_flat_4x_config_reads_the_same(hf, hf_dir):
    """The Hub's flat layout (text fields at the top, rope_scaling type mrope) = the nested one."""
    nested = json.loads((hf_dir / "config.json").read_text())
    flat = {k: v for k, v in nested.items() if k != "text_config"}
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat.update(text, rope_theta=rope["rope_theta"])
    flat["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    flat["model_type"] = "qwen2_5_vl"
    parse = lambda d: config_from_hf(text_config_dict(d, "c"), source="c")  # noqa: E731
    assert parse(flat) == parse(nested)
    assert read_vl_config(flat, "flat") == read_vl_config(nested, "nested")
    theirs = transformers.Qwen2_5_VLConfig(**flat)
    assert theirs.text_config.rope_parameters["mrope_section"] == [2, 3, 3]


def test_image_token_count_mismatch_names_the_row(relax_model):
    ids, mask, grids = _prompts()
    ids[2, -3] = IMAGE  # row 2's second image ends one token later: 2 tokens for a 1-token grid
    with pytest.raises(ValueError, match=r"row 2: image 2 has 2 image tokens"):
        vl_forward(relax_model, ids, mask, _pixels(grids), grids)
    with pytest.raises(
        ValueError, match=r"row 2: image token run .* is image 2, but image_grid_thw lists 2"
    ):
        vl_forward(relax_model, *_prompts()[:2], _pixels(grids[:2]), grids[:2])


# ------------------------------------------------ image prompts in the sampler and the trainer


def _prompt_inputs(model, ids, mask, grids):
    from relax.models.vision.qwen2_5_vl import prepare_inputs, prompt_inputs

    x = prepare_inputs(model, ids, mask, grids)
    return prompt_inputs(
        model,
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        jnp.asarray(x.positions, jnp.int32),
        jnp.asarray(_pixels(grids)),
        tuple(grids),
    )


@pytest.mark.slow
def test_prefix_shared_logprobs_match_transformers(hf, relax_model):
    """The trainer's prefix-shared forward over G completions of each image prompt (the image
    encoded and the prompt run once per group) gives transformers' log-probs of the whole
    [prompt; completion] sequences."""
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs

    ids, mask, grids = _prompts()
    p, g, n = ids.shape[0], 2, 3
    tokens = np.random.default_rng(5).integers(3, IMAGE, (p, g, n))
    inputs = _prompt_inputs(relax_model, ids, mask, grids)
    got = completion_logprobs(
        relax_model.language_model,
        jnp.asarray(ids, jnp.int32),
        jnp.asarray(mask, jnp.int32),
        jnp.asarray(tokens, jnp.int32),
        jnp.ones((p, g, n), jnp.int32),
        ForwardPass(attention="group"),
        prompt=inputs,
    )
    full = np.concatenate([np.repeat(ids, g, 0), tokens.reshape(p * g, n)], 1)
    fmask = np.concatenate([np.repeat(mask, g, 0), np.ones((p * g, n), np.int64)], 1)
    rep = [gr for r in range(p) for _ in range(g) for gr in _row_grids(r, grids)]
    logits = torch.tensor(_hf_logits_rep(hf, full, fmask, rep))
    want = torch.log_softmax(logits, -1)[:, ids.shape[1] - 1 : -1]
    want = torch.gather(want, -1, torch.tensor(tokens.reshape(p * g, n, 1))).numpy()
    np.testing.assert_allclose(np.asarray(got).reshape(p * g, n), want[..., 0], atol=ATOL, rtol=0)


def _row_grids(r, grids):
    """The grids of prompt row ``r`` of ``_prompts`` (0, 1 and 2 images)."""
    return [[], grids[:1], grids[1:]][r]


def _hf_logits_rep(hf, ids, mask, grids):
    """transformers' logits of rows whose images are ``grids`` (each one of ``GRIDS``, with its
    own pixels: its slice of ``_pixels(GRIDS)``)."""
    sizes = [t * h * w for t, h, w in GRIDS]
    chunks = np.split(_pixels(GRIDS), np.cumsum(sizes)[:-1])
    pix = np.concatenate([chunks[GRIDS.index(tuple(gr))] for gr in grids])
    kw = dict(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
        pixel_values=torch.tensor(pix),
        image_grid_thw=torch.tensor(grids),
    )
    with torch.no_grad():
        return hf(**kw).logits.numpy()


@pytest.mark.slow
def test_sampler_greedy_matches_generate(hf, relax_model):
    """relax's sampler, prefilling each image prompt once for its G completions, decodes what
    transformers' ``generate`` decodes greedily, and its log-probs are the trainer's."""
    from relax.models.forward.forward_pass import ForwardPass
    from relax.models.forward.prefix_shared import completion_logprobs
    from relax.rollout.config import RolloutConfig
    from relax.rollout.sampler import generate_program
    from relax.rollout.sampling import SamplingConfig

    ids, mask, grids = _prompts()
    steps, g = 4, 2
    with torch.no_grad():
        out = hf.generate(
            **_hf_inputs(ids, mask, grids), max_new_tokens=steps, do_sample=False, pad_token_id=0
        )
    want = out[:, ids.shape[1] :].numpy()
    inputs = _prompt_inputs(relax_model, ids, mask, grids)
    cfg = RolloutConfig(
        num_generations=g,
        max_new_tokens=steps,
        sampling=SamplingConfig(temperature=0.0),
        eos_ids=(),
        cache_chunk=2,
    )
    lm = relax_model.language_model
    pid, pm = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    r = generate_program(lm, pid, pm, jax.random.key(0), cfg, prompt=inputs)
    np.testing.assert_array_equal(np.asarray(r.tokens), np.repeat(want[:, None], g, 1))
    # at temperature 1 the sampled tokens' log-probs are the prefix-shared trainer's
    cfg1 = RolloutConfig(
        num_generations=g, max_new_tokens=steps, sampling=SamplingConfig(), eos_ids=()
    )
    r1 = generate_program(lm, pid, pm, jax.random.key(3), cfg1, prompt=inputs)
    train = completion_logprobs(
        lm, pid, pm, r1.tokens, r1.mask, ForwardPass(attention="group"), prompt=inputs
    )
    np.testing.assert_allclose(np.asarray(r1.logprobs), np.asarray(train), atol=1e-5, rtol=0)


# ------------------------------------------------ other configs (held-out robustness)

OTHER = {
    # the Hub's flat 7B layout (rope_scaling type mrope, in_chans, spatial_patch_size), bfloat16
    # weights; a 3x3 merge of 3-pixel patches, 1 frame per patch, windows of 2 merged tokens
    # plus a pixel (19), no full-attention block, quick_gelu, an empty mrope section, tied head
    "hub_flat_bf16": dict(
        text=dict(hidden_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1),
        vision=dict(
            depth=2, hidden_size=16, intermediate_size=24, num_heads=1, patch_size=3,
            temporal_patch_size=1, spatial_merge_size=3, window_size=19,
            fullatt_block_indexes=[], hidden_act="quick_gelu",
        ),
        section=[4, 0, 2], theta=5e5, tie=True, flat=True, bf16=True,
    ),
    # every block full attention, no merge (1 patch = 1 token), 3 frames per patch, relu
    "all_full_relu": dict(
        text=dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2),
        vision=dict(
            depth=2, hidden_size=24, intermediate_size=16, num_heads=2, patch_size=2,
            temporal_patch_size=3, spatial_merge_size=1, window_size=4,
            fullatt_block_indexes=[0, 1], hidden_act="relu",
        ),
        section=[1, 2, 7], theta=1e4, tie=False, flat=False, bf16=False,
    ),
}  # fmt: skip


def _flatten_like_the_hub(path):
    """Rewrite a saved ``config.json`` as the Hub's Qwen2.5-VL-7B file (transformers 4.x)."""
    d = json.loads((path / "config.json").read_text())
    text = d.pop("text_config")
    rope = text.pop("rope_parameters")
    d.update({k: v for k, v in text.items() if k not in ("model_type", "dtype")})
    d.update(
        rope_theta=rope["rope_theta"],
        rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]},
        use_sliding_window=False,
        sliding_window=32768,
        max_window_layers=d["num_hidden_layers"],
    )
    v = d["vision_config"]
    for k in ("model_type", "rope_parameters"):
        v.pop(k)
    v.update(in_chans=v.pop("in_channels"), spatial_patch_size=v["patch_size"])
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("name", sorted(OTHER))
@pytest.mark.slow
def test_other_configs_match_transformers(name, tmp_path):
    """Configs unlike the module's (geometry, activations, attention kinds, RoPE sections, the
    Hub's flat layout, bfloat16 weights computed in float32) through ``load_vision_language`` and
    ``encode_images``: logits of rows with images first, adjacent and last equal transformers'
    float32 model, and the sampler decodes what ``generate`` decodes."""
    from relax.data.image_prompts import ImageBatch
    from relax.models.decoder.prompt_inputs import prompt_hidden_states
    from relax.models.decoder.transformer import project
    from relax.models.vision.families import encode_images, load_vision_language
    from relax.rollout.config import RolloutConfig
    from relax.rollout.sampler import generate_program
    from relax.rollout.sampling import SamplingConfig

    c = OTHER[name]
    v = dict(c["vision"], out_hidden_size=c["text"]["hidden_size"])
    rope = {"rope_type": "default", "mrope_section": c["section"], "rope_theta": c["theta"]}
    text = dict(TEXT, intermediate_size=32, **c["text"], rope_parameters=rope)
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=v,
        image_token_id=IMAGE,
        vision_start_token_id=START,
        vision_end_token_id=END,
        video_token_id=153,
        tie_word_embeddings=c["tie"],
    )
    torch.manual_seed(1)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.copy_(p + 0.3 * torch.randn_like(p) if p.ndim == 1 else 0.1 * torch.randn_like(p))
    (hf.to(torch.bfloat16) if c["bf16"] else hf).save_pretrained(tmp_path)
    if c["flat"]:
        _flatten_like_the_hub(tmp_path)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tmp_path, dtype=torch.float32
    ).eval()
    vl = load_vision_language(tmp_path)
    m, p, tp = v["spatial_merge_size"], v["patch_size"], v["temporal_patch_size"]
    grids = [(1, 2 * m, 3 * m), (1, m, m), (1, 3 * m, m)]
    img = [[START] + [IMAGE] * (h * w // m**2) + [END] for _, h, w in grids]
    ids, mask = _batch([img[0] + [7, 8], [9, 10, *img[1], *img[2], 11], [12, 13, 14]])
    pv = np.random.default_rng(2).standard_normal((sum(h * w for _, h, w in grids), 3 * tp * p * p))
    pv = pv.astype(np.float32)
    kw = dict(
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        mm_token_type_ids=torch.tensor((ids == IMAGE).astype(np.int64)),
        pixel_values=torch.tensor(pv),
        image_grid_thw=torch.tensor(grids),
    )
    lm = vl.language_model
    inputs = encode_images(vl, lm, ids, mask, ImageBatch(pv, tuple(grids)))
    pid, pm = jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32)
    got = np.asarray(project(lm, prompt_hidden_states(lm, pid, pm, inputs)))
    with torch.no_grad():
        want = hf(**kw).logits.numpy()
        out = hf.generate(**kw, max_new_tokens=3, do_sample=False, pad_token_id=0)
    valid = mask.astype(bool)
    np.testing.assert_allclose(got[valid], want[valid], atol=ATOL, rtol=0)
    rollout = RolloutConfig(
        num_generations=1, max_new_tokens=3, sampling=SamplingConfig(temperature=0.0), eos_ids=()
    )
    r = generate_program(lm, pid, pm, jax.random.key(0), rollout, prompt=inputs)
    np.testing.assert_array_equal(np.asarray(r.tokens)[:, 0], out[:, ids.shape[1] :].numpy())
