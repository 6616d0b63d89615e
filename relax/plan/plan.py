"""``plan``: whether a run fits a target, per chip and per program, before anyone pays for it.

    from relax.plan import plan
    p = plan("grpo", ["--model", "llama-3.1-8b/config.json", "--batch-size", "64",
                      "--grpo.max-new-tokens", "2048", "--parallel.mesh", "fsdp=8"], "v5p:2x2x2")
    print(p.table())

The flags are the run's own (``examples/train_grpo.py``'s, parsed the same way); ``--model`` may
be a directory or just its ``config.json`` (no weights are read) and ``--data`` is not needed.
Without ``--parallel.mesh`` the plan uses ``fsdp=-1`` (every chip), for every trainer
(``relax.plan.trainers``: the online ones, the offline ones and the agent). Every program of one
step is compiled by the target's compiler (``relax.plan.programs``) and measured
(``relax.plan.memory``, ``relax.plan.measure``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time
from collections.abc import Callable
from typing import Any

from relax.algorithms.cli.flags import parse_flags
from relax.algorithms.online.config import ModelRunConfig, OnlineRunConfig
from relax.models.config.model import ModelConfig
from relax.plan import targets as targets_lib
from relax.plan import vision as vision_lib
from relax.plan.hlo_summary import ProgramTraffic
from relax.plan.memory import ProgramMemory
from relax.plan.reward_model import add_reward_model
from relax.plan.trainers import ALGORITHMS
from relax.plan.vision import ImagePlan, language_config


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
    if not named("--parallel.mesh") and not named("--parallel.sampler-devices"):
        argv += ["--parallel.mesh", "fsdp=-1"]  # every chip (before parsing: flags may need a mesh)
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
    images: ImagePlan | None = None  # an image run's images per prompt (``relax.plan.vision``)

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


def plan_run(
    algorithm: str,
    run: ModelRunConfig,
    model: ModelConfig,
    target: targets_lib.Target,
    *,
    compile_fn: Callable[[Any], tuple] = compile_program,
    exact: bool = False,
    workers: int = 1,
    images: ImagePlan | None = None,
) -> Plan:
    """Compile one step of ``run`` for ``target`` (with ``compile_fn``, ``workers`` programs at a
    time: one by default, since a deep model's program can take 16 GB of host memory to compile)
    and measure each program. The sampler of
    a deep model is compiled at two shallow depths and extended to its own (``relax.plan.depth``)
    unless ``exact``; an online run's ``--reward-model`` is resident beside its programs and
    scores with a program of its own (``relax.plan.reward_model``); a GRPO run's
    ``--image-field`` prompts hold ``images`` (default ``ImagePlan()``: one image of the family's
    usual size), encoded by a program of their own, the vision part resident beside every
    program (``relax.plan.vision``)."""
    entry = ALGORITHMS[algorithm]
    algo = entry.algorithm(run)
    devices = targets_lib.devices(target)
    measure_fn = entry.measure
    if getattr(run, "image_field", None) is not None:
        if algorithm != "grpo":
            raise ValueError(f"relax plan plans image prompts for grpo runs; got {algorithm}")
        if run.tower_trains:
            raise ValueError(
                "relax plan plans a frozen vision tower: a trained one (--train-vision, "
                "--lora.vision) adds its weights' optimizer state and its backward in the update, "
                "which the plan does not count yet; plan without the flag for the frozen figures"
            )
        vm, images = vision_lib.resolved(run, images)
        measure_fn = functools.partial(vision_lib.image_run, vm=vm, images=images)
    elif images is not None:
        raise ValueError("--images-per-prompt / --image-tokens need --image-field")
    t0 = time.perf_counter()
    try:
        measured = measure_fn(
            run, algo, model, target, devices, compile_fn=compile_fn, exact=exact, workers=workers
        )
    except RuntimeError as e:
        if "cuDNN" not in str(e):
            raise
        raise RuntimeError(
            f"{e}: the fused cuDNN attention (train attention 'auto' in 16 bits on GPU) needs "
            f"cuDNN to compile; plan with {entry.flag(run, 'train-attention')} group"
        ) from e
    if isinstance(run, OnlineRunConfig) and run.reward_model is not None:
        measured = add_reward_model(run, algo, measured, target, compile_fn)
    return Plan(
        algorithm,
        target,
        run,
        model,
        tuple(m.memory for m in measured),
        tuple(m.traffic for m in measured),
        time.perf_counter() - t0,
        exact,
        images,
    )


def plan(
    algorithm: str,
    argv: list[str],
    target: str | targets_lib.Target,
    *,
    compile_fn: Callable[[Any], tuple] = compile_program,
    exact: bool = False,
    workers: int = 1,
    images: ImagePlan | None = None,
) -> Plan:
    """Parse the run's flags ``argv`` and plan it on ``target`` (e.g. ``"v5p:2x2x2"``, ``"h100x8"``);
    ``images``: an ``--image-field`` run's images per prompt (``plan_run``'s)."""
    run = parse_run(algorithm, argv)
    target = target if isinstance(target, targets_lib.Target) else targets_lib.Target.parse(target)
    return plan_run(
        algorithm,
        run,
        language_config(run.model),
        target,
        compile_fn=compile_fn,
        exact=exact,
        workers=workers,
        images=images,
    )
