"""PPO configuration. Names follow verl / TRL's PPO where they have the option (``gamma``,
``lam``, ``cliprange_value``, ``vf_coef``, ``whiten_advantages``, ``kl_coef``)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

from relax.algorithms.cli.configure import FLAT
from relax.choices import check_choice
from relax.data.completion_layout import PackingConfig
from relax.models.forward.config import ForwardConfig
from relax.objectives.aggregation import resolve_mode
from relax.objectives.kl import KL_ESTIMATORS
from relax.objectives.reference import ReferenceConfig
from relax.objectives.registry import LossConfig, PPOLossConfig, loss_name
from relax.rollout.generation import GenerationConfig
from relax.train.optimizer import OptimizerConfig

ADVANTAGES = ("gae", "vineppo")
CRITICS = ("separate", "shared")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """One PPO algorithm.

    Sampling: ``generation`` (``relax.rollout.generation.GenerationConfig``, flat flags:
    ``num_generations`` completions per prompt, which share the prompt's KV cache; PPO needs no
    group, 1 is classic PPO; ``max_new_tokens``, ``temperature``, ``top_k`` / ``top_p`` /
    ``min_p``, ``stop_strings``).
    Rewards: the reward functions' score at a completion's last token, and ``-kl_coef * KL_t``
    (``kl_estimator``, to the ``reference``) at every token: ``r_t = score * [t = last] - kl_coef KL_t``.
    Advantage: ``gae`` (``gamma``, ``lam``, values from the critic) or ``vineppo`` (no critic:
    ``V(s_t)`` is the mean score of ``vine_rollouts`` completions re-sampled from the state
    before token t, at every ``vine_every``-th token; ``gamma = lam = 1``); advantages whitened
    over the batch's valid tokens when ``whiten_advantages``.
    Policy loss: ``policy_loss``, a loss of ``relax.objectives.registry`` with its own options
    (``--ppo.policy-loss dapo --ppo.policy-loss.epsilon-high 0.3``), aggregated by
    ``loss_type``; ``entropy_coef``.
    Critic (``critic``): ``separate``, a value model of its own (``critic_model``: an HF directory
    with a scalar score head, else a copy of the policy with a zero head); or ``shared``, a value
    head on the policy's backbone, one forward for log-probs and values and one joint loss
    ``policy_loss + vf_coef * value_loss`` (the backbone learns from both). Either way the value
    parameters have their own optimizer (``critic_optimizer``) and the value loss is the clipped
    one (``cliprange_value``; None: unclipped) scaled by ``vf_coef``.
    Update: ``num_iterations`` epochs x ``num_minibatches`` optimizer steps x ``grad_accum``
    micro-batches (None: the backend's choice, ``relax.passes``), the same split for the critic;
    ``forward`` (``relax.models.forward.config.ForwardConfig``, flat flags: ``train_attention``,
    ``remat``, ``remat_policy``) for the policy's and the critic's forwards; ``packing``
    (``relax.data.completion_layout.PackingConfig``): the completions packed by token count in the
    reference, value, proximal and update forwards of both models (``relax.models.forward.completion_packing``;
    the same losses and metrics as padded).
    """

    generation: Annotated[GenerationConfig, FLAT] = GenerationConfig(
        num_generations=4, max_new_tokens=256
    )
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    reference: ReferenceConfig = ReferenceConfig()
    advantage: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    vine_rollouts: int = 4
    vine_every: int = 4
    policy_loss: LossConfig = PPOLossConfig()
    loss_type: str = "token-mean"
    entropy_coef: float = 0.0
    critic: str = "separate"
    critic_model: str | None = None
    cliprange_value: float | None = 0.2
    vf_coef: float = 1.0
    num_iterations: int = 1
    num_minibatches: int = 1
    grad_accum: int | None = None
    forward: Annotated[ForwardConfig, FLAT] = ForwardConfig()
    packing: PackingConfig = PackingConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    critic_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5)

    def __post_init__(self):
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_choice("critic", self.critic, CRITICS)
        if self.critic == "shared" and self.critic_model is not None:
            raise ValueError("critic='shared' is a value head on the policy: drop critic_model")
        check_choice("kl estimator", self.kl_estimator, KL_ESTIMATORS)
        loss_name(self.policy_loss)  # a registry loss
        resolve_mode(self.loss_type)
        for name in ("num_iterations", "num_minibatches", "vine_rollouts", "vine_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1 or None, got {self.grad_accum}")
        if self.kl_coef < 0 or self.vf_coef <= 0:
            raise ValueError("kl_coef >= 0 and vf_coef > 0 are required")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.reference.needs_stats:
            raise ValueError(
                "reference kind 'prorl' resets on running KL / entropy statistics, which the PPO "
                "trainer does not keep: use static, ema, periodic or mixup"
            )
        if self.advantage == "vineppo" and self.critic_model is not None:
            raise ValueError(
                "advantage='vineppo' uses Monte-Carlo values, not a critic: drop critic_model"
            )

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per update: ``num_iterations`` epochs x ``num_minibatches``."""
        return self.num_iterations * self.num_minibatches

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0

    @property
    def needs_critic(self) -> bool:
        return self.advantage == "gae"

    @property
    def shared_critic(self) -> bool:
        return self.needs_critic and self.critic == "shared"
