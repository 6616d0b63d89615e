"""KTO configuration (option names as TRL's ``KTOConfig``: ``beta``, ``desirable_weight``,
``undesirable_weight``, ``precompute_ref_log_probs`` as ``precompute_reference``)."""

from __future__ import annotations

import dataclasses

from relax.algorithms.preference.config import PreferenceTrainConfig


@dataclasses.dataclass(frozen=True)
class KTOConfig(PreferenceTrainConfig):
    """KTO on unpaired rows (every field is read by ``relax.algorithms.kto``).

    Loss (``relax.objectives.preference.kto_loss``): ``beta``, and the weights of desirable /
    undesirable examples ``desirable_weight`` / ``undesirable_weight`` (the paper suggests
    ``w_d n_d / (w_u n_u)`` in [1, 4/3]). Data, update, attention and reference options as in
    ``DPOConfig``: ``max_prompt_tokens`` / ``max_completion_tokens`` (the batch's ``Lp`` / ``N``),
    ``truncate_prompt``, ``grad_accum``, ``remat`` / ``remat_policy``, ``train_attention``,
    ``precompute_reference`` (read ``ref_logps`` from the batch; no reference model in the state).
    """

    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if self.desirable_weight < 0 or self.undesirable_weight < 0:
            raise ValueError(
                f"desirable_weight={self.desirable_weight} and undesirable_weight="
                f"{self.undesirable_weight} must be >= 0"
            )
