"""A vision-language run exports the whole model (``relax.algorithms.online.setup.exporter``):
GRPO and SFT runs of one step on the tiny Qwen2.5-VL (``relax.tasks.tiny_vlm``) write a
directory transformers loads as ``Qwen2_5_VLForConditionalGeneration``, whose logits on an image
prompt equal the trained policy's in relax (the policy as it reached the export, its adapters
unmerged); with LoRA the merged export does and so does PEFT's ``PeftModel`` on the base model
with ``dir/adapter``. The adapter's tensor names are the ones PEFT itself writes for the
transformers VLM classes (Qwen2.5-VL and Gemma 3), and ``load_adapter`` reads them back.
The reference logits are transformers' (the image processed by its own PIL processor)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_example

import relax.algorithms.offline.run as offline_run
import relax.algorithms.online.run as online_run
from relax.models.adapters.operations import add_lora, merge_lora
from relax.models.adapters.peft import load_adapter, save_adapter
from relax.models.hf.config import HFFormatError
from relax.models.layers.lora import LoRAConfig
from relax.models.vision.families import VISION_FAMILIES, load_vision_language
from relax.models.vision.qwen2_5_vl import vl_forward
from relax.rewards.builtin import BUILTIN_REWARDS
from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
from relax.tasks.visual import VisualTask, make_splits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_vision_gemma3 import BOI, EOI, IMG, MM, _hf_model  # noqa: E402

pytestmark = pytest.mark.parity

TASK = VisualTask(num_train=4, num_eval=2)
ATOL = 2e-4
TARGETS = ("q_proj", "v_proj", "gate_proj", "down_proj")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm-export")
    write_tiny_qwen2_5_vl(root / "model", TASK, key=jax.random.key(0))
    train, held_out = make_splits(TASK)
    for name, rows in (("train", train), ("eval", held_out)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = [{"prompt": r["prompt"], "completion": r["answer"], "image": r["image"]} for r in train]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    return root, held_out[0]


def _varied(prompts, completions, **fields):
    """A reward that differs between completions (the tiny model never counts right), so that
    one GRPO step moves the policy."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def _record_exports(monkeypatch, module) -> dict:
    """Wrap ``module.exporter``: every exported policy, by directory name, as the run held it."""
    seen, real = {}, module.exporter

    def recording(*args, **kw):
        export = real(*args, **kw)

        def wrapped(policy, directory, **kw):  # kw: a trained tower (vision=)
            seen[Path(directory).name] = policy
            seen[f"{Path(directory).name}/vision"] = kw.get("vision")
            return export(policy, directory, **kw)

        return wrapped

    monkeypatch.setattr(module, "exporter", recording)
    return seen


def _grpo(root, run_dir, *extra):
    return [
        "--model", str(root / "model"),
        "--data", str(root / "train.jsonl"),
        "--image-field", "image",
        "--reward", "format_reward",
        "--run-dir", str(run_dir),
        "--steps", "1",
        "--batch-size", "2",
        "--max-prompt-tokens", "64",
        "--grpo.num-generations", "2",
        "--grpo.max-new-tokens", "2",
        "--grpo.optimizer.learning-rate", "0.01",
        "--eval-every", "0",
        *extra,
    ]  # fmt: skip


def _sft(root, run_dir, *extra):
    return [
        "--model", str(root / "model"),
        "--data", str(root / "sft.jsonl"),
        "--image-field", "image",
        "--run-dir", str(run_dir),
        "--steps", "1",
        "--batch-size", "2",
        "--sft.max-length", "48",
        "--sft.optimizer.learning-rate", "0.01",
        "--eval-every", "0",
        "--eval-fraction", "0",
        *extra,
    ]  # fmt: skip


