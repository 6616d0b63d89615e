"""SFT on rows with images (relax.data.image_rows, relax.algorithms.sft.images) on the tiny
Qwen2.5-VL (relax.tasks.tiny_vlm) and a tiny Gemma 3 written by transformers: the per-example
NLL equals one computed from transformers' logits (parity), the vision tower runs once per
example, ``examples/train_sft.py --image-field image`` trains 2 steps, a text model refuses the
flag and a bad image is named."""

from __future__ import annotations

import base64
import dataclasses
import io
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example

from relax.algorithms.sft.images import (
    ImageSFTRows,
    attach_prompt,
    image_target_mask,
    image_token_logprobs,
)
from relax.data.image_prompts import ImageBatch, ImagePrompts, processor_for
from relax.data.image_rows import collate_image_sft, encode_sft_images
from relax.models.vision import families
from relax.models.vision.families import encode_images, load_vision_language
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=8, num_eval=2)
LENGTH = 160


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-sft")
    write_tiny_qwen2_5_vl(root / "model", TASK, key=jax.random.key(0))
    train, held_out = make_splits(TASK)
    rows = [
        {"prompt": r["prompt"], "completion": r["answer"], "image": r["image"]}
        for r in train + held_out
    ]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, train


def _chat_row(train):
    """Two user turns with an image each, two assistant turns: the second image follows a turn."""
    user = lambda r: {
        "role": "user",
        "content": [{"type": "image"}, {"type": "text", "text": r["prompt"]}],
    }  # noqa: E731
    return {
        "messages": [
            user(train[0]),
            {"role": "assistant", "content": train[0]["answer"]},
            user(train[1]),
            {"role": "assistant", "content": train[1]["answer"]},
        ],
        "image": [train[0]["image"], train[1]["image"]],
    }


def _rows(train):
    two = {
        "prompt": "Count both.",
        "completion": "7",
        "image": [train[2]["image"], train[3]["image"]],
    }
    one = {
        "prompt": train[4]["prompt"],
        "completion": train[4]["answer"],
        "image": train[4]["image"],
    }
    return [one, two, _chat_row(train)]


def _relax_nll(model_dir, records):
    vl = load_vision_language(model_dir)
    tok = load_tokenizer(model_dir)
    images = ImagePrompts("image", processor_for("qwen2_5_vl", model_dir))
    rows = encode_sft_images(records, tok, images, max_length=LENGTH)
    batch = collate_image_sft(rows.examples, length=LENGTH, pad_id=tok.pad_token_id, images=images)
    encode = lambda i, m, b: encode_images(vl, vl.language_model, i, m, b)  # noqa: E731
    r = attach_prompt(batch, encode)
    logp, _ = image_token_logprobs(vl.language_model, r)
    return -np.asarray(jnp.sum(jnp.where(image_target_mask(r), logp, 0.0), axis=1))


def _pil(b64):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


