"""Gemma 3 from the command line, on the tiny Gemma 3 directory (``relax.tasks.tiny_gemma3``) and
the counting task's rows (``relax.tasks.visual``): transformers loads the directory (model,
tokenizer, ``Gemma3Processor``) and its prompt ids, pixels and logits on an image prompt equal
relax's; ``examples/train_grpo.py``, ``train_sft.py`` and ``train_dpo.py`` with ``--image-field
image`` train 2 steps; the GRPO run's export loads in transformers as
``Gemma3ForConditionalGeneration`` with the logits of the policy the run exported; a processor
whose image tokens per image are not the model's is refused at start-up, as transformers' model
refuses its prompts."""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example

import relax.algorithms.online.run as online_run
from relax.data.files import Record
from relax.data.image_prompts import ImagePrompts, processor_for
from relax.data.prompts import DataConfig, prepare_prompts
from relax.models.hf.config import HFFormatError
from relax.models.vision.families import load_vision_language
from relax.models.vision.gemma3 import vlm_logits
from relax.rewards.builtin import BUILTIN_REWARDS
from relax.tasks.tiny_gemma3 import write_tiny_gemma3
from relax.tasks.visual import VisualTask, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=8, num_eval=2)
ATOL = 2e-4  # logits, float32


def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-runs")
    write_tiny_gemma3(root / "model", TASK, key=jax.random.key(0))
    train, held_out = make_splits(TASK)
    _write(root / "train.jsonl", train)
    _write(root / "eval.jsonl", held_out)
    sft = [{"prompt": r["prompt"], "completion": r["answer"], "image": r["image"]} for r in train]
    _write(root / "sft.jsonl", sft)
    pairs = [
        dict(
            prompt=r["prompt"],
            chosen=r["answer"],
            rejected=str(int(r["answer"]) + 1),
            image=r["image"],
        )
        for r in train
    ]
    _write(root / "dpo.jsonl", pairs)
    return root, held_out[0]


def _pil(b64):
    from PIL import Image

    return Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")


@functools.cache
def _hf_processor(model_dir):
    import transformers

    proc = transformers.AutoProcessor.from_pretrained(model_dir)
    assert type(proc).__name__ == "Gemma3Processor"
    assert type(proc.image_processor).__name__ == "Gemma3ImageProcessorPil"
    return proc


def _hf_inputs(row, model_dir):
    """transformers' inputs of ``row`` as one user turn (its image, its text) + the generation
    prompt: the directory's chat template rendered by its tokenizer, then ``Gemma3Processor``."""
    proc = _hf_processor(model_dir)
    content = [{"type": "image"}, {"type": "text", "text": row["prompt"]}]
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return proc(text=text, images=[_pil(row["image"])], return_tensors="pt")


@functools.cache
def _hf_model(model_dir):
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    return model


def _hf_logits(model_dir, inputs):
    import torch

    model = _hf_model(model_dir)
    with torch.no_grad():
        return model(**inputs).logits.numpy()


def _relax_logits(policy, vision, ids, pixels):
    ids = jnp.asarray(ids)
    return np.asarray(vlm_logits(policy, vision, ids, jnp.ones_like(ids), jnp.asarray(pixels)))