def _prompt(row, model_dir):
    """transformers' inputs of ``row`` as a user turn (its image, its text) + generation prompt:
    the tokenizer and ``Qwen2VLImageProcessorPil`` of ``model_dir``, each image pad expanded to
    its grid's merged tokens."""
    from PIL import Image
    from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

    image = Image.open(io.BytesIO(base64.b64decode(row["image"]))).convert("RGB")
    proc = Qwen2VLImageProcessorPil.from_pretrained(model_dir)([image])
    grid = [tuple(int(x) for x in g) for g in proc["image_grid_thw"].tolist()]
    pads = "<|image_pad|>" * (int(np.prod(grid[0])) // 4)
    text = (
        f"<|im_start|>user\n<|vision_start|>{pads}<|vision_end|>{row['prompt']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = np.asarray([tok(text, add_special_tokens=False)["input_ids"]])
    return ids, np.asarray(proc["pixel_values"]), grid


def _hf_logits(model, ids, pixels, grid):
    t = torch.tensor(ids)
    image_id = model.config.image_token_id
    with torch.no_grad():
        return model(
            input_ids=t,
            attention_mask=torch.ones_like(t),
            pixel_values=torch.tensor(pixels),
            image_grid_thw=torch.tensor(grid),
            mm_token_type_ids=(t == image_id).long(),
        ).logits.numpy()


def _relax_logits(policy, model_dir, ids, pixels, grid):
    """The policy's logits with the frozen vision part of ``model_dir`` (adapters unmerged)."""
    vision = load_vision_language(model_dir).vision
    m = dataclasses.replace(vision, language_model=policy)
    return np.asarray(vl_forward(m, ids, np.ones_like(ids), jnp.asarray(pixels), grid))


def _load(directory):
    model = transformers.AutoModelForImageTextToText.from_pretrained(directory).eval()
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    return model


def _check_export(root, row, policy, export, *, lora):
    """``export`` (the run's output) is the whole VLM with the processor files, transformers'
    logits on an image prompt equal the policy's, and they differ from the base model's (the
    step trained); with ``lora`` PEFT's model on the base gives them too."""
    files = {p.name for p in export.iterdir()}
    want = {"config.json", "generation_config.json", "tokenizer.json", "preprocessor_config.json"}
    assert want <= files, sorted(files)
    assert json.loads((export / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert ("adapter" in files) == lora
    ids, pixels, grid = _prompt(row, export)  # the exported tokenizer and processor
    ids0, pixels0, grid0 = _prompt(row, root / "model")
    assert np.array_equal(ids, ids0) and np.array_equal(pixels, pixels0) and grid == grid0
    want = _relax_logits(policy, root / "model", ids, pixels, grid)
    got = _hf_logits(_load(export), ids, pixels, grid)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    base = _hf_logits(_load(root / "model"), ids, pixels, grid)
    assert np.max(np.abs(base - want)) > 20 * ATOL  # the export is the trained policy
    if lora:
        tuned = peft.PeftModel.from_pretrained(_load(root / "model"), export / "adapter").eval()
        np.testing.assert_allclose(_hf_logits(tuned, ids, pixels, grid), want, atol=ATOL, rtol=0)


@pytest.mark.slow  # a whole run: make test-all
def test_grpo_lora_exports_the_whole_vlm_and_its_adapters(setup, tmp_path, monkeypatch):
    """GRPO with LoRA (the exporter is the same without: SFT tests both); the export of step 1
    (--export-every) is the whole model too."""
    root, row = setup
    monkeypatch.setitem(BUILTIN_REWARDS, "format_reward", _varied)
    seen = _record_exports(monkeypatch, online_run)
    extra = ("--lora.rank", "4", "--lora.target-modules", *TARGETS, "--export-every", "1")
    summary = load_example("grpo").main(_grpo(root, tmp_path / "run", *extra))
    export = Path(summary["export"])
    _check_export(root, row, seen[export.name], export, lora=True)
    step = tmp_path / "run" / "hf" / "step-1"
    assert json.loads((step / "config.json").read_text())["model_type"] == "qwen2_5_vl"
    assert (step / "preprocessor_config.json").is_file() and (step / "adapter").is_dir()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.slow
def test_sft_exports_the_whole_vlm(setup, tmp_path, monkeypatch, lora):
    root, row = setup
    seen = _record_exports(monkeypatch, offline_run)
    extra = ("--lora.rank", "4", "--lora.target-modules", *TARGETS) if lora else ()
    summary = load_example("sft").main(_sft(root, tmp_path / "run", *extra))
    export = Path(summary["export"])
    _check_export(root, row, seen[export.name], export, lora=lora)


def _lora(lm, seed=1):
    """``lm`` with random adapters on ``TARGETS`` (B nonzero too: a fresh adapter's B is 0)."""
    m = add_lora(lm, LoRAConfig(rank=4, alpha=8.0, target_modules=TARGETS), jax.random.key(seed))
    leaves, tree = jax.tree.flatten(m.layers.lora)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    rand = [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    lora = jax.tree.unflatten(tree, rand)
    return dataclasses.replace(m, layers=dataclasses.replace(m.layers, lora=lora))


def _peft_names(model) -> set[str]:
    """The tensor names PEFT itself writes for ``TARGETS`` on the VLM's language model."""
    cfg = peft.LoraConfig(r=4, target_modules=list(TARGETS), task_type="CAUSAL_LM")
    names = peft.get_peft_model(model, cfg).state_dict()
    return {n.replace(".default.", ".") for n in names if ".lora_" in n and "language_model" in n}


def _saved_names(directory) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "adapter_model.safetensors"), "np") as f:
        return set(f.keys())


def test_qwen_adapter_is_peft_s_on_the_vlm_class(setup, tmp_path):
    root, row = setup
    vl = load_vision_language(root / "model")
    policy = _lora(vl.language_model)
    prefix = VISION_FAMILIES["qwen2_5_vl"].peft_prefix
    save_adapter(policy, tmp_path / "adapter", prefix=prefix)
    assert _saved_names(tmp_path / "adapter") == _peft_names(_load(root / "model"))
    tuned = peft.PeftModel.from_pretrained(_load(root / "model"), tmp_path / "adapter").eval()
    assert not [n for n, _ in tuned.named_parameters() if "lora_" in n and ".visual." in n]
    ids, pixels, grid = _prompt(row, root / "model")
    want = _relax_logits(policy, root / "model", ids, pixels, grid)
    np.testing.assert_allclose(_hf_logits(tuned, ids, pixels, grid), want, atol=ATOL, rtol=0)
    base = _hf_logits(_load(root / "model"), ids, pixels, grid)
    assert np.max(np.abs(base - want)) > 20 * ATOL  # the adapters are live
    back = load_adapter(vl.language_model, tmp_path / "adapter", prefix=prefix)
    for a, b in zip(jax.tree.leaves(back.layers.lora), jax.tree.leaves(policy.layers.lora)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(HFFormatError, match=r"under \['model.language_model'\].*pass prefix="):
        load_adapter(vl.language_model, tmp_path / "adapter")  # a causal LM's names


def test_gemma3_adapter_both_ways(tmp_path):
    from relax.models.vision.gemma3 import vlm_logits

    _hf_model().save_pretrained(tmp_path / "hf")  # the parity tests' tiny Gemma 3

    def hf():
        return transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf")

    ids = np.asarray([[5, 6, BOI, *[IMG] * MM, EOI, 10, 11]])
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1

    def hf_logits(model):
        t = torch.tensor(ids)
        with torch.no_grad():
            out = model.eval()(
                input_ids=t,
                pixel_values=pixels,
                attention_mask=torch.ones_like(t),
                token_type_ids=(t == IMG).long(),
            )
        return out.logits.numpy()

    def relax_logits(lm, vision):
        args = (jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), jnp.asarray(pixels.numpy()))
        return np.asarray(vlm_logits(lm, vision, *args, jnp.zeros((1,), jnp.int32)))

    vl = load_vision_language(tmp_path / "hf")
    prefix = vl.family.peft_prefix
    policy = _lora(vl.language_model)
    save_adapter(policy, tmp_path / "ours", prefix=prefix)
    assert _saved_names(tmp_path / "ours") == _peft_names(hf())
    tuned = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours")
    assert not [n for n, _ in tuned.named_parameters() if "lora_" in n and "vision" in n]
    want = relax_logits(policy, vl.vision)
    assert np.max(np.abs(relax_logits(vl.language_model, vl.vision) - want)) > 20 * ATOL
    np.testing.assert_allclose(hf_logits(tuned), want, atol=ATOL, rtol=0)
    np.testing.assert_allclose(relax_logits(merge_lora(policy), vl.vision), want, atol=ATOL, rtol=0)

    # an adapter PEFT writes (its own random B) loads into relax with the same logits
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=list(TARGETS), exclude_modules=r".*vision.*|.*projector.*"
    )
    theirs = peft.get_peft_model(hf(), cfg)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            if "lora_B" in n:
                p.copy_(0.2 * torch.randn_like(p))
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = load_adapter(vl.language_model, tmp_path / "theirs", prefix=prefix)
    np.testing.assert_allclose(
        relax_logits(loaded, vl.vision), hf_logits(theirs), atol=ATOL, rtol=0
    )


def _tower_lora(vision, modules, seed=3):
    """``vision`` with random adapters (B nonzero) on its family's ``lora_modules``."""
    from relax.models.adapters.tower import add_module_lora

    cfg = LoRAConfig(rank=4, alpha=8.0, vision=True)
    m = add_module_lora(vision, tuple(modules), cfg, jax.random.key(seed))
    keys = iter(jax.random.split(jax.random.key(seed + 1), 2 * len(m.b)))
    b = {p: 0.2 * jax.random.normal(next(keys), x.shape, x.dtype) for p, x in m.b.items()}
    return dataclasses.replace(m, b=b)


def _saved_with_tower(vl, family, directory):
    """Random adapters on ``vl``'s language model and tower, saved to ``directory``."""
    policy, tower = _lora(vl.language_model), _tower_lora(vl.vision, family.lora_modules)
    modules = family.lora_modules
    save_adapter(policy, directory, prefix=family.peft_prefix, tower=tower, tower_modules=modules)
    return policy, tower


def _peft_names_of(model, directory) -> set[str]:
    """The tensor names PEFT itself writes for the modules ``directory``'s config targets."""
    targets = json.loads((directory / "adapter_config.json").read_text())["target_modules"]
    theirs = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets)).state_dict()
    return {n.replace(".default.", ".") for n in theirs if ".lora_" in n}


