"""A run's compiled programs, built from abstract arrays for a target's devices.

``online_programs(run_cfg, algorithm, model_config, devices)`` builds exactly what
``relax.algorithms.online.run.run_online`` would run (the algorithm's state and composed step, laid
out by ``relax.parallel.ShardedStep`` on the meshes of ``--parallel.*``) with nothing allocated:

- the model and the state are ``jax.eval_shape`` s of their initialisers (a ``config.json`` is
  all it takes);
- each jitted segment (the sampler, the reference forward, the update, ...) is lowered with its
  call arguments as ``ShapeDtypeStruct`` s carrying the run's shardings (``Segment.abstract``)
  and compiled by the target's compiler;
- a host segment (reward functions, packing) runs for real on a batch of zeros (its arrays are
  small next to the model), so the next program sees the batch the run would give it.

``offline_programs`` does the same for an offline trainer (SFT, DPO, KTO, reward model,
distillation) as ``relax.algorithms.offline.run.run_offline`` lays it out on the same meshes,
with a batch of the longest items its config admits (``OfflineAlgorithm.longest``);
``sharded_programs`` for any step (the agent's, ``relax.plan.agent``), and
``multi_turn_programs`` for the multi-turn decoder on a laid-out model.

Every program is traced under ``relax.passes.target_backend``: the backend-dependent choices
(passes, kernels) are the target's, not this host's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.offline.run import OfflineAlgorithm
from relax.algorithms.online.ahead import prompt_batch, stand_in, zero_reward
from relax.algorithms.online.config import (
    ModelRunConfig,
    OnlineAlgorithm,
    OnlineRunConfig,
    run_parts,
)
from relax.algorithms.online.setup import with_lora
from relax.algorithms.online.step import StepParts
from relax.compose import WithHost
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.decoder.transformer import init as init_model
from relax.parallel import ShardedStep, batch_shards, check_batch, replicated, state_shardings
from relax.passes import Passes, choose_passes, target_backend
from relax.rewards.functions import RewardFunction
from relax.rollout import turns
from relax.rollout.turns import TurnConfig
from relax.train.ahead import device_map, lower_step, program_mesh


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the run: its segment's stage names, where it runs, its call
    arguments (abstract, sharded) and the target compiler's executable (None with ``error``)."""

    name: str
    mesh: jax.sharding.Mesh
    args: tuple[Any, Any]
    compiled: Any = None
    error: str | None = None
    compile_s: float = 0.0
    outputs: Any = None  # its results' shapes (what the next program is called with)


class Concurrently:
    """A ``compile_fn`` that starts each compile on a pool of ``workers`` threads and returns at
    once, the program's ``compiled`` then a future; ``resolved(program)`` waits for it. XLA
    compiles outside the interpreter lock, so the programs of a plan (its shallow samplers, the
    reference and the update) compile side by side while the next walk lowers. A context manager:
    the pool is shut down on exit."""

    def __init__(self, compile_fn: Callable[[Any], tuple], workers: int):
        self.compile_fn = compile_fn
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers))

    def __call__(self, lowered) -> tuple:
        return self.pool.submit(self.compile_fn, lowered), None, 0.0

    def resolved(self, program: Program) -> Program:
        """``program`` with its compile's results (``compiled``, ``error``, ``compile_s``)."""
        if not isinstance(program.compiled, concurrent.futures.Future):
            return program
        compiled, error, seconds = program.compiled.result()
        return dataclasses.replace(program, compiled=compiled, error=error, compile_s=seconds)

    def __enter__(self) -> Concurrently:
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=exc[0] is not None)


def abstract_model(run: ModelRunConfig, config: ModelConfig):
    """The policy (with ``--lora.*`` adapters) as ``ShapeDtypeStruct`` s in the run's dtypes and
    precision policy."""
    init = lambda key: with_lora(
        run,
        dataclasses.replace(
            init_model(
                config, key, param_dtype=DTYPES[run.param_dtype], dtype=DTYPES[run.compute_dtype]
            ),
            precision=run.precision,
        ),
    )
    return jax.eval_shape(init, jax.random.key(0))


def abstract_state(
    algorithm: OnlineAlgorithm | OfflineAlgorithm, run: ModelRunConfig, config: ModelConfig
):
    """The algorithm's train state for the policy of ``abstract_model``, as ``ShapeDtypeStruct`` s."""
    return jax.eval_shape(
        algorithm.make_state, abstract_model(run, config), jax.random.key(run.seed)
    )


def _parts(
    run: OnlineRunConfig, config: ModelConfig, passes, algorithm: OnlineAlgorithm
) -> StepParts:
    """Step parts that stand in for the run's (``relax.algorithms.online.ahead.stand_in``): one
    reward function returning 0 and a decoder returning empty texts (what they compute does not
    change the programs' shapes), scheduled as the run's (``run_parts``)."""
    parts = StepParts(
        reward_fns=[RewardFunction(zero_reward, name="reward")],
        eos_ids=tuple(config.eos_ids) or (0,),
        pad_id=0,
        passes=passes,
    )
    return run_parts(run, stand_in(parts), algorithm.generation)


