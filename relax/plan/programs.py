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

``offline_programs`` does the same for an offline trainer (SFT, DPO), which runs on one device:
its step on one chip of the target, with a batch of the longest items its config admits
(``OfflineAlgorithm.longest``).

Every program is traced under ``relax.passes.target_backend``: the backend-dependent choices
(passes, kernels) are the target's, not this host's.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.offline.run import OfflineAlgorithm
from relax.algorithms.online.batch import HostRecord, Prompts
from relax.algorithms.online.config import (
    ModelRunConfig,
    OnlineAlgorithm,
    OnlineRunConfig,
    run_parts,
)
from relax.algorithms.online.setup import with_lora
from relax.algorithms.online.step import StepParts
from relax.compose import WithHost, join_host, split_host
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.decoder.transformer import init as init_model
from relax.parallel import ShardedStep, batch_shards
from relax.passes import choose_passes, target_backend
from relax.rewards.functions import RewardFunction
from relax.rollout import turns
from relax.rollout.turns import TurnConfig


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


def abstract_model(run: ModelRunConfig, config: ModelConfig):
    """The policy (with ``--lora.*`` adapters) as ``ShapeDtypeStruct`` s in the run's dtypes."""
    init = lambda key: with_lora(
        run,
        init_model(
            config, key, param_dtype=DTYPES[run.param_dtype], dtype=DTYPES[run.compute_dtype]
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


def _zero_reward(prompts, completions, **_) -> list[float]:
    return [0.0] * len(completions)


def _parts(run: OnlineRunConfig, config: ModelConfig, passes) -> StepParts:
    """Step parts that stand in for the run's: one reward function returning 0 and a decoder
    returning empty texts (what they compute does not change the programs' shapes), scheduled
    as the run's (``run_parts``)."""
    decode = lambda tokens, mask: [""] * int(np.prod(np.shape(tokens)[:-1]))
    parts = StepParts(
        reward_fns=[RewardFunction(_zero_reward, name="reward")],
        decode=decode,
        eos_ids=tuple(config.eos_ids) or (0,),
        pad_id=0,
        passes=passes,
    )
    return run_parts(run, parts)


def first_batch(run: OnlineRunConfig) -> WithHost:
    """A batch of ``--batch-size`` prompts padded to ``--max-prompt-tokens`` (the longest bucket)."""
    rows, length = run.batch_size, run.max_prompt_tokens
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    return WithHost(
        Prompts(ids, ids), HostRecord(prompts=[""] * rows, fields={run.answer_field: [""] * rows})
    )


def _device_map(fn: Callable, batch: Any) -> Any:
    """``fn`` over the leaves of a batch's device part (a ``WithHost``'s record kept)."""
    if isinstance(batch, WithHost):
        return batch.replace(device=jax.tree.map(fn, batch.device))
    return jax.tree.map(fn, batch)


def _concrete(tree: Any) -> Any:
    """Zeros for every ``ShapeDtypeStruct`` (what a host segment reads)."""
    return _device_map(
        lambda x: np.zeros(x.shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct) else x, tree
    )


def _shapes(tree: Any) -> Any:
    """Arrays (and a lowered program's output infos) as ``ShapeDtypeStruct`` s without a sharding
    (what the next jitted segment is lowered with, placed its own way)."""
    is_array = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # numpy, jax, lowered.out_info
    return _device_map(
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
) -> list[Program]:
    """The jitted programs of one step of ``run`` on ``devices`` (a target's), in the order the
    step runs them; ``compile_fn(lowered) -> (compiled | None, error | None, seconds)``.
    ``known``: the outputs of programs (by name) that are not to be compiled (left ``compiled``
    None, ``error`` None); ``until``: stop after the first program whose name it accepts."""
    platform = _platform(devices[0])
    if not run.parallel.enabled:
        raise ValueError("planning needs --parallel.mesh (e.g. fsdp=-1: every chip of the target)")
    trainer_mesh, sampler_mesh = run.parallel.meshes(devices)
    with target_backend(platform):
        state = abstract_state(algorithm, run, config)
        step = algorithm.make_step(
            _parts(run, config, choose_passes(batch_shards=batch_shards(trainer_mesh)))
        )
        sharded = ShardedStep(
            step,
            state,
            trainer_mesh,
            sampler_mesh=sampler_mesh,
            offload_reference=run.parallel.offload_reference,
        )
        return _walk(
            sharded.segments, state, first_batch(run), compile_fn, known=known or {}, until=until
        )


def offline_programs(
    run: ModelRunConfig,
    algorithm: OfflineAlgorithm,
    config: ModelConfig,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
) -> list[Program]:
    """The jitted programs of one step of an offline trainer, on one chip (``devices[0]``)."""
    if algorithm.longest is None:
        raise ValueError(
            f"relax plan cannot plan {algorithm.name} runs yet: its algorithm gives no longest batch"
        )
    device = devices[0]
    with target_backend(_platform(device)):
        state = abstract_state(algorithm, run, config)
        step = algorithm.make_step(choose_passes(), None)
        return _walk(
            step.segments,
            state,
            _shapes(algorithm.longest(run.batch_size)),
            compile_fn,
            device=device,
        )


def _walk(
    segments,
    state,
    batch: dict,
    compile_fn,
    device: jax.Device | None = None,
    *,
    known: dict[str, Any] | None = None,
    until: Callable[[str], bool] | None = None,
) -> list[Program]:
    """Lower and compile each jitted segment in order, with its ``Segment.abstract`` arguments
    (a ``ShardedStep``'s) or else the state and batch placed on ``device``; host segments run on
    zeros. Each program's outputs are the next one's batch (``known`` ones' as given)."""
    programs, known = [], known or {}
    for seg in segments:
        if not seg.jittable:
            if seg.names != ("weight_transfer",):  # a copy between meshes: nothing to compile
                _, batch = seg.run(state, _concrete(batch))
                batch = _shapes(batch)
            continue
        name = "+".join(seg.names)
        args = (
            seg.abstract(state, batch)
            if seg.abstract is not None
            else (_on_device(state, device), _on_device(split_host(batch)[1], device))
        )
        mesh = _mesh_of(args[1])
        if name in known:
            if seg.updates_state:
                raise ValueError(f"program {name} updates the state: its outputs cannot be given")
            program = Program(name, mesh, args, outputs=known[name])
        else:
            with jax.set_mesh(mesh):
                lowered = seg.jitted.lower(*args)
                compiled, error, seconds = compile_fn(lowered)
            program = Program(
                name, mesh, args, compiled, error, seconds, outputs=_shapes(lowered.out_info)
            )
        programs.append(program)
        out = program.outputs
        batch = join_host(split_host(batch)[0], out[1] if seg.updates_state else out, batch)
        if until is not None and until(name):
            break
    return programs


def _mesh_of(batch: dict) -> jax.sharding.Mesh:
    """The mesh a program's batch arguments are laid out on (one device's for a single-device sharding)."""
    sharding = jax.tree.leaves(batch)[0].sharding
    return getattr(sharding, "mesh", None) or jax.sharding.Mesh(
        np.asarray(list(sharding.device_set)), ("data",)
    )


def _on_device(tree: Any, device: jax.Device) -> Any:
    """``tree``'s arrays as ``ShapeDtypeStruct`` s placed on ``device``."""
    one = jax.sharding.SingleDeviceSharding(device)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), tree)


