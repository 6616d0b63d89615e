"""The multi-turn agent trainer in a plan (``relax plan agent``): its update, GRPO's or PPO's on
trajectories, and its multi-turn decoder, on the run's mesh.

The agent's step (``relax.algorithms.agent.step``) is ``compose(rollout, [reference], advantage,
drop_errored, update)`` whose rollout is a host stage: environments stepped between turns of the
cache-carrying decoder (``relax.rollout.turns``) on the policy as the mesh holds it. A plan
cannot run environments, so:

- the update's programs are the agent's own step with its rollout replaced by a stand-in that
  gives them what the rollout gives (``trajectories``: P x G trajectories of zeros,
  ``--<algorithm>.max-new-tokens`` slots after prompts of ``--max-prompt-tokens``, a mixture of
  experts' routes for the update to replay; the batch ``relax agent``'s compile-ahead makes), laid
  out by ``relax.parallel.ShardedStep`` as ``relax agent`` lays it out;
- the decoder's programs (start, the fused decode weights, a turn, an observation's append) are
  compiled apart (``multi_turn_programs``) on the train state's policy, for P prompts of
  ``--max-prompt-tokens`` and an observation's chunk (``--agent.observation-chunk``), the rest of the
  train state resident beside them. On a target of several hosts each host samples its share of
  the prompts on its own copy of the policy over its own devices (``relax.parallel.local``): the
  decoder is planned so, on the first host, the copy counted beside the trainer's policy.

``--max-prompt-tokens`` is the plan's own flag (the run pads each batch's prompts to their
bucket); every other flag is ``relax agent``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from relax.algorithms.agent.ahead import placeholder_batch
from relax.algorithms.agent.config import rollout_config
from relax.algorithms.agent.run import AgentRunConfig, builtin_defaults
from relax.algorithms.agent.step import make_agent_grpo_step, make_agent_ppo_step, step_sampler
from relax.algorithms.grpo.run import make_state as grpo_state
from relax.algorithms.online.batch import HostRecord
from relax.algorithms.online.config import OnlineAlgorithm
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.run import make_state as ppo_state
from relax.compose import Stage, WithHost, compose, stage
from relax.environments.rollout import AgentRolloutConfig
from relax.models.config.model import ModelConfig
from relax.parallel.local import host_mesh, processes
from relax.parallel.mesh import param_shardings
from relax.plan.measure import Measured, measure, resident_state
from relax.plan.programs import Concurrently, Program, multi_turn_programs, sharded_programs
from relax.plan.targets import Target


@dataclasses.dataclass(frozen=True)
class AgentPlanConfig(AgentRunConfig):
    """``relax agent``'s flags, and the longest prompt the plan lays the decoder and the update
    out for (the run pads each batch's prompts to their bucket)."""

    max_prompt_tokens: int = 512


def defaults() -> AgentPlanConfig:
    """``relax agent``'s defaults (its built-in run's, with or without ``--model``) as a plan's."""
    run = builtin_defaults()
    return AgentPlanConfig(**{f.name: getattr(run, f.name) for f in dataclasses.fields(run)})


@dataclasses.dataclass(frozen=True)
class StopIds:
    """What the agent's step reads of its chat format outside the rollout a plan replaces: the
    ids that end a policy turn (the model's end-of-sequence ids)."""

    stop_ids: tuple[int, ...]


def trajectories(cfg: AgentPlanConfig, rcfg: AgentRolloutConfig) -> Stage:
    """The rollout's stand-in (module docstring): the host stage that turns P dataset rows into
    P x G trajectories of zeros with prompts of ``--max-prompt-tokens``, the batch compile-ahead
    gives the run's step (``placeholder_batch``: the rollout's shapes, a mixture of experts'
    routes included). The plan's state is abstract: the policy version is a stand-in 0."""

    def rollout(state, batch: WithHost) -> tuple[Any, WithHost]:
        version = state.replace(step=np.zeros((), state.step.dtype))
        return state, placeholder_batch(version, batch, rcfg, cfg.max_prompt_tokens)

    return stage(rollout, jit=False, name="rollout", updates_state=False)


def agent_step(cfg: AgentPlanConfig, parts: StepParts) -> Stage:
    """The agent's step (``make_agent_grpo_step`` / ``make_agent_ppo_step``) with the schedule of
    ``parts``, a turn ending at its ``eos_ids``, and its rollout replaced by ``trajectories``."""
    make = make_agent_grpo_step if cfg.algorithm == "grpo" else make_agent_ppo_step
    chat = StopIds(parts.eos_ids)
    step = make(cfg.algorithm_config, cfg.agent, None, chat, parts)
    rollout, *rest = step.leaves
    if rollout.name != "rollout":
        raise ValueError(f"the agent's step starts with {rollout.name!r}, not its rollout")
    rcfg = step_sampler(cfg.algorithm_config, cfg.agent, chat, parts)
    return compose(trajectories(cfg, rcfg), *rest, name=step.name)


def algorithm(cfg: AgentPlanConfig) -> OnlineAlgorithm:
    """The agent trainer as an online algorithm: GRPO's state (or PPO's, with its critic), what
    it samples, and ``agent_step``."""
    algo = cfg.algorithm_config
    make_state = grpo_state if cfg.algorithm == "grpo" else ppo_state
    return OnlineAlgorithm(
        name=f"agent-{cfg.algorithm}",
        make_state=functools.partial(make_state, algo),
        make_step=functools.partial(agent_step, cfg),
        generation=algo.generation,
    )


def update_programs(
    run: AgentPlanConfig, algo: OnlineAlgorithm, model: ModelConfig, devices, compile_fn
) -> list[Program]:
    """The programs of the agent's step after its rollout, on the run's mesh over ``devices``,
    scheduled as ``relax agent`` schedules it (``--async.*``)."""
    parts = lambda passes: StepParts(
        eos_ids=tuple(model.eos_ids) or (0,),
        pad_id=0,
        passes=passes,
        off_policy=run.async_.off_policy,
        pipelined=run.async_.staleness > 0,
    )
    return sharded_programs(
        run,
        algo,
        model,
        devices,
        make_step=lambda passes: algo.make_step(parts(passes)),
        batch=WithHost(None, HostRecord(rows=[{}] * run.batch_size)),
        compile_fn=compile_fn,
    )


def measured(
    run: AgentPlanConfig,
    algo: OnlineAlgorithm,
    model: ModelConfig,
    target: Target,
    devices: Sequence[jax.Device],
    *,
    compile_fn: Callable[[Any], tuple],
    exact: bool,
    workers: int = 1,
) -> list[Measured]:
    """The decoder's programs and then the update's, measured (``exact`` is moot: no sampler is
    extended from shallow compiles); the update's programs ``workers`` at a time."""
    with Concurrently(compile_fn, workers) as pending:
        programs = update_programs(run, algo, model, devices, pending)
        update = [measure(pending.resolved(p), target) for p in programs]
    resident = resident_state(run, update)
    eos = tuple(model.eos_ids) or (0,)
    turns = rollout_config(run.agent, algo.generation, eos_ids=eos, pad_id=0).turns
    policy, hosts = sampling_policy(resident.policy)
    decoder = multi_turn_programs(
        policy,
        turns,
        run.batch_size // hosts,
        run.max_prompt_tokens,
        turns.observation_chunk,
        compile_fn=compile_fn,
    )
    return [_decoder(p, resident, target, copied=hosts > 1) for p in decoder] + update


def sampling_policy(policy: Any) -> tuple[Any, int]:
    """Where ``relax agent`` samples: ``(the policy, 1)`` as its mesh holds it on one host; on
    ``n`` hosts ``(each host's own copy of it, n)``, laid out over the first host's devices
    (``relax.parallel.local``), which samples its ``1 / n`` of the rows."""
    mesh = jax.tree.leaves(policy)[0].sharding.mesh
    hosts = processes(mesh)
    if hosts == 1:
        return policy, 1
    local = host_mesh(mesh, min(d.process_index for d in mesh.devices.flat))
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        policy,
        param_shardings(policy, local),
    ), hosts


def _decoder(p: Program, resident: Any, target: Target, *, copied: bool) -> Measured:
    """A decoder program beside the train state: ``resident`` with its policy replaced by the
    weights the program reads (the policy itself, and the fused decode weights); ``copied``
    (several hosts): beside the trainer's policy, which stays where it is."""
    weights, arrays = p.args
    policy = (resident.policy, weights) if copied else weights
    return measure(p, target, args=(resident.replace(policy=policy), arrays))
