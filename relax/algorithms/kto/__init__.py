"""KTO (Ethayarajh et al. 2024): preference training from unpaired desirable / undesirable examples."""

from relax.algorithms.kto.config import KTOConfig
from relax.algorithms.kto.loss import kto_normalizers, make_kto_loss
from relax.algorithms.kto.step import collate, encode, evaluate, make_kto_eval, make_kto_step
from relax.algorithms.preference.config import (
    make_state,  # the DPO family's rule: a reference unless precomputed
)

__all__ = [
    "KTOConfig",
    "collate",
    "encode",
    "evaluate",
    "kto_normalizers",
    "make_kto_eval",
    "make_kto_loss",
    "make_kto_step",
    "make_state",
]
