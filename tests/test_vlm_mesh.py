"""Image-prompt GRPO on a mesh: the frozen vision part sharded by the language model's rules
(``relax.models.config.sharding.VISION_LOGICAL_AXES``, ``relax.parallel.shard_vision``), image
prompts' ``PromptInputs`` split by rows like ``prompt_ids``, the encode run on the mesh.

Checked against one device (the reference: the unsharded programs), on ``data=2,fsdp=2,tensor=2``:
a GRPO step on the tiny Qwen2.5-VL (``relax.tasks.tiny_vlm``) gives the same metrics, sampled
tokens, log-probs and updated weights; Gemma 3's encode (SigLIP + projector) gives the same
``PromptInputs``; ``examples/train_grpo.py --image-field image --parallel.mesh ...`` trains and
evaluates as it does on one device. The vision weights' ``PartitionSpec`` s are the rules' (hand
written below), and heads that do not split are an error naming the weight.

Eight simulated devices: one subprocess (this file as a script) computes everything and writes
JSON, as tests/test_parallel.py does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
MESH = "data=2,fsdp=2,tensor=2"  # 4 prompts over data x fsdp; heads, MLP, vocabulary over tensor
P, G, N = 4, 2, 4  # prompts, completions per prompt, new tokens
RTOL, ATOL = 1e-4, 1e-5
# One Adam step moves a weight by lr g / (|g| + eps): with the default eps (1e-8) a gradient
# within round-off of zero gets a step whose size round-off decides (tests/test_parallel.py);
# eps 1e-3 keeps those steps small, and the weights agree to a 1e-3 of the learning rate.
LEARNING_RATE, ADAM_EPS = 1e-2, 1e-3
WEIGHT_ATOL = 1e-3 * LEARNING_RATE


def _task():
    from relax.tasks.visual import VisualTask

    return VisualTask(num_train=8, num_eval=4)


def write_setup(root: Path) -> None:
    """The tiny Qwen2.5-VL and the counting task's rows (train, held out) under ``root``."""
    import jax

    from relax.tasks.tiny_vlm import write_tiny_qwen2_5_vl
    from relax.tasks.visual import make_splits

    write_tiny_qwen2_5_vl(root / "model", _task(), key=jax.random.key(0))
    train, held_out = make_splits(_task())
    for name, rows in (("train", train), ("eval", held_out)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _decode(tokens, mask):
    return [" ".join(str(t) for t, m in zip(row, mr) if m) for row, mr in zip(tokens, mask)]


def _evens(prompts, completions, **fields):
    """A reward that tells random completions apart: the share of even token ids."""
    return [sum(int(t) % 2 == 0 for t in c.split()) / N for c in completions]


def _max_diff(a, b) -> tuple[float, float]:
    """``(max |a - b|, max |b|)`` as floats."""
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0)), float(np.max(np.abs(b), initial=0.0))