def first_batch(run: OnlineRunConfig, images: PromptInputs | None = None) -> WithHost:
    """A batch of ``--batch-size`` prompts padded to ``--max-prompt-tokens`` (the longest bucket);
    ``images``: image prompts' inputs (``ShapeDtypeStruct`` s, ``relax.plan.vision``)."""
    batch = prompt_batch(run.batch_size, run.max_prompt_tokens, run.answer_field)
    if images is None:
        return batch
    return WithHost(batch.device.replace(images=images), batch.host)


def _shapes(tree: Any) -> Any:
    """Arrays (and a lowered program's output infos) as ``ShapeDtypeStruct`` s without a sharding
    (what the next jitted segment is lowered with, placed its own way)."""
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # numpy, jax, lowered.out_info
    return device_map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if is_array(x) else x, tree
    )


def online_programs(
    run: OnlineRunConfig,
    algorithm: OnlineAlgorithm,
    config: ModelConfig,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
    known: dict[str, Any] | None = None,
    until: Callable[[str], bool] | None = None,
    images: PromptInputs | None = None,
) -> list[Program]:
    """The jitted programs of one step of ``run`` on ``devices`` (a target's), in the order the
    step runs them; ``compile_fn(lowered) -> (compiled | None, error | None, seconds)``.
    ``known``: the outputs of programs (by name) that are not to be compiled (left ``compiled``
    None, ``error`` None); ``until``: stop after the first program whose name it accepts;
    ``images``: the prompts' ``PromptInputs`` (abstract; None: text prompts)."""
    return sharded_programs(
        run,
        algorithm,
        config,
        devices,
        make_step=lambda passes: algorithm.make_step(_parts(run, config, passes, algorithm)),
        batch=first_batch(run, images),
        compile_fn=compile_fn,
        known=known,
        until=until,
    )


@dataclasses.dataclass(frozen=True)
class PlanTokenizer:
    """What an offline trainer's step reads of its tokenizer, standing in for the run's: the
    model's end-of-sequence ids and pad id 0 (distillation's sampler stops at them; neither
    changes a program's shape)."""

    eos_token_ids: tuple[int, ...]
    pad_token_id: int = 0


def offline_programs(
    run: ModelRunConfig,
    algorithm: OfflineAlgorithm,
    config: ModelConfig,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
) -> list[Program]:
    """The jitted programs of one step of an offline trainer on ``devices``, as ``run_offline``
    runs it, called with a batch of the longest items its config admits."""
    if algorithm.longest is None:
        raise ValueError(
            f"relax plan cannot plan {algorithm.name} runs yet: its algorithm gives no longest batch"
        )
    tokenizer = PlanTokenizer(tuple(config.eos_ids) or (0,))

    def make_step(passes):
        step = algorithm.make_step(passes, tokenizer)
        if run.parallel.sampler_devices and not any(s.placement == "sampler" for s in step.leaves):
            raise ValueError(
                f"--parallel.sampler-devices: {algorithm.name} samples nothing (its run refuses it)"
            )
        return step

    batch = _shapes(algorithm.longest(run.batch_size))
    return sharded_programs(
        run, algorithm, config, devices, make_step=make_step, batch=batch, compile_fn=compile_fn
    )


def sharded_programs(
    run: ModelRunConfig,
    algorithm: OnlineAlgorithm | OfflineAlgorithm,
    config: ModelConfig,
    devices: Sequence[jax.Device],
    *,
    make_step: Callable[[Any], Any],
    batch: Any,
    compile_fn: Callable[[Any], tuple],
    known: dict[str, Any] | None = None,
    until: Callable[[str], bool] | None = None,
) -> list[Program]:
    """The jitted programs of the step ``make_step(passes)`` called with ``batch``, laid out as a
    run lays it out (``relax.parallel.ShardedStep`` on the meshes of ``--parallel.*`` over
    ``devices``, the algorithm's state by the sharding rules); ``known`` and ``until`` as
    ``online_programs``'."""
    meshes = _run_meshes(run, devices)
    with target_backend(platform(devices[0])):
        state = abstract_state(algorithm, run, config)
        step = make_step(run_passes(run, devices))
        sharded = _sharded_step(run, step, state, meshes)
        return _walk(sharded.segments, state, batch, compile_fn, known=known, until=until)


def run_passes(run: ModelRunConfig, devices: Sequence[jax.Device]) -> Passes:
    """The passes ``run`` takes on ``devices`` (``relax.passes.choose_passes``): the target's
    backend's, with the batch split over the trainer mesh's batch axes."""
    return choose_passes(
        platform(devices[0]), batch_shards=batch_shards(_run_meshes(run, devices)[0])
    )


