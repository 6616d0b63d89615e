"""Reward models: a scalar head on a transformer, read at the sequence's last token.

    rm = init_reward_model(policy, jax.random.key(0))     # a copy of the policy's backbone, head N(0, 0.02)
    r = sequence_rewards(rm, prompt_ids, prompt_mask, tokens, mask)        # [P, G] float32
    save_reward_model(rm, "out/rm", tokenizer=tok)   # transformers' AutoModelForSequenceClassification
    rm = load_reward_model("out/rm")

A reward model is a critic (``relax.models.heads.critic``) whose value is read once per sequence:
the score of ``[prompt; completion]`` is the linear read-out of the final-norm hidden state AT
its last token (the state after that token; ``r = h . head`` in float32, no bias)::

    r[p, g] = h(prompt p ++ completion g)[j] . head,   j = the last valid position

This is transformers' ``...ForSequenceClassification`` pooling, which reads the score of the
rightmost token that is not ``config.pad_token_id`` (whatever the attention mask says).
``sequence_rewards`` takes ``j`` as the rightmost position that is valid (mask on) AND, when the
config has a ``pad_token_id``, does not hold that id: where the padding holds ``pad_token_id``, both
pick the same token, including when a completion ends in a token equal to the pad id (pad = eos:
the score is then read at the token before it, as transformers and TRL's trainer do). A
completion with no valid token is scored at the prompt's last one; a sequence with none at all
at position 0 (transformers' ``argmax`` of zeros).

The head is the ``...ForSequenceClassification`` ``score`` (``[1, D]``), which has no bias; a
``RewardModel`` has none either (Bradley-Terry is blind to a shift anyway). Its backbone has no
``lm_head`` (``tie_word_embeddings=True``, as a critic's).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from relax.masked import last_valid_index
from relax.models.config.model import ModelConfig
from relax.models.decoder.transformer import Transformer
from relax.models.forward.forward_pass import DEFAULT_PASS, ForwardPass
from relax.models.forward.prefix_shared import (
    CompletionRope,
    completion_rope,
    over_groups,
    shared_hidden,
)
from relax.models.heads.critic import (
    Critic,
    init_critic,
    load_critic,
    save_critic,
    value_architectures,
    values_from_hidden,
)
from relax.models.hf.config import HFFormatError
from relax.models.hf.weights_io import read_json

__all__ = [
    "RewardModel",
    "init_reward_model",
    "load_reward_model",
    "save_reward_model",
    "sequence_rewards",
]


class RewardModel(eqx.Module):
    """``r(sequence) = final_norm_hidden(backbone)[last token] . head`` (float32; module docstring)."""

    backbone: Transformer
    head: Float[Array, " d"]

    @property
    def config(self) -> ModelConfig:
        """The backbone's config (what the run loop and health checks read from ``state.policy``)."""
        return self.backbone.config

    def as_critic(self) -> Critic:
        """The same weights as a :class:`Critic` (bias 0)."""
        return Critic(self.backbone, self.head, jnp.zeros((), jnp.float32))


def init_reward_model(
    model: Transformer,
    key: Array | None = None,
    *,
    head_std: float = 0.02,
    pad_token_id: int | None = None,
) -> RewardModel:
    """A reward model on a copy of ``model``'s backbone (a policy or a headless backbone; new
    buffers, no ``lm_head``), head ``N(0, head_std)`` in float32 (transformers' ``score`` init with
    ``initializer_range=0.02``; ``head_std=0`` gives zeros and needs no key).

    ``pad_token_id`` (None: keep the config's) sets the config's pad id: transformers needs one to
    score a batch, and ``sequence_rewards`` skips tokens equal to it (module docstring).
    """
    critic = init_critic(model, key=key, head_std=head_std)
    backbone = critic.backbone
    if pad_token_id is not None:
        backbone = dataclasses.replace(
            backbone, config=dataclasses.replace(backbone.config, pad_token_id=pad_token_id)
        )
    return RewardModel(backbone, critic.head)


