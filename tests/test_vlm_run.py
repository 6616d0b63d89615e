"""A GRPO run on a vision-language model from the command line: ``examples/train_grpo.py --model
VLM_DIR --data rows.jsonl --image-field image`` on the tiny Qwen2.5-VL (``relax.tasks.tiny_vlm``)
and the counting task's rows (base64 PNGs, ``relax.tasks.visual``). The start-up report counts
the images, the step's programs compile before it (none in a step), the held-out evaluation
samples with the images, a bad image is an error naming the file, row and field or a dropped
row, and a text model refuses --image-field.
PPO trains on them as well, its vision tower once per prompt."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest
from conftest import load_example

from relax.data.files import Record
from relax.data.image_prompts import ImagePrompts, processor_for
from relax.data.prompts import DataConfig, prepare_prompts
from relax.models.vision import families
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits
from relax.text import load_tokenizer

TASK = VisualTask(num_train=16, num_eval=4)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-run")
    write_tiny_qwen2_5_vl(root / "model", TASK, key=jax.random.key(0))
    train, held_out = make_splits(TASK)
    for name, rows in (("train", train), ("eval", held_out)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _args(setup, run_dir, *extra):
    return [
        "--model", str(setup / "model"),
        "--data", str(setup / "train.jsonl"),
        "--eval-data", str(setup / "eval.jsonl"),
        "--image-field", "image",
        "--reward", "exact_match",
        "--run-dir", str(run_dir),
        "--steps", "2",
        "--batch-size", "2",
        "--max-prompt-tokens", "64",
        "--grpo.num-generations", "2",
        "--grpo.max-new-tokens", "3",
        "--eval-every", "2",
        *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_grpo_trains_on_image_prompts(setup, tmp_path, capsys):
    summary = load_example("grpo").main(_args(setup, tmp_path / "run"))
    out = capsys.readouterr().out
    assert "training images: 16 in all, 1-1 per prompt" in out
    # the step's programs compiled before it, for the image prompts' inputs; their encode and
    # the held-out samplers when first called (the evaluation before step 1 calls them)
    assert "rollout [prompts 64]" in out and "advantage+update [prompts 64]" in out
    assert "image prompts' encode (its shapes follow each batch's images)" in out
    assert "padded rows (not packed)" in out and "packed across groups" not in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(abs(s["mismatch/abs_max"]) < 1e-3 for s in steps)
    assert [s["compiles"] for s in steps] == [0, 0]
    assert any("eval/greedy/accuracy" in x for x in lines)
    assert summary["data"]["train"]["images"] == 16


def _rows(setup, tmp_path, bad):
    rows = [json.loads(x) for x in (setup / "train.jsonl").read_text().splitlines()][:4]
    rows[2]["image"] = bad
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [Record(str(path), i + 1, r) for i, r in enumerate(rows)]


@pytest.mark.parametrize("bad", ["missing.png", "aGVsbG8gd29ybGQ="], ids=["path", "base64"])
def test_a_bad_image_is_named_or_dropped(setup, tmp_path, bad):
    model = setup / "model"
    tokenizer = load_tokenizer(model)
    cfg = DataConfig(path=str(setup / "train.jsonl"), batch_size=2, max_prompt_tokens=64)
    images = ImagePrompts("image", processor_for("qwen2_5_vl", model))
    rows = _rows(setup, tmp_path, bad)
    with pytest.raises(ValueError, match=r"rows.jsonl row 3, field 'image'"):
        prepare_prompts(rows, cfg, tokenizer, images)
    dropped = ImagePrompts("image", images.processor, bad_images="drop")
    prepared = prepare_prompts(rows, cfg, tokenizer, dropped)
    assert prepared.stats.kept == 3 and len(prepared.stats.bad_images) == 1
    assert "row 3" in prepared.stats.bad_images_message("training")
    assert prepared.stats.summary()["dropped"] == 1


def test_image_field_needs_a_vision_language_model(tmp_path):
    example = load_example("grpo")
    with pytest.raises((SystemExit, ValueError)):  # before any base model is trained
        example.main(["--image-field", "image", "--steps", "1", "--run-dir", str(tmp_path)])
    assert not (tmp_path / "task").exists()


@pytest.mark.slow  # a whole run: make test-all
def test_ppo_trains_on_image_prompts_encoding_each_prompt_once(
    setup, tmp_path, capsys, monkeypatch
):
    calls = []
    family = families.VISION_FAMILIES["qwen2_5_vl"]

    def counting(lm, vision, ids, mask, pixels, grid):
        calls.append((np.asarray(ids).shape[0], len(grid)))
        return family.encode(lm, vision, ids, mask, pixels, grid)

    monkeypatch.setitem(
        families.VISION_FAMILIES, "qwen2_5_vl", dataclasses.replace(family, encode=counting)
    )
    args = _args(setup, tmp_path / "ppo")
    cut = args.index("--grpo.num-generations")
    args = args[:cut] + ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "3"]
    summary = load_example("ppo").main(args + ["--eval-every", "2"])
    out = capsys.readouterr().out
    assert "training images: 16 in all, 1-1 per prompt" in out
    lines = [json.loads(x) for x in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(abs(s["mismatch/abs_max"]) < 1e-3 for s in steps)
    assert all(np.isfinite(s["critic/loss"]) and "values_mean" in s for s in steps)
    assert any("eval/greedy/accuracy" in x for x in lines)
    assert summary["data"]["train"]["images"] == 16
    exported = json.loads((tmp_path / "ppo" / "final_hf" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]  # the whole VLM
    # each step's 2 prompts (2 completions each) encoded once, and the 4 held-out prompts once
    # for the run's evaluations: one image per prompt
    assert sorted(calls) == [(2, 2), (2, 2), (4, 4)], calls


def _vision_tensors(directory) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(
            {k: v for k, v in load_file(f).items() if ".visual." in k or k.startswith("visual.")}
        )
    return out


@pytest.mark.slow  # two whole runs: make test-all
def test_train_vision_exports_and_resumes_the_trained_tower(setup, tmp_path, capsys):
    """``--train-vision``: every vision tensor of the export moved from the base model's, and a
    run resumed from the last checkpoint holds that trained tower, not the initial one."""
    run_dir = tmp_path / "tv"
    args = _args(setup, run_dir, "--train-vision", "--checkpoint-every", "1")
    summary = load_example("grpo").main(args)
    assert "vision tower: trained with the language model" in capsys.readouterr().out
    base, trained = _vision_tensors(setup / "model"), _vision_tensors(run_dir / "final_hf")
    assert base.keys() == trained.keys() and len(base) > 10
    assert all(not np.array_equal(base[k], trained[k]) for k in base)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(x["grad_norm"]) for x in lines if "loss" in x)
    assert summary["steps"] == 2
    shutil.rmtree(run_dir / "final_hf")
    load_example("grpo").main([*args, "--resume"])  # restores step 2: nothing left to train
    restored = _vision_tensors(run_dir / "final_hf")  # the resumed run's export
    assert all(np.array_equal(restored[k], trained[k]) for k in base)


def _ppo_args(setup, run_dir, *extra):
    args = _args(setup, run_dir)
    cut = args.index("--grpo.num-generations")
    return args[:cut] + ["--ppo.num-generations", "2", "--ppo.max-new-tokens", "3", *extra]


@pytest.mark.parametrize(
    "algo, extra, why",
    [
        ("grpo", ("--async.staleness", "1"), "--async.staleness"),
        ("ppo", ("--ppo.critic", "shared"), "use a separate critic"),
        (
            "grpo",
            (
                "--grpo.beta",
                "0.04",
                "--grpo.reference.kind",
                "ema",
                "--grpo.reference.alpha",
                "0.9",
            ),
            "kind static",
        ),
    ],
    ids=["async", "shared-critic", "moving-reference"],
)
@pytest.mark.slow
def test_train_vision_refusals(setup, tmp_path, algo, extra, why):
    if algo == "ppo":
        args = _ppo_args(setup, tmp_path / "r", "--train-vision", *extra)
    else:
        args = _args(setup, tmp_path / "r", "--train-vision", *extra)
    with pytest.raises(ValueError, match=why):
        load_example(algo).main(args)


@pytest.mark.slow  # a whole run: make test-all
def test_ppo_train_vision_moves_the_tower_and_samples_as_it_trains(setup, tmp_path):
    """PPO with ``--train-vision`` (a separate critic): every exported vision tensor moved, and
    the sampler's log-probs are the trainer's with the state's tower (the first optimizer
    step's mismatch is round-off)."""
    run_dir = tmp_path / "ppo"
    load_example("ppo").main(_ppo_args(setup, run_dir, "--train-vision"))
    base, trained = _vision_tensors(setup / "model"), _vision_tensors(run_dir / "final_hf")
    assert base.keys() == trained.keys() and len(base) > 10
    assert all(not np.array_equal(base[k], trained[k]) for k in base)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "loss" in x]
    assert len(steps) == 2 and all(abs(s["mismatch/abs_max"]) < 1e-5 for s in steps), steps


@pytest.mark.parametrize(
    "flags", [{"train_vision": True}, {"lora": "vision"}], ids=["train", "lora"]
)
def test_a_trained_tower_needs_image_prompts(flags):
    """``--train-vision`` and ``--lora.vision`` on a run without ``--image-field``: refused when
    the config is made, before anything loads."""
    from relax.algorithms.grpo.run import GRPORunConfig
    from relax.algorithms.sft.run import SFTRunConfig
    from relax.models.layers.lora import LoRAConfig

    kw = {"lora": LoRAConfig(rank=4, vision=True)} if "lora" in flags else flags
    for config in (GRPORunConfig, SFTRunConfig):
        with pytest.raises(ValueError, match="give --image-field"):
            config(model="m", data="d.jsonl", **kw)
