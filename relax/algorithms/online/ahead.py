"""An online run's programs compiled before its first step (``--compile-ahead``, the default;
docs/architecture.md, "Compiled before the first step").

The step's programs (``relax.train.ahead``) are lowered for each length a batch of prompts can be
padded to (``relax.data.prompts.batch_lengths``: one with ``--pad-to data``, one per bucket met
in the data with ``--pad-to batch``), its host stages standing in with the run's shapes and none
of its work (``stand_in``); the held-out evaluation's samplers are lowered for the held-out
batch. All of them are then compiled from a thread pool, and the start-up report lists each
with its compile seconds and what it allocates per device when called (``CompiledAhead.lines``;
``relax.train.fits``). A program that needs more than its devices have free stops the run
there, before its first step, with the flags that make it smaller (``CompiledAhead.check_fit``).

A step whose rollout is partial rollouts' (``--async.partial`` > 1, a host stage that calls the
sampler itself) has its programs compiled when the step first calls them; the report says so.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.cli.report import StartupReport
from relax.algorithms.online.batch import HostRecord, Prompts
from relax.algorithms.online.step import StepParts
from relax.compose import Segment, SegmentRunner, Stage, WithHost
from relax.parallel.distributed import barrier
from relax.rewards.functions import RewardFunction, as_reward_functions
from relax.rewards.token_rewards import TokenRewardFunction
from relax.train.ahead import (
    Compiled,
    HostRun,
    Lowering,
    call_aval,
    call_avals,
    compile_programs,
    output_avals,
    walk_step,
)
from relax.train.fits import ProgramNeed, check_fit, program_need, size_text
from relax.train.logs import is_main_process
from relax.train.pipeline import copy_view, producer_part

ImageShapes = Callable[[int, int], Any]
"""``images(rows, length)``: the ``PromptInputs`` shapes of a step's image prompts
(``relax.algorithms.online.setup.RunData.encoded_shape``)."""


def zero_reward(prompts, completions, **_) -> list[float]:
    """A reward function that scores every completion 0 (the shapes of a run's rewards)."""
    return [0.0] * len(completions)


def empty_texts(tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    """A decoder that returns an empty text for every completion ``[rows, n]``."""
    return [""] * int(np.prod(np.shape(tokens)[:-1]))


def stand_in(parts: StepParts) -> StepParts:
    """``parts`` whose host stages give the run's shapes without its work: each text reward
    function returns 0 under its own name (the batch keeps each function's rewards by name), the
    token reward functions (device programs) are kept, the decoder returns empty texts, no reward
    pool and no partial rollouts; scheduled as ``parts`` (passes, off-policy correction,
    pipelined)."""
    tokens = [f for f in parts.reward_fns if isinstance(f, TokenRewardFunction)]
    texts = [f for f in parts.reward_fns if not isinstance(f, TokenRewardFunction)]
    named = as_reward_functions(texts) if texts else ()
    zeros = [RewardFunction(zero_reward, name=f.name) for f in named]
    return dataclasses.replace(
        parts,
        reward_fns=[*zeros, *tokens],
        decode=empty_texts,
        on_error="raise",
        timeout_s=None,
        pool=None,
        partial=None,
    )


def prompt_batch(
    rows: int, length: int, answer_field: str, images: ImageShapes | None = None
) -> WithHost:
    """A step's input of ``rows`` prompts left-padded to ``length``, as the run's data iterator
    gives it (int32, placed by the step), with empty texts and answers beside it; image prompts'
    inputs as ``images(rows, length)`` gives their shapes (``RunData.encoded_shape``)."""
    ids = jax.ShapeDtypeStruct((rows, length), jnp.int32)
    inputs = None if images is None else images(rows, length)
    return WithHost(
        Prompts(ids, ids, images=inputs),
        HostRecord(prompts=[""] * rows, fields={answer_field: [""] * rows}),
    )


def host_runner(stand_in_step: Stage) -> HostRun:
    """``run_host`` for ``relax.train.ahead``: each host segment of the run's step runs as the
    stage of the same name of ``stand_in_step`` (the step made with ``stand_in`` parts)."""
    stages = {leaf.name: leaf.fn for leaf in stand_in_step.leaves if not leaf.jittable}

    def run_host(seg: Segment, state, batch):
        if seg.names[0] not in stages:
            raise ValueError(
                f"compile ahead: the step's host stage {seg.names[0]!r} is not in the stand-in "
                f"step (its host stages: {sorted(stages)}); run with --no-compile-ahead"
            )
        return stages[seg.names[0]](state, batch)[1]

    return run_host


@dataclasses.dataclass(frozen=True)
class CompiledAhead:
    """What the start-up compile did: each program as ``(what, name, seconds, need)`` (``need``:
    what it allocates when called, ``relax.train.fits``; None: unknown), its wall time, its
    compile threads, and what was left to compile when first called (``not_ahead``)."""

    programs: tuple[tuple[str, str, float, ProgramNeed | None], ...]
    wall_s: float
    workers: int
    not_ahead: tuple[str, ...] = ()

    def lines(self) -> tuple[str, ...]:
        """The start-up report's section: the total, then one line per program."""
        total = sum(s for _, _, s, _ in self.programs)
        head = (
            f"{len(self.programs)} programs lowered and compiled in {self.wall_s:.1f} s ({self.workers} "
            f"compile thread(s); their compile times add up to {total:.1f} s)"
        )
        return (
            head,
            *(f"{name} [{what}]: {s:.2f} s" + _need_text(n) for what, name, s, n in self.programs),
            *self.not_ahead,
        )

    def check_fit(self, hint: str) -> None:
        """Stop the run (``relax.train.fits.DoesNotFit``) when a program needs more memory than
        its devices have free, with ``hint`` (``shrink_hint``: the flags that make it smaller)."""
        check_fit([n for *_, n in self.programs if n is not None], hint)


def _need_text(need: ProgramNeed | None) -> str:
    return "" if need is None else f", allocates {size_text(need.bytes)} per device"


def shrink_hint(
    flags: str, plan: str | None = None, rows: str = "fewer prompts (--batch-size) or completions"
) -> str:
    """The flags that make a run's programs smaller, for the ``DoesNotFit`` message: those of the
    trainer's config group ``flags`` (``--flags.remat``), ``rows`` (how its batch gets smaller),
    and ``relax plan <plan>`` (default: ``flags``) that tries them."""
    return (
        f"Smaller: --{flags}.remat (if turned off), --{flags}.grad-accum N (N micro-batches "
        f"per minibatch, the same loss and gradient), {rows}, "
        f"more chips in --parallel.mesh fsdp=N, or LoRA (--lora.rank 16). `relax plan "
        f"{plan or flags} --target <chips> <these flags>` tries them in turn and says which fit."
    )


def publish(
    lines: Sequence[str],
    ahead: CompiledAhead | None,
    report: StartupReport,
    run_dir: Path,
    log: Callable[[str], Any],
    hint: str,
) -> None:
    """The start-up report's last section, "compiled ahead" (``lines``), printed and written (by
    the main process), then, after every process has compiled, the run stopped if one of
    ``ahead``'s programs cannot fit its devices' free memory (``CompiledAhead.check_fit``)."""
    log(StartupReport((("compiled ahead", lines),), {}).text())
    if is_main_process():
        report.with_section("compiled ahead", lines).write(run_dir)
    if ahead is not None:  # the report is written first: it says what each program needs
        barrier("compiled ahead")  # processes whose compiles took longer are waited for
        ahead.check_fit(hint)


def step_lowerings(
    step: SegmentRunner,
    stand_in_step: Stage,
    state: Any,
    lengths: Sequence[int],
    *,
    batch_size: int,
    answer_field: str,
    pipelined: bool,
    images: ImageShapes | None = None,
) -> list[tuple[str, Lowering]]:
    """The step's programs for batches of ``batch_size`` prompts padded to each of ``lengths``
    (``relax.train.ahead.walk_step``; a pipelined producer reads ``producer_part`` of the state),
    each labelled with the first length that needed it; ``images``: the prompts are image
    prompts, their inputs of these shapes (``prompt_batch``)."""
    run_host, seen, out = host_runner(stand_in_step), {}, []
    for length in lengths:
        batch = prompt_batch(batch_size, length, answer_field, images)
        found = walk_step(
            step.segments,
            state,
            batch,
            run_host=run_host,
            views=producer_part if pipelined else None,
            seen=seen,
            host_state=state,
        )
        out += [(f"prompts {length}", lo) for lo in found]
    return out + ([view_lowering(state)] if pipelined else [])


def view_lowering(state: Any) -> tuple[str, Lowering]:
    """A pipelined run's copy of the weights it samples with (``relax.train.pipeline.copy_view``)."""
    args = (call_avals((state.policy, state.step, state.key)),)
    return "every version pushed to the sampler", Lowering(
        "sampler_view", -1, args, copy_view.lower(*args), None
    )


def eval_lowerings(
    policy: Any, calls: Mapping[str, tuple], key: jax.Array
) -> list[tuple[str, Lowering]]:
    """The held-out evaluation's samplers (``relax.eval.evaluate.sampler_calls``) lowered for the
    ``policy`` and ``key`` it is called with."""
    out = []
    for name, (jitted, ids, mask) in calls.items():
        args = (call_avals(policy), call_aval(ids), call_aval(mask), call_aval(key))
        lowered = jitted.lower(*args)
        what = f"held-out, {ids.shape[0]} prompts of {ids.shape[1]}"
        lowering = Lowering(f"eval {name}", -1, args, lowered, output_avals(lowered.out_info, args))
        out.append((what, lowering))
    return out


def compile_ahead(
    lowerings: Sequence[tuple[str, Lowering]],
    *,
    workers: int,
    not_ahead: Sequence[str] = (),
    t_start: float | None = None,
) -> CompiledAhead:
    """Compile ``lowerings`` (``relax.train.ahead.compile_programs``, ``workers`` threads); the wall
    time counted from ``t_start`` (the lowering's start; default now)."""
    t0 = time.perf_counter() if t_start is None else t_start
    compiled: list[Compiled] = compile_programs([lo for _, lo in lowerings], workers=workers)
    what = {id(lo): label for label, lo in lowerings}
    programs = []
    for c in compiled:
        label = what[id(c.lowering)]
        need = program_need(f"{c.name} [{label}]", c.compiled)
        programs.append((label, c.name, c.seconds, need))
    return CompiledAhead(tuple(programs), time.perf_counter() - t0, workers, tuple(not_ahead))