def qwen_step(root: Path, spec: str | None, train_vision: str | None = None) -> dict:
    """One GRPO step on 4 image prompts of the tiny Qwen2.5-VL (``RunData.encode`` for their
    inputs), on one device (``spec`` None) or on the mesh; what it computed, as arrays.
    ``train_vision``: the state trains a copy of the tower, ``"full"`` (``--train-vision``) or
    through rank-4 adapters, ``"lora"`` (``--lora.vision``)."""
    import jax
    import numpy as np

    from relax import parallel
    from relax.algorithms.cli.configure import configure
    from relax.algorithms.grpo.config import GRPOConfig
    from relax.algorithms.grpo.step import make_grpo_step
    from relax.algorithms.online.batch import step_input
    from relax.algorithms.online.setup import RunData
    from relax.algorithms.online.step import StepParts
    from relax.data.completion_layout import PackingConfig
    from relax.data.files import Record
    from relax.data.image_prompts import ImagePrompts, processor_for
    from relax.data.prompts import DataConfig, batch_of, prepare_prompts
    from relax.models.layers.lora import LoRAConfig
    from relax.models.vision.families import load_vision_language, pixels_of, trainable_vision
    from relax.passes import choose_passes
    from relax.text import load_tokenizer
    from relax.train.optimizer import OptimizerConfig
    from relax.train.state import init_state

    model_dir, path = root / "model", root / "train.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()][:P]
    tokenizer, vl = load_tokenizer(model_dir), load_vision_language(model_dir)
    images = ImagePrompts("image", processor_for("qwen2_5_vl", model_dir))
    data_cfg = DataConfig(path=str(path), batch_size=P, max_prompt_tokens=64)
    records = [Record(str(path), i + 1, r) for i, r in enumerate(rows)]
    prepared = prepare_prompts(records, data_cfg, tokenizer, images)
    data = RunData(tokenizer, vl.language_model, data_cfg, prepared, None, vl, images)
    mesh = None if spec is None else parallel.make_mesh(spec)
    if mesh is not None:
        data = data.on_mesh(mesh)
    batch = batch_of(prepared, data_cfg, tokenizer.pad_token_id, images)
    inputs = data.encode(data.model, batch)

    cfg = configure(
        GRPOConfig,
        num_generations=G,
        max_new_tokens=N,
        beta=0.04,
        packing=PackingConfig("off"),
        optimizer=OptimizerConfig(learning_rate=LEARNING_RATE, eps=ADAM_EPS),
    )
    policy = data.model
    tower = None
    if train_vision:
        lora = LoRAConfig(rank=4, alpha=8.0, vision=train_vision == "lora")
        tower = trainable_vision(vl, lora, jax.random.key(2))
    host = lambda t: jax.tree.map(np.asarray, t)  # noqa: E731
    initial = host(tower)
    state = init_state(
        policy, cfg.optimizer.make(), key=jax.random.key(1), with_reference=True, vision=tower
    )
    passes = choose_passes(batch_shards=1 if mesh is None else parallel.batch_shards(mesh))
    step = make_grpo_step(
        cfg, StepParts(reward_fns=[_evens], decode=_decode, eos_ids=(), pad_id=0, passes=passes)
    )
    if mesh is not None:
        step = parallel.ShardedStep(step, state, mesh)
        state = step.place(state)
    pixels = pixels_of(batch.images) if train_vision else None
    x = step_input(
        batch.prompt_ids,
        batch.prompt_mask,
        batch.prompts,
        {"answer": batch.answers},
        inputs,
        pixels,
    )
    trained_spec = None
    if mesh is not None and train_vision == "full":
        trained_spec = str(state.vision.visual.blocks.qkv.sharding.spec)
    state, out = step(state, x)
    b = out.device.batch
    return {
        "metrics": {k: float(v) for k, v in out.device.metrics.items() if "time" not in k},
        "tokens": np.asarray(b.tokens),
        "mask": np.asarray(b.mask, bool),
        "old_logprobs": np.asarray(b.old_logprobs),
        "inputs": host(inputs),
        "policy": host((state.policy, state.vision)),
        "before": (host(load_vision_language(model_dir).language_model), initial),
        "specs": {} if mesh is None else _specs(data.vision.vision.visual, inputs),
        "trained_qkv": trained_spec,
    }


def _specs(visual, inputs) -> dict[str, str]:
    """The ``PartitionSpec`` s of a few of the tower's weights and of the prompts' inputs."""
    blocks, merger = visual.blocks, visual.merger
    return {
        "features": str(inputs.features.sharding.spec),
        "rope": str(inputs.rope.full[0].sharding.spec),
        **{n: str(getattr(blocks, n).sharding.spec) for n in ("qkv", "proj", "gate", "down")},
        "norm1": str(blocks.norm1.sharding.spec),
        "merger.fc1": str(merger.fc1.sharding.spec),
        "merger.fc2": str(merger.fc2.sharding.spec),
    }


def qwen_case(root: Path, train_vision: str | None = None) -> dict:
    """The step on one device and on the mesh: largest differences, the mesh's specs."""
    import jax
    import numpy as np

    one, mesh = qwen_step(root, None, train_vision), qwen_step(root, MESH, train_vision)
    m = one["mask"]
    weights = {}
    for (path, a), b, w0 in zip(
        jax.tree_util.tree_leaves_with_path(mesh["policy"]),
        jax.tree.leaves(one["policy"]),
        jax.tree.leaves(one["before"]),
    ):
        weights[jax.tree_util.keystr(path)] = [*_max_diff(a, b), _max_diff(b, w0)[0]]
    return {
        "metrics": {"one": one["metrics"], "mesh": mesh["metrics"]},
        "tokens_equal": bool(np.array_equal(one["tokens"], mesh["tokens"])),
        "masks_equal": bool(np.array_equal(one["mask"], mesh["mask"])),
        "logprobs": _max_diff(mesh["old_logprobs"][m], one["old_logprobs"][m]),
        "inputs": {
            jax.tree_util.keystr(p): _max_diff(a, b)
            for (p, a), b in zip(
                jax.tree_util.tree_leaves_with_path(mesh["inputs"]),
                jax.tree.leaves(one["inputs"]),
            )
        },
        "image_tokens": int(np.sum(one["inputs"].is_image)),
        "weights": weights,
        "specs": mesh["specs"],
        "trained_qkv": mesh["trained_qkv"],
    }


