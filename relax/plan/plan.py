"""``plan``: whether a run fits a target, per chip and per program, before anyone pays for it.

    from relax.plan import plan
    p = plan("grpo", ["--model", "llama-3.1-8b/config.json", "--batch-size", "64",
                      "--grpo.max-new-tokens", "2048", "--parallel.mesh", "fsdp=8"], "v5p:2x2x2")
    print(p.table())

The flags are the run's own (``examples/train_grpo.py``'s, parsed the same way); ``--model`` may
be a directory or just its ``config.json`` (no weights are read) and ``--data`` is not needed.
Without ``--parallel.mesh`` the plan uses ``fsdp=-1`` (every chip). The offline trainers (sft,
dpo, orpo) run on one device, so their plan is for one chip of the target. Every program of one step is
compiled by the target's compiler (``relax.plan.programs``) and measured (``relax.plan.memory``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.dpo import run as dpo_run
from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.grpo import run as grpo_run
from relax.algorithms.online.config import ModelRunConfig, OnlineRunConfig
from relax.algorithms.ppo import run as ppo_run
from relax.algorithms.sft import run as sft_run
from relax.models.config.model import DTYPES, ModelConfig
from relax.models.config.sharding import batch_shards
from relax.models.hf.checkpoint import read_config
from relax.plan import depth as depth_lib
from relax.plan import targets as targets_lib
from relax.plan.hlo_summary import ProgramTraffic, traffic
from relax.plan.memory import ProgramMemory, kv_cache_per_chip, kv_heads_per_chip, program_memory
from relax.plan.programs import offline_programs, online_programs
from relax.rollout.sampler import RolloutConfig, block_sizes, cache_bytes


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """How to parse an algorithm's flags and build it (online: GRPO, PPO; offline: SFT, DPO,
    ORPO); ``field``: its config's flag group (``--grpo.*``)."""

    config: type
    builtin: Callable[[], ModelRunConfig]
    real: Callable[[], ModelRunConfig]
    algorithm: Callable[[Any], Any]  # run config -> OnlineAlgorithm | OfflineAlgorithm
    field: str

    @property
    def online(self) -> bool:
        return issubclass(self.config, OnlineRunConfig)


ALGORITHMS = {
    "grpo": AlgorithmEntry(
        grpo_run.GRPORunConfig,
        grpo_run.builtin_defaults,
        grpo_run.real_defaults,
        grpo_run.algorithm,
        "grpo",
    ),
    "ppo": AlgorithmEntry(
        ppo_run.PPORunConfig,
        ppo_run.builtin_defaults,
        ppo_run.real_defaults,
        ppo_run.algorithm,
        "ppo",
    ),
    "sft": AlgorithmEntry(
        sft_run.SFTRunConfig,
        sft_run.builtin_defaults,
        sft_run.SFTRunConfig,
        sft_run.algorithm,
        "sft",
    ),
    "dpo": AlgorithmEntry(
        dpo_run.DPORunConfig,
        dpo_run.builtin_defaults,
        dpo_run.DPORunConfig,
        dpo_run.algorithm,
        "dpo",
    ),
    "orpo": AlgorithmEntry(
        dpo_run.DPORunConfig,
        lambda: dpo_run.builtin_defaults("orpo"),
        lambda: dpo_run.DPORunConfig(dpo=DPOConfig(loss_type="orpo")),
        dpo_run.algorithm,
        "dpo",
    ),
}


def parse_run(algorithm: str, argv: list[str]) -> ModelRunConfig:
    """The run config ``argv`` gives ``algorithm`` (``--data`` and a mesh are filled in if absent)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"relax plan knows {', '.join(ALGORITHMS)}; got {algorithm!r}")
    entry = ALGORITHMS[algorithm]
    argv = list(argv)
    if not any(a == "--model" or a.startswith("--model=") for a in argv):
        raise ValueError("relax plan needs --model (a model directory or its config.json)")
    if not any(a == "--data" or a.startswith("--data=") for a in argv):
        argv += ["--data", "(not read by a plan)"]
    named = lambda flag: any(a == flag or a.startswith(flag + "=") for a in argv)
    if entry.online and not named("--parallel.mesh") and not named("--parallel.sampler-devices"):
        argv += [
            "--parallel.mesh",
            "fsdp=-1",
        ]  # every chip (before parsing: other flags may need a mesh)
    return worst_case(parse_flags(entry.config, argv, builtin=entry.builtin, real=entry.real))


def worst_case(cfg: ModelRunConfig) -> ModelRunConfig:
    """The run with completions padded to the budget (packing only ever lowers the update's need,
    and what it packs depends on lengths a plan does not know)."""
    for name in ("grpo", "ppo"):
        algo = getattr(cfg, name, None)
        if algo is not None and algo.packing.mode != "off":
            padded = dataclasses.replace(
                algo, packing=dataclasses.replace(algo.packing, mode="off")
            )
            cfg = dataclasses.replace(cfg, **{name: padded})
    return cfg


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step of a run compiled for ``target``: each program's memory and traffic per chip."""

    algorithm: str
    target: targets_lib.Target
    run: ModelRunConfig
    model: ModelConfig
    programs: tuple[ProgramMemory, ...]
    traffic: tuple[ProgramTraffic | None, ...]
    compile_s: float
    exact: bool = False  # every program compiled whole (no sampler extended from shallow compiles)

    @property
    def peak(self) -> ProgramMemory:
        return max(self.programs, key=lambda p: p.total)

    @property
    def fits(self) -> bool:
        return all(p.fits for p in self.programs)

    def table(self) -> str:
        from relax.plan.report import plan_table

        return plan_table(self)


