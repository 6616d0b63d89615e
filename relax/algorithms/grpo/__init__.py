"""GRPO and its family (Dr. GRPO, DAPO, GSPO, RLOO, CISPO presets)."""

from relax.algorithms.grpo.config import ADVANTAGES, PRESETS, ZERO_STD, GRPOConfig, preset
from relax.algorithms.grpo.loss import make_grpo_update, make_loss
from relax.algorithms.grpo.run import GRPORunConfig, make_state
from relax.algorithms.grpo.step import (
    GRPOBatch,
    grpo_parts,
    loss_rows,
    make_advantage,
    make_grpo_step,
    make_update_stage,
    shape_rewards,
)

__all__ = [
    "ADVANTAGES",
    "GRPOBatch",
    "GRPOConfig",
    "GRPORunConfig",
    "PRESETS",
    "ZERO_STD",
    "grpo_parts",
    "loss_rows",
    "make_advantage",
    "make_grpo_step",
    "make_grpo_update",
    "make_loss",
    "make_state",
    "make_update_stage",
    "preset",
    "shape_rewards",
]
