"""The agent run: ``run(cfg)`` is what ``examples/train_agent.py`` calls. It trains GRPO (or PPO
with a critic) on multi-turn trajectories: of the built-in tool task (``relax.tasks.agent``:
multiply two numbers, with a calculator tool), or of a user's environment (``--env
module:factory``) on a user's rows (``--data``) and model (``--model``), on one device or a mesh
(``--parallel.mesh``); it evaluates held-out rows greedily before, during and after: the success
rate, how often a tool is called, and the success rate with and without it. Checkpoints, logs,
resume and the HF export are ``relax.train.run``'s."""

from __future__ import annotations

import dataclasses
import time
from typing import Annotated, Literal

import jax
import numpy as np
import tyro

from relax.algorithms.agent.ahead import prepare_agent
from relax.algorithms.agent.config import AgentConfig
from relax.algorithms.agent.evaluate import HeldOut
from relax.algorithms.agent.setup import AgentSetup, load_setup, reasoning_gym_spec
from relax.algorithms.agent.step import make_agent_grpo_step, make_agent_ppo_step, step_sampler
from relax.algorithms.cli.configure import configure
from relax.algorithms.cli.report import first_row_lines, run_report
from relax.algorithms.grpo.config import GRPOConfig
from relax.algorithms.grpo.run import make_state as grpo_state
from relax.algorithms.online.batch import HostRecord
from relax.algorithms.online.config import ModelRunConfig
from relax.algorithms.online.run import run_meshes, start_run
from relax.algorithms.online.setup import base_path, exporter
from relax.algorithms.online.step import StepParts
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.run import make_state as ppo_state
from relax.compose import WithHost
from relax.environments.chat import ChatFormat
from relax.environments.reasoning_gym_env import is_reasoning_gym
from relax.environments.verifiers_source import is_verifiers
from relax.parallel import ShardedStep, batch_shards
from relax.parallel.local import process_rows
from relax.passes import choose_passes
from relax.tasks import agent as agent_task
from relax.tasks import reasoning_gym as reasoning_gym_task
from relax.train.pipeline import AsyncConfig
from relax.train.run import Trainer, run_loop

BAR_KEYS = (("reward", "reward"), ("tool_calls", "calls"), ("turns", "turns"))
BUILTIN_MAX_NEW_TOKENS = (
    64  # a trajectory's slots after the prompt: 3 turns of <= 16 tokens and their observations
)


