"""KTO configuration (option names as TRL's ``KTOConfig``: ``beta``, ``desirable_weight``,
``undesirable_weight``, ``precompute_ref_log_probs`` as ``precompute_reference``)."""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.models.prefix_shared import REMAT_POLICIES, TRAIN_ATTENTION
from relax.train.optimizer import OptimizerConfig


@dataclasses.dataclass(frozen=True)
class KTOConfig:
    """KTO on unpaired rows (every field is read by ``relax.algorithms.kto``).

    Loss (``relax.objectives.preference.kto_loss``): ``beta``, and the weights of desirable /
    undesirable examples ``desirable_weight`` / ``undesirable_weight`` (the paper suggests
    ``w_d n_d / (w_u n_u)`` in [1, 4/3]). Data, update, attention and reference options as in
    ``DPOConfig``: ``max_prompt_tokens`` / ``max_completion_tokens`` (the batch's ``Lp`` / ``N``),
    ``truncate_prompt``, ``grad_accum``, ``remat`` / ``remat_policy``, ``train_attention``,
    ``precompute_reference`` (read ``ref_logps`` / ``ref_kl_logps`` from the batch; no reference
    model in the state).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    max_prompt_tokens: int = 512
    max_completion_tokens: int = 512
    truncate_prompt: bool = False
    grad_accum: int | None = None
    remat: bool = False
    remat_policy: str = "nothing"
    train_attention: str = "auto"
    precompute_reference: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        check_choice("train_attention", self.train_attention, TRAIN_ATTENTION)
        check_choice("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError(f"desirable_weight={self.desirable_weight} and undesirable_weight="
                             f"{self.undesirable_weight} must be >= 0")
        for name in ("max_prompt_tokens", "max_completion_tokens", "grad_accum"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def needs_reference(self) -> bool:
        """Whether the state needs a reference model (``init_state(with_reference=...)``)."""
        return not self.precompute_reference