def tiny_gemma3(lm_width: int):
    """A random Gemma 3 vision part: a 2-layer SigLIP tower on 32 x 32 images (4 x 4 patches,
    pooled to 4 soft tokens) and its projector to ``lm_width``."""
    import jax

    from relax.models.vision.gemma3 import Gemma3Vision, Gemma3VisionConfig, Projector
    from relax.models.vision.siglip import SiglipConfig, init_siglip

    c = SiglipConfig(
        hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=32, patch_size=8
    )
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    projector = Projector(
        norm=0.1 * jax.random.normal(k2, (32,)), proj=0.2 * jax.random.normal(k3, (32, lm_width))
    )
    config = Gemma3VisionConfig(vision=c, mm_tokens_per_image=4, image_token_id=60)
    return Gemma3Vision(tower=init_siglip(c, k1, std=0.2), projector=projector, config=config)


def gemma_case() -> dict:
    """Gemma 3's image prompts' inputs (``gemma3_prompt_inputs``) with the vision part on one
    device and sharded on the mesh (placed rows-split, as ``RunData.encode`` does)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from relax import parallel
    from relax.models import ModelConfig, init
    from relax.models.vision.gemma3 import gemma3_prompt_inputs

    lm = init(
        ModelConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
            num_kv_heads=2, head_dim=16, max_position_embeddings=64,
        ),
        jax.random.key(0),
    )  # fmt: skip
    vision = tiny_gemma3(32)
    image = [7, 60, 60, 60, 60, 8]  # <boi>, 4 image tokens, <eoi>; rows left-padded with 0
    ids = jnp.asarray([[0, 0, 5, 6, *image], [5, *image, 9, 3, 4], [*image, 5, 6, 7, 8]])
    mask = jnp.asarray(ids != 0, jnp.int32)
    pixels = jax.random.normal(jax.random.key(9), (3, 3, 32, 32))
    one = gemma3_prompt_inputs(lm, vision, ids, mask, pixels)
    mesh = parallel.make_mesh(MESH)
    sharded = parallel.shard_vision(vision, mesh)
    encode = jax.jit(gemma3_prompt_inputs)
    on_mesh = parallel.place_rows(encode(lm, sharded, ids, mask, pixels), mesh, 3)
    leaves = jax.tree_util.tree_leaves_with_path(on_mesh)
    return {
        "inputs": {
            jax.tree_util.keystr(p): _max_diff(a, b)
            for (p, a), b in zip(leaves, jax.tree.leaves(one))
        },
        "image_tokens": int(np.sum(one.is_image)),
        "features_spec": str(on_mesh.features.sharding.spec),  # 3 rows: replicated
        "specs": {
            jax.tree_util.keystr(p): str(x.sharding.spec)
            for p, x in jax.tree_util.tree_leaves_with_path(sharded)
        },
    }


def _lines(run_dir: Path) -> dict:
    """A run's ``metrics.jsonl`` as ``{"train <step>" | "eval <step>": {metric: value}}`` (times
    and throughputs left out)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        x = json.loads(line)
        kind = "train" if "loss" in x else "eval"
        keep = {
            k: v
            for k, v in x.items()
            if isinstance(v, (int, float))
            and not any(s in k for s in ("time", "per_s", "compiles"))
        }
        out[f"{kind} {x['step']}"] = keep
    return out


def cli_args(root: Path) -> list[str]:
    """``examples/train_grpo.py``'s flags for the image rows under ``root``: 2 steps and a
    held-out evaluation (no run dir, no mesh)."""
    return [
        "--model", str(root / "model"),
        "--data", str(root / "train.jsonl"),
        "--eval-data", str(root / "eval.jsonl"),
        "--image-field", "image",
        "--reward", "exact_match",
        "--steps", "2",
        "--batch-size", str(P),
        "--max-prompt-tokens", "64",
        "--grpo.num-generations", str(G),
        "--grpo.max-new-tokens", "3",
        "--eval-every", "2",
        "--no-export-hf",
    ]  # fmt: skip


def cli_case(root: Path) -> dict:
    """``examples/train_grpo.py`` on the image rows (``cli_args``) on one device and on the mesh:
    each run's metrics lines."""
    from conftest import load_example

    runs = {}
    for where, flags in (("one", []), ("mesh", ["--parallel.mesh", MESH])):
        run_dir = root / f"cli-{where}"
        load_example("grpo").main([*cli_args(root), *flags, "--run-dir", str(run_dir)])
        runs[where] = _lines(run_dir)
    lines = [json.loads(x) for x in (root / "cli-mesh" / "metrics.jsonl").read_text().splitlines()]
    runs["mesh_compiles"] = [x["compiles"] for x in lines if "loss" in x]
    return runs


