"""The DPO family on prompts with images (relax.data.image_rows, relax.algorithms.dpo.images) on
the tiny Qwen2.5-VL and a tiny Gemma 3 written by transformers: the per-sequence log-probs of
chosen and rejected equal ones from transformers' logits (parity), the vision tower runs once
per prompt for both completions, ``examples/train_dpo.py --image-field image`` trains 2 steps, a
text model refuses the flag and a bad image is named."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example
from test_vlm_sft import _hf_nll, _pil, text_model

from relax.algorithms.dpo.images import pair_forward, with_prompt
from relax.algorithms.preference.pairs import sequence_logps
from relax.data.image_prompts import ImageBatch, ImagePrompts, processor_for
from relax.data.image_rows import collate_image_pairs, encode_image_pairs
from relax.data.pairs import PairBatch
from relax.models.vision import families
from relax.models.vision.families import encode_images, load_vision_language
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=8, num_eval=2)
LP, N = 96, 4


def _pair(r):
    return {
        "prompt": r["prompt"],
        "chosen": r["answer"],
        "rejected": str(int(r["answer"]) + 1),
        "image": r["image"],
    }


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-dpo")
    write_tiny_qwen2_5_vl(root / "model", TASK, key=jax.random.key(0))
    train, held_out = make_splits(TASK)
    rows = [_pair(r) for r in train + held_out]
    (root / "dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, train


def _images(root, **kw):
    return ImagePrompts("image", processor_for("qwen2_5_vl", root / "model"), **kw)


def _host_pairs(rows, tok, images):
    """``rows`` as one host batch of image pairs (prompts of ``LP``, completions of ``N``)."""
    pairs = encode_image_pairs(rows, tok, images, max_prompt_tokens=LP, max_completion_tokens=N)
    return collate_image_pairs(
        pairs.examples,
        pad_id=tok.pad_token_id,
        prompt_length=LP,
        completion_length=N,
        images=images,
    )


@pytest.mark.parity
@pytest.mark.slow
def test_pair_logps_match_transformers(setup):
    root, train = setup
    model_dir = root / "model"
    two = dict(_pair(train[1]), prompt="Count both.", image=[train[1]["image"], train[2]["image"]])
    rows = [_pair(train[0]), two]
    vl, tok, images = load_vision_language(model_dir), load_tokenizer(model_dir), _images(root)
    batch = _host_pairs(rows, tok, images)
    b = with_prompt(batch, lambda i, m, x: encode_images(vl, vl.language_model, i, m, x))
    sums, _ = sequence_logps(pair_forward()(vl.language_model, b, False), b.mask)
    for row, got in zip(rows, np.asarray(sums)):
        imgs = row["image"] if isinstance(row["image"], list) else [row["image"]]
        pads = "<|vision_start|><|image_pad|><|vision_end|>" * len(imgs)
        prompt = f"<|im_start|>user\n{pads}{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
        for k, field in enumerate(("chosen", "rejected")):
            segments = [(prompt, False), (row[field] + "<|im_end|>", True)]
            ref = -_hf_nll(model_dir, segments, [_pil(x) for x in imgs])
            np.testing.assert_allclose(got[k], ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parity
def test_gemma3_pair_logps_match_transformers(tmp_path):
    """Gemma 3: each prompt run once for both completions (prefix-shared, bidirectional image
    blocks) against transformers' logits of the whole sequences."""
    torch = pytest.importorskip("torch")
    from test_vision_gemma3 import IMAGE, _batch, _hf_logits, _hf_model, _pixels

    from relax.models.vision.gemma3_checkpoint import load_gemma3

    m = _hf_model()
    m.save_pretrained(tmp_path)
    lm, vision = load_gemma3(tmp_path)
    prompts = [[5, *IMAGE, 10, 11], [7, 8, *IMAGE, 30, *IMAGE, 31]]
    completions = [[[12, 13, 14], [15, 16]], [[40, 41], [42, 43, 44]]]
    p_ids, p_mask = _batch(prompts)
    tokens, mask = np.zeros((2, 2, 3), np.int32), np.zeros((2, 2, 3), np.int32)
    for i, cs in enumerate(completions):
        for k, c in enumerate(cs):
            tokens[i, k, : len(c)], mask[i, k, : len(c)] = c, 1
    pix = _pixels(3)
    vl = families.VisionLanguage(families.VISION_FAMILIES["gemma3"], lm, vision)
    prompt = encode_images(vl, lm, p_ids, p_mask, ImageBatch(pix.numpy(), ()))
    batch = PairBatch(
        jnp.asarray(p_ids), jnp.asarray(p_mask), jnp.asarray(tokens), jnp.asarray(mask),
        prompt=prompt,
    )  # fmt: skip
    sums, _ = sequence_logps(pair_forward()(lm, batch, False), batch.mask)
    for k in range(2):  # every row's chosen (k = 0) or rejected (k = 1) completion after its prompt
        full = [p + c[k] for p, c in zip(prompts, completions)]
        ids, fmask = _batch(full)
        logp = torch.log_softmax(torch.tensor(_hf_logits(m, ids, fmask, pix)).double(), -1).numpy()
        for i, c in enumerate(completions):
            n, t = len(c[k]), ids.shape[1]
            want = sum(logp[i, t - n - 1 + j, c[k][j]] for j in range(n))
            np.testing.assert_allclose(float(sums[i, k]), want, rtol=1e-4, atol=1e-4)


