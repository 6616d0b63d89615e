"""DPO-family configuration: one config for the pairwise preference losses.

Option names follow TRL where TRL has the option (``DPOConfig.beta``, ``loss_type``,
``label_smoothing``, ``CPOConfig.simpo_gamma``, ``precompute_ref_log_probs``); ORPO's weight of
the odds-ratio term, TRL's ``ORPOConfig.beta``, is ``orpo_lambda`` here (the paper's lambda).
"""

from __future__ import annotations

import dataclasses

from relax.algorithms.preference.config import PreferenceTrainConfig
from relax.choices import check_choice
from relax.objectives.preference import DPO_LOSS_TYPES

LOSS_TYPES = DPO_LOSS_TYPES + ("simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")


@dataclasses.dataclass(frozen=True)
class DPOConfig(PreferenceTrainConfig):
    """One pairwise preference algorithm (every field is read by ``relax.algorithms.dpo``).

    Loss (``loss_type``; formulas in ``relax.algorithms.dpo.loss``): ``sigmoid`` (DPO), ``ipo``,
    ``hinge`` (SLiC), ``robust`` (rDPO) against a reference model, with ``beta`` and
    ``label_smoothing`` (sigmoid: conservative DPO, in [0, 0.5]; robust: in [0, 0.5); the others: 0);
    ``simpo`` (reference-free, length-normalised, margin ``simpo_gamma``; ``label_smoothing`` in
    [0, 0.5]) and ``orpo`` (reference-free: NLL on the chosen completion plus ``orpo_lambda`` times
    the odds-ratio term; does not read ``beta``).
    Data: ``max_prompt_tokens`` / ``max_completion_tokens`` are the batch's ``Lp`` / ``N``; a longer
    prompt is an error unless ``truncate_prompt`` (keep its last tokens), a longer completion always
    is (``relax.data.pairs``).
    Update: one optimizer step per batch, summing ``grad_accum`` micro-batches of pairs (the same
    loss and gradient; ``None``: the passes' choice, one pair per micro-batch on a single CPU),
    ``remat`` / ``remat_policy`` and ``train_attention`` as in ``GRPOConfig``.
    Reference: with ``precompute_reference`` the reference log-probs are read from the batch
    (``ref_logps``, from ``relax.algorithms.preference.reference_cache``) and the state holds no
    reference model; otherwise ``state.ref`` runs once per batch.
    """

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    orpo_lambda: float = 0.1

    def __post_init__(self):
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        super().__post_init__()
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        e, kind = self.label_smoothing, self.loss_type
        if kind in ("sigmoid", "simpo") and not 0 <= e <= 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5] for {kind}, got {e}")
        if kind == "robust" and not 0 <= e < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5) for robust, got {e}")
        if kind in ("hinge", "ipo", "orpo") and e != 0:
            raise ValueError(f"label_smoothing is not used by loss_type={kind!r}; got {e}")
        if self.orpo_lambda < 0:
            raise ValueError(f"orpo_lambda must be >= 0, got {self.orpo_lambda}")
        if self.precompute_reference and kind in REFERENCE_FREE:
            raise ValueError(
                f"precompute_reference=True but loss_type={kind!r} uses no reference model"
            )

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares with reference log-probs (every loss but simpo and orpo)."""
        return self.loss_type not in REFERENCE_FREE

    @property
    def needs_reference(self) -> bool:
        """Whether the state needs a reference model (``init_state(with_reference=...)``)."""
        return self.uses_reference and not self.precompute_reference
