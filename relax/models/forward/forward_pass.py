"""How one call of the prefix-shared training forwards runs: one object, ``ForwardPass``.

The forwards of ``relax.models.forward.prefix_shared`` (``completion_logprobs``,
``completion_hidden``) and the heads built on them (``relax.models.heads.critic``'s values,
``relax.models.heads.reward_model.sequence_rewards``) take the model, the batch's arrays and a
``ForwardPass``: the attention kernel, rematerialisation, the layer loop, how many prompt groups
run at a time, the vocabulary chunk and which extra outputs the log-prob forward returns. A
trainer's ``relax.models.forward.config.ForwardConfig`` makes one (``ForwardConfig.pass_``); a
differentiated call lays it out as the backend's ``relax.passes.Passes`` say (``laid_out``).
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Array, Int

from relax.models.attention.dense import fused_attention_available
from relax.models.config.model import ModelConfig
from relax.models.decoder.logprobs import DEFAULT_CHUNK
from relax.models.decoder.transformer import Transformer
from relax.passes import Passes

TRAIN_ATTENTION = ("auto", "group", "dense")
# what a rematerialised layer keeps for the backward: nothing (recompute the whole layer) or the
# outputs of its weight matmuls (recompute only attention and elementwise ops; more memory)
REMAT_POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def check_train_attention(choice: str) -> None:
    if choice not in TRAIN_ATTENTION:
        raise ValueError(f"unknown train attention {choice!r}; valid: {', '.join(TRAIN_ATTENTION)}")


def resolve_attention(choice: str, model: Transformer) -> str:
    """``"auto"`` -> ``"dense"`` where a fused kernel runs it (GPU, 16-bit, no sliding window) and the
    precision policy lets it round the softmax probabilities (``attention_probs="compute"``: cuDNN's
    ``P`` is in the compute dtype, not the sampler's), else ``"group"``."""
    check_train_attention(choice)
    c = model.config
    if choice == "auto":
        fused = (
            fused_attention_available(model.dtype) and model.precision.attention_probs == "compute"
        )
        return "dense" if not c.has_window and fused else "group"
    if choice == "dense" and c.has_window:
        raise ValueError(
            f"train attention 'dense' has no sliding window (the model's is {c.sliding_window}); "
            "use 'group'"
        )
    return choice


def attention_probs_bytes(
    config: ModelConfig, prompt_ids: Int[Array, "p lp"], rows: Int[Array, "p g n"]
) -> int:
    """The bytes of one layer's float32 attention probabilities over completion ``rows`` (padded
    ``[P, G, N]``) after prompts of ``prompt_ids``' length: what
    ``ForwardPass.save_attention`` would keep (``laid_out``)."""
    p, g, n = rows.shape
    return 4 * p * config.num_heads * g * n * (prompt_ids.shape[1] + n)


@dataclasses.dataclass(frozen=True)
class ForwardPass:
    """How one call of a prefix-shared forward runs (the same values and gradients whatever the
    first seven fields say; only time and memory differ).

    ``attention``: the completion attention, ``"auto"`` | ``"group"`` | ``"dense"``
    (``relax.models.forward.prefix_shared``'s docstring; ``"auto"`` is resolved per model at the
    call, ``resolved``). ``remat``: recompute each layer in the backward, keeping ``remat_policy``
    (a key of ``REMAT_POLICIES``). ``unroll``: run the layers unrolled instead of as a
    ``lax.scan``, so the backward reads each layer's residuals from its own buffers (update -2.5%
    on 2 CPU cores; a forward alone gets slower). ``save_attention``: the group attention keeps
    its probabilities for the backward (``prefix_group_attention(save_probabilities=True)``; no
    effect on ``"dense"``). ``groups_per_pass``: run the whole network over that many prompt groups
    at a time (a ``lax.map``; it must divide P; None: all at once) - for forward-only use, e.g. the
    reference log-probs on CPU, where a group's activations then stay in cache.
    ``bins_per_pass``: over packed bins, the bins each device runs at a time
    (``relax.models.forward.binned.over_bins``; 1: one).
    ``chunk_size``: rows of the vocabulary projection per chunk (``relax.models.decoder.logprobs``).

    What ``completion_logprobs`` returns besides the log-probs: ``with_entropy`` the entropy of
    each predicted distribution (``entropy_grad=False``: a stop-gradient metric, the backward
    skips its term); ``router_stats`` a mixture of experts' summed ``RouterStats`` (``(values,
    stats)``). ``replay_routes``: the experts a sampler recorded (the call's ``routes``) are
    replayed, else only compared with the forward's own (no effect without routes).
    """

    attention: str = "auto"
    remat: bool = False
    remat_policy: str = "nothing"
    unroll: bool = False
    save_attention: bool = False
    groups_per_pass: int | None = None
    bins_per_pass: int = 1
    chunk_size: int = DEFAULT_CHUNK
    with_entropy: bool = False
    entropy_grad: bool = True
    replay_routes: bool = True
    router_stats: bool = False

    def __post_init__(self):
        check_train_attention(self.attention)
        if self.bins_per_pass < 1:
            raise ValueError(f"bins_per_pass={self.bins_per_pass} must be >= 1")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"unknown remat policy {self.remat_policy!r}; valid: {', '.join(REMAT_POLICIES)}"
            )

    def resolved(self, model: Transformer) -> ForwardPass:
        """This pass with its attention resolved for ``model`` (``resolve_attention``); over packed
        bins ``"group"`` is the block-sparse loop, ``"dense"`` a fused kernel per bin over its mask
        (``relax.models.forward.binned``)."""
        return dataclasses.replace(self, attention=resolve_attention(self.attention, model))

    def laid_out(
        self, passes: Passes, config: ModelConfig, probs_bytes: int | None = None
    ) -> ForwardPass:
        """This pass for a differentiated call of a model of ``config``, laid out as ``passes`` say:
        the layers unrolled (``Passes.unroll``) and, given ``probs_bytes``
        (``attention_probs_bytes``), the attention probabilities kept where they fit
        (``Passes.save_attention``; None: not kept)."""
        save = probs_bytes is not None and passes.save_attention(probs_bytes)
        return dataclasses.replace(
            self, unroll=passes.unroll(config.num_layers), save_attention=save
        )


# the default of every forward's ``how``: "auto" attention, no remat, all groups at once
DEFAULT_PASS = ForwardPass()