def sequence_rewards(
    model: RewardModel,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    tokens: Int[Array, "p g n"],
    mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    ignore_pad_tokens: bool = True,
    rope: CompletionRope | None = None,
) -> Float[Array, "p g"]:
    """The score of each ``[prompt; completion]``, ``[P, G]`` float32, differentiable.

    Read at the last valid token (module docstring); with ``ignore_pad_tokens=False`` only the
    masks decide (a valid token equal to the pad id counts). Prompts are left-padded,
    completions start right after the prompt's last valid token (``completion_hidden``'s layout:
    each prompt runs once for its G completions). ``how``: how the backbone's forward runs
    (``relax.models.forward.forward_pass.ForwardPass``; ``how.groups_per_pass``: score that many
    prompt groups at a time, a ``lax.map`` that must divide P, for forward-only use on a CPU);
    ``rope`` as ``relax.models.forward.prefix_shared.completion_logprobs``'.
    """
    backbone = model.backbone
    layers = how.resolved(backbone)
    groups_per_pass = how.groups_per_pass
    if prompt_ids.ndim != 2 or tokens.ndim != 3:
        raise ValueError(
            f"need prompt_ids [P, Lp] and tokens [P, G, N], got {prompt_ids.shape}, {tokens.shape}"
        )
    pad = backbone.config.pad_token_id if ignore_pad_tokens else None

    def run(prompt_ids, prompt_mask, tokens, mask, rope):
        hp, hc = shared_hidden(
            backbone, prompt_ids, prompt_mask, tokens, mask, layers, rope
        )  # [p, Lp, D], [p*g, N, D]
        pv, cv = prompt_mask.astype(bool), mask.astype(bool)
        if pad is not None:
            pv, cv = pv & (prompt_ids != pad), cv & (tokens != pad)
        p_last, c_last = jnp.maximum(last_valid_index(pv), 0), last_valid_index(cv)  # [p], [p, g]
        rows, g, n = tokens.shape
        h_prompt = jnp.take_along_axis(hp, p_last[:, None, None], axis=1)[:, 0]  # [p, D]
        hc = hc.reshape(rows, g, n, hc.shape[-1])
        h_completion = jnp.take_along_axis(hc, jnp.maximum(c_last, 0)[:, :, None, None], axis=2)[
            :, :, 0
        ]
        h = jnp.where((c_last >= 0)[..., None], h_completion, h_prompt[:, None])  # [p, g, D]
        return values_from_hidden(h, model.head, jnp.zeros((), jnp.float32))

    if rope is None and groups_per_pass not in (
        None,
        prompt_ids.shape[0],
    ):  # outside the loop over groups
        rope = completion_rope(backbone.config, prompt_mask, tokens.shape[1], tokens.shape[2])
    return over_groups(
        run, (prompt_ids, prompt_mask, tokens, mask, rope), groups_per_pass=groups_per_pass
    )


# ----------------------------------------------------------------------------- Hugging Face directories


def save_reward_model(
    model: RewardModel,
    directory: str | os.PathLike,
    *,
    tokenizer=None,
    max_shard_bytes: int | None = None,
    dtype=None,
) -> Path:
    """Write ``model`` as ``<Family>ForSequenceClassification`` with ``num_labels=1`` (loads with
    ``transformers.AutoModelForSequenceClassification``): the backbone as ``model.*``, the head as
    ``score.weight`` ``[1, D]`` (no bias, no ``lm_head``). ``tokenizer`` (anything with
    ``save_pretrained(directory)``, e.g. a ``relax.text`` tokenizer): its files are written too.
    The config's ``pad_token_id`` is saved as it is (transformers needs one to score batches).
    ``max_shard_bytes`` and ``dtype`` as ``relax.models.hf.checkpoint.save_pretrained``'s. Returns the directory.
    """
    save_critic(
        model.as_critic(),
        directory,
        layout="sequence",
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return Path(directory)


def load_reward_model(
    directory: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None
) -> RewardModel:
    """A :class:`RewardModel` from a ``<Family>ForSequenceClassification`` directory with
    ``num_labels=1`` (``save_reward_model``'s, or transformers' / TRL's). ``dtype`` /
    ``param_dtype`` as ``load_pretrained``'s. Errors are ``HFFormatError`` naming the file and the
    tensor or field (a policy's directory, a ``score.weight`` that is not ``[1, D]``, a
    ``score.bias``, a token-classification model, ``num_labels != 1``)."""
    root = Path(directory)
    try:
        critic = load_critic(root, dtype=dtype, param_dtype=param_dtype)
    except HFFormatError as e:
        message = str(e)
        if "init_critic(" in message:  # a causal LM's directory
            raise HFFormatError(
                message.replace("value model", "reward model").replace(
                    "start a critic from it with init_critic",
                    "start a reward model from it with init_reward_model",
                )
            ) from None
        raise
    archs = read_json(root / "config.json").get("architectures")  # read and checked by load_critic
    if archs and archs[0] in value_architectures("token"):
        raise HFFormatError(
            f"{root / 'config.json'}: field 'architectures' = {archs!r} is a per-token value "
            "model; a reward model is a ...ForSequenceClassification "
            f"({value_architectures('sequence')})"
        )
    return RewardModel(critic.backbone, critic.head)
