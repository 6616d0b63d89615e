"""What the preference trainers (the DPO family, KTO) train with alike: the batch's budgets, the
update's options, the reference rule (``PreferenceTrainConfig``), and the state they start from
(``make_state``)."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import jax

from relax.algorithms.cli.configure import FLAT
from relax.models.forward.config import ForwardConfig
from relax.train.optimizer import OptimizerConfig
from relax.train.state import TrainState, init_state


@dataclasses.dataclass(frozen=True)
class PreferenceTrainConfig:
    """What the DPO family and KTO train with alike (each subclass documents the fields): the
    batch's ``Lp`` / ``N`` (``max_prompt_tokens`` / ``max_completion_tokens``), ``truncate_prompt``,
    ``grad_accum``, ``forward`` (``relax.models.forward.config.ForwardConfig``: ``train_attention``, ``remat``,
    ``remat_policy``; flat flags), ``precompute_reference``
    and the optimizer. A subclass says whether its state needs a reference model
    (``needs_reference``)."""

    max_prompt_tokens: int = 512
    max_completion_tokens: int = 512
    truncate_prompt: bool = False
    grad_accum: int | None = None
    forward: Annotated[ForwardConfig, FLAT] = ForwardConfig()
    precompute_reference: bool = False
    optimizer: OptimizerConfig = OptimizerConfig()

    def __post_init__(self):
        for name in ("max_prompt_tokens", "max_completion_tokens", "grad_accum"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def needs_reference(self) -> bool:
        """Whether the state needs a reference model (``init_state(with_reference=...)``)."""
        return not self.precompute_reference


def make_state(cfg: PreferenceTrainConfig, policy, key: jax.Array) -> TrainState:
    """A fresh state with the config's optimizer, and a reference model (a copy of ``policy``)
    when the loss reads one and it is not precomputed (``cfg.needs_reference``)."""
    return init_state(policy, cfg.optimizer.make(), key=key, with_reference=cfg.needs_reference)