def _hf_nll(model_dir, text_segments, images):
    """-sum log p of the target segments from transformers' logits: ``text_segments`` a list of
    ``(text, is_target)``, each ``<|image_pad|>`` expanded here to its grid's tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(images)
    grids = proc["image_grid_thw"].tolist()
    counts = iter(int(np.prod(g)) // 4 for g in grids)
    ids, target = [], []
    for text, is_target in text_segments:
        parts = text.split("<|image_pad|>")
        text = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
        seg = tok(text, add_special_tokens=False)["input_ids"]
        ids += seg
        target += [is_target] * len(seg)
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir).eval()
    image_id = hf.config.image_token_id
    ids_t = torch.tensor([ids])
    with torch.no_grad():
        logits = (
            hf(
                input_ids=ids_t,
                attention_mask=torch.ones_like(ids_t),
                pixel_values=torch.tensor(np.asarray(proc["pixel_values"])),
                image_grid_thw=torch.tensor(grids),
                mm_token_type_ids=(ids_t == image_id).long(),
            )
            .logits[0]
            .double()
        )
    logp = torch.log_softmax(logits, -1)[:-1].gather(1, ids_t[0, 1:, None])[:, 0].numpy()
    return -float(np.sum(logp[np.asarray(target[1:])]))


def _segments(row):
    """The rendered chat split at the assistant turns (Qwen's template, written out)."""
    head = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    if "messages" in row:
        m = row["messages"]
        return [
            (head + m[0]["content"][1]["text"] + "<|im_end|>\n<|im_start|>assistant\n", False),
            (m[1]["content"] + "<|im_end|>\n", True),
            (head + m[2]["content"][1]["text"] + "<|im_end|>\n<|im_start|>assistant\n", False),
            (m[3]["content"] + "<|im_end|>\n", True),
        ]
    n = len(row["image"]) if isinstance(row["image"], list) else 1
    pads = "<|vision_start|><|image_pad|><|vision_end|>" * n
    prompt = f"<|im_start|>user\n{pads}{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
    return [(prompt, False), (row["completion"] + "<|im_end|>\n", True)]


@pytest.mark.parity
@pytest.mark.slow
def test_sft_nll_matches_transformers(setup):
    root, train = setup
    rows = _rows(train)
    ours = _relax_nll(root / "model", rows)
    for row, got in zip(rows, ours):
        imgs = row["image"] if isinstance(row["image"], list) else [row["image"]]
        ref = _hf_nll(root / "model", _segments(row), [_pil(b) for b in imgs])
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parity
def test_gemma3_sft_nll_matches_transformers():
    """Gemma 3 (bidirectional image blocks, sliding layers): the image SFT loss's per-row NLL
    against transformers' logits on left-padded token rows."""
    torch = pytest.importorskip("torch")
    from test_vision_gemma3 import IMAGE, _batch, _hf_logits, _hf_model, _pixels

    from relax.models.vision.gemma3_checkpoint import load_gemma3

    m = _hf_model()
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        m.save_pretrained(d)
        lm, vision = load_gemma3(d)
    rows = [[5, *IMAGE, 10, 11, 12, 13], [7, 8, *IMAGE, 30, 31, *IMAGE, 40, 41]]
    ids, mask = _batch(rows)
    loss_mask = np.zeros_like(ids)
    loss_mask[:, -2:] = 1  # the last two tokens of each row are the targets
    pix = _pixels(3)
    ref = np.log(torch.softmax(torch.tensor(_hf_logits(m, ids, mask, pix)).double(), -1).numpy())
    want = -np.array([ref[i, -3, ids[i, -2]] + ref[i, -2, ids[i, -1]] for i in range(2)])
    vl = families.VisionLanguage(families.VISION_FAMILIES["gemma3"], lm, vision)
    prompt = encode_images(vl, lm, ids, mask, ImageBatch(pix.numpy(), ()))
    r = ImageSFTRows(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(loss_mask), prompt)
    logp, _ = image_token_logprobs(lm, r)
    got = -np.asarray(jnp.sum(jnp.where(image_target_mask(r), logp, 0.0), axis=1))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _args(root, run_dir, data, *extra):
    return [
        "--model", str(root / "model"),
        "--data", str(data),
        "--image-field", "image",
        "--run-dir", str(run_dir),
        "--steps", "2",
        "--batch-size", "2",
        "--sft.max-length", str(LENGTH),
        "--eval-every", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow  # a whole run: make test-all
def test_sft_cli_trains_on_images_and_encodes_once(setup, tmp_path, capsys, monkeypatch):
    root, _ = setup
    calls = []
    family = families.VISION_FAMILIES["qwen2_5_vl"]

    def counting(lm, vision, ids, mask, pixels, grid):
        calls.append((np.asarray(ids).shape[0], len(grid)))
        return family.encode(lm, vision, ids, mask, pixels, grid)

    counted = dataclasses.replace(family, encode=counting)
    monkeypatch.setitem(families.VISION_FAMILIES, "qwen2_5_vl", counted)
    summary = load_example("sft").main(_args(root, tmp_path / "run", root / "sft.jsonl"))
    out = capsys.readouterr().out
    assert "training images: 9 in all, 1-1 per example" in out
    assert "not packed" in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
    assert any("eval/nll" in x for x in lines)
    # 2 steps of 2 examples, and the held-out example at steps 0 and 2: one image per example
    assert sorted(calls) == sorted([(2, 2), (2, 2), (2, 2), (2, 2)])
    assert summary["data"]["train_rows"] == 9


def text_model(root, directory):
    """The tiny VLM's language model alone, saved as a text model with its tokenizer."""
    import shutil

    from relax.models.hf.checkpoint import save_pretrained

    save_pretrained(load_vision_language(root / "model").language_model, directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "model" / name, directory / name)
    return directory


def test_text_model_refuses_image_field(setup, tmp_path):
    root, _ = setup
    args = _args(root, tmp_path / "run", root / "sft.jsonl")
    args[1] = str(text_model(root, tmp_path / "text"))
    with pytest.raises(ValueError, match="needs a vision-language --model"):
        load_example("sft").main(args)


def test_bad_image_is_named_or_dropped(setup, tmp_path):
    root, train = setup
    rows = [
        {"prompt": r["prompt"], "completion": r["answer"], "image": r["image"]} for r in train[:3]
    ]
    rows[1]["image"] = "missing.png"
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from relax.data.files import read_records

    records = read_records(path)
    tok = load_tokenizer(root / "model")
    proc = processor_for("qwen2_5_vl", root / "model")
    with pytest.raises(ValueError, match=r"rows.jsonl row 2, field 'image'"):
        encode_sft_images(records, tok, ImagePrompts("image", proc), max_length=LENGTH)
    kept = encode_sft_images(
        records, tok, ImagePrompts("image", proc, bad_images="drop"), max_length=LENGTH
    )
    assert len(kept.examples) == 2 and len(kept.bad) == 1 and "row 2" in kept.bad[0]
    assert "1 training rows were dropped for a bad image" in kept.summary("training")


@pytest.mark.slow
def test_train_vision_step_is_sgd_on_the_loss_with_the_tower_inside(setup):
    """``--train-vision`` SFT: one step (2 micro-batches, images of 1 and 2 per row) moves the
    language model and the tower as plain SGD on the image SFT loss with the tower inside,
    differentiated directly (``make_image_sft_loss`` on features recomputed from the tower)."""
    import optax

    from relax.algorithms.sft.config import SFTConfig
    from relax.algorithms.sft.images import make_image_sft_loss, make_image_sft_step
    from relax.train.state import init_state
    from relax.train.update import LossContext

    root, train = setup
    vl, tok = load_vision_language(root / "model"), load_tokenizer(root / "model")
    images = ImagePrompts("image", processor_for("qwen2_5_vl", root / "model"))
    records = [*_rows(train), _rows(train)[0]]  # 4 rows: 2 micro-batches of 2
    rows = encode_sft_images(records, tok, images, max_length=LENGTH)
    batch = collate_image_sft(rows.examples, length=LENGTH, pad_id=tok.pad_token_id, images=images)
    encode = lambda i, m, b: encode_images(vl, vl.language_model, i, m, b)  # noqa: E731
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (a step donates its state)
    lr = 0.5
    state = init_state(
        copy(vl.language_model), optax.sgd(lr), key=jax.random.key(0), vision=copy(vl.vision)
    )
    step = make_image_sft_step(SFTConfig(max_length=LENGTH, grad_accum=2))
    new, _ = step(state, attach_prompt(batch, encode, pixels=True))
    # the data need not run the tower (no reference reads its features): the same step
    bare = lambda i, m, b: encode_images(vl, vl.language_model, i, m, b, features=False)  # noqa: E731
    fresh = init_state(
        copy(vl.language_model), optax.sgd(lr), key=jax.random.key(0), vision=copy(vl.vision)
    )
    again, _ = step(fresh, attach_prompt(batch, bare, pixels=True))
    for a, b in zip(
        jax.tree.leaves((again.policy, again.vision)), jax.tree.leaves((new.policy, new.vision))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    r = attach_prompt(batch, encode, pixels=True)
    tokens = jnp.maximum(jnp.sum(image_target_mask(r)), 1).astype(jnp.float32)
    ctx = LossContext({"tokens": tokens}, jnp.bool_(False))

    def loss(params):
        lm, tower = params
        inputs = families.with_image_features(r.prompt, tower, r.pixels)
        rows_ = dataclasses.replace(r, prompt=inputs, pixels=None)
        return make_image_sft_loss()(lm, rows_, ctx)[0]

    grads = jax.grad(loss)((vl.language_model, vl.vision))
    want = jax.tree.map(lambda p, g: p - lr * g, (vl.language_model, vl.vision), grads)
    got = (new.policy, new.vision)
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(grads))
    tower_moved = 0
    for a, w, g in leaves:
        np.testing.assert_allclose(a, w, rtol=2e-4, atol=2e-6)
        tower_moved += int(np.abs(np.asarray(g)).max() > 0)
    assert tower_moved > len(jax.tree.leaves(vl.language_model))  # the tower's got gradients too


@pytest.mark.slow  # a whole run: make test-all
def test_train_vision_sft_cli_exports_the_trained_tower(setup, tmp_path, capsys):
    from safetensors.numpy import load_file

    root, _ = setup
    run = tmp_path / "run"
    load_example("sft").main(_args(root, run, root / "sft.jsonl", "--train-vision"))
    assert "vision tower: trained with the language model" in capsys.readouterr().out

    def tower(directory):
        (f,) = directory.glob("*.safetensors")
        return {k: v for k, v in load_file(f).items() if ".visual." in k or k.startswith("visual.")}

    base, trained = tower(root / "model"), tower(run / "final_hf")
    assert base.keys() == trained.keys() and len(base) > 10
    assert all(not np.array_equal(base[k], trained[k]) for k in base)


def test_train_vision_needs_an_image_trainer(setup, tmp_path):
    root, _ = setup
    args = _args(root, tmp_path / "run", root / "sft.jsonl", "--train-vision")
    cut = args.index("--sft.max-length")
    args = args[:cut] + args[cut + 2 :]  # a KTO run's flags
    with pytest.raises(ValueError, match="trains on text only"):
        load_example("kto").main(args)
