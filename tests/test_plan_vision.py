"""relax plan for a vision-language GRPO run (``--image-field``, ``relax.plan.vision``): a tiny
Qwen2.5-VL and a tiny Gemma 3 ``config.json`` (no weights) planned on ``v5e:2x2``. The frozen
vision part's bytes per chip are checked against a hand count from the config's numbers (every
weight with a model-width axis split over ``fsdp``, the heads' biases and MLP biases whole), the
encode program comes first, and the sampler and the update take ``PromptInputs`` of the image
prompts, rows split over the batch axes.

The compile-only tests need libtpu (the ``tpu`` extra); without it they are skipped."""

from __future__ import annotations

import json

import pytest

from relax.plan import targets

needs_tpu = pytest.mark.skipif(
    not targets.tpu_available(), reason="libtpu (the tpu extra) is not installed"
)

D, F, V, L, HQ, HKV, HD = 64, 128, 256, 2, 4, 2, 16  # the language model
DV, FV, LV, HV = 32, 48, 2, 2  # the vision tower
C, P, TP, MERGE = 3, 14, 2, 2  # channels, patch, Qwen's temporal patch and merge
QWEN = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "vocab_size": V,
    "hidden_size": D,
    "intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": HQ,
    "num_key_value_heads": HKV,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "vision_config": {
        "depth": LV,
        "hidden_size": DV,
        "intermediate_size": FV,
        "num_heads": HV,
        "in_channels": C,
        "patch_size": P,
        "spatial_merge_size": MERGE,
        "temporal_patch_size": TP,
        "window_size": 112,
        "fullatt_block_indexes": [1],
        "out_hidden_size": D,
    },
}
IMAGE, TOKENS = 56, 4  # Gemma 3: a 56 x 56 image, 4 x 4 patches pooled to 2 x 2 soft tokens
GEMMA = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": TOKENS,
    "text_config": {
        "model_type": "gemma3_text",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": F,
        "num_hidden_layers": L,
        "num_attention_heads": HQ,
        "num_key_value_heads": HKV,
        "head_dim": HD,
        "sliding_window": 16,
    },
    "vision_config": {
        "hidden_size": DV,
        "intermediate_size": FV,
        "num_hidden_layers": LV,
        "num_attention_heads": HV,
        "patch_size": P,
        "image_size": IMAGE,
    },
}
RUN = [
    "--image-field",
    "image",
    "--batch-size",
    "8",
    "--grpo.num-generations",
    "4",
    "--grpo.max-new-tokens",
    "16",
    "--max-prompt-tokens",
    "32",
]