def worker(out_path: str, root: str) -> None:
    import jax
    from conftest import use_compile_cache

    use_compile_cache()
    assert jax.device_count() == 8, jax.devices()
    root = Path(root)
    write_setup(root)
    results = {
        "qwen": qwen_case(root),
        "tower": qwen_case(root, train_vision="full"),
        "tower_lora": qwen_case(root, train_vision="lora"),
        "gemma": gemma_case(),
        "cli": cli_case(root),
    }
    Path(out_path).write_text(json.dumps(results))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    worker(*sys.argv[1:])
else:
    import jax
    import numpy as np
    import pytest
    from jax.sharding import PartitionSpec as PS
    from test_parallel import run_worker

    from relax import parallel
    from relax.models.config.sharding import VISION_LOGICAL_AXES, path_name

    @pytest.fixture(scope="module")
    def results(tmp_path_factory):
        d = tmp_path_factory.mktemp("vlm_mesh")
        run_worker(HERE, [str(d / "results.json"), str(d)], timeout=900.0)
        return json.loads((d / "results.json").read_text())

    def _close(got, want, what):
        assert set(got) == set(want), (what, set(got) ^ set(want))
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=RTOL, atol=ATOL, err_msg=f"{what}: {k}")

    # ------------------------------------------------------------------ 8 devices (subprocess)

    @pytest.mark.slow  # a whole run: make test-all
    @pytest.mark.parametrize(
        "case", ["qwen", "tower", "tower_lora"], ids=["frozen-tower", "train-vision", "lora-vision"]
    )
    def test_grpo_step_with_image_prompts_on_a_mesh_equals_one_device(results, case):
        """``tower``: the state trains the tower too; its weights agree as the policy's do;
        ``tower_lora``: through its adapters (``ModuleLoRA``: the base laid out as a frozen
        part, the factors replicated)."""
        got = results[case]
        assert got["image_tokens"] > 0
        for name, (diff, scale) in got["inputs"].items():  # the encode on the mesh
            assert diff <= ATOL + RTOL * scale, (name, diff, scale)
        assert got["tokens_equal"] and got["masks_equal"]
        diff, scale = got["logprobs"]
        assert diff <= ATOL + RTOL * scale, got["logprobs"]
        one, mesh = got["metrics"]["one"], got["metrics"]["mesh"]
        assert one["reward_std"] > 0 and "loss" in one, one  # advantages: the update moves
        _close(mesh, one, "metrics")
        weights = got["weights"]
        if case == "tower_lora":  # the tower's base stays; its B factors leave 0 (A waits for B)
            assert all(step == 0 for n, (_, _, step) in weights.items() if ".base." in n)
            assert all(step > 0 for n, (_, _, step) in weights.items() if n.startswith("[1].b["))
            weights = {n: w for n, w in weights.items() if not n.startswith("[1]")}
        moved = [name for name, (_, _, step) in weights.items() if step > LEARNING_RATE / 2]
        assert len(moved) >= len(weights) // 2, moved
        for name, (diff, _, _) in got["weights"].items():
            assert diff <= WEIGHT_ATOL, (name, diff)

    @pytest.mark.slow  # a whole run: make test-all
    def test_a_trained_tower_is_sharded_by_the_vision_rules(results):
        assert results["tower"]["trained_qkv"] == str(PS(None, "fsdp", "tensor"))
        assert any(".visual." in name for name in results["tower"]["weights"])

    @pytest.mark.slow  # a whole run: make test-all
    def test_vision_weights_and_prompt_inputs_are_sharded(results):
        specs = results["qwen"]["specs"]
        rows = str(PS(("data", "expert", "fsdp")))  # the batch axes (expert: size 1)
        assert specs["features"] == rows and specs["rope"] == rows, specs
        assert specs["qkv"] == str(PS(None, "fsdp", "tensor")), specs
        assert specs["proj"] == str(PS(None, "tensor", "fsdp")), specs
        assert specs["gate"] == str(PS(None, "fsdp", "tensor")), specs
        assert specs["down"] == str(PS(None, "tensor", "fsdp")), specs
        assert specs["norm1"] == str(PS(None, "fsdp")), specs
        assert specs["merger.fc1"] == str(PS("fsdp", "tensor")), specs
        assert specs["merger.fc2"] == str(PS("tensor", "fsdp")), specs

    @pytest.mark.slow  # a whole run: make test-all
    def test_gemma3_encode_on_a_mesh_equals_one_device(results):
        got = results["gemma"]
        assert got["image_tokens"] == 12
        for name, (diff, scale) in got["inputs"].items():
            assert diff <= ATOL + RTOL * scale, (name, diff, scale)
        assert got["features_spec"] == str(PS()), got  # 3 rows do not split over 4: replicated
        specs = got["specs"]
        assert specs[".tower.layers.wq"] == str(PS(None, "fsdp", "tensor")), specs
        assert specs[".tower.layers.wo"] == str(PS(None, "tensor", "fsdp")), specs
        assert specs[".tower.layers.w1"] == str(PS(None, "fsdp", "tensor")), specs
        assert specs[".tower.pos"] == str(PS(None, "fsdp")), specs
        assert specs[".projector.proj"] == str(PS("fsdp", "tensor")), specs

    @pytest.mark.slow  # a whole run: make test-all
    def test_cli_grpo_with_images_on_a_mesh_trains_like_one_device(results):
        one, mesh = results["cli"]["one"], results["cli"]["mesh"]
        assert results["cli"]["mesh_compiles"] == [0, 0]  # compiled ahead for the mesh's layout
        assert {"train 1", "train 2", "eval 2"} <= set(one), one
        assert set(mesh) == set(one), (set(mesh), set(one))
        for line, want in one.items():
            _close(mesh[line], want, line)

    # ------------------------------------------------------------------ in process (no devices)

    def test_image_prompts_refuse_separate_sampler_devices(tmp_path):
        from conftest import load_example

        argv = ["--task", "visual", "--image-field", "image", "--parallel.sampler-devices", "1"]
        with pytest.raises(ValueError, match="drop --parallel.sampler-devices"):
            load_example("grpo").main([*argv, "--run-dir", str(tmp_path)])
        assert not (tmp_path / "task").exists()  # refused before anything is built

    def _abstract(data=1, fsdp=1, tensor=1):
        return jax.sharding.AbstractMesh((data, 1, fsdp, tensor), parallel.AXES)

    def _qwen_vision(heads=2):
        from relax.models.vision.qwen2_5_vl import Qwen2_5_VL, VLConfig
        from relax.models.vision.qwen_vit import QwenVisionConfig, init_qwen_vision

        c = QwenVisionConfig(
            depth=2, hidden_size=32, intermediate_size=48, num_heads=heads, patch_size=7,
            window_size=28, out_hidden_size=64, fullatt_block_indexes=(1,),
        )  # fmt: skip
        visual = jax.eval_shape(lambda: init_qwen_vision(c, jax.random.key(0)))
        return Qwen2_5_VL(language_model=None, visual=visual, config=VLConfig())

    def test_every_vision_weight_has_logical_axes():
        names = set()
        for vision in (_qwen_vision(), jax.eval_shape(lambda: tiny_gemma3(64))):
            names |= {path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(vision)}
        assert names == set(VISION_LOGICAL_AXES)

    def test_vision_specs_follow_the_rules():
        """fsdp splits the tower's width, tensor its heads (qkv: 3 x 2 heads of 16) and MLP."""
        specs = parallel.vision_shardings(_qwen_vision(), _abstract(2, 2, 2))
        blocks = specs.visual.blocks
        assert blocks.qkv.spec == PS(None, "fsdp", "tensor")
        assert blocks.qkv_bias.spec == PS(None, "tensor")
        assert blocks.down.spec == PS(None, "tensor", "fsdp")
        assert specs.visual.patch_embed.spec == PS(None, "fsdp")
        assert specs.visual.merger.fc2_bias.spec == PS("fsdp")
        # rules mapping the vision's own axes to None replicate it alone
        rules = (*parallel.DEFAULT_RULES[:-3], ("vision_heads", None), ("vision_mlp", None))
        alone = parallel.vision_shardings(_qwen_vision(), _abstract(tensor=8), rules)
        assert alone.visual.blocks.qkv.spec == PS(None, None, None)
        assert alone.visual.blocks.gate.spec == PS(None, None, None)

    def test_vision_weights_that_do_not_split_are_replicated_with_a_warning():
        """Two heads: the fused q/k/v's 6 heads do not split 4 ways (its 96 columns would): the
        frozen weight is replicated, named in the warning; the weights that split still do."""
        with pytest.warns(UserWarning, match=r"visual\.blocks\.qkv .*6 heads x 16.*tensor=4"):
            specs = parallel.vision_shardings(_qwen_vision(), _abstract(tensor=4))
        assert specs.visual.blocks.qkv.spec == PS()
        assert specs.visual.blocks.down.spec == PS(None, "tensor", None)
