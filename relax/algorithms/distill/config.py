"""Knowledge-distillation configuration (GKD, Agarwal et al. 2024; TRL's ``GKDConfig`` names where
TRL has the option: ``lmbda``, ``temperature``, ``max_new_tokens``; TRL's ``beta`` is ``jsd_beta``).

Every field is read by the trainer (``relax.algorithms.distill.step``); the run reads ``optimizer``.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated

from relax.algorithms.cli.configure import FLAT
from relax.choices import check_choice
from relax.models.forward.config import ForwardConfig
from relax.models.heads.distill import DIVERGENCES, resolve_divergence
from relax.rollout.generation import GenerationConfig
from relax.train.optimizer import OptimizerConfig

MODES = ("off_policy", "on_policy", "mixed")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """Distil a teacher (``TrainState.ref``) into the student (``TrainState.policy``).

    Divergence per completion token (``relax.models.heads.distill``), at ``temperature`` for both models,
    no ``T^2`` factor: ``divergence`` forward = KL(teacher || student), reverse = KL(student ||
    teacher), jsd = ``jsd_beta KL(p || m) + (1 - jsd_beta) KL(q || m)``, ``m = jsd_beta p + (1 -
    jsd_beta) q`` (p teacher, q student; ``jsd_beta`` 0 / 1 are the forward / reverse KL, as in TRL).
    The loss is the token sum divided by the batch's loss tokens.

    Data (``mode``): ``off_policy`` trains on the batch's completions (a dataset's; GKD's
    supervised KD, lambda = 0); ``on_policy`` samples ``generation`` (``relax.rollout.generation``,
    flat flags: ``num_generations`` completions of at most ``max_new_tokens`` per prompt at
    ``temperature``, the divergence's too; no ``stop_strings``: the sampler stops at EOS) from the
    student every step (lambda = 1);
    ``mixed`` samples with probability ``lmbda`` per step (TRL's ``lmbda``), else uses the batch's
    completions, which must then be ``[P, num_generations, max_new_tokens]``.

    Update: one optimizer step per batch, the batch split into ``grad_accum`` micro-batches
    (``None``: the passes' choice, ``relax.passes``); ``chunk_size`` rows of vocabulary logits at a
    time; ``forward`` (``relax.models.forward.config.ForwardConfig``, flat flags): ``train_attention`` of
    both models' forwards, ``remat`` / ``remat_policy`` of the student's backward.
    """

    divergence: str = "forward"
    jsd_beta: float = 0.5
    generation: Annotated[GenerationConfig, FLAT] = GenerationConfig(
        num_generations=1, max_new_tokens=128
    )
    mode: str = "off_policy"
    lmbda: float = 0.5
    grad_accum: int | None = None
    chunk_size: int = 512
    forward: Annotated[ForwardConfig, FLAT] = ForwardConfig()
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        check_choice("divergence", self.divergence, DIVERGENCES)
        check_choice("mode", self.mode, MODES)
        resolve_divergence(
            self.divergence, beta=self.jsd_beta, temperature=self.generation.temperature
        )  # ranges
        if self.generation.stop_strings:
            raise ValueError(
                "distillation samples on the device and stops at EOS: stop_strings are not supported"
            )
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"lmbda must be in [0, 1], got {self.lmbda}")
        for name in ("grad_accum", "chunk_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def samples(self) -> bool:
        """Whether a step may sample completions from the student."""
        return self.mode != "off_policy"

    @property
    def metric_name(self) -> str:
        """``jsd`` for a proper JSD (``0 < jsd_beta < 1``), else ``kl``."""
        return (
            "jsd" if resolve_divergence(self.divergence, beta=self.jsd_beta).kind == "jsd" else "kl"
        )
