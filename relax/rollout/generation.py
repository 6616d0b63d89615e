"""What a trainer samples: one config, nested in every online algorithm's (GRPO, PPO, agents).

``num_generations`` completions of at most ``max_new_tokens`` per prompt, drawn at
``temperature`` (0: greedy, for evaluation; a trainer needs > 0) / ``top_k`` / ``top_p`` /
``min_p`` (``relax.rollout.sampling``; the trainer recomputes log-probs at the same
temperature); a completion also ends at its first ``stop_strings`` match
(``relax.text.stop_strings``; used in evaluation too). ``compactions``: how many times the
decode batch may halve as its rows finish (``relax.rollout.compaction``; 0: never).
``sampler_precision``: the sampler's weights, the model's own or 8-bit (``int8`` / ``fp8``,
``RolloutConfig.sampler_precision``); an online run then corrects every batch as off-policy.
"""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.models.layers.quantized import PRECISIONS
from relax.rollout.sampler import RolloutConfig
from relax.rollout.sampling import SamplingConfig


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The completions a step samples per prompt and how (module docstring)."""

    num_generations: int = 8
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    stop_strings: tuple[str, ...] = ()
    compactions: int = RolloutConfig.compactions
    sampler_precision: str = RolloutConfig.sampler_precision
    """The sampler's weights: model (the model's own), int8 or fp8 (weight-only, per output
    channel: ``relax.models.layers.quantized``, the quant extra). The trainer keeps the model's;
    the run corrects the drift as an off-policy batch's (``--async.correction.*``), every step."""

    def __post_init__(self):
        for name in ("num_generations", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.compactions < 0:
            raise ValueError(f"compactions must be >= 0, got {self.compactions}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must be non-empty strings")
        _ = self.sampling  # top_k / top_p / min_p are valid
        check_choice("sampler_precision", self.sampler_precision, PRECISIONS)

    @property
    def quantized(self) -> bool:
        """Whether the sampler's weights are 8-bit (its samples off-policy for the trainer)."""
        return self.sampler_precision != "model"

    @property
    def sampling(self) -> SamplingConfig:
        """The per-token sampling controls."""
        return SamplingConfig(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p
        )

    def rollout(self, *, eos_ids: tuple[int, ...], pad_id: int) -> RolloutConfig:
        """The sampler's config for a tokenizer's ``eos_ids`` and ``pad_id``."""
        return RolloutConfig(
            num_generations=self.num_generations,
            max_new_tokens=self.max_new_tokens,
            sampling=self.sampling,
            eos_ids=eos_ids,
            pad_id=pad_id,
            compactions=self.compactions,
            sampler_precision=self.sampler_precision,
        )
