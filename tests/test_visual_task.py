"""The built-in visual task (``relax.tasks.visual``: count the shapes) and its tiny random
Qwen2.5-VL directory (``relax.tasks.tiny_vlm``), loaded by relax and by transformers alike.

Counts are checked independently of the drawing code: the shapes are the 8-connected
non-background regions of the decoded PNG, each of one colour. The directory's parity with
transformers: the chat template rendered with an image part (relax's tokenizer vs
``AutoTokenizer``), its ids, the pixel values and grid (``Qwen2VLImageConfig.from_dir`` vs
``Qwen2VLImageProcessorPil.from_pretrained``), and the logits (``vl_forward`` vs
``Qwen2_5_VLForConditionalGeneration.from_pretrained``) at the default init scale and at a
larger one, where the image moves the logits far more than the tolerance.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from relax.data.images import Qwen2VLImageConfig, Qwen2VLImageProcessor, decode_image
from relax.models.vision.families import load_vision_language
from relax.models.vision.qwen2_5_vl import vl_forward
from relax.models.vision.qwen_vit import QwenVisionConfig, init_qwen_vision
from relax.tasks.tiny_vlm import SPECIAL_TOKENS, write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, draw, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=300, num_eval=100, seed=3)
BACKGROUND = np.array(TASK.background, np.uint8)
ATOL = 1e-4


def _components(mask: np.ndarray) -> np.ndarray:
    """Each pixel of ``mask`` [h, w] labelled by its 8-connected region (the least flat index in
    it; background: h * w), by propagating the minimum over neighbours until nothing changes."""
    h, w = mask.shape
    big = h * w
    labels = np.where(mask, np.arange(big).reshape(h, w), big)
    while True:
        p = np.pad(labels, 1, constant_values=big)
        near = np.min(
            [p[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1)],
            axis=0,
        )
        new = np.where(mask, near, big)
        if np.array_equal(new, labels):
            return labels
        labels = new


@pytest.fixture(scope="module")
def splits():
    return make_splits(TASK)


def test_splits_are_deterministic_and_disjoint(splits):
    train, held_out = splits
    assert (len(train), len(held_out)) == (TASK.num_train, TASK.num_eval)
    assert make_splits(TASK) == (train, held_out)
    for r in train + held_out:
        assert set(r) == {"prompt", "image", "answer", "data_source"}
        assert r["prompt"] == "How many shapes are in the image?" and r["data_source"] == "count"
    train_images = {r["image"] for r in train}
    assert len(train_images) == len(train)  # no image twice
    assert not train_images & {r["image"] for r in held_out}
    assert {tuple(map(tuple, decode_image(r["image"]).reshape(-1, 3))) for r in held_out[:20]}
    # the first training image is the first draw of its seed stream
    image, count = draw(TASK, np.random.default_rng([TASK.seed, 0]))
    np.testing.assert_array_equal(decode_image(train[0]["image"]), np.asarray(image))
    assert train[0]["answer"] == str(count)
    other = make_splits(dataclasses.replace(TASK, seed=4, num_train=20, num_eval=5))
    assert [r["image"] for r in other[0]] != [r["image"] for r in train[:20]]
    answers = {r["answer"] for r in train}
    assert answers == {str(n) for n in range(1, TASK.max_count + 1)}


def test_every_image_shows_its_count_in_distinct_colours(splits):
    for r in splits[0] + splits[1]:
        pixels = decode_image(r["image"])
        assert pixels.shape == (TASK.image_size, TASK.image_size, 3)
        shape = (pixels != BACKGROUND).any(-1)
        labels = _components(shape)
        regions = np.unique(labels[shape])
        assert len(regions) == int(r["answer"]), r["answer"]
        colours = set()
        for region in regions:
            own = np.unique(pixels[labels == region], axis=0)
            assert len(own) == 1  # one flat colour, no anti-aliasing
            colours.add(tuple(own[0]))
            assert tuple(own[0]) in TASK.colours
        assert len(colours) == len(regions)


def test_task_refuses_settings_it_cannot_draw():
    with pytest.raises(ValueError, match="max_count"):
        VisualTask(max_count=9)
    with pytest.raises(ValueError, match="shapes"):
        VisualTask(shapes=("hexagon",))
    with pytest.raises(ValueError, match="cannot be placed"):
        VisualTask(max_count=8, max_size=20)


def test_init_qwen_vision_shapes_norms_and_biases():
    c = QwenVisionConfig(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4,
        window_size=16, out_hidden_size=24, fullatt_block_indexes=(1,),
    )  # fmt: skip
    v = init_qwen_vision(c, jax.random.key(0), std=0.1)
    assert v.patch_embed.shape == (3 * 2 * 4 * 4, 32)
    assert v.blocks.qkv.shape == (2, 32, 96) and v.merger.fc2.shape == (128, 24)
    assert np.all(np.asarray(v.blocks.norm1) == 1) and np.all(np.asarray(v.merger.ln_q) == 1)
    assert not np.any(np.asarray(v.blocks.qkv_bias)) and not np.any(np.asarray(v.merger.fc2_bias))
    assert abs(float(jnp.std(v.blocks.gate)) - 0.1) < 0.01
    assert v.patch_embed.dtype == jnp.float32
    assert (
        init_qwen_vision(c, jax.random.key(0), dtype=jnp.bfloat16).blocks.proj.dtype == jnp.bfloat16
    )


# ------------------------------------------------------------------ the tiny model's directory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[0.02, 0.3], ids=["std0.02", "std0.3"])
def tiny(request, tmp_path_factory):
    return write_tiny_qwen2_5_vl(
        tmp_path_factory.mktemp("tiny_vlm"), TASK, key=jax.random.key(1), std=request.param
    )


def _messages(text="How many shapes are in the image?"):
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]


def _prompt(tiny, images):
    """(ids [1, t], pixel values, grid) of an image prompt, all from relax."""
    tok = load_tokenizer(tiny)
    proc = Qwen2VLImageProcessor(Qwen2VLImageConfig.from_dir(tiny))
    text = tok.apply_chat_template(_messages(), add_generation_prompt=True, tokenize=False)
    out = proc(images)
    ids = tok.encode(proc.expand_prompt(text, out.image_grid_thw), add_special_tokens=False)
    return np.array([ids]), out.pixel_values, out.image_grid_thw


def test_directory_config_and_sizes(tiny):
    d = json.loads((tiny / "config.json").read_text())
    tok = load_tokenizer(tiny)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    assert d["image_token_id"] == ids["<|image_pad|>"]
    assert d["vision_start_token_id"] == ids["<|vision_start|>"]
    assert d["vision_end_token_id"] == ids["<|vision_end|>"]
    assert d["vocab_size"] >= tok.vocab_size
    assert tok.eos_token_ids == (ids["<|im_end|>"],) and tok.pad_token_id == ids["<|endoftext|>"]
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ids["<|im_end|>"]
    vl = load_vision_language(tiny)
    assert vl.family.model_type == "qwen2_5_vl" and vl.language_model.config.family == "qwen2"
    proc = Qwen2VLImageProcessor(Qwen2VLImageConfig.from_dir(tiny))
    images = [decode_image(r["image"]) for r in make_splits(TASK)[1][:8]]
    grid = proc(images).image_grid_thw
    assert {tuple(g) for g in grid.tolist()} == {(1, 8, 8)}  # one grid for every task image
    assert proc.num_tokens(grid[:1]) == (16,)
    # the answer's text round-trips through the word-level vocabulary
    for n in range(1, TASK.max_count + 1):
        assert tok.decode(tok.encode(str(n), add_special_tokens=False)) == str(n)
    assert tok.token_to_id("<unk>") not in tok.encode(TASK.prompt, add_special_tokens=False)


def test_tokenizer_and_chat_template_match_transformers(tiny):
    tok = load_tokenizer(tiny)
    ref = transformers.AutoTokenizer.from_pretrained(tiny)
    for messages in (_messages(), [{"role": "user", "content": "How many?"}]):
        for gen in (True, False):
            ours = tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            theirs = ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False)
            assert ours == theirs
    text = tok.apply_chat_template(_messages(), add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
        "How many shapes are in the image?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids, _, _ = _prompt(tiny, [decode_image(make_splits(TASK)[0][0]["image"])])
    expanded = tok.decode(ids[0])
    assert ref(expanded, add_special_tokens=False)["input_ids"] == ids[0].tolist()
    assert ref.decode(ids[0]) == expanded
    assert ref.eos_token == "<|im_end|>" and ref.pad_token == "<|endoftext|>"


def test_processor_matches_transformers(tiny):
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    images = [decode_image(r["image"]) for r in make_splits(TASK)[0][:6]]
    ours = Qwen2VLImageProcessor(Qwen2VLImageConfig.from_dir(tiny))(images)
    theirs = Qwen2VLImageProcessorPil.from_pretrained(tiny)(images)
    np.testing.assert_array_equal(ours.image_grid_thw, theirs["image_grid_thw"])
    np.testing.assert_array_equal(ours.pixel_values, theirs["pixel_values"])


def test_logits_match_transformers(tiny):
    vl = load_vision_language(tiny)
    model = dataclasses.replace(vl.vision, language_model=vl.language_model)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32)
    hf = hf.eval()
    image_id = model.config.image_token_id
    got = {}
    for i, record in enumerate(make_splits(TASK)[0][:2]):
        ids, pixels, grid = _prompt(tiny, [decode_image(record["image"])])
        ours = np.asarray(vl_forward(model, ids, None, pixels, grid))
        with torch.no_grad():
            theirs = hf(
                input_ids=torch.tensor(ids),
                attention_mask=torch.ones(ids.shape, dtype=torch.long),
                mm_token_type_ids=torch.tensor((ids == image_id).astype(np.int64)),
                pixel_values=torch.tensor(pixels),
                image_grid_thw=torch.tensor(grid),
            ).logits.numpy()
        assert ours.shape == theirs.shape == (1, ids.shape[1], vl.language_model.config.vocab_size)
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)
        got[i] = ours
    if vl.language_model.embed.std() > 0.1:  # the larger init: the image visibly matters
        assert np.abs(got[0][0, -1] - got[1][0, -1]).max() > 100 * ATOL
