"""The DPO family of pairwise preference trainers: DPO (sigmoid), IPO, SLiC (hinge), robust DPO,
and the reference-free SimPO and ORPO (``DPOConfig.loss_type``); ``make_dpo_step`` runs one
optimizer step per batch of pairs with both completions in one prefix-shared forward."""

from relax.algorithms.dpo.config import DPOConfig
from relax.algorithms.dpo.loss import make_dpo_loss, pair_normalizers
from relax.algorithms.dpo.step import collate, encode, evaluate, make_dpo_eval, make_dpo_step
from relax.algorithms.preference.config import make_state  # a reference model unless precomputed

__all__ = [
    "DPOConfig",
    "collate",
    "encode",
    "evaluate",
    "make_dpo_eval",
    "make_dpo_loss",
    "make_dpo_step",
    "make_state",
    "pair_normalizers",
]
