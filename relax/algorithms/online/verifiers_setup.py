"""GRPO / PPO on a single-turn ``verifiers`` environment (``--env verifiers:<id>``): its tasks as
the run's rows and its rewards as the run's reward functions.

    cfg, env_rewards = verifiers_setup(cfg, run_dir, log)   # before the data is loaded

The taskset's tasks (``VerifiersSource.rows``: ``prompt``, ``answer``, ``vf_task``) are written by
the main process to ``run_dir/env/{train,eval}.jsonl`` (``--eval-fraction`` held out, seeded by
``--seed``) and the run becomes a ``--data`` run on them. Without ``--model`` the built-in task's
base model (``--task``, the reverse task by default) is made first and the run trains it, as
``--task visual`` does. The rewards are the environment's (``relax.environments.verifiers_reward``),
plus ``--reward``'s when it is not left at its default.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from relax.algorithms.online.config import OnlineRunConfig
from relax.algorithms.online.setup import builtin_setup
from relax.data.prompts import train_eval_split
from relax.environments.verifiers_reward import rubric_functions
from relax.environments.verifiers_source import load_source
from relax.parallel.distributed import barrier
from relax.rewards.contract import RewardFunction
from relax.tasks.base import write_jsonl
from relax.train.logs import is_main_process


def verifiers_setup(
    cfg: OnlineRunConfig, run_dir: Path, log
) -> tuple[OnlineRunConfig, list[RewardFunction]]:
    """``cfg`` unchanged and no rewards without ``--env``; else ``cfg`` as a ``--data`` run on
    the environment's tasks and the environment's reward functions (module docstring)."""
    if cfg.env is None:
        return cfg, []
    source = load_source(cfg.env)
    if not source.single_turn:
        raise ValueError(
            f"--env {cfg.env!r}: {type(source.env).__name__} with {len(source.tools)} tool(s) is "
            "multi-turn; GRPO / PPO sample one turn per prompt: train it with relax agent"
        )
    model = cfg.model
    if model is None:
        builtin_setup(cfg, run_dir, log)  # the built-in task's base model, saved in run_dir
        barrier("verifiers base model")
        model = str(run_dir / "base_model")
    env_dir = run_dir / "env"
    if is_main_process():
        train, held_out = train_eval_split(source.rows(), cfg.eval_fraction, cfg.seed)
        write_jsonl(train, env_dir / "train.jsonl")
        write_jsonl(held_out, env_dir / "eval.jsonl")
        log(
            f"verifiers {cfg.env}: {len(train)} training tasks, {len(held_out)} held out in "
            f"{env_dir}; rewards {source.reward_weights()}"
        )
    barrier("verifiers rows")
    default_reward = cfg.reward == ("exact_match",) and not cfg.reward_weights
    cfg = dataclasses.replace(
        cfg,
        model=model,
        data=str(env_dir / "train.jsonl"),
        eval_data=str(env_dir / "eval.jsonl") if cfg.eval_fraction > 0 else None,
        prompt_field="prompt",
        answer_field="answer",
        reward=() if default_reward else cfg.reward,
        env=None,  # its rows are written and its rewards made: a plain --data run from here
    )
    return cfg, rubric_functions(source.spec.text)