def test_qwen_tower_adapters_are_peft_s_on_the_vlm_class(setup, tmp_path):
    """``--lora.vision``: the tower's adapters beside the language model's, under the names PEFT
    writes for the same modules on ``Qwen2_5_VLForConditionalGeneration``; PEFT's model on the base
    gives relax's logits (the tower merged), and the tower's adapters change them."""
    from relax.models.adapters.tower import merged_module

    root, row = setup
    vl = load_vision_language(root / "model")
    family = VISION_FAMILIES["qwen2_5_vl"]
    policy, tower = _saved_with_tower(vl, family, tmp_path / "adapter")
    names = _peft_names_of(_load(root / "model"), tmp_path / "adapter")
    assert _saved_names(tmp_path / "adapter") == names
    assert any(".visual.merger." in n for n in names) and any(".visual.blocks." in n for n in names)
    tuned = peft.PeftModel.from_pretrained(_load(root / "model"), tmp_path / "adapter").eval()
    ids, pixels, grid = _prompt(row, root / "model")
    m = dataclasses.replace(merged_module(tower), language_model=policy)
    want = np.asarray(vl_forward(m, ids, np.ones_like(ids), jnp.asarray(pixels), grid))
    np.testing.assert_allclose(_hf_logits(tuned, ids, pixels, grid), want, atol=ATOL, rtol=0)
    frozen_tower = _relax_logits(policy, root / "model", ids, pixels, grid)
    assert np.max(np.abs(frozen_tower - want)) > 20 * ATOL  # the tower's adapters are live
    with pytest.raises(HFFormatError, match="a vision tower's adapters"):
        load_adapter(vl.language_model, tmp_path / "adapter", prefix=family.peft_prefix)


