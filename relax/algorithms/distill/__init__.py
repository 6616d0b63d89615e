"""Knowledge distillation (GKD, Agarwal et al. 2024): forward / reverse KL or generalized JSD to a
teacher of the same vocabulary, on dataset completions, on completions sampled from the student
each step, or a mix; the divergences over the vocabulary are chunked (``relax.models.heads.distill``)."""

from relax.algorithms.distill.config import MODES, DistillConfig
from relax.algorithms.distill.data import DistillBatch
from relax.algorithms.distill.loss import make_distill_update, make_loss
from relax.algorithms.distill.step import init_distill_state, load_teacher, make_distill_step

__all__ = [
    "MODES",
    "DistillBatch",
    "DistillConfig",
    "init_distill_state",
    "load_teacher",
    "make_distill_step",
    "make_distill_update",
    "make_loss",
]
