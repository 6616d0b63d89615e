"""An agent run's model, rows and environment: the built-in calculator task, or a user's model
(``--model``), rows (``--data``, ``--eval-data`` / ``--eval-fraction``) and environment
(``--env module:factory`` or ``--env verifiers:<id>``, ``relax.environments.factory``; a verifiers
environment's own tasks are the rows when there is no ``--data``; ``--env reasoning_gym:<names>``:
reasoning-gym's generated rows, ``relax.environments.reasoning_gym_env``), in any combination:
without ``--env`` the built-in calculator environment (``relax.tasks.agent``) runs on the rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax.algorithms.online.config import ModelRunConfig
from relax.algorithms.online.setup import with_lora
from relax.data.files import read_records
from relax.data.prompts import train_eval_split
from relax.environments.factory import make_checked, tool_schemas
from relax.environments.reasoning_gym_env import ReasoningGymEnv, ReasoningGymSpec, is_reasoning_gym
from relax.environments.verifiers_source import is_verifiers, load_source
from relax.models.config.model import DTYPES
from relax.models.hf.checkpoint import load_pretrained
from relax.parallel.distributed import on_host_memory
from relax.tasks import agent as agent_task
from relax.tasks import reasoning_gym as reasoning_gym_task
from relax.tasks.base import prepare
from relax.text import TextTokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class AgentSetup:
    """The run's tokenizer, model (with ``--lora.*`` adapters), training and held-out rows (plain
    dicts, what ``env.reset`` gets), ``make_env`` (a fresh environment per trajectory), the tools'
    schemas (None: none) and where the rows and the environment come from (the start-up report)."""

    tokenizer: TextTokenizer
    model: Any
    train: list[dict]
    held_out: list[dict]
    make_env: Callable[[], Any]
    tools: list[dict] | None
    source: str


def load_setup(
    cfg: ModelRunConfig,
    task: agent_task.AgentTask,
    env: str | None,
    run_dir: Path,
    *,
    reasoning_gym: reasoning_gym_task.ReasoningGymTask,
    eval_max_rows: int | None,
    on_host: bool,
    log,
) -> AgentSetup:
    """The built-in task's model and rows unless ``cfg.model`` / ``cfg.data``; the built-in
    environment unless ``env``. The model is loaded on the host when ``on_host`` (a mesh run).
    ``reasoning_gym``: the rows' options for ``--env reasoning_gym:<names>``."""
    with on_host_memory(on_host):
        if cfg.model is None:
            tokenizer, model, train, held_out = prepare(
                agent_task,
                task,
                run_dir,
                seed=cfg.seed,
                log=log,
                teacher="a teacher that calls the calculator on some prompts",
            )
        else:
            tokenizer = load_tokenizer(cfg.model if cfg.tokenizer is None else cfg.tokenizer)
            model = load_pretrained(
                cfg.model,
                dtype=DTYPES[cfg.compute_dtype],
                param_dtype=DTYPES[cfg.param_dtype],
                precision=cfg.precision,
            )
    if cfg.data is not None:
        train, held_out = _rows(cfg)
    elif is_verifiers(env):  # the environment's own tasks, --eval-fraction of them held out
        train, held_out = train_eval_split(load_source(env).rows(), cfg.eval_fraction, cfg.seed)
    if eval_max_rows is not None:
        held_out = held_out[:eval_max_rows]
    if env is None:
        make_env = lambda: agent_task.make_environment(task)  # noqa: E731 - one per trajectory
        tools = [t.schema() for t in agent_task.tools(task)]
    elif is_reasoning_gym(env):
        make_env, generated = reasoning_gym_env(env, reasoning_gym)
        if cfg.data is None:
            train, held_out = generated()
            held_out = held_out if eval_max_rows is None else held_out[:eval_max_rows]
        tools = None
    else:
        make_env, probe = make_checked(env)
        tools = tool_schemas(probe)
    rows = "the built-in task" if cfg.data is None else cfg.data
    rows = f"the tasks of {env}" if cfg.data is None and is_verifiers(env) else rows
    rows = f"reasoning-gym ({env})" if cfg.data is None and is_reasoning_gym(env) else rows
    return AgentSetup(
        tokenizer,
        with_lora(cfg, model),
        train,
        held_out,
        make_env,
        tools,
        f"rows from {rows}, environment {env or 'the built-in calculator'}",
    )


def reasoning_gym_spec(
    env: str, options: reasoning_gym_task.ReasoningGymTask
) -> tuple[ReasoningGymSpec, reasoning_gym_task.ReasoningGymTask]:
    """``--env reasoning_gym:<names>?...`` parsed, and the rows' options for its tasks (names,
    options and seeds checked: a ``ValueError`` naming the flag)."""
    spec = ReasoningGymSpec.parse(env)
    names = reasoning_gym_task.task_names(spec.task, "--env")
    return spec, reasoning_gym_task.with_names(options, names)


def reasoning_gym_env(
    env: str, options: reasoning_gym_task.ReasoningGymTask
) -> tuple[Callable[[], ReasoningGymEnv], Callable[[], tuple[list[dict], list[dict]]]]:
    """``(make_env, rows)`` of ``--env reasoning_gym:<names>?...``: a fresh episode per
    trajectory (reasoning-gym's system prompt ``--reasoning-gym.prompt-style`` when answers are
    tagged, none when plain) and the generated training and held-out rows (``make_splits``)."""
    spec, task = reasoning_gym_spec(env, options)
    prompt = reasoning_gym_task.system_prompt(task) if spec.answer == "tagged" else None
    return (lambda: ReasoningGymEnv(spec, prompt)), (lambda: reasoning_gym_task.make_splits(task))


def _rows(cfg: ModelRunConfig) -> tuple[list[dict], list[dict]]:
    """``--data``'s rows, and ``--eval-data``'s or ``--eval-fraction`` of ``--data``'s held out."""
    rows = read_records(cfg.data)
    if cfg.eval_data is not None:
        train, held_out = rows, read_records(cfg.eval_data)
    else:
        train, held_out = train_eval_split(rows, cfg.eval_fraction, cfg.seed)
    return [r.record for r in train], [r.record for r in held_out]
