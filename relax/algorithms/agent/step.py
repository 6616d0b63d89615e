"""GRPO and PPO on multi-turn trajectories: ``compose(rollout, [reference], advantage, update)``,
the online step (``relax.algorithms.online.step``) with a rollout that scores its own samples.

- ``rollout`` (host): ``relax.environments.rollout`` steps P x G environments over the
  cache-carrying sampler. Its trajectories enter the batch as a ``Scored`` batch
  (``relax.algorithms.online.batch``): ``tokens`` (sampled and observation tokens in order), ``mask``
  (every filled slot: what the trainer's forward attends), ``sampled_mask`` (the policy's tokens:
  the loss, the KL and the advantages), ``old_logprobs`` (the sampler's, at sampled tokens),
  ``rewards`` (the environments' sum per trajectory; NaN where one raised), ``turn_rewards`` /
  ``turn_index`` (per-turn credit), ``lengths`` (sampled tokens), ``finished`` (not truncated);
  the host record gets the metrics ``agent``.
- ``reference``, ``advantage`` and ``update``: GRPO's or PPO's own stages, which train on the
  batch's ``policy_tokens`` (``sampled_mask``): observation tokens are read by every forward and
  scored by none.
- A trajectory whose reward is NaN (its environment raised) is out of ``loss_mask``: no policy,
  KL or entropy term and not counted in the loss's normalisers (GRPO: ``drop_errored``, after
  the advantage; PPO's advantage stage leaves out non-finite scores itself).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from relax.algorithms.agent.config import AgentConfig, rollout_config
from relax.algorithms.grpo import step as grpo
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.online.batch import Advantaged, Scored
from relax.algorithms.online.stages import ROLLOUT_STREAM, sample_versions
from relax.algorithms.online.step import StepParts, make_online_step
from relax.algorithms.ppo import step as ppo
from relax.algorithms.ppo.config import PPOConfig
from relax.compose import Stage, WithHost, stage
from relax.environments.chat import ChatFormat
from relax.environments.rollout import AgentRolloutConfig, Trajectories, rollout_trajectories
from relax.parallel.distributed import all_rows
from relax.parallel.local import process_rows


def per_trajectory(t: Trajectories | None) -> dict[str, np.ndarray]:
    """Every process's trajectories as flat per-trajectory vectors, in process order (each
    process calls this with its own; None: it has none): ``rewards``, ``turns``, ``sampled`` /
    ``filled`` tokens, ``truncated``, ``error`` (its environment raised), ``info/<name>`` (0 where
    a process's environments never reported ``name``) and ``time`` (``[processes, 2]``: seconds on
    environments and on the device)."""
    flat = lambda x: np.asarray(x, np.float64).reshape(-1)  # noqa: E731
    local = {}
    if t is not None:
        local = {
            "rewards": flat(t.rewards),
            "turns": flat(t.turns),
            "sampled": flat(t.sampled_mask.sum(-1)),
            "filled": flat(t.mask.sum(-1)),
            "truncated": flat(t.truncated),
            "error": flat([e is not None for e in t.env_errors]),
            **{f"info/{k}": flat(v) for k, v in t.info.items()},
        }
    count = len(local.get("rewards", ()))
    names = _union(["rewards", "turns", "sampled", "filled", "truncated", "error", *local])
    out = {k: all_rows(local.get(k, np.zeros(count))) for k in names}
    clock = (0.0, 0.0) if t is None else (t.timings["env_s"], t.timings["device_s"])
    out["time"] = all_rows(np.asarray([clock]))
    return out


def _union(names: list[str]) -> list[str]:
    """The sorted union of every process's ``names`` (each process calls this); sent as a text
    of a power of two bytes, at least 256, so that steps reporting other names rarely send a
    new shape (a new program of the collective)."""
    text = "".join(n + "\n" for n in names).encode()
    size = max(256, 1 << (len(text) - 1).bit_length())
    padded = np.frombuffer(text.ljust(size, b"\n"), np.uint8)
    return sorted({n for n in bytes(all_rows(padded)).decode().splitlines() if n})


def trajectory_metrics(t: Trajectories) -> dict[str, float]:
    """Host metrics of a batch (every process's trajectories: each process calls this): turns per
    trajectory, tool calls and their success rate, sampled vs observation (masked) tokens,
    truncations, environment errors, time on device vs environments (the slowest process's)."""
    v = per_trajectory(t)
    out = {
        "turns": float(v["turns"].mean()),
        "sampled_tokens": float(v["sampled"].mean()),
        "observation_tokens": float((v["filled"] - v["sampled"]).mean()),
        "truncated": float(v["truncated"].mean()),
        "env_errors": float(v["error"].sum()),
        "time/env_s": float(v["time"][:, 0].max()),
        "time/device_s": float(v["time"][:, 1].max()),
    }
    # each reward an environment reports in ``info`` (a verifiers environment's ``reward/<name>``)
    out |= {
        k[len("info/") :]: float(x.mean()) for k, x in v.items() if k.startswith("info/reward/")
    }
    calls, errors = v.get("info/tool_calls"), v.get("info/tool_errors", 0.0)
    if calls is not None:
        out["tool_calls"] = float(calls.mean())
        out["tool_call_success"] = (
            float(1.0 - np.sum(errors) / calls.sum()) if calls.sum() else float("nan")
        )
    return out


def trajectory_keys(state, local_rows: int, g: int) -> jax.Array:
    """The keys of this process's ``local_rows x g`` trajectories: its share of the step's whole
    batch's split of the state's rollout stream (the same keys on any number of processes)."""
    share, total = process_rows(local_rows * g)
    return jax.random.split(jax.random.fold_in(state.key, ROLLOUT_STREAM), total)[share]


def longest_prompt(n: int) -> int:
    """The longest prompt of a step's rows on every process, given this process's longest ``n``
    (each process calls this): every process pads its rows' prompts to one width."""
    return int(all_rows(np.asarray([n], np.int64)).max())


def scored(t: Trajectories, state) -> Scored:
    """Trajectories as the step's ``Scored`` batch (module docstring); ``state``: the policy
    version they were sampled with."""
    rewards = jnp.asarray(t.rewards, jnp.float32)
    return Scored(
        prompt_ids=jnp.asarray(t.prompt_ids),
        prompt_mask=jnp.asarray(t.prompt_mask),
        tokens=jnp.asarray(t.tokens),
        mask=jnp.asarray(t.mask),
        sampled_mask=jnp.asarray(t.sampled_mask),
        old_logprobs=jnp.asarray(t.logprobs),
        turn_rewards=jnp.asarray(t.turn_rewards),
        turn_index=jnp.asarray(t.turn_index),
        rewards=rewards,
        lengths=jnp.asarray(t.sampled_mask.sum(-1), jnp.int32),
        finished=jnp.asarray(~t.truncated),
        policy_version=sample_versions(state, rewards),
        reward_parts={"env": rewards},
        routes=None if t.routes is None else jax.tree.map(jnp.asarray, t.routes),
    )


def step_sampler(
    cfg: GRPOConfig | PPOConfig, agent: AgentConfig, chat: ChatFormat, parts: StepParts
) -> AgentRolloutConfig:
    """The training step's trajectory sampler (``rollout_config``): ``cfg``'s generation, turns
    ending at ``chat.stop_ids``, padded with ``parts.pad_id``."""
    return rollout_config(agent, cfg.generation, eos_ids=chat.stop_ids, pad_id=parts.pad_id)


def make_agent_rollout(rcfg: AgentRolloutConfig, make_env: Callable, chat: ChatFormat) -> Stage:
    """The host stage: the host record's ``rows`` (P dataset rows) -> P x G trajectories, a
    ``Scored`` batch (module docstring). Placed on each process: on several, each samples its
    own rows (its share of the step's, with their keys of the whole batch's split, prompts
    padded to one width on all) on its own copy of the policy (``relax.parallel.local``)."""

    def rollout(state, batch: WithHost) -> tuple[object, WithHost]:
        rows = batch.host.rows
        keys = trajectory_keys(state, len(rows), rcfg.turns.num_generations)
        t = rollout_trajectories(
            state.policy, rows, make_env, chat, key=keys, cfg=rcfg, longest=longest_prompt
        )
        host = batch.host.replace(reward_info={}, agent=trajectory_metrics(t))
        return state, WithHost(scored(t, state), host)

    return stage(rollout, jit=False, name="rollout", updates_state=False, placement="process")


def drop_errored(state, batch: Advantaged):
    """``loss_mask`` without the trajectories whose reward is NaN (an environment raised): GRPO's
    advantage gives them 0, and this takes their tokens out of the KL, the entropy and the
    normalisers too."""
    ok = jnp.isfinite(batch.rewards)[..., None]
    return state, batch.replace(loss_mask=batch.loss_mask * ok.astype(batch.loss_mask.dtype))


def make_agent_grpo_step(
    cfg: GRPOConfig, agent: AgentConfig, make_env: Callable, chat: ChatFormat, parts: StepParts
) -> Stage:
    """GRPO on trajectories of ``make_env()`` environments; a turn ends at ``chat.stop_ids``.
    ``parts``: ``pad_id`` and the schedule (``passes``, ``off_policy``, ``pipelined``: run by
    ``relax.train.pipeline``, the rollout with its environments is the producer); the
    environments score, so it holds no reward functions (``make_online_step``).

    Args:
        cfg: the GRPO-family config: completions per row, sampling, the whole trajectory's token
            budget (``max_new_tokens``), advantage, loss and update. No ``stop_strings``.
        agent: the multi-turn part (``AgentConfig``): turns, tokens per turn, per-turn
            advantages (``agent.per_turn``).
        make_env: ``make_env()`` returns a fresh ``Environment`` or ``AsyncEnvironment``; one is
            made per trajectory and reset with its dataset row.
        chat: the chat format that renders the prompts and observations; its ``stop_ids`` end a
            policy turn.
        parts: a ``StepParts`` with ``pad_id`` and the schedule; no reward functions, pool or
            partial rollouts.

    Returns:
        A ``Stage`` named ``"agent_grpo_step"``, ``step(state, batch) -> (state, out)``: ``batch``
            is a ``WithHost(None, HostRecord(rows=...))`` of P dataset rows, ``out`` a
            ``WithHost(Updated, HostRecord)`` whose host record holds the trajectories' metrics
            (``agent``). The ``Updated`` is ``make_grpo_step``'s.
    """
    rollout = make_agent_rollout(step_sampler(cfg, agent, chat, parts), make_env, chat)
    algorithm = dataclasses.replace(
        grpo.grpo_parts(cfg, per_turn=agent.per_turn),
        name="agent_grpo_step",
        packing=None,
        rollout=rollout,
        after_advantage=(stage(drop_errored, name="drop_errored"),),
    )
    return make_online_step(algorithm, parts)


def make_agent_ppo_step(
    cfg: PPOConfig, agent: AgentConfig, make_env: Callable, chat: ChatFormat, parts: StepParts
) -> Stage:
    """PPO (GAE with the critic) on trajectories; the score sits on each trajectory's last sampled
    token. ``parts`` as ``make_agent_grpo_step``'s.

    Args:
        cfg: the PPO config; its ``advantage`` must be ``"gae"``.
        agent: as ``make_agent_grpo_step``'s; ``agent.per_turn`` must be False.
        make_env: as ``make_agent_grpo_step``'s.
        chat: as ``make_agent_grpo_step``'s.
        parts: as ``make_agent_grpo_step``'s.

    Returns:
        A ``Stage`` named ``"agent_ppo_step"``, with ``make_agent_grpo_step``'s input and output
            types. Its ``state`` holds the critic (``relax.algorithms.ppo.run.make_state``); the
            ``Updated`` is ``make_ppo_step``'s.
    """
    if cfg.advantage != "gae":
        raise ValueError(
            f"multi-turn PPO uses GAE; --ppo.advantage {cfg.advantage} is not supported"
        )
    if agent.per_turn:
        raise ValueError("per-turn advantages are GRPO's; PPO's critic assigns credit per token")
    rollout = make_agent_rollout(step_sampler(cfg, agent, chat, parts), make_env, chat)
    algorithm = dataclasses.replace(
        ppo.ppo_parts(cfg), name="agent_ppo_step", packing=None, rollout=rollout
    )
    return make_online_step(algorithm, parts)


def success_metrics(t: Trajectories | None, *, success: float = 1.0) -> dict[str, float]:
    """Held-out metrics of every process's trajectories (each process calls this with its own;
    None: it has none): success rate (a trajectory's reward is ``success``), and split by whether
    the trajectory called a tool: the success rate with and without the tool, and how often it
    was called."""
    v = per_trajectory(t)
    won = v["rewards"] == success
    out = {
        "success": float(won.mean()),
        "reward": float(np.nanmean(v["rewards"])),
        "turns": float(v["turns"].mean()),
    }
    calls = v.get("info/tool_calls")
    if calls is not None:
        used = calls > 0
        out["tool_use"] = float(used.mean())
        out["success_with_tool"] = float(won[used].mean()) if used.any() else float("nan")
        out["success_without_tool"] = float(won[~used].mean()) if (~used).any() else float("nan")
    return out