def _platform(device: jax.Device) -> str:
    return "gpu" if device.platform in ("cuda", "rocm", "gpu") else device.platform


def multi_turn_programs(
    run: ModelRunConfig,
    config: ModelConfig,
    cfg: TurnConfig,
    prompts: int,
    prompt_len: int,
    observation_len: int,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
) -> list[Program]:
    """The multi-turn decoder's programs (``relax.rollout.turns``: start, the fused weights,
    decode_turn, append) for ``prompts`` prompts of ``prompt_len`` tokens, on one chip."""
    device = devices[0]
    mesh = jax.sharding.Mesh(np.asarray([device]), ("data",))
    typed = functools.partial(_on_device, device=device)
    ids = jax.ShapeDtypeStruct((prompts, prompt_len), jnp.int32)
    rows = prompts * cfg.num_generations
    obs, count = (
        jax.ShapeDtypeStruct((rows, observation_len), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
    )
    active = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    programs = []
    with target_backend(_platform(device)):
        model = typed(abstract_model(run, config))
        state = typed(
            jax.eval_shape(
                functools.partial(turns.start_state, cfg=cfg), model, ids, ids, jax.random.key(0)
            )
        )
        layers = typed(jax.eval_shape(functools.partial(turns.fused_decode_layers, cfg=cfg), model))
        calls = (
            ("start", turns.start, (model, typed(ids), typed(ids), typed(jax.random.key(0))), {}),
            ("fused_layers", turns.fused_layers, (model,), {}),
            ("decode_turn", turns.decode_turn, (model, state, typed(active)), {"layers": layers}),
            ("append", turns.append, (model, state, typed(obs), typed(count)), {"layers": layers}),
        )
        for name, fn, args, kwargs in calls:
            compiled, error, seconds = compile_fn(fn.lower(*args, cfg=cfg, **kwargs))
            programs.append(Program(name, mesh, (None, args), compiled, error, seconds))
    return programs
