"""A vision-language GRPO run in its plan (``--image-field``): the frozen vision part on every
chip of the trainer, the program that encodes a batch's images, and the sampler and update
called with the image prompts' ``PromptInputs``. On a slice of several hosts the run lays the
vision part out on each host's chips and each process encodes its own prompts: the plan's
encode is one host's, for its share of the batch.

The run (``relax.algorithms.online.setup.RunData``) loads the vision part once, lays it out on
the trainer mesh (``relax.parallel.shard_vision``: widths over ``fsdp``, heads and MLP widths
over ``tensor``) and keeps it there through the run: its weights are resident beside every
program on those chips (the plan's ``vision`` column). Each step it encodes the batch's images
(the tower and projection once per image, its inputs replicated over the mesh) into
``PromptInputs`` ``[P, Lp, ...]`` laid out with their rows over the batch axes, which the
sampler and every training forward read. A plan reads the directory's ``config.json`` alone
(``read_vision_language``: the families' own config readers, the models built under
``jax.eval_shape``), lowers that encode with the vision weights as sharded
``ShapeDtypeStruct`` s (``encode_program``; the towers scan their layers, so it compiles at
full depth), and gives the step ``PromptInputs`` of the encode's output shapes.

Every prompt is planned with ``ImagePlan.per_prompt`` images of ``ImagePlan.tokens`` image
tokens each, in a prompt of ``--max-prompt-tokens``: Gemma 3's images are always
``mm_tokens_per_image`` tokens (its 896 x 896 crop); a Qwen2.5-VL image of ``T = s * s``
tokens is a square of ``s * merge * patch`` pixels (1,024 tokens: 896 x 896).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from relax.algorithms.online.config import OnlineAlgorithm, OnlineRunConfig
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.hf.checkpoint import read_config
from relax.models.hf.config import config_from_hf
from relax.models.vision.families import VISION_FAMILIES, VisionFamily
from relax.models.vision.gemma3 import Gemma3Vision, Projector, gemma3_prompt_inputs
from relax.models.vision.gemma3_checkpoint import gemma3_config_from_hf
from relax.models.vision.qwen2_5_vl import Qwen2_5_VL
from relax.models.vision.qwen2_5_vl import prompt_inputs as qwen_prompt_inputs
from relax.models.vision.qwen2_5_vl_checkpoint import read_vl_config, text_config_dict
from relax.models.vision.qwen_vit import init_qwen_vision
from relax.models.vision.siglip import init_siglip
from relax.parallel import replicated, vision_shardings
from relax.parallel.local import host_mesh, processes
from relax.passes import target_backend
from relax.plan.checkpoints import config_json
from relax.plan.measure import Measured, measure, online, resident_state
from relax.plan.memory import per_chip, with_vision
from relax.plan.programs import Program, abstract_model, platform
from relax.plan.targets import Target

NAME = "encode"
QWEN_TOKENS = 1024  # a 896 x 896 image: (896 / 28)^2 merged patches


@dataclasses.dataclass(frozen=True)
class ImagePlan:
    """The images of every planned prompt: ``per_prompt`` images of ``tokens`` image tokens each
    (None: the family's usual, Gemma 3's ``mm_tokens_per_image`` or Qwen2.5-VL's 1,024)."""

    per_prompt: int = 1
    tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class VisionModel:
    """A vision-language ``config.json`` read for a plan: its family, its language model's
    ``ModelConfig`` and its frozen vision part as ``ShapeDtypeStruct`` s (no sharding)."""

    family: VisionFamily
    config: ModelConfig
    vision: Any


def family_of(path: str | Path) -> VisionFamily | None:
    """The vision-language family a directory's (or a ``config.json`` file's) ``model_type``
    names; None for a text model."""
    _, d = config_json(path)
    mt = d.get("model_type") if isinstance(d, dict) else None
    return VISION_FAMILIES.get(mt) if isinstance(mt, str) else None


def language_config(path: str | Path) -> ModelConfig:
    """The ``ModelConfig`` of the model a run trains: a vision-language model's language model,
    else the text model's (``read_config``)."""
    if family_of(path) is None:
        return read_config(path)
    return read_vision_language(path, param_dtype=jnp.float32, dtype=jnp.float32).config


def _cast(tree: Any, dtype) -> Any:
    """Every floating leaf of an abstract ``tree`` in ``dtype`` (the loaders' ``param_dtype``)."""
    to = lambda x: (  # noqa: E731
        jax.ShapeDtypeStruct(x.shape, dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
    )
    return jax.tree.map(to, tree)


def read_vision_language(path: str | Path, *, param_dtype, dtype) -> VisionModel:
    """A vision-language directory or ``config.json`` read as the family's loader reads it
    (Gemma 3: ``gemma3_config_from_hf``; Qwen2.5-VL: ``text_config_dict`` and ``read_vl_config``),
    its vision part built under ``jax.eval_shape`` with ``param_dtype`` weights computing in
    ``dtype``; no weight is read. ``ValueError`` naming the file for a text model."""
    file, d = config_json(path)
    family = family_of(path)
    if family is None:
        raise ValueError(
            f"{file}: field 'model_type' = {d.get('model_type')!r} is not a vision-language "
            f"model ({sorted(VISION_FAMILIES)}); --image-field needs one"
        )
    key = jax.random.key(0)
    if family.model_type == "gemma3":
        text, vc = gemma3_config_from_hf(d, str(file))
        config = config_from_hf(text, source=str(file))
        dv = vc.vision.hidden_size

        def build(k):
            tower = init_siglip(vc.vision, k, dtype=dtype)
            projector = Projector(jnp.zeros((dv,)), jnp.zeros((dv, config.hidden_size)))
            return Gemma3Vision(tower, projector, vc)

    else:
        config = config_from_hf(text_config_dict(d, str(file)), source=str(file))
        vl, vc = read_vl_config(d, str(file))

        def build(k):
            return Qwen2_5_VL(None, init_qwen_vision(vc, k, dtype=dtype), vl)

    return VisionModel(family, config, _cast(jax.eval_shape(build, key), param_dtype))


def image_tokens(vm: VisionModel, images: ImagePlan) -> int:
    """Image tokens of one image (``images.tokens``, checked against the family: Gemma 3's
    fixed ``mm_tokens_per_image``, a square count for Qwen2.5-VL)."""
    if vm.family.model_type == "gemma3":
        fixed = vm.vision.config.mm_tokens_per_image
        if images.tokens not in (None, fixed):
            raise ValueError(
                f"--image-tokens {images.tokens}: a Gemma 3 image is mm_tokens_per_image = "
                f"{fixed} tokens (config.json)"
            )
        return fixed
    tokens = QWEN_TOKENS if images.tokens is None else images.tokens
    if tokens < 1 or math.isqrt(tokens) ** 2 != tokens:
        raise ValueError(
            f"--image-tokens {tokens}: a planned Qwen2.5-VL image is a square of s x s merged "
            "patches (e.g. 256, 1024)"
        )
    return tokens


def pixel_batch(vm: VisionModel, images: ImagePlan, prompts: int) -> tuple[Any, tuple]:
    """``(pixel_values, grid)`` of ``prompts * per_prompt`` images, as the processors give them
    (float32): Gemma 3 ``[n, C, S, S]`` and no grid; Qwen2.5-VL ``[n * g * g, C * tp * p * p]``
    and the grid ``(1, g, g)`` per image, ``g = sqrt(tokens) * merge`` patches a side."""
    n = prompts * images.per_prompt
    if vm.family.model_type == "gemma3":
        c = vm.vision.config.vision
        shape = (n, c.num_channels, c.image_size, c.image_size)
        return jax.ShapeDtypeStruct(shape, jnp.float32), ()
    c = vm.vision.visual.config
    g = math.isqrt(image_tokens(vm, images)) * c.spatial_merge_size
    grid = ((1, g, g),) * n
    return jax.ShapeDtypeStruct((n * g * g, c.patch_dim), jnp.float32), grid


def _encode_fn(vm: VisionModel, language_model: Any, grid: tuple) -> Callable[..., PromptInputs]:
    """``encode(vision, ids, mask, [positions,] pixels) -> PromptInputs``: the family's device
    part of ``encode_images`` (Qwen2.5-VL's M-RoPE ``positions`` are the host's; Gemma 3 has none)."""
    if vm.family.model_type == "gemma3":
        return lambda v, ids, mask, px: gemma3_prompt_inputs(language_model, v, ids, mask, px)
    return lambda v, ids, mask, pos, px: qwen_prompt_inputs(
        dataclasses.replace(v, language_model=language_model), ids, mask, pos, px, grid
    )


def check_prompt_length(run: OnlineRunConfig, tokens: int, images: ImagePlan) -> None:
    """``ValueError`` unless ``--max-prompt-tokens`` holds the prompt's images' tokens."""
    need = tokens * images.per_prompt
    if need >= run.max_prompt_tokens:
        raise ValueError(
            f"--max-prompt-tokens {run.max_prompt_tokens} cannot hold {images.per_prompt} "
            f"image(s) of {tokens} tokens ({need}) and the prompt's text: raise it"
        )


def encode_program(
    run: OnlineRunConfig,
    vm: VisionModel,
    images: ImagePlan,
    mesh: jax.sharding.Mesh,
    compile_fn: Callable[[Any], tuple],
    processes: int = 1,
) -> Program:
    """The encode of one batch (``--batch-size`` prompts of ``--max-prompt-tokens``, their
    images) on ``mesh`` (the trainer mesh; a run of several ``processes``: one process's devices
    of it, ``relax.parallel.local.host_mesh``, encoding its share of the prompts): the vision
    weights laid out by ``vision_shardings``, the host's arrays replicated. Its ``args`` are
    ``(None, arrays)`` (the state resident meanwhile is the caller's to give; the weights are
    counted apart, ``vision_per_chip``); its ``outputs`` the ``PromptInputs`` shapes the step
    takes (the whole batch's)."""
    check_prompt_length(run, image_tokens(vm, images), images)
    vision = laid_out_vision(vm, mesh)
    model = abstract_model(run, vm.config)
    shape_only = eqx.filter(model, lambda _: False)  # config and dtype, as encode_images
    p, lp = run.batch_size // processes, run.max_prompt_tokens
    pixels, grid = pixel_batch(vm, images, p)
    whole = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated(mesh))  # noqa: E731
    ids = jax.ShapeDtypeStruct((p, lp), jnp.int32)
    positions = jax.ShapeDtypeStruct((3, p, lp), jnp.int32)
    qwen = vm.family.model_type != "gemma3"
    arrays = tuple(whole(x) for x in (ids, ids, *((positions,) if qwen else ()), pixels))
    fn = jax.jit(_encode_fn(vm, shape_only, grid))
    with target_backend(platform(mesh.devices.flat[0])), jax.set_mesh(mesh):
        lowered = fn.lower(vision, *arrays)
        compiled, error, seconds = compile_fn(lowered)
    outputs = jax.tree.map(  # every process's rows: the whole batch
        lambda x: jax.ShapeDtypeStruct((x.shape[0] * processes, *x.shape[1:]), x.dtype),
        lowered.out_info,
    )
    return Program(NAME, mesh, (None, arrays), compiled, error, seconds, outputs)


def laid_out_vision(vm: VisionModel, mesh: jax.sharding.Mesh) -> Any:
    """The vision part as ``ShapeDtypeStruct`` s laid out on ``mesh`` as the run lays it out
    (``relax.parallel.vision_shardings``)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        vm.vision,
        vision_shardings(vm.vision, mesh),
    )


def vision_per_chip(vm: VisionModel, mesh: jax.sharding.Mesh) -> int:
    """Bytes of the frozen vision part on each chip of ``mesh``."""
    return per_chip(laid_out_vision(vm, mesh))


def vision_model(run: OnlineRunConfig) -> VisionModel:
    """The run's ``--model`` read as a vision-language model in its dtypes."""
    return read_vision_language(
        run.model, param_dtype=DTYPES[run.param_dtype], dtype=DTYPES[run.compute_dtype]
    )


def resolved(run: OnlineRunConfig, images: ImagePlan | None) -> tuple[VisionModel, ImagePlan]:
    """The run's vision-language model and its images with the token count filled in (the
    family's usual when not given); ``ValueError`` for what an image run refuses."""
    if run.parallel.sampler_devices:
        raise ValueError(
            "--image-field: image prompts run on the trainer's chips (a run refuses "
            "--parallel.sampler-devices with them)"
        )
    images = ImagePlan() if images is None else images
    if images.per_prompt < 1:
        raise ValueError(f"--images-per-prompt must be >= 1, got {images.per_prompt}")
    vm = vision_model(run)
    return vm, dataclasses.replace(images, tokens=image_tokens(vm, images))


def image_run(
    run: OnlineRunConfig,
    algo: OnlineAlgorithm,
    model: ModelConfig,
    target: Target,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
    exact: bool,
    workers: int = 1,
    vm: VisionModel,
    images: ImagePlan,
) -> list[Measured]:
    """An image run's programs, measured (``relax.plan.measure.online``'s arguments): the encode
    first, then the step's programs called with its ``PromptInputs``; the vision part's weights
    resident beside every program on the trainer's chips (the ``vision`` column)."""
    trainer = run.parallel.meshes(devices)[0]
    n = processes(trainer)
    first = min(d.process_index for d in trainer.devices.flat)
    where = host_mesh(trainer, first) if n > 1 else trainer  # as RunData.on_mesh lays it out
    encode = encode_program(run, vm, images, where, compile_fn, n)
    measured = online(
        run,
        algo,
        model,
        target,
        devices,
        compile_fn=compile_fn,
        exact=exact,
        workers=workers,
        images=encode.outputs,
    )
    encoded = measure(encode, target, args=(resident_state(run, measured), encode.args[1]))
    weights = vision_per_chip(vm, where)
    beside = lambda m: dataclasses.replace(m, memory=with_vision(m.memory, weights))  # noqa: E731
    return [beside(encoded), *(beside(m) if m.program.mesh == trainer else m for m in measured)]