def _args(root, run_dir, *extra):
    return [
        "--model", str(root / "model"),
        "--data", str(root / "dpo.jsonl"),
        "--image-field", "image",
        "--run-dir", str(run_dir),
        "--steps", "2",
        "--batch-size", "2",
        "--dpo.max-prompt-tokens", str(LP),
        "--dpo.max-completion-tokens", str(N),
        "--eval-every", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow  # a whole run: make test-all
def test_dpo_cli_trains_on_images_and_encodes_each_prompt_once(
    setup, tmp_path, capsys, monkeypatch
):
    root, _ = setup
    calls = []
    family = families.VISION_FAMILIES["qwen2_5_vl"]

    def counting(lm, vision, ids, mask, pixels, grid):
        calls.append((np.asarray(ids).shape[0], len(grid)))
        return family.encode(lm, vision, ids, mask, pixels, grid)

    counted = dataclasses.replace(family, encode=counting)
    monkeypatch.setitem(families.VISION_FAMILIES, "qwen2_5_vl", counted)
    load_example("dpo").main(_args(root, tmp_path / "run"))
    out = capsys.readouterr().out
    assert "training images: 9 in all, 1-1 per example" in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
    assert any("eval/rewards/accuracies" in x for x in lines)
    # per batch: 2 prompts, 2 images (one each), not one per completion; 2 steps + 2 evaluations
    assert calls == [(2, 2)] * 4


def test_text_model_refuses_image_field(setup, tmp_path):
    root, _ = setup
    args = _args(root, tmp_path / "run")
    args[1] = str(text_model(root, tmp_path / "text"))
    with pytest.raises(ValueError, match="needs a vision-language --model"):
        load_example("dpo").main(args)


def test_kto_refuses_image_field(setup, tmp_path):
    root, _ = setup
    args = _args(root, tmp_path / "run")[:8] + ["--steps", "1"]
    with pytest.raises(ValueError, match="kto trains on text only"):
        load_example("kto").main(args)


def test_bad_image_is_named_or_dropped(setup, tmp_path):
    root, train = setup
    rows = [_pair(r) for r in train[:3]]
    rows[2]["image"] = "aGVsbG8gd29ybGQ="
    tok = load_tokenizer(root / "model")
    kw = dict(max_prompt_tokens=LP, max_completion_tokens=N)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from relax.data.files import read_records

    records = read_records(path)
    with pytest.raises(ValueError, match=r"rows.jsonl row 3, field 'image'"):
        encode_image_pairs(records, tok, _images(root), **kw)
    kept = encode_image_pairs(records, tok, _images(root, bad_images="drop"), **kw)
    assert [p.pair.row for p in kept.examples] == [1, 2] and "row 3" in kept.bad[0]


@pytest.mark.slow
def test_train_vision_step_is_sgd_on_the_loss_with_the_tower_inside(setup):
    """``--train-vision`` DPO, the tower already moved (step 1): the reference reads the initial
    tower's features, and one step (2 micro-batches of 2 pairs) moves the language model and the
    tower as plain SGD on the DPO loss with the tower inside, differentiated directly."""
    import equinox as eqx
    import optax

    from relax.algorithms.dpo.config import DPOConfig
    from relax.algorithms.dpo.loss import make_dpo_loss, pair_normalizers
    from relax.algorithms.dpo.step import make_dpo_step, pair_rows
    from relax.train.state import init_state
    from relax.train.update import LossContext

    root, train = setup
    vl, tok, images = (
        load_vision_language(root / "model"),
        load_tokenizer(root / "model"),
        _images(root),
    )
    host = _host_pairs([_pair(r) for r in train[:4]], tok, images)
    encode = lambda i, m, x: encode_images(vl, vl.language_model, i, m, x)  # noqa: E731
    initial = with_prompt(host, encode)  # the initial tower's features: the reference's
    pixels = families.pixels_of(host.images)
    tower = eqx.tree_at(lambda v: v.visual.merger.fc2, vl.vision, vl.vision.visual.merger.fc2 * 1.5)
    cfg = DPOConfig(max_prompt_tokens=LP, max_completion_tokens=N, grad_accum=2, beta=0.5)
    copy = lambda t: jax.tree.map(jnp.copy, t)  # noqa: E731  (a step donates its state)
    lr = 0.5
    state = init_state(
        copy(vl.language_model),
        optax.sgd(lr),
        key=jax.random.key(0),
        with_reference=True,
        vision=copy(tower),
    )
    state = state.replace(step=state.step + 1)
    new, _ = make_dpo_step(cfg)(state, dataclasses.replace(initial, pixels=pixels))

    ref_logps, _ = sequence_logps(pair_forward()(vl.language_model, initial, False), initial.mask)
    batch = dataclasses.replace(initial, ref_logps=ref_logps, loss_mask=jnp.ones(4, jnp.int32))
    ctx = LossContext(pair_normalizers(pair_rows(cfg, batch)), jnp.bool_(False))

    def loss(params):
        lm, part = params
        inputs = families.with_image_features(initial.prompt, part, pixels)
        return make_dpo_loss(cfg)(
            lm, pair_rows(cfg, dataclasses.replace(batch, prompt=inputs)), ctx
        )[0]

    grads = jax.grad(loss)((vl.language_model, tower))
    want = jax.tree.map(lambda p, g: p - lr * g, (vl.language_model, tower), grads)
    moved = 0
    for a, w, g in zip(
        jax.tree.leaves((new.policy, new.vision)), jax.tree.leaves(want), jax.tree.leaves(grads)
    ):
        np.testing.assert_allclose(a, w, rtol=2e-4, atol=2e-6)
        moved += int(np.abs(np.asarray(g)).max() > 0)
    assert moved > len(jax.tree.leaves(vl.language_model))  # the tower's got gradients too
