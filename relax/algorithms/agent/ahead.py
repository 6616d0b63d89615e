"""An agent run's programs compiled before its first step (``--compile-ahead``, the default;
docs/architecture.md, "Compiled before the first step").

The rollout is a host stage whose device calls follow what the environments answer, but the
programs it can call are few and known: for each width its prompts pad to, ``start``, the fused
weights, and at each device batch size the compactions go down (``compact_sizes``) one
``decode_turn``, one ``append`` (observations go in fixed chunks) and one ``compact``. The widths
are the buckets of the training rows' prompts: each row's environment is reset once at start-up
and its conversation rendered (``prompt_lengths``; on several processes each renders its share
and the widths are every process's). For each width:

- the rest of the step (reference, advantage, update) is lowered with placeholder trajectories
  standing in for the rollout (``placeholder_trajectories``) and compiled from a thread pool
  with the online runs' ``compile_ahead``, which says what each program allocates and stops the
  run when one cannot fit;
- the rollout's programs are called once on placeholder rows (``warm_rollout``) with the policy
  the rollout samples with (on several processes, this process's copy).

The held-out evaluation's rollout is warmed for its rows alike (``HeldOut.warm``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from relax.algorithms.agent.evaluate import HeldOut
from relax.algorithms.agent.step import (
    longest_prompt,
    scored,
    trajectory_keys,
    trajectory_metrics,
)
from relax.algorithms.cli.report import StartupReport
from relax.algorithms.online.ahead import (
    CompiledAhead,
    compile_ahead,
    publish,
    shrink_hint,
    view_lowering,
)
from relax.algorithms.online.batch import HostRecord
from relax.compose import Segment, WithHost
from relax.environments.chat import ChatFormat
from relax.environments.rollout import (
    AgentRolloutConfig,
    placeholder_trajectories,
    prompt_lengths,
    prompt_width,
    warm_rollout,
)
from relax.parallel.distributed import all_rows
from relax.train.ahead import default_workers, walk_step
from relax.train.pipeline import producer_part


def prompt_widths(
    rows: Sequence[dict],
    make_env: Callable,
    chat: ChatFormat,
    rcfg: AgentRolloutConfig,
    context: int,
) -> tuple[int, ...]:
    """The widths (buckets) the prompts of ``rows`` pad to, every process's (each renders its
    contiguous share of the rows, ``prompt_lengths``)."""
    parts = np.array_split(np.arange(len(rows)), jax.process_count())
    lengths = prompt_lengths([rows[i] for i in parts[jax.process_index()]], make_env, chat)
    mine = {prompt_width(n, rcfg.turns, context) for n in lengths} or {0}
    every = all_rows(np.asarray(sorted(mine), np.int64))
    return tuple(sorted({int(w) for w in every if w}))


def placeholder_rollout(rcfg: AgentRolloutConfig, width: int) -> Callable:
    """``run_host`` for ``relax.train.ahead``: the rollout segment gives placeholder trajectories
    of the walked batch's rows with prompts of ``width`` (no metrics), as ``scored`` makes them."""

    def run_host(seg: Segment, state, batch: WithHost):
        if seg.names != ("rollout",):
            raise ValueError(
                f"compile ahead: the agent's step has a host stage {seg.names} besides its "
                "rollout; run with --no-compile-ahead"
            )
        return placeholder_batch(state, batch, rcfg, width)

    return run_host


def placeholder_batch(state, batch: WithHost, rcfg: AgentRolloutConfig, width: int) -> WithHost:
    """What the rollout stage gives for ``batch``'s rows with prompts of ``width``, of zeros and
    with no metrics: ``placeholder_trajectories`` as ``scored`` makes them (a mixture of experts'
    routes included). ``state.policy`` may be abstract (a plan's)."""
    t = placeholder_trajectories(state.policy, len(batch.host.rows), width, rcfg)
    return WithHost(scored(t, state), batch.host.replace(reward_info={}, agent={}))


def step_lowerings(step, state, widths, *, batch_size: int, rcfg, pipelined: bool) -> list:
    """The step's programs after its rollout, for batches of ``batch_size`` rows of each width."""
    seen, out = {}, []
    batch = WithHost(None, HostRecord(rows=[{}] * batch_size))
    for width in widths:
        found = walk_step(
            step.segments,
            state,
            batch,
            run_host=placeholder_rollout(rcfg, width),
            views=producer_part if pipelined else None,
            seen=seen,
            host_state=state,
        )
        out += [(f"prompts {width}", lo) for lo in found]
    return out + ([view_lowering(state)] if pipelined else [])


def warm_rollouts(step, state, widths, *, local_rows: int, rcfg) -> list[tuple[str, float]]:
    """The rollout's programs for this process's ``local_rows`` rows at each width, called once
    with the policy and keys the rollout gets (``ShardedStep.process_view``), then the stage's
    own operations on placeholder trajectories (its batch, its metrics' collectives)."""
    view = step.process_view(state) if hasattr(step, "process_view") else state
    keys = trajectory_keys(view, local_rows, rcfg.turns.num_generations)
    longest_prompt(0)  # the step's collective for its prompts' width
    timed = []
    for width in widths:
        timed += warm_rollout(view.policy, local_rows, width, key=keys, cfg=rcfg)
        # what the stage makes of its trajectories: the batch, and every process's metrics
        placeholder = placeholder_trajectories(view.policy, local_rows, width, rcfg)
        jax.block_until_ready(scored(placeholder, view))
        trajectory_metrics(placeholder)
    return timed


def prepare_agent(
    cfg,
    setup,
    chat: ChatFormat,
    step,
    rcfg: AgentRolloutConfig,
    held_out: HeldOut,
    report: StartupReport,
    log: Callable[[str], Any],
) -> Callable[[Any, Path], None]:
    """The run's ``Trainer.prepare``: with ``cfg.compile_ahead`` every program compiled (module
    docstring), listed in the start-up report's "compiled ahead" section and checked
    (``publish``)."""
    hint = shrink_hint(cfg.algorithm, "agent", "fewer rows (--batch-size) or trajectories")

    def prepare(state, run_dir: Path) -> None:
        ahead = None
        if not cfg.compile_ahead:
            lines = (
                "off (--no-compile-ahead): each program compiles when the step first calls it",
            )
        else:
            t0 = time.perf_counter()
            context = state.policy.config.max_position_embeddings
            widths = prompt_widths(setup.train, setup.make_env, chat, rcfg, context)
            log(f"compile ahead: the training rows' prompts pad to {', '.join(map(str, widths))}")
            lowerings = step_lowerings(
                step,
                state,
                widths,
                batch_size=cfg.batch_size,
                rcfg=rcfg,
                pipelined=cfg.async_.staleness > 0,
            )
            warmed = warm_rollouts(
                step, state, widths, local_rows=cfg.batch_size // jax.process_count(), rcfg=rcfg
            )
            warmed += held_out.warm(state)
            ahead = compile_ahead(lowerings, workers=default_workers(), t_start=t0)
            lines = _lines(ahead, warmed)
        publish(lines, ahead, report, run_dir, log, hint)

    return prepare


def _lines(ahead: CompiledAhead, warmed: list[tuple[str, float]]) -> tuple[str, ...]:
    """The report's section: the step's programs (``CompiledAhead.lines``), then the rollouts'."""
    total = sum(s for _, s in warmed)
    return (
        *ahead.lines(),
        f"{len(warmed)} rollout programs called once on placeholder rows in {total:.1f} s:",
        *(f"rollout {name}: {s:.2f} s" for name, s in warmed),
    )