@pytest.mark.slow  # a whole run: make test-all
def test_grpo_lora_vision_exports_the_merged_tower_and_its_adapters(setup, tmp_path, monkeypatch):
    """``--lora.rank 4 --lora.vision``: the export is the VLM with the tower merged (transformers'
    logits equal the run's policy and tower), and PEFT's model on the base with ``adapter``
    gives them too."""
    from relax.models.adapters.tower import ModuleLoRA, merged_module

    root, row = setup
    monkeypatch.setitem(BUILTIN_REWARDS, "format_reward", _varied)
    seen = _record_exports(monkeypatch, online_run)
    extra = ("--lora.rank", "4", "--lora.target-modules", *TARGETS, "--lora.vision")
    summary = load_example("grpo").main(_grpo(root, tmp_path / "run", *extra))
    export = Path(summary["export"])
    policy, tower = seen[export.name], seen[f"{export.name}/vision"]
    assert isinstance(tower, ModuleLoRA)
    assert all(float(jnp.abs(b).max()) > 0 for b in tower.b.values())  # the step moved them
    ids, pixels, grid = _prompt(row, export)
    m = dataclasses.replace(merged_module(tower), language_model=policy)
    want = np.asarray(vl_forward(m, ids, np.ones_like(ids), jnp.asarray(pixels), grid))
    np.testing.assert_allclose(
        _hf_logits(_load(export), ids, pixels, grid), want, atol=ATOL, rtol=0
    )
    tuned = peft.PeftModel.from_pretrained(_load(root / "model"), export / "adapter").eval()
    np.testing.assert_allclose(_hf_logits(tuned, ids, pixels, grid), want, atol=ATOL, rtol=0)