def compile_program(lowered) -> tuple[Any, str | None, float]:
    """``lowered.compile()``; an out-of-memory refusal is returned as its message, not raised."""
    t0 = time.perf_counter()
    try:
        return lowered.compile(), None, time.perf_counter() - t0
    except Exception as e:  # the compile-only clients raise JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        return None, str(e).splitlines()[0], time.perf_counter() - t0


def compile_once(compile_fn: Callable[[Any], tuple] = compile_program) -> Callable[[Any], tuple]:
    """``compile_fn`` that compiles each distinct program (by its lowered text) once: the plans of
    one run with other flags (``relax.plan.suggest``) share the programs a flag does not change,
    e.g. the sampler when only the update's micro-batches differ."""
    done: dict[str, tuple] = {}

    def run(lowered) -> tuple:
        key = hashlib.sha256(lowered.as_text().encode()).hexdigest()
        if key not in done:
            done[key] = compile_fn(lowered)
        return done[key]

    return run


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


def is_sampler(name: str) -> bool:
    """Whether a program of an online run is its sampler (the ``rollout`` stage)."""
    return "rollout" in name.split("+")


def plan_run(
    algorithm: str,
    run: ModelRunConfig,
    model: ModelConfig,
    target: targets_lib.Target,
    *,
    compile_fn: Callable[[Any], tuple] = compile_program,
    exact: bool = False,
) -> Plan:
    """Compile one step of ``run`` for ``target`` (with ``compile_fn``) and measure each program.
    The sampler of a deep model is compiled at two shallow depths and extended to its own
    (``relax.plan.depth``) unless ``exact``."""
    entry = ALGORITHMS[algorithm]
    algo = entry.algorithm(run)
    devices = targets_lib.devices(target)
    t0 = time.perf_counter()
    if not entry.online:  # one chip: the offline trainers run on one device
        programs = offline_programs(run, algo, model, devices, compile_fn=compile_fn)
        measured = [
            (
                program_memory(
                    p.name,
                    p.compiled,
                    p.args,
                    limit=target.chip.hbm_bytes,
                    error=p.error,
                    compile_s=p.compile_s,
                ),
                _traffic(p, target),
            )
            for p in programs
        ]
    else:
        measured = _online(entry, run, algo, model, target, devices, compile_fn, exact)
    memory, flows = zip(*measured)
    return Plan(
        algorithm, target, run, model, tuple(memory), tuple(flows), time.perf_counter() - t0, exact
    )


def _traffic(p, target, sampler: tuple | None = None) -> ProgramTraffic | None:
    """A compiled program's traffic; ``sampler``: its first cache block's slots and the blocks' shapes."""
    if p.compiled is None:
        return None
    return traffic(p.name, p.compiled, target.chip, *(sampler or (None, frozenset())))


def _online(entry, run, algo, model, target, devices, compile_fn, exact: bool) -> list[tuple]:
    """Each program of an online run, measured: ``(ProgramMemory, ProgramTraffic | None)``."""
    try:
        at = None if exact else depth_lib.depths(model)
        shallow = [
            online_programs(
                run,
                algo,
                depth_lib.shallow(model, d),
                devices,
                compile_fn=compile_fn,
                until=is_sampler,
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
        programs = online_programs(run, algo, model, devices, compile_fn=compile_fn, known=known)
    except RuntimeError as e:
        if "cuDNN" not in str(e):
            raise
        raise RuntimeError(
            f"{e}: the fused cuDNN attention (train attention 'auto' in 16 bits on GPU) needs "
            f"cuDNN to compile; plan with --{entry.field}.train-attention group"
        ) from e
    rollout = algo.generation.rollout(eos_ids=(), pad_id=0)
    kv_total = cache_bytes(
        model, run.batch_size, run.max_prompt_tokens, rollout, DTYPES[run.compute_dtype]
    )
    limit = target.chip.hbm_bytes
    out = []
    for p in programs:
        sampler = is_sampler(p.name)
        kv = kv_cache_per_chip(kv_total, p.mesh, model) if sampler else 0
        blocks = (
            None
            if not sampler
            else (block_sizes(rollout)[0], cache_block_dims(model, rollout, run.batch_size, p.mesh))
        )
        if known and p.name in known:  # the sampler, extended from its shallow compiles
            low = [next(q for q in qs if q.name == p.name) for qs in shallow]
            ma, mb = (
                program_memory(
                    q.name, q.compiled, q.args, limit=limit, error=q.error, compile_s=q.compile_s
                )
                for q in low
            )
            ta, tb = (_traffic(q, target, blocks) for q in low)
            out.append(
                (
                    depth_lib.extend_memory(p.name, p.args, kv, ma, mb, *at, model.num_layers),
                    None
                    if ta is None or tb is None
                    else depth_lib.extend_traffic(ta, tb, *at, model.num_layers),
                )
            )
            continue
        out.append(
            (
                program_memory(
                    p.name,
                    p.compiled,
                    p.args,
                    limit=limit,
                    kv_cache=kv,
                    error=p.error,
                    compile_s=p.compile_s,
                ),
                _traffic(p, target, blocks),
            )
        )
    return out


def plan(
    algorithm: str,
    argv: list[str],
    target: str | targets_lib.Target,
    *,
    compile_fn: Callable[[Any], tuple] = compile_program,
    exact: bool = False,
) -> Plan:
    """Parse the run's flags ``argv`` and plan it on ``target`` (e.g. ``"v5p:2x2x2"``, ``"h100x8"``)."""
    run = parse_run(algorithm, argv)
    target = target if isinstance(target, targets_lib.Target) else targets_lib.Target.parse(target)
    return plan_run(
        algorithm, run, read_config(run.model), target, compile_fn=compile_fn, exact=exact
    )
