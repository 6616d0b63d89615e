"""The GRPO run: ``run(cfg)`` is what ``examples/train_grpo.py`` calls after parsing flags into
``GRPORunConfig``. With no ``model`` it trains on the built-in offline task
(``relax.tasks.reverse``): the base model is produced by a short supervised phase and saved as
an HF directory in the run dir. Everything but the algorithm is ``relax.algorithms.online.run``.
"""

from __future__ import annotations

import dataclasses
import functools

from relax.algorithms.grpo.config import PRESETS, GRPOConfig, preset
from relax.algorithms.grpo.step import make_grpo_step
from relax.algorithms.online.config import OnlineAlgorithm, OnlineRunConfig, describe_update
from relax.algorithms.online.run import run_online
from relax.algorithms.online.setup import check_lora_reference
from relax.choices import check_choice
from relax.tasks import (
    TASK_MAX_NEW_TOKENS,
    TASK_PROMPT_TOKENS,
    TASK_REWARD_WORKERS,
    TASK_REWARDS,
    kind,
)
from relax.train.state import TrainState, init_state


@dataclasses.dataclass(frozen=True)
class GRPORunConfig(OnlineRunConfig):
    """A GRPO run (every ``OnlineRunConfig`` flag, plus the algorithm's)."""

    preset: str = "grpo"
    """Algorithm preset (grpo, dr_grpo, dapo, gspo, rloo): the defaults of --grpo.*"""
    grpo: GRPOConfig = GRPOConfig()
    run_dir: str = "runs/grpo"

    def __post_init__(self):
        super().__post_init__()
        check_choice("preset", self.preset, tuple(PRESETS))


def builtin_defaults(preset_name: str = "grpo", task: str = "reverse") -> GRPORunConfig:
    """The no-argument run: a built-in task (reverse unless ``--task code`` / ``--task math`` /
    ``--task visual``: its rows' ``image`` column holds the pictures), sized to finish in a few
    minutes on 2 CPU cores.

    Only the sizes, the rewards and the learning rate are the task's; every algorithm value is the preset's."""
    grpo = preset(
        preset_name,
        num_generations=8,
        max_new_tokens=TASK_MAX_NEW_TOKENS[kind(task)],
        optimizer=dataclasses.replace(GRPOConfig().optimizer, learning_rate=1e-3),
    )
    return GRPORunConfig(
        preset=preset_name,
        grpo=grpo,
        task=task,
        reward=TASK_REWARDS[kind(task)],
        steps=60,
        batch_size=16,
        max_prompt_tokens=TASK_PROMPT_TOKENS[kind(task)],
        eval_every=20,
        checkpoint_every=20,
        run_dir=f"runs/grpo-{task}",
        reward_workers=TASK_REWARD_WORKERS[kind(task)],
        image_field="image" if task == "visual" else None,
    )


def real_defaults(preset_name: str = "grpo") -> GRPORunConfig:
    return GRPORunConfig(preset=preset_name, grpo=preset(preset_name))


def make_state(g: GRPOConfig, model, key, vision=None) -> TrainState:
    """GRPO's state for ``model``: its optimizer, a reference (with its statistics) when
    ``beta > 0``, and ``vision``, a vision part trained with it (``--train-vision``; its
    reference is the initial tower, so the reference must stay the initial model)."""
    check_lora_reference(model, g.reference, g.needs_reference)
    if vision is not None and g.needs_reference and g.reference.kind != "static":
        raise ValueError(
            f"--train-vision: the reference's features are the initial tower's, so the KL "
            f"reference must be the initial model (--grpo.reference.kind static), not "
            f"{g.reference.kind!r}"
        )
    return init_state(
        model,
        g.optimizer.make(),
        key=key,
        with_reference=g.needs_reference,
        with_ref_stats=g.needs_reference and g.reference.needs_stats,
        vision=vision,
    )


def algorithm(cfg: GRPORunConfig) -> OnlineAlgorithm:
    g = cfg.grpo
    return OnlineAlgorithm(
        name="grpo",
        make_state=functools.partial(make_state, g),
        make_step=functools.partial(make_grpo_step, g),
        generation=g.generation,
        describe_update=functools.partial(describe_update, g, cfg.batch_size, "grpo"),
    )


def run(cfg: GRPORunConfig) -> dict:
    """Train (or evaluate) as configured; returns the summary written to ``summary.json``."""
    return run_online(cfg, algorithm(cfg))