@pytest.mark.parity
def test_transformers_loads_the_directory_and_agrees(setup):
    """The prompt relax builds from a row (chat template, ``<start_of_image>`` expanded), its
    pixels and the model's logits on it equal transformers' processor's and model's."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    root, row = setup
    model_dir = root / "model"
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (
        tok.convert_tokens_to_ids("<end_of_turn>")
        in transformers.GenerationConfig.from_pretrained(model_dir).eos_token_id
    )
    inputs = _hf_inputs(row, model_dir)
    hf_ids = inputs["input_ids"][0].tolist()
    assert hf_ids.count(tok.convert_tokens_to_ids("<image_soft_token>")) == 4
    assert tok.convert_ids_to_tokens(hf_ids[:2]) == ["<bos>", "<start_of_turn>"]

    images = ImagePrompts("image", processor_for("gemma3", model_dir))
    cfg = DataConfig(path=str(root / "eval.jsonl"), batch_size=1, max_prompt_tokens=64)
    prepared = prepare_prompts(
        [Record("eval.jsonl", 1, row)], cfg, load_tokenizer(model_dir), images
    )
    (example,) = prepared.examples
    assert example.ids == hf_ids
    pixels = images.batch([example.images]).pixel_values
    np.testing.assert_allclose(pixels, inputs["pixel_values"].numpy(), atol=1e-6, rtol=0)

    vl = load_vision_language(model_dir)
    assert vl.family.model_type == "gemma3"
    want = _hf_logits(model_dir, inputs)
    got = _relax_logits(vl.language_model, vl.vision, [hf_ids], pixels)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    blank = _relax_logits(vl.language_model, vl.vision, [hf_ids], np.zeros_like(pixels))
    assert np.max(np.abs(blank - want)) > 20 * ATOL  # the image reaches the logits


def _unmatched(setup, tmp_path) -> Path:
    """The tiny Gemma 3 without ``processor_config.json``: the processor's 256 image tokens per
    image (Gemma3Processor's default) against the model's 4 features."""
    model = tmp_path / "model"
    shutil.copytree(setup[0] / "model", model)
    (model / "processor_config.json").unlink()
    return model


def test_image_tokens_per_image_must_be_the_model_s(setup, tmp_path):
    root, _ = setup
    model = _unmatched(setup, tmp_path)
    args = ["--model", str(model), "--data", str(root / "train.jsonl"), "--image-field", "image"]
    args += ["--run-dir", str(tmp_path / "run"), "--steps", "1", "--max-prompt-tokens", "512"]
    want = r"processor_config.json: field 'image_seq_length' = 256 .* mm_tokens_per_image = 4"
    with pytest.raises(HFFormatError, match=want):
        load_example("grpo").main(args)


@pytest.mark.parity
def test_transformers_refuses_those_prompts_too(setup, tmp_path):
    """The reference for the refusal above: transformers' processor gives 256 image tokens per
    image there, and its model refuses them for the 4 features."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    model = _unmatched(setup, tmp_path)
    inputs = _hf_inputs(setup[1], model)
    assert int((inputs["token_type_ids"] == 1).sum()) == 256
    with pytest.raises(ValueError, match="do not match"):
        _hf_logits(model, inputs)


def _varied(prompts, completions, **fields):
    """A reward that differs between completions (the tiny model never counts right), so that
    a GRPO step moves the policy."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


@pytest.fixture(scope="module")
def grpo(setup, tmp_path_factory):
    """One GRPO run of 2 steps with a held-out evaluation; (run dir, printed output, summary,
    the policy each export was written from, by directory name)."""
    root, _ = setup
    run_dir = tmp_path_factory.mktemp("gemma3-grpo") / "run"
    seen, real = {}, online_run.exporter

    def recording(*args, **kw):
        export = real(*args, **kw)

        def wrapped(policy, directory):
            seen[Path(directory).name] = policy
            return export(policy, directory)

        return wrapped

    args = [
        "--model", str(root / "model"),
        "--data", str(root / "train.jsonl"),
        "--eval-data", str(root / "eval.jsonl"),
        "--image-field", "image",
        "--reward", "format_reward",
        "--run-dir", str(run_dir),
        "--steps", "2",
        "--batch-size", "2",
        "--max-prompt-tokens", "64",
        "--grpo.num-generations", "2",
        "--grpo.max-new-tokens", "3",
        "--grpo.optimizer.learning-rate", "0.01",
        "--eval-every", "2",
    ]  # fmt: skip
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.setitem(BUILTIN_REWARDS, "format_reward", _varied)
        mp.setattr(online_run, "exporter", recording)
        summary = load_example("grpo").main(args)
    return run_dir, out.getvalue(), summary, seen


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # a whole run: make test-all
def test_grpo_trains_on_gemma3(grpo):
    run_dir, out, summary, _ = grpo
    assert "training images: 8 in all, 1-1 per prompt" in out
    assert "padded rows (not packed)" in out
    lines = _metrics(run_dir)
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(abs(s["mismatch/abs_max"]) < 1e-3 for s in steps)
    assert all(np.isfinite(s["loss"]) for s in steps)
    assert any("eval/greedy/accuracy" in x for x in lines)
    assert summary["data"]["train"]["images"] == 8


@pytest.mark.parity
@pytest.mark.slow  # a whole run: make test-all
def test_grpo_export_is_the_trained_gemma3(setup, grpo):
    """The export is the whole Gemma 3 with its processor files, and transformers' logits on an
    image prompt equal those of the policy the run exported (and not the base model's)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root, row = setup
    _, _, summary, seen = grpo
    export = Path(summary["export"])
    files = {p.name for p in export.iterdir()}
    want = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}
    assert want | {"preprocessor_config.json", "processor_config.json"} <= files, sorted(files)
    assert json.loads((export / "config.json").read_text())["model_type"] == "gemma3"
    inputs = _hf_inputs(row, export)  # the exported tokenizer and processor
    base_inputs = _hf_inputs(row, root / "model")
    for k in inputs:
        np.testing.assert_array_equal(inputs[k].numpy(), base_inputs[k].numpy())
    ids, pixels = inputs["input_ids"].numpy(), inputs["pixel_values"].numpy()
    vision = load_vision_language(root / "model").vision
    want = _relax_logits(seen[export.name], vision, ids, pixels)
    np.testing.assert_allclose(_hf_logits(export, inputs), want, atol=ATOL, rtol=0)
    base = _hf_logits(root / "model", inputs)
    assert np.max(np.abs(base - want)) > 20 * ATOL  # the export is the trained policy


def _trained(run_dir: Path, held_out_key: str) -> None:
    lines = _metrics(run_dir)
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
    assert any(held_out_key in x for x in lines)


@pytest.fixture(scope="module")
def sft(setup, tmp_path_factory):
    """One SFT run of 2 steps with a held-out evaluation: (run dir, printed output, summary)."""
    root, _ = setup
    run_dir = tmp_path_factory.mktemp("gemma3-sft") / "run"
    args = [
        "--model", str(root / "model"),
        "--data", str(root / "sft.jsonl"),
        "--image-field", "image",
        "--run-dir", str(run_dir),
        "--steps", "2",
        "--batch-size", "2",
        "--sft.max-length", "64",
        "--eval-every", "2",
    ]  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = load_example("sft").main(args)
    return run_dir, out.getvalue(), summary


@pytest.mark.slow  # a whole run: make test-all
def test_sft_trains_on_gemma3(sft):
    run_dir, out, summary = sft
    assert "training images: 7 in all, 1-1 per example" in out and "not packed" in out
    _trained(run_dir, "eval/nll")
    assert summary["data"]["train_rows"] == 7 and summary["data"]["held_out_rows"] == 1


def _hf_answer_nll(row, model_dir) -> float:
    """transformers' mean NLL of the assistant turn (the answer, ``<end_of_turn>``, ``\\n``) after
    the row's user turn, the chat rendered by the directory's template and ``Gemma3Processor``."""
    import torch

    proc = _hf_processor(model_dir)
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": row["prompt"]}]}
    chat = [user, {"role": "assistant", "content": row["completion"]}]
    render = proc.tokenizer.apply_chat_template
    image = [_pil(row["image"])]
    prompt = proc(text=render([user], add_generation_prompt=True, tokenize=False), images=image)
    inputs = proc(text=render(chat, tokenize=False), images=image, return_tensors="pt")
    ids, start = inputs["input_ids"][0], len(prompt["input_ids"][0])
    logits = torch.tensor(_hf_logits(model_dir, inputs)[0]).double()
    logp = torch.log_softmax(logits, -1)[start - 1 : -1].gather(1, ids[start:, None])
    return -float(logp.mean())


@pytest.mark.parity
@pytest.mark.slow  # a whole run: make test-all
def test_sft_held_out_nll_is_transformers(setup, sft):
    """The held-out NLL before training equals transformers' on one of the rows (the one held
    out: the rows' values differ by far more than the tolerance)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    root, _ = setup
    run_dir, _, _ = sft
    got = next(x["eval/nll"] for x in _metrics(run_dir) if x["step"] == 0 and "eval/nll" in x)
    rows = [json.loads(x) for x in (root / "sft.jsonl").read_text().splitlines()]
    want = np.array([_hf_answer_nll(r, root / "model") for r in rows])
    assert np.min(np.abs(want - got)) < 1e-4, (got, want)
    assert np.sort(np.abs(want - got))[1] > 1e-3  # one row matches, not several


@pytest.mark.slow  # a whole run: make test-all
def test_dpo_trains_on_gemma3(setup, tmp_path, capsys):
    root, _ = setup
    args = [
        "--model", str(root / "model"),
        "--data", str(root / "dpo.jsonl"),
        "--image-field", "image",
        "--run-dir", str(tmp_path / "run"),
        "--steps", "2",
        "--batch-size", "2",
        "--dpo.max-prompt-tokens", "64",
        "--dpo.max-completion-tokens", "4",
        "--eval-every", "2",
    ]  # fmt: skip
    load_example("dpo").main(args)
    assert "in all, 1-1 per example" in capsys.readouterr().out
    _trained(tmp_path / "run", "eval/rewards/accuracies")
