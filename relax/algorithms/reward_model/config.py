"""Reward-model training configuration (TRL ``RewardConfig``'s names where TRL has the option)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from relax.algorithms.cli.configure import FLAT
from relax.models.forward.config import ForwardConfig
from relax.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
    """Bradley-Terry training of a reward model on preference pairs.

    Loss per pair (``relax.objectives.preference.bradley_terry_loss``)::

        -log s(r_chosen - r_rejected - margin) + center_rewards_coefficient * (r_chosen + r_rejected)^2

    with ``margin`` the batch's optional ``margin`` column (TRL's), and the centering term
    (Eisenstein et al. 2023) only when ``center_rewards_coefficient`` is set; averaged over the
    batch's pairs. Model: a copy of the base model's backbone with a head ``N(0, head_std)``
    (``init_reward_model``). Update: each batch of pairs in ``num_minibatches`` optimizer steps,
    each split into ``grad_accum`` micro-batches (None: the passes' choice, one pair per
    micro-batch on a single CPU device; the loss and gradient do not depend on it), with
    ``optimizer``; ``forward`` (``relax.models.forward.config.ForwardConfig``, flat flags:
    ``train_attention``, ``remat``, ``remat_policy``) as GRPO's (the prefix-shared forward: a
    pair's prompt runs once for both completions).
    """

    center_rewards_coefficient: float | None = None
    head_std: float = 0.02
    num_minibatches: int = 1
    grad_accum: int | None = None
    forward: Annotated[ForwardConfig, FLAT] = ForwardConfig()
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5)

    def __post_init__(self):
        if self.center_rewards_coefficient is not None and not self.center_rewards_coefficient >= 0:
            raise ValueError(
                f"center_rewards_coefficient must be >= 0 or None, got {self.center_rewards_coefficient}"
            )
        if not self.head_std >= 0:
            raise ValueError(f"head_std must be >= 0, got {self.head_std}")
        for name in ("num_minibatches", "grad_accum"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