def test_gemma3_tower_adapters_are_peft_s_on_the_vlm_class(tmp_path):
    """Gemma 3's SigLIP adapters (``--lora.vision``) under the names PEFT writes on
    ``Gemma3ForConditionalGeneration``; PEFT's model on the base gives relax's logits."""
    from relax.models.adapters.tower import merged_module
    from relax.models.vision.gemma3 import vlm_logits

    _hf_model().save_pretrained(tmp_path / "hf")

    def hf():
        return transformers.Gemma3ForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()

    vl = load_vision_language(tmp_path / "hf")
    family = VISION_FAMILIES["gemma3"]
    policy, tower = _saved_with_tower(vl, family, tmp_path / "ours")
    names = _peft_names_of(hf(), tmp_path / "ours")
    assert _saved_names(tmp_path / "ours") == names
    assert any(".vision_tower." in n for n in names)
    ids = np.asarray([[5, 6, BOI, *[IMG] * MM, EOI, 10, 11]])
    pixels = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    t = torch.tensor(ids)
    tuned = peft.PeftModel.from_pretrained(hf(), tmp_path / "ours").eval()
    with torch.no_grad():
        got = tuned(
            input_ids=t,
            pixel_values=pixels,
            attention_mask=torch.ones_like(t),
            token_type_ids=(t == IMG).long(),
        ).logits.numpy()
    args = (jnp.asarray(ids), jnp.ones(ids.shape, jnp.int32), jnp.asarray(pixels.numpy()))
    rows = jnp.zeros((1,), jnp.int32)
    want = np.asarray(vlm_logits(policy, merged_module(tower), *args, rows))
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
    frozen_tower = np.asarray(vlm_logits(policy, vl.vision, *args, rows))
    assert np.max(np.abs(frozen_tower - want)) > 20 * ATOL  # the tower's adapters are live
