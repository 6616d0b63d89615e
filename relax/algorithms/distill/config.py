"""Knowledge-distillation configuration (GKD, Agarwal et al. 2024; TRL's ``GKDConfig`` names where
TRL has the option: ``lmbda``, ``temperature``, ``max_new_tokens``; TRL's ``beta`` is ``jsd_beta``).

Every field is read by the trainer (``relax.algorithms.distill.step``); the run reads ``optimizer``.
"""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.models.distill import DIVERGENCES, resolve_divergence
from relax.models.prefix_shared import TRAIN_ATTENTION
from relax.train.optimizer import OptimizerConfig

MODES = ("off_policy", "on_policy", "mixed")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distil a teacher (``TrainState.ref``) into the student (``TrainState.policy``).

    Divergence per completion token (``relax.models.distill``), at ``temperature`` for both models,
    no ``T^2`` factor: ``divergence`` forward = KL(teacher || student), reverse = KL(student ||
    teacher), jsd = ``jsd_beta KL(p || m) + (1 - jsd_beta) KL(q || m)``, ``m = jsd_beta p + (1 -
    jsd_beta) q`` (p teacher, q student; ``jsd_beta`` 0 / 1 are the forward / reverse KL, as in TRL).
    The loss is the token sum divided by the batch's loss tokens.

    Data (``mode``): ``off_policy`` trains on the batch's completions (a dataset's; GKD's
    supervised KD, lambda = 0); ``on_policy`` samples ``num_generations`` completions of at most
    ``max_new_tokens`` per prompt from the student at ``temperature`` every step (lambda = 1);
    ``mixed`` samples with probability ``lmbda`` per step (TRL's ``lmbda``), else uses the batch's
    completions, which must then be ``[P, num_generations, max_new_tokens]``.

    Update: one optimizer step per batch, the batch split into ``grad_accum`` micro-batches
    (``None``: the passes' choice, ``relax.passes``); ``chunk_size`` rows of vocabulary logits at a
    time; ``remat`` recomputes each student layer in the backward; ``train_attention`` is the
    completion attention of the training forward of both models (``relax.models.prefix_shared``).
    """

    divergence: str = "forward"
    jsd_beta: float = 0.5
    temperature: float = 1.0
    mode: str = "off_policy"
    lmbda: float = 0.5
    num_generations: int = 1
    max_new_tokens: int = 128
    grad_accum: int | None = None
    chunk_size: int = 512
    remat: bool = False
    train_attention: str = "auto"
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_choice("mode", self.mode, MODES)
        check_choice("train_attention", self.train_attention, TRAIN_ATTENTION)
        resolve_divergence(self.divergence, beta=self.jsd_beta, temperature=self.temperature)  # ranges
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda must be in [0, 1], got {self.lmbda}")
        for name in ("num_generations", "max_new_tokens", "grad_accum", "chunk_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def samples(self) -> bool:
        """Whether a step may sample completions from the student."""
        return self.mode != "off_policy"

    @property
    def metric_name(self) -> str:
        """``jsd`` for a proper JSD (``0 < jsd_beta < 1``), else ``kl``."""
        return "jsd" if resolve_divergence(self.divergence, beta=self.jsd_beta).kind == "jsd" else "kl"
