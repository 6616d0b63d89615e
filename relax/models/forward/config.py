"""How a trainer's forwards run (not what they compute): one config, nested in every algorithm's.

``train_attention``: the completion attention of the training forwards (auto | group | dense,
``relax.models.forward.prefix_shared``; auto = a fused cuDNN kernel on GPU, the group kernel elsewhere);
``remat``: recompute each layer in the backward, keeping ``remat_policy`` (nothing | dots: the
weight matmuls' outputs, less recompute for more memory). On by default, as TRL's
``gradient_checkpointing`` and verl's actor: without it a real model's update keeps every
layer's activations of the whole micro-batch, which an 8B model's plan puts at ten times its
chips' memory (benchmarks/RESULTS.md, "Plans without the hardware"). ``--<algo>.no-remat`` skips
the recomputed forward (at most a third of the update's compute) where memory allows: a small
model, or one prompt group per micro-batch on a CPU. The same values and gradients whatever the
choice; only time and memory differ.
``moe``: a mixture-of-experts model's routing replay and router losses (``relax.models.moe.experts.MoEConfig``;
no effect on a dense model).
"""

from __future__ import annotations

import dataclasses

from relax.choices import check_choice
from relax.models.forward.forward_pass import REMAT_POLICIES, TRAIN_ATTENTION, ForwardPass
from relax.models.moe.experts import MoEConfig


@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """The training forwards' attention kernel and rematerialisation, and how they treat a
    mixture of experts (module docstring)."""

    train_attention: str = "auto"
    remat: bool = True
    remat_policy: str = "nothing"
    moe: MoEConfig = MoEConfig()

    def __post_init__(self):
        check_choice("train_attention", self.train_attention, TRAIN_ATTENTION)
        check_choice("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))

    def pass_(
        self,
        *,
        differentiated: bool = True,
        groups_per_pass: int | None = None,
        bins_per_pass: int = 1,
    ) -> ForwardPass:
        """How a prefix-shared forward runs under this config (``ForwardPass``): its attention,
        remat only where a backward follows (``differentiated``), ``groups_per_pass`` prompt
        groups (over packed bins ``bins_per_pass`` bins per device) at a time, routes replayed
        as ``moe`` says. A differentiated call lays it out as the backend's passes say
        (``ForwardPass.laid_out``)."""
        return ForwardPass(
            attention=self.train_attention,
            remat=self.remat and differentiated,
            remat_policy=self.remat_policy,
            groups_per_pass=groups_per_pass,
            bins_per_pass=bins_per_pass,
            replay_routes=self.moe.replays,
        )
