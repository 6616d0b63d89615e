"""Each compiled program of a run, measured per chip: its memory (``relax.plan.memory``) and its
traffic (``relax.plan.hlo_summary``), for the online trainers (with the sampler of a deep model
extended from two shallow compiles, ``relax.plan.depth``) and the offline ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from relax.algorithms.offline.run import OfflineAlgorithm
from relax.algorithms.online.config import ModelRunConfig, OnlineAlgorithm, OnlineRunConfig
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.config.sharding import batch_shards
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.plan import depth as depth_lib
from relax.plan.hlo_summary import ProgramTraffic, traffic
from relax.plan.memory import (
    ProgramMemory,
    kv_cache_per_chip,
    kv_heads_per_chip,
    program_memory,
    sampler_weights_per_chip,
)
from relax.plan.programs import Concurrently, Program, offline_programs, online_programs
from relax.plan.targets import Target
from relax.rollout.sampler import RolloutConfig, block_sizes, cache_bytes


@dataclasses.dataclass(frozen=True)
class Measured:
    """One program of a plan: what was compiled, and its memory and traffic per chip."""

    program: Program
    memory: ProgramMemory
    traffic: ProgramTraffic | None


def measure(
    p: Program,
    target: Target,
    *,
    kv_cache: int = 0,
    sampler=None,
    args=None,
    sampler_weights: int = 0,
) -> Measured:
    """A compiled program's memory against the chip's HBM (``kv_cache``, ``sampler_weights``: its
    KV caches and weight copy per chip) and traffic; ``sampler``: its first cache block's slots and
    the blocks' shapes; ``args``: the ``(state, batch)`` its memory counts (default: its own
    arguments)."""
    memory = program_memory(
        p.name,
        p.compiled,
        p.args if args is None else args,
        limit=target.chip.hbm_bytes,
        kv_cache=kv_cache,
        error=p.error,
        compile_s=p.compile_s,
        sampler_weights=sampler_weights,
    )
    return Measured(p, memory, _traffic(p, target, sampler))


def _traffic(p: Program, target: Target, sampler: tuple | None) -> ProgramTraffic | None:
    if p.compiled is None:
        return None
    return traffic(p.name, p.compiled, target.chip, *(sampler or (None, frozenset())))


def cache_block_dims(model: ModelConfig, rollout: RolloutConfig, prompts: int, mesh) -> frozenset:
    """Per-chip shapes of the sampler's completion-cache blocks (keys ``[rows, Hkv, D, S]``,
    values ``[rows, Hkv, S, D]``): rows over the batch axes, KV heads as ``kv_heads_per_chip``."""
    rows, heads, d = (
        prompts * rollout.num_generations // batch_shards(mesh),
        kv_heads_per_chip(model, mesh),
        model.head_dim,
    )
    return frozenset(
        x for s in block_sizes(rollout) for x in ((rows, heads, d, s), (rows, heads, s, d))
    )


def resident_state(run: ModelRunConfig, measured: list[Measured]) -> Any:
    """The train state as it lies on the trainer's chips between programs: the last program's
    (the update's) state argument, without the reference when it is offloaded to host memory."""
    state = measured[-1].program.args[0]
    return state.replace(ref=None) if run.parallel.offload_reference else state


def is_sampler(name: str) -> bool:
    """Whether a program of an online run is its sampler (the ``rollout`` stage)."""
    return "rollout" in name.split("+")


def offline(
    run: ModelRunConfig,
    algo: OfflineAlgorithm,
    model: ModelConfig,
    target: Target,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
    exact: bool,
    workers: int = 1,
) -> list[Measured]:
    """Each program of an offline trainer's step on the run's meshes, measured (``exact`` is
    moot: no sampler is extended); ``workers`` programs compiled at a time."""
    with Concurrently(compile_fn, workers) as pending:
        programs = offline_programs(run, algo, model, devices, compile_fn=pending)
        return [measure(pending.resolved(p), target) for p in programs]


def online(
    run: OnlineRunConfig,
    algo: OnlineAlgorithm,
    model: ModelConfig,
    target: Target,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
    exact: bool,
    workers: int = 1,
    images: PromptInputs | None = None,
) -> list[Measured]:
    """Each program of an online run, measured; the sampler of a deep model compiled at two
    shallow depths and extended to its own unless ``exact``. Every walk is lowered before the
    compiles are awaited, ``workers`` programs compiled at a time (``Concurrently``).
    ``images``: image prompts' ``PromptInputs`` (abstract, ``relax.plan.vision``): the sampler
    and the update at every depth take them (their shapes do not depend on the depth)."""
    at = None if exact else depth_lib.depths(model)
    with Concurrently(compile_fn, workers) as pending:
        shallow = [
            online_programs(
                run,
                algo,
                depth_lib.shallow(model, d),
                devices,
                compile_fn=pending,
                until=is_sampler,
                images=images,
            )
            for d in (at or ())
        ]
        known = (
            {
                p.name: depth_lib.deepen_outputs(p.outputs, model)
                for p in shallow[0]
                if is_sampler(p.name)
            }
            if shallow
            else None
        )
        programs = online_programs(
            run, algo, model, devices, compile_fn=pending, known=known, images=images
        )
        shallow = [[pending.resolved(p) for p in qs] for qs in shallow]
        programs = [pending.resolved(p) for p in programs]
    rollout = algo.generation.rollout(eos_ids=(), pad_id=0)
    kv_total = cache_bytes(
        model, run.batch_size, run.max_prompt_tokens, rollout, DTYPES[run.compute_dtype]
    )
    out = []
    for p in programs:
        if not is_sampler(p.name):
            out.append(measure(p, target))
            continue
        kv = kv_cache_per_chip(kv_total, p.mesh, model)
        copy = sampler_weights_per_chip(
            model,
            rollout.sampler_precision,
            DTYPES[run.param_dtype],
            DTYPES[run.compute_dtype],
            p.mesh,
        )
        blocks = (block_sizes(rollout)[0], cache_block_dims(model, rollout, run.batch_size, p.mesh))
        if known and p.name in known:  # extended from its shallow compiles
            low = [
                measure(next(q for q in qs if q.name == p.name), target, sampler=blocks)
                for qs in shallow
            ]
            out.append(_extended(p, low, (kv, copy), at, model.num_layers))
        else:
            out.append(measure(p, target, kv_cache=kv, sampler=blocks, sampler_weights=copy))
    return out


def _extended(
    p: Program, low: list[Measured], known: tuple[int, int], at: tuple, layers: int
) -> Measured:
    """The sampler ``p`` on the line through its shallow compiles ``low`` (at depths ``at``);
    ``known``: its KV caches and weight copy per chip."""
    (ma, ta), (mb, tb) = ((m.memory, m.traffic) for m in low)
    kv, copy = known
    memory = depth_lib.extend_memory(p.name, p.args, kv, ma, mb, *at, layers, sampler_weights=copy)
    flow = None if ta is None or tb is None else depth_lib.extend_traffic(ta, tb, *at, layers)
    return Measured(p, memory, flow)