def qwen_vision_bytes(fsdp: int, itemsize: int = 4) -> int:
    """Qwen's tower per chip: patch embedding ``[C tp p p, Dv]``; per block two norms ``[Dv]``,
    q/k/v ``[Dv, 3 Dv]`` and its bias ``[3 Dv]`` (heads: whole), proj ``[Dv, Dv]`` and bias, gate
    / up ``[Dv, Fv]`` with biases ``[Fv]`` (whole), down ``[Fv, Dv]`` and bias; the merger's
    norm ``[Dv]``, fc1 ``[M, M]`` + bias ``[M]`` (whole), fc2 ``[M, D]`` + bias ``[D]``,
    ``M = Dv merge^2``. Every other tensor has a model-width axis, split over fsdp."""
    m = DV * MERGE**2
    split = C * TP * P * P * DV + LV * (2 * DV + 3 * DV * DV + DV * DV + DV + 3 * DV * FV + DV)
    split += DV + m * m + m * D + D
    whole = LV * (3 * DV + 2 * FV) + m
    return (split // fsdp + whole) * itemsize


def gemma_vision_bytes(fsdp: int, itemsize: int = 4) -> int:
    """SigLIP per chip: patch weight ``[C p p, Dv]`` and bias, positions ``[(S/p)^2, Dv]``; per
    layer four LayerNorm vectors, q/k/v/o ``[Dv, Dv]``, the o and fc2 biases, fc1 ``[Dv, Fv]``,
    fc2 ``[Fv, Dv]`` (split); the q/k/v biases ``[Dv]`` (heads) and fc1's ``[Fv]`` (whole); the
    post LayerNorm; the projector's norm ``[Dv]`` and projection ``[Dv, D]`` (split)."""
    split = C * P * P * DV + DV + (IMAGE // P) ** 2 * DV
    split += LV * (4 * DV + 4 * DV * DV + 2 * DV + 2 * DV * FV) + 2 * DV + DV + DV * D
    whole = LV * (3 * DV + FV)
    return (split // fsdp + whole) * itemsize


def write(tmp_path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def no_compile(lowered):
    """Compile nothing: the layout per chip comes from the programs' arguments."""
    return None, "RESOURCE_EXHAUSTED: not compiled", 0.0


def gemma_plan(tmp_path, mesh: str, target: str):
    """``(config path, plan)``: GRPO on the tiny Gemma 3 with two images per prompt on ``mesh``
    of ``target``, nothing compiled."""
    from relax.plan import plan
    from relax.plan.vision import ImagePlan

    config = write(tmp_path, GEMMA)
    argv = ["--model", config, *RUN, "--parallel.mesh", mesh]
    return config, plan("grpo", argv, target, compile_fn=no_compile, images=ImagePlan(per_prompt=2))


@pytest.fixture(scope="module")
def qwen_plan(tmp_path_factory):
    from relax.plan import plan
    from relax.plan.vision import ImagePlan

    config = write(tmp_path_factory.mktemp("qwen"), QWEN)
    return plan(
        "grpo", ["--model", config, *RUN, "--parallel.mesh", "fsdp=4"], "v5e:2x2",
        images=ImagePlan(1, 16),
    )  # fmt: skip


@needs_tpu
@pytest.mark.slow  # a TPU compile of three programs: make test-all
def test_qwen_encode_program_and_vision_bytes_by_hand(qwen_plan):
    names = [m.name for m in qwen_plan.programs]
    assert names[0] == "encode" and any("rollout" in n for n in names), names
    assert all(m.error is None for m in qwen_plan.programs), qwen_plan.programs
    for m in qwen_plan.programs:  # every program lives on the trainer's chips beside the tower
        assert m.vision == qwen_vision_bytes(fsdp=4), (m.name, m.vision)
    encode = qwen_plan.programs[0]
    # the encode's inputs, replicated: ids + mask [8, 32], positions [3, 8, 32] int32, and 8 images
    # of (16 tokens x merge^2) patches of C tp p p float32 pixels
    assert encode.batch == (2 + 3) * 8 * 32 * 4 + 8 * 16 * MERGE**2 * C * TP * P * P * 4
    assert "vision" in qwen_plan.table() and "1 x 16 image tokens" in qwen_plan.table()


@needs_tpu
@pytest.mark.slow
def test_gemma3_image_prompts_reach_the_sampler_split_by_rows(tmp_path):
    from relax.plan.vision import ImagePlan

    config, p = gemma_plan(tmp_path, "fsdp=4", "v5e:2x2")
    assert p.images.tokens == TOKENS and p.programs[0].name == "encode"
    assert all(m.vision == gemma_vision_bytes(fsdp=4) for m in p.programs)
    encode = p.programs[0]
    assert encode.batch == 2 * 8 * 32 * 4 + 2 * 8 * C * IMAGE * IMAGE * 4  # ids, mask, 16 images
    # not compiled: the programs' arguments, as laid out
    from relax.plan.plan import parse_run
    from relax.plan.programs import online_programs
    from relax.plan.trainers import ALGORITHMS
    from relax.plan.vision import encode_program, resolved

    run = parse_run("grpo", ["--model", config, *RUN, "--parallel.mesh", "fsdp=4"])
    vm, images = resolved(run, ImagePlan(per_prompt=2))
    devices = targets.devices(targets.Target.parse("v5e:2x2"))
    mesh = run.parallel.meshes(devices)[0]
    inputs = encode_program(run, vm, images, mesh, no_compile).outputs
    assert inputs.features.shape == (8, 32, D) and inputs.is_image.shape == (8, 32)
    algo = ALGORITHMS["grpo"].algorithm(run)
    programs = online_programs(run, algo, vm.config, devices, compile_fn=no_compile, images=inputs)
    sampler = next(q for q in programs if "rollout" in q.name)
    features = sampler.args[1].images.features
    assert features.sharding.shard_shape(features.shape) == (2, 32, D)  # rows over fsdp=4


@needs_tpu
def test_a_multi_host_slice_encodes_each_hosts_prompts_on_its_own_chips(tmp_path):
    # v5e:2x4 is two hosts of four chips: each process of the run encodes its 4 of the 8 prompts
    # on its own chips, the vision part sharded over those 4 (RunData.on_mesh's local_mesh),
    # and the step takes the 8 prompts' inputs
    from relax.plan.vision import ImagePlan

    config, p = gemma_plan(tmp_path, "fsdp=8", "v5e:2x4")
    encode = p.programs[0]
    assert encode.name == "encode" and encode.error is not None  # not compiled
    assert encode.batch == 2 * 4 * 32 * 4 + 2 * 4 * C * IMAGE * IMAGE * 4  # 4 prompts, 8 images
    assert all(m.vision == gemma_vision_bytes(fsdp=4) for m in p.programs)
    from relax.parallel.local import host_mesh
    from relax.plan.plan import parse_run
    from relax.plan.vision import encode_program, resolved

    run = parse_run("grpo", ["--model", config, *RUN, "--parallel.mesh", "fsdp=8"])
    vm, images = resolved(run, ImagePlan(per_prompt=2))
    mesh = run.parallel.meshes(targets.devices(targets.Target.parse("v5e:2x4")))[0]
    host = host_mesh(mesh, 1)
    assert {d.process_index for d in host.devices.flat} == {1} and host.devices.size == 4
    program = encode_program(run, vm, images, host, no_compile, processes=2)
    assert program.args[1][0].shape == (4, 32)  # this host's prompts
    assert program.outputs.features.shape == (8, 32, D)  # the step's: every host's


@needs_tpu
def test_image_plan_refusals(tmp_path):
    from relax.plan import plan
    from relax.plan.vision import ImagePlan

    (tmp_path / "g").mkdir(), (tmp_path / "q").mkdir()
    gemma, qwen = write(tmp_path / "g", GEMMA), write(tmp_path / "q", QWEN)
    argv = lambda config, *more: ["--model", config, *RUN, "--parallel.mesh", "fsdp=4", *more]
    with pytest.raises(ValueError, match="mm_tokens_per_image = 4"):
        plan("grpo", argv(gemma), "v5e:2x2", compile_fn=no_compile, images=ImagePlan(1, 9))
    with pytest.raises(ValueError, match="square"):
        plan("grpo", argv(qwen), "v5e:2x2", compile_fn=no_compile, images=ImagePlan(1, 15))
    with pytest.raises(ValueError, match="cannot hold 2 image"):
        plan("grpo", argv(qwen), "v5e:2x2", compile_fn=no_compile, images=ImagePlan(2, 16))
    with pytest.raises(ValueError, match="need --image-field"):
        text = [a for a in argv(qwen) if a not in ("--image-field", "image")]
        plan("grpo", text, "v5e:2x2", compile_fn=no_compile, images=ImagePlan(1, 16))
    for flag in (("--train-vision",), ("--lora.rank", "4", "--lora.vision")):
        with pytest.raises(ValueError, match="plans a frozen vision tower"):
            plan("grpo", argv(qwen, *flag), "v5e:2x2", compile_fn=no_compile)