@dataclasses.dataclass(frozen=True)
class AgentRunConfig(ModelRunConfig):
    """A multi-turn tool-use run: the model, rows and meshes of every run (``--model``,
    ``--data``, ``--lora.*``, ``--parallel.*``; without ``--model`` the built-in task's, ``--task.*``),
    the environment (``--env module:factory``; without it the built-in calculator), ``--algorithm
    grpo|ppo`` with its ``--grpo.*`` / ``--ppo.*`` values (``max_new_tokens``: a trajectory's slots
    after the prompt, observations included) and ``--agent.*`` (turns, per-turn budget, per-turn
    advantages)."""

    task: agent_task.AgentTask = agent_task.AgentTask()
    env: str | None = None
    """Your environment: ``module:factory``, a callable of no arguments returning a fresh
    environment (``relax.environments``: ``reset(row)`` / ``step(action)``), made once per
    trajectory and reset with one ``--data`` row; the module is imported from the working
    directory or the installed packages. Its ``schemas()``, if it has one, are the tools the chat
    template shows the model. A trajectory succeeds when its reward is 1. Or
    ``verifiers:<id>[?key=value&...]``, a ``verifiers`` environment (its tasks are the rows when
    there is no ``--data``; ``relax.environments.verifiers_env``). Or
    ``reasoning_gym:<name>[,<name>...][?attempts=K&answer=tagged|plain]``: reasoning-gym's rows
    (``--reasoning-gym.*``), each answer scored by its task, up to K answers an episode
    (``relax.environments.reasoning_gym_env``)."""
    reasoning_gym: reasoning_gym_task.ReasoningGymTask = reasoning_gym_task.ReasoningGymTask()
    """The rows of ``--env reasoning_gym:<names>``: their number, seeds, generator options, level
    and system prompt (the built-in base model's fields are GRPO's and PPO's)."""
    algorithm: Literal["grpo", "ppo"] = "grpo"
    grpo: GRPOConfig = GRPOConfig()
    ppo: PPOConfig = PPOConfig()
    agent: AgentConfig = AgentConfig()
    batch_size: int = 8
    """Rows per step (each gets G trajectories)."""
    eval_max_rows: int | None = 200
    """Held-out rows evaluated (greedy trajectories) at each evaluation; None: all."""
    async_: Annotated[AsyncConfig, tyro.conf.arg(name="async")] = AsyncConfig()
    """Asynchronous RL (``relax.train.pipeline``): ``--async.staleness 1`` runs the next batch's
    trajectories (decoding and environments) while the update runs, with an off-policy
    correction (``--async.correction.kind``); the schedule, not timing, decides every version."""
    compile_ahead: bool = True
    """Compile every program of the step and of its rollout (for each width the training rows'
    prompts pad to, found by resetting each row's environment once) and of the held-out
    evaluation before the first step, listed in the start-up report with their seconds; off:
    each compiles when first called."""
    run_dir: str = "runs/agent"

    @property
    def algorithm_config(self) -> GRPOConfig | PPOConfig:
        return self.grpo if self.algorithm == "grpo" else self.ppo

    @property
    def makes_data(self) -> bool:
        """A verifiers environment's own tasks, or reasoning-gym's rows, are the rows when there
        is no --data."""
        return is_verifiers(self.env) or is_reasoning_gym(self.env)

    def __post_init__(self):
        super().__post_init__()
        if self.lora.vision:
            raise ValueError(
                "--lora.vision adapts a vision tower: the agent trainer takes text models"
            )
        if self.env is None and self.task.max_turns != self.agent.max_turns:
            raise ValueError(
                f"--task.max-turns {self.task.max_turns} and --agent.max-turns {self.agent.max_turns} "
                "must agree: the environment ends a trajectory after the first, the rollout after the second"
            )
        if is_reasoning_gym(self.env):  # names, options and seeds checked now, not at setup
            spec, _ = reasoning_gym_spec(self.env, self.reasoning_gym)
            if self.reasoning_gym.max_level is not None:
                raise ValueError(
                    "--reasoning-gym.max-level: the rising curriculum runs with GRPO and PPO; "
                    "the agent trainer takes one --reasoning-gym.level"
                )
            if spec.attempts > self.agent.max_turns:
                raise ValueError(
                    f"--env {self.env}: {spec.attempts} attempts need --agent.max-turns >= "
                    f"{spec.attempts} (it is {self.agent.max_turns})"
                )
        if self.env is not None and self.data is None and not self.makes_data:
            raise ValueError("--env needs --data: the rows its environments are reset with")
        if self.async_.partial > 1:
            raise ValueError(
                "--async.partial: partial rollouts are single-turn (GRPO, PPO); a trajectory's turns "
                "are sampled in one rollout"
            )
        if self.parallel.sampler_devices:
            raise ValueError(
                "--parallel.sampler-devices: an agent's trajectories are sampled on the trainer "
                "mesh, between its environments' steps on the host; use --parallel.mesh"
            )
        if self.model is None:
            check_budget(self)


def check_budget(cfg: AgentRunConfig) -> None:
    """Raise ``ValueError`` naming the flag when the algorithm's ``max_new_tokens`` (a trajectory's
    slots after the prompt) leaves no room for a prompt in the built-in model's positions."""
    positions, n = (
        agent_task.max_positions(cfg.task),
        cfg.algorithm_config.generation.max_new_tokens,
    )
    if n >= positions:
        raise ValueError(
            f"--{cfg.algorithm}.max-new-tokens {n} leaves no room for the prompt: the built-in agent "
            f"model has {positions} positions (max(256, 64 x --task.max-turns)) for the prompt and the "
            f"trajectory together (the built-in run's default: {BUILTIN_MAX_NEW_TOKENS})"
        )


class RowIterator:
    """Training rows ``batch_size`` at a time, reshuffled every epoch (seeded); its position is
    checkpointed (``get_state`` / ``set_state``), so a resumed run sees the rows it would have.
    On several processes each gets its contiguous share of a step's rows (``process_rows``)."""

    def __init__(self, rows: list[dict], batch_size: int, seed: int):
        if batch_size > len(rows):
            raise ValueError(
                f"--batch-size {batch_size} is more than the {len(rows)} training rows"
            )
        if batch_size % jax.process_count():
            raise ValueError(
                f"--batch-size {batch_size} does not split over {jax.process_count()} processes"
            )
        self.rows, self.batch_size, self.seed, self.position = rows, batch_size, seed, 0

    def __next__(self) -> list[dict]:
        per_epoch = len(self.rows) // self.batch_size
        epoch, i = divmod(self.position, per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        self.position += 1
        step = order[i * self.batch_size : (i + 1) * self.batch_size]
        mine, _ = process_rows(self.batch_size // jax.process_count())
        return [self.rows[j] for j in step[mine]]

    def get_state(self) -> dict:
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])