def _run_meshes(run: ModelRunConfig, devices: Sequence[jax.Device]) -> tuple[Any, Any]:
    """``(trainer, sampler)`` meshes of ``--parallel.*`` over ``devices``, checked against
    ``--batch-size`` as a run checks them (its rows split over the batch axes)."""
    if not run.parallel.enabled:
        raise ValueError("planning needs --parallel.mesh (e.g. fsdp=-1: every chip of the target)")
    trainer, sampler = run.parallel.meshes(devices)
    check_batch(run.batch_size, trainer)
    check_batch(run.batch_size, sampler)
    return trainer, sampler


def _sharded_step(run: ModelRunConfig, step, state, meshes: tuple[Any, Any]) -> ShardedStep:
    """``step`` on the run's ``meshes``, its ``state`` laid out by the sharding rules: what
    ``run_online`` and ``run_offline`` run."""
    return ShardedStep(
        step,
        state,
        meshes[0],
        sampler_mesh=meshes[1],
        offload_reference=run.parallel.offload_reference,
    )


def _walk(
    segments,
    state,
    batch: dict,
    compile_fn,
    *,
    known: dict[str, Any] | None = None,
    until: Callable[[str], bool] | None = None,
) -> list[Program]:
    """Lower each jitted segment in order with its ``Segment.abstract`` arguments (a
    ``ShardedStep``'s; ``relax.train.ahead.lower_step``, host segments on zeros), then compile each
    (``known`` ones are not compiled: their outputs are given)."""
    lowerings, _ = lower_step(segments, state, batch, run_host=_run_host, known=known, until=until)
    programs = []
    for lo in lowerings:
        compiled, error, seconds = (
            (None, None, 0.0) if lo.lowered is None else compile_fn(lo.lowered)
        )
        outputs = lo.outputs if lo.lowered is None else _shapes(lo.outputs)
        programs.append(
            Program(lo.name, program_mesh(lo.args), lo.args, compiled, error, seconds, outputs)
        )
    return programs


def _run_host(seg, state, batch):
    """A host segment of a planned step on a batch of zeros."""
    return seg.run(state, batch)[1]


def platform(device: jax.Device) -> str:
    """The backend name a target's device compiles for (``relax.passes.target_backend``'s)."""
    return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform


def laid_out(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tree`` (abstract models, or a state holding them) as ``ShapeDtypeStruct`` s laid out on
    ``mesh`` by the sharding rules (``relax.parallel.state_shardings``: models sharded, the
    rest replicated)."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        tree,
        state_shardings(tree, mesh),
    )


def multi_turn_programs(
    model: Any,
    cfg: TurnConfig,
    prompts: int,
    prompt_len: int,
    observation_len: int,
    *,
    compile_fn: Callable[[Any], tuple],
) -> list[Program]:
    """The multi-turn decoder's programs (``relax.rollout.turns``: start, the fused weights,
    decode_turn, append) as ``relax.environments.rollout`` calls them with a laid-out ``model``
    (``ShapeDtypeStruct`` s with shardings, e.g. the train state's policy on its mesh): ``prompts``
    prompts of ``prompt_len`` tokens, observations of ``observation_len``, the host's arrays
    replicated over the mesh, the decoder's state and fused weights where start and fused_layers
    put them (replicated when the compiler refused those). Each program's ``args`` are
    ``(weights, arrays)``: the weights it reads (the model, and the fused decode weights for
    decode_turn and append) and its other arguments."""
    mesh = jax.tree.leaves(model)[0].sharding.mesh
    whole = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(
        shape, dtype, sharding=replicated(mesh)
    )
    rows, key = prompts * cfg.num_generations, jax.random.key(0)
    ids = whole(prompts, prompt_len)
    run = functools.partial(_decoder_program, cfg=cfg, compile_fn=compile_fn)
    with target_backend(platform(mesh.devices.flat[0])), jax.set_mesh(mesh):
        start = run("start", turns.start, (model, ids, ids, whole(dtype=key.dtype)))
        fused = run("fused_layers", turns.fused_layers, (model,))
        state, layers = start.outputs, fused.outputs
        turn = run(
            "decode_turn", turns.decode_turn, (model, state, whole(rows, dtype=bool)), layers
        )
        obs = (whole(rows, observation_len), whole(rows))
        return [start, fused, turn, run("append", turns.append, (model, state, *obs), layers)]


def _decoder_program(name, fn, args, layers=None, *, cfg, compile_fn) -> Program:
    """One decoder program, compiled; its outputs laid out as the compiler laid them out."""
    extra = {} if layers is None else {"layers": layers}
    lowered = fn.lower(*args, cfg=cfg, **extra)
    compiled, error, seconds = compile_fn(lowered)
    mesh = jax.tree.leaves(args[0])[0].sharding.mesh
    shardings = (
        compiled.output_shardings
        if compiled is not None
        else jax.tree.map(lambda _: replicated(mesh), lowered.out_info)
    )
    outputs = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        lowered.out_info,
        shardings,
    )
    weights = (args[0], *extra.values())
    return Program(name, mesh, (weights, args[1:]), compiled, error, seconds, outputs)
