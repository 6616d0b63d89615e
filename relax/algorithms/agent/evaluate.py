"""An agent run's held-out evaluation: greedy trajectories of every held-out row, their success
rate, how often a tool is called, and the success rate with and without it
(``relax.algorithms.agent.step.success_metrics``)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import numpy as np

from relax.algorithms.agent.config import rollout_config
from relax.algorithms.agent.setup import AgentSetup
from relax.algorithms.agent.step import success_metrics
from relax.environments.chat import ChatFormat
from relax.environments.rollout import (
    placeholder_trajectories,
    prompt_lengths,
    prompt_width,
    rollout_trajectories,
    warm_rollout,
)
from relax.parallel.distributed import multi_process
from relax.parallel.local import ProcessCopy
from relax.train.logs import MetricsLogger

EVAL_STREAM = 1_000_003


class HeldOut:
    """``evaluate(state, step, logger)``: greedy trajectories of every held-out row (nothing
    when none is held out). On several processes each evaluates its contiguous part of the rows
    on its own copy of the policy (``relax.parallel.local``) and the metrics are of every
    process's trajectories. ``warm(state)`` calls its rollout's programs once ahead
    (``relax.environments.rollout.warm_rollout``)."""

    def __init__(self, cfg, setup: AgentSetup, chat: ChatFormat, mesh, log: Callable):
        greedy = dataclasses.replace(
            cfg.algorithm_config.generation, num_generations=1, temperature=0.0
        )
        self.rcfg = rollout_config(
            cfg.agent, greedy, eos_ids=chat.stop_ids, pad_id=setup.tokenizer.pad_token_id
        )
        self.setup, self.chat, self.log = setup, chat, log
        self.copy = ProcessCopy(mesh) if multi_process() else None
        parts = np.array_split(np.arange(len(setup.held_out)), jax.process_count())
        self.mine = parts[jax.process_index()]
        self.keys = jax.random.split(
            jax.random.fold_in(jax.random.key(cfg.seed), EVAL_STREAM), len(setup.held_out)
        )

    def _policy(self, state):
        return state.policy if self.copy is None else self.copy(state.policy)

    def _rows(self) -> list[dict]:
        return [self.setup.held_out[i] for i in self.mine]

    def _keys(self) -> jax.Array:
        return self.keys[self.mine[0] : self.mine[-1] + 1]

    def warm(self, state) -> list[tuple[str, float]]:
        """Each program this process's evaluation calls, called once now (its rows' prompts
        rendered once to know their width), and its metrics' collectives on placeholder
        trajectories; every process calls this, as the evaluation."""
        if not self.setup.held_out:
            return []
        policy, timed, t = self._policy(state), [], None
        if self.mine.size:
            lengths = prompt_lengths(self._rows(), self.setup.make_env, self.chat)
            context = policy.config.max_position_embeddings
            width = prompt_width(max(lengths), self.rcfg.turns, context)
            timed = warm_rollout(policy, self.mine.size, width, key=self._keys(), cfg=self.rcfg)
            t = placeholder_trajectories(policy, self.mine.size, width, self.rcfg)
        success_metrics(t)
        return [(f"held-out {name}", s) for name, s in timed]

    def __call__(self, state, step: int, logger: MetricsLogger) -> dict:
        if not self.setup.held_out:
            return {}
        t0 = time.perf_counter()
        policy, t = self._policy(state), None
        if self.mine.size:
            t = rollout_trajectories(
                policy,
                self._rows(),
                self.setup.make_env,
                self.chat,
                key=self._keys(),
                cfg=self.rcfg,
            )
        metrics = success_metrics(t)
        logger.log(
            step, {f"eval/{k}": v for k, v in metrics.items() if np.isfinite(v)}
        )  # NaN: no such trajectory
        self.log(
            f"eval @ step {step} ({time.perf_counter() - t0:.1f}s): "
            + ", ".join(f"{k} {v:.3f}" for k, v in metrics.items())
        )
        return metrics
