"""PPO configuration. Names follow verl / TRL's PPO where they have the option (``gamma``,
``lam``, ``cliprange_value``, ``vf_coef``, ``whiten_advantages``, ``kl_coef``)."""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.models.prefix_shared import TRAIN_ATTENTION
from relax.objectives.aggregation import resolve_mode
from relax.objectives.kl import KL_ESTIMATORS
from relax.objectives.reference import ReferenceConfig
from relax.objectives.registry import policy_loss
from relax.train.optimizer import OptimizerConfig

ADVANTAGES = ("gae", "vineppo")
CRITICS = ("separate", "shared")


@dataclasses.dataclass(frozen=True)
class PPOConfig:
    """One PPO algorithm.

    Sampling: ``num_generations`` completions per prompt (they share the prompt's KV cache; PPO
    needs no group, 1 is classic PPO), ``max_new_tokens``, ``temperature``, ``stop_strings``.
    Rewards: the reward functions' score at a completion's last token, and ``-kl_coef * KL_t``
    (``kl_estimator``, to the ``reference``) at every token: ``r_t = score * [t = last] - kl_coef KL_t``.
    Advantage: ``gae`` (``gamma``, ``lam``, values from the critic) or ``vineppo`` (no critic:
    ``V(s_t)`` is the mean score of ``vine_rollouts`` completions re-sampled from the state
    before token t, at every ``vine_every``-th token; ``gamma = lam = 1``); advantages whitened
    over the batch's valid tokens when ``whiten_advantages``.
    Policy loss: ``policy_loss``, a name of ``relax.objectives.registry`` (ppo, grpo, dapo, gspo,
    cispo, reinforce, importance_sampling, conservative_ppo) with ``policy_loss_args``
    (``"field=value"`` overrides of that loss's config), aggregated by ``loss_type``;
    ``entropy_coef``.
    Critic (``critic``): ``separate``, a value model of its own (``critic_model``: an HF directory
    with a scalar score head, else a copy of the policy with a zero head); or ``shared``, a value
    head on the policy's backbone, one forward for log-probs and values and one joint loss
    ``policy_loss + vf_coef * value_loss`` (the backbone learns from both). Either way the value
    parameters have their own optimizer (``critic_optimizer``) and the value loss is the clipped
    one (``cliprange_value``; None: unclipped) scaled by ``vf_coef``.
    Update: ``num_iterations`` epochs x ``num_minibatches`` optimizer steps x ``grad_accum``
    micro-batches (None: the backend's choice, ``relax.passes``), the same split for the critic.
    """

    num_generations: int = 4
    max_new_tokens: int = 256
    temperature: float = 1.0
    stop_strings: tuple[str, ...] = ()
    kl_coef: float = 0.05
    kl_estimator: str = "k1"
    reference: ReferenceConfig = ReferenceConfig()
    advantage: str = "gae"
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    vine_rollouts: int = 4
    vine_every: int = 4
    policy_loss: str = "ppo"
    policy_loss_args: tuple[str, ...] = ()
    loss_type: str = "token-mean"
    entropy_coef: float = 0.0
    critic: str = "separate"
    critic_model: str | None = None
    cliprange_value: float | None = 0.2
    vf_coef: float = 1.0
    num_iterations: int = 1
    num_minibatches: int = 1
    grad_accum: int | None = None
    train_attention: str = "auto"
    optimizer: OptimizerConfig = OptimizerConfig()
    critic_optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5)

    def __post_init__(self):
        check_choice("advantage", self.advantage, ADVANTAGES)
        check_choice("critic", self.critic, CRITICS)
        if self.critic == "shared" and self.critic_model is not None:
            raise ValueError("critic='shared' is a value head on the policy: drop critic_model")
        check_choice("kl estimator", self.kl_estimator, KL_ESTIMATORS)
        check_choice("train attention", self.train_attention, TRAIN_ATTENTION)
        resolve_mode(self.loss_type)
        for name in ("num_generations", "max_new_tokens", "num_iterations", "num_minibatches", "vine_rollouts",
                     "vine_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.grad_accum is not None and self.grad_accum < 1:
            raise ValueError(f"grad_accum must be >= 1 or None, got {self.grad_accum}")
        if self.kl_coef < 0 or self.vf_coef <= 0 or self.temperature <= 0:
            raise ValueError("kl_coef >= 0, vf_coef > 0 and temperature > 0 are required")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.reference.needs_stats:
            raise ValueError("reference kind 'prorl' resets on running KL / entropy statistics, which the PPO "
                             "trainer does not keep: use static, ema, periodic or mixup")
        if self.advantage == "vineppo" and self.critic_model is not None:
            raise ValueError("advantage='vineppo' uses Monte-Carlo values, not a critic: drop critic_model")
        self.loss()  # the loss name and its arguments are valid

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

    def loss(self):
        """The policy loss from the registry, its config overridden by ``policy_loss_args``."""
        return policy_loss(self.policy_loss, **_parse_args(self.policy_loss_args))


def _parse_args(args: tuple[str, ...]) -> dict:
    out = {}
    for arg in args:
        name, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"policy_loss_args: {arg!r} is not field=value")
        out[name.strip()] = _value(value.strip())
    return out


def _value(text: str):
    if text in ("None", "none"):
        return None
    if text in ("True", "true", "False", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
