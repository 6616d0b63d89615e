"""GRPO-family configuration: algorithm, optimizer and named presets.

Every field is read by the trainer (``relax.algorithms.grpo.step``); option names follow TRL's
``GRPOConfig`` where TRL has the option (``beta``, ``loss_type``, ``num_iterations``,
``scale_rewards``; the clip options are the registry loss's, ``relax.objectives.registry``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Annotated

from relax.algorithms.cli.configure import FLAT, configure
from relax.choices import check_choice
from relax.data.completion_layout import PackingConfig
from relax.models.forward.config import ForwardConfig
from relax.objectives.advantages import GRPO_SCALES
from relax.objectives.aggregation import resolve_mode
from relax.objectives.kl import KL_ESTIMATORS
from relax.objectives.reference import ReferenceConfig
from relax.objectives.registry import (
    DAPOLossConfig,
    GSPOLossConfig,
    LossConfig,
    PPOLossConfig,
    loss_name,
)
from relax.rewards.shaping import LENGTH_SHAPING_MODES
from relax.rollout.generation import GenerationConfig
from relax.train.optimizer import OptimizerConfig

ADVANTAGES = ("grpo", "rloo", "reinforce_pp")
ZERO_STD = ("zero", "drop")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """One GRPO-family algorithm.

    Sampling: ``generation`` (``relax.rollout.generation.GenerationConfig``: ``num_generations``
    (G) completions of at most ``max_new_tokens`` per prompt at ``temperature`` / ``top_k`` /
    ``top_p`` / ``min_p``, ``stop_strings``; its flags read flat, ``--grpo.temperature``).
    Reward shaping (before the advantage): DAPO's soft overlong penalty when ``overlong_buffer``
    is set (``max_length = max_new_tokens``, ``overlong_penalty_factor``), and ``length_shaping``
    (linear | punitive, with ``length_target`` tokens and ``length_coef``).
    Advantage: ``advantage`` (grpo | rloo | reinforce_pp = REINFORCE++ with a group baseline,
    token-level, whitened over the batch), ``scale_rewards`` (group | batch | none; none is
    Dr.GRPO), ``zero_std_groups`` (zero: all-equal groups get advantage 0; drop: also removed
    from the loss and its normaliser).
    Loss: ``policy_loss``, a loss of the registry with its own options
    (``relax.objectives.registry``; ``--grpo.policy-loss dapo --grpo.policy-loss.epsilon-high 0.3``),
    ``loss_type`` (TRL name or verl aggregation mode), ``beta`` (KL coefficient; 0 = no reference
    model), ``kl_estimator``, ``kl_threshold`` (None: linear ``beta * KL``; a number: Signal's
    conservative ``beta * max(0, KL - threshold)^2`` per token), ``kl_in_reward`` (subtract
    ``beta * KL`` from the per-token reward instead of adding it to the loss), ``entropy_coef``,
    ``mask_truncated_completions``.
    Update: ``num_iterations`` epochs over the batch in ``num_minibatches`` optimizer steps each,
    each minibatch split into ``grad_accum`` micro-batches (same loss and gradient; ``None``: one
    prompt group per micro-batch on a single CPU device, where that is fastest, else one
    micro-batch; see ``relax.passes``); ``forward`` (``relax.models.forward.config.ForwardConfig``:
    ``train_attention``, ``remat``, ``remat_policy``; flat flags); ``packing`` (the completions
    of the update and of the reference / proximal forwards packed by token count instead of
    padded to the budget: ``relax.models.forward.completion_packing``; the same loss and metrics).
    """

    generation: Annotated[GenerationConfig, FLAT] = GenerationConfig()
    overlong_buffer: int | None = None
    overlong_penalty_factor: float = 1.0
    length_shaping: str | None = None
    length_target: float = 1.0
    length_coef: float = 0.0
    advantage: str = "grpo"
    scale_rewards: str = "group"
    advantage_eps: float = 1e-4
    zero_std_groups: str = "zero"
    policy_loss: LossConfig = PPOLossConfig()
    loss_type: str = "grpo"
    beta: float = 0.0
    kl_estimator: str = "k3"
    kl_threshold: float | None = None
    kl_in_reward: bool = False
    entropy_coef: float = 0.0
    mask_truncated_completions: bool = False
    num_iterations: int = 1
    num_minibatches: int = 1
    grad_accum: int | None = None
    forward: Annotated[ForwardConfig, FLAT] = ForwardConfig()
    packing: PackingConfig = PackingConfig()
    reference: ReferenceConfig = ReferenceConfig()
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_choice("scale_rewards", self.scale_rewards, GRPO_SCALES)
        check_choice("zero_std_groups", self.zero_std_groups, ZERO_STD)
        check_choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        loss_name(self.policy_loss)  # a registry loss
        resolve_mode(self.loss_type)
        if self.length_shaping is not None:
            check_choice("length_shaping", self.length_shaping, LENGTH_SHAPING_MODES)
        if (
            self.overlong_buffer is not None
            and not 0 <= self.overlong_buffer <= self.generation.max_new_tokens
        ):
            raise ValueError(
                f"overlong_buffer={self.overlong_buffer} must be in [0, max_new_tokens]"
            )
        if self.kl_threshold is not None and self.kl_in_reward:
            raise ValueError(
                "kl_threshold (conservative penalty) applies to the loss, not with kl_in_reward"
            )
        for name in ("num_iterations", "num_minibatches", "grad_accum"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.generation.num_generations < 2:
            warnings.warn(
                f"num_generations={self.generation.num_generations}: the {self.advantage!r} advantage is "
                "relative to the prompt's group, so with one completion per prompt every advantage is 0 "
                "and only the KL term (beta) trains; use --grpo.num-generations >= 2",
                stacklevel=2,
            )
        if self.kl_in_reward and self.beta == 0:
            raise ValueError("kl_in_reward=True needs beta > 0")

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps per update: ``num_iterations`` epochs x ``num_minibatches``."""
        return self.num_iterations * self.num_minibatches

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0


