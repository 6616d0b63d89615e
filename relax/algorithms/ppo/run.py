"""The PPO run: ``run(cfg)`` is what ``examples/train_ppo.py`` calls. Everything but the
algorithm (model and data, the built-in task, evaluation, checkpoints, logs, export) is
``relax.algorithms.online.run``, as for GRPO; the run directory has the same layout."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from relax.algorithms.cli.configure import configure
from relax.algorithms.online.config import OnlineAlgorithm, OnlineRunConfig, describe_update
from relax.algorithms.online.run import run_online
from relax.algorithms.online.setup import check_lora_reference
from relax.algorithms.ppo.config import PPOConfig
from relax.algorithms.ppo.step import make_ppo_step
from relax.models.config.model import DTYPES
from relax.models.heads.critic import (
    check_reads_prompt_inputs,
    init_critic,
    init_value_head,
    load_critic,
)
from relax.tasks import (
    TASK_MAX_NEW_TOKENS,
    TASK_PROMPT_TOKENS,
    TASK_REWARD_WORKERS,
    TASK_REWARDS,
    kind,
)
from relax.train.state import TrainState, init_state


@dataclasses.dataclass(frozen=True)
class PPORunConfig(OnlineRunConfig):
    """A PPO run (every ``OnlineRunConfig`` flag, plus ``--ppo.*``)."""

    ppo: PPOConfig = PPOConfig()
    run_dir: str = "runs/ppo"

    def __post_init__(self):
        super().__post_init__()
        if self.ppo.advantage == "vineppo" and self.parallel.enabled:
            raise ValueError(
                "--ppo.advantage vineppo samples its branches on the host's device: "
                "it runs without --parallel.mesh / --parallel.sampler-devices"
            )
        if self.ppo.advantage == "vineppo" and self.image_field is not None:
            raise ValueError(
                "--ppo.advantage vineppo branches from text prefixes: image prompts "
                "(--image-field) train with --ppo.advantage gae"
            )


def builtin_defaults(task: str = "reverse") -> PPORunConfig:
    """The no-argument run: a built-in task (reverse unless ``--task code`` / ``--task math`` /
    ``--task visual``, whose rows' ``image`` column holds the pictures), sized to finish in a few
    minutes on 2 CPU cores."""
    ppo = configure(
        PPOConfig,
        num_generations=4,
        max_new_tokens=TASK_MAX_NEW_TOKENS[kind(task)],
        optimizer=dataclasses.replace(PPOConfig().optimizer, learning_rate=1e-3),
        critic_optimizer=dataclasses.replace(PPOConfig().critic_optimizer, learning_rate=3e-3),
    )
    return PPORunConfig(
        ppo=ppo,
        task=task,
        reward=TASK_REWARDS[kind(task)],
        steps=60,
        batch_size=16,
        max_prompt_tokens=TASK_PROMPT_TOKENS[kind(task)],
        eval_every=20,
        checkpoint_every=20,
        run_dir=f"runs/ppo-{task}",
        reward_workers=TASK_REWARD_WORKERS[kind(task)],
        image_field="image" if task == "visual" else None,
    )


def real_defaults() -> PPORunConfig:
    return PPORunConfig()


def make_state(
    p: PPOConfig,
    model,
    key,
    *,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    images: bool = False,
    vision=None,
) -> TrainState:
    """PPO's state for ``model``: its optimizer, the critic (a value head, a copy of the policy, or
    ``p.critic_model`` loaded in ``dtype`` / ``param_dtype`` with the policy's precision policy)
    with its own, and the reference. ``images``: the run trains on image prompts, whose inputs
    a separate critic reads as the policy does (``check_reads_prompt_inputs``: a ``ValueError``
    here, at start, for a critic that cannot). ``vision``: a vision part the policy's optimizer
    trains with it (``--train-vision``; a separate critic reads the initial tower's features)."""
    check_lora_reference(model, p.reference, p.needs_reference)
    if vision is not None and p.shared_critic:
        raise ValueError(
            "--train-vision: the shared critic's head reads the policy's own forward, which the "
            "trained tower's update does not give it; use a separate critic (--ppo.critic copy)"
        )
    if vision is not None and p.needs_reference and p.reference.kind != "static":
        raise ValueError(
            f"--train-vision: the reference's features are the initial tower's, so the KL "
            f"reference must be the initial model (--ppo.reference.kind static), not "
            f"{p.reference.kind!r}"
        )
    critic = None
    if p.shared_critic:
        critic = init_value_head(model.config)
    elif p.needs_critic:
        critic = (
            init_critic(model)
            if p.critic_model is None
            else load_critic(
                p.critic_model, dtype=dtype, param_dtype=param_dtype, precision=model.precision
            )
        )
        if images:
            check_reads_prompt_inputs(critic.backbone.config, model.config)
    return init_state(
        model,
        p.optimizer.make(),
        key=key,
        with_reference=p.needs_reference,
        critic=critic,
        critic_optimizer=None if critic is None else p.critic_optimizer.make(),
        vision=vision,
    )


def algorithm(cfg: PPORunConfig) -> OnlineAlgorithm:
    p = cfg.ppo
    state = functools.partial(
        make_state,
        p,
        dtype=DTYPES[cfg.compute_dtype],
        param_dtype=DTYPES[cfg.param_dtype],
        images=cfg.image_field is not None,
    )

    return OnlineAlgorithm(
        name="ppo",
        make_state=state,
        make_step=functools.partial(make_ppo_step, p),
        generation=p.generation,
        describe_update=functools.partial(describe_update, p, cfg.batch_size, "ppo"),
    )


def run(cfg: PPORunConfig) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    return run_online(cfg, algorithm(cfg))