def builtin_defaults() -> AgentRunConfig:
    """The no-argument run, sized to show learning in a few minutes on 2 CPU cores; ``--algorithm
    ppo`` gets the same trajectory budget and learning rate (and the PPO demo's critic rate)."""
    grpo = configure(
        GRPOConfig,
        num_generations=8,
        max_new_tokens=BUILTIN_MAX_NEW_TOKENS,
        beta=0.0,
        optimizer=dataclasses.replace(GRPOConfig().optimizer, learning_rate=5e-4),
    )
    ppo = configure(
        PPOConfig,
        max_new_tokens=grpo.generation.max_new_tokens,
        optimizer=grpo.optimizer,
        critic_optimizer=dataclasses.replace(PPOConfig().critic_optimizer, learning_rate=3e-3),
    )
    task = agent_task.AgentTask()
    return AgentRunConfig(
        task=task,
        grpo=grpo,
        ppo=ppo,
        agent=AgentConfig(max_turns=task.max_turns, max_turn_tokens=16),
        steps=30,
        eval_every=10,
        checkpoint_every=10,
    )


def _report(cfg: AgentRunConfig, setup: AgentSetup, mesh):
    """The start-up report: rows, trajectories per step, the tools and the first row."""
    algo = cfg.algorithm_config
    return run_report(
        cfg,
        setup.model,
        [
            f"{len(setup.train)} training rows, {len(setup.held_out)} held out ({setup.source})",
            f"{cfg.batch_size} rows x {algo.generation.num_generations} trajectories per "
            f"step, at most {cfg.agent.max_turns} turns and "
            f"{algo.generation.max_new_tokens} tokens after the prompt",
        ],
        mesh=mesh,
        extra=[
            (
                "tools",
                tuple(
                    f"{t['function']['name']}: {t['function'].get('description', '')}"
                    for t in setup.tools or ()
                )
                or ("none",),
            ),
            ("first training row", first_row_lines(setup.train[0] if setup.train else None)),
        ],
    )


def run(cfg: AgentRunConfig) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    cfg.parallel.initialize()  # multi-host flags: before anything touches a device
    run_dir, log = start_run(cfg, f"agent-{cfg.algorithm}")
    t_start = time.perf_counter()
    mesh, _ = run_meshes(cfg, log)
    setup = load_setup(
        cfg,
        cfg.task,
        cfg.env,
        run_dir,
        reasoning_gym=cfg.reasoning_gym,
        eval_max_rows=cfg.eval_max_rows,
        on_host=mesh is not None,
        log=log,
    )
    chat = ChatFormat(setup.tokenizer, tools=setup.tools)
    parts = StepParts(
        pad_id=setup.tokenizer.pad_token_id,
        passes=choose_passes(batch_shards=1 if mesh is None else batch_shards(mesh)),
        off_policy=cfg.async_.off_policy,
        pipelined=cfg.async_.staleness > 0,
    )
    make_step = make_agent_grpo_step if cfg.algorithm == "grpo" else make_agent_ppo_step
    step = make_step(cfg.algorithm_config, cfg.agent, setup.make_env, chat, parts)
    report = _report(cfg, setup, mesh)
    log(report.text())
    rcfg = step_sampler(cfg.algorithm_config, cfg.agent, chat, parts)
    make_state = grpo_state if cfg.algorithm == "grpo" else ppo_state
    state = make_state(cfg.algorithm_config, setup.model, jax.random.key(cfg.seed))
    if mesh is not None:
        step = ShardedStep(step, state, mesh)
        state = step.place(state)
    held_out = HeldOut(cfg, setup, chat, mesh, log)
    trainer = Trainer(
        name=f"agent-{cfg.algorithm}",
        step=step,
        batches=RowIterator(setup.train, cfg.batch_size, cfg.seed),
        make_batch=lambda rows: WithHost(None, HostRecord(rows=rows)),
        host_metrics=lambda out, metrics: {
            k: v for k, v in out.host.agent.items() if np.isfinite(v)
        },
        evaluate=held_out,
        export=exporter(setup.tokenizer, base_path(cfg, run_dir)),
        bar_keys=BAR_KEYS,
        asynchronous=cfg.async_,
        on_start=report.write,
        prepare=prepare_agent(cfg, setup, chat, step, rcfg, held_out, report, log),
        info={"data": {"train_rows": len(setup.train), "held_out_rows": len(setup.held_out)}},
    )
    _, summary = run_loop(cfg, trainer, state, log, t_start=t_start)
    return summary