PRESETS: dict[str, dict] = {
    # DeepSeekMath GRPO as TRL runs it: per-sequence token mean, std-scaled group advantages.
    "grpo": dict(loss_type="grpo", scale_rewards="group", beta=0.04),
    # Dr.GRPO (Liu et al. 2025): no std scaling, constant length normaliser, no KL.
    "dr_grpo": dict(loss_type="dr_grpo", scale_rewards="none", beta=0.0),
    # DAPO (Yu et al. 2025): clip-higher, token-level loss over the batch, drop all-equal groups,
    # no KL, mask truncated completions (overlong filtering).
    "dapo": dict(
        policy_loss=DAPOLossConfig(),
        loss_type="dapo",
        beta=0.0,
        zero_std_groups="drop",
        mask_truncated_completions=True,
    ),
    # GSPO (Zheng et al. 2025): sequence-level importance ratio, tight clipping, sequence mean.
    "gspo": dict(policy_loss=GSPOLossConfig(), loss_type="seq-mean-token-mean", beta=0.0),
    # RLOO (Ahmadian et al. 2024): leave-one-out baseline, REINFORCE-style single epoch.
    "rloo": dict(advantage="rloo", scale_rewards="none", loss_type="grpo", beta=0.0),
}


def preset(name: str, **overrides) -> GRPOConfig:
    """A named algorithm preset with overrides, given flat (``relax.algorithms.cli.configure``): a
    preset is a registry loss plus advantage, aggregation and KL choices.

    Args:
        name: a key of ``PRESETS``: ``"grpo"``, ``"dr_grpo"``, ``"dapo"``, ``"gspo"`` or
            ``"rloo"``.
        **overrides: values by name that replace the preset's: ``GRPOConfig`` fields, fields of
            its flat nested configs (``generation``: ``num_generations``, ``temperature``, ...;
            ``forward``) and options of its ``policy_loss``. An unknown name is a ``TypeError``.

    Returns:
        The ``GRPOConfig``: ``GRPOConfig``'s defaults, the preset's values, then ``overrides``.
    """
    check_choice("preset", name, tuple(PRESETS))
    return configure(GRPOConfig, **{**PRESETS[name], **overrides})
