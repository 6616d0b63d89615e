"""What a prompt brings to the layers besides its token ids: an image prompt's inputs.

A vision-language model's prompt enters the language model as its token embeddings with the
image features in place of its image tokens, at RoPE positions that need not be ``0..len-1``
(Qwen2.5-VL's multimodal RoPE gives an image's tokens 2-D positions), and with attention that
may look forward inside an image (Gemma 3: the tokens of one image see each other both ways).
:class:`PromptInputs` carries exactly that, computed once per prompt; the sampler's prefill and
the trainer's prefix-shared forward take it in place of ``embed(prompt_ids)`` and the text
positions, so the image is encoded and prefilled once for the whole group. The completions that
follow are text: token ``t`` of a completion sits at RoPE position ``next_position + t``.

Masks keep sequence positions (``positions_from_mask``: index among the prompt's valid tokens);
only RoPE reads ``rope``. The attention of a prompt token ``q`` to a key ``k`` of its own prompt::

    allowed(q, k) = valid(k) & [ k <= q                    (causal)
                                 | b(q) = b(k) > 0 ]       (same bidirectional block)
                             & ( q - k < W )               (sliding layers, window W)

which is transformers' Gemma 3 rule: full layers OR(causal, block), sliding layers
AND(window, OR(causal, block)) with the window one-sided (``k > q - W``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from relax.models.decoder.transformer import (
    Transformer,
    embed,
    full_attention,
    positions_from_mask,
    run_layers,
)
from relax.models.layers.rope import Rotary, rotary

__all__ = [
    "PromptInputs",
    "features_at",
    "prompt_embeddings",
    "prompt_hidden_states",
    "text_prompt_inputs",
]


class PromptInputs(NamedTuple):
    """A batch of prompts' inputs to the layers (every leaf leads with ``[P]``).

    ``features``: ``[P, Lp, D]`` the image features at the image tokens (anything elsewhere);
    ``is_image``: ``[P, Lp]`` which tokens take them. The layers' input is
    ``prompt_embeddings``: the token embeddings of the model being run (so a trained embedding
    table gets its gradient from the prompt's text tokens) with the features at the image
    tokens; the features are computed once, by a vision tower outside. ``rope``: the prompt tokens' RoPE tables
    (``Rotary`` of ``[P, Lp, d]`` tables). ``next_position``: the RoPE position of every
    completion's first token ``[P]`` (text prompts: the prompt's length). ``blocks``: ``[P, Lp]``
    ids of bidirectional blocks, ``> 0`` where tokens of one block see each other both ways,
    0 elsewhere."""

    features: Float[Array, "p lp d"]
    is_image: Bool[Array, "p lp"]
    rope: Rotary
    next_position: Int[Array, " p"]
    blocks: Int[Array, "p lp"]


def text_prompt_inputs(
    model: Transformer, prompt_ids: Int[Array, "p lp"], prompt_mask: Int[Array, "p lp"]
) -> PromptInputs:
    """A text prompt's inputs: what the layers take when none are given (left-padded prompts at
    positions ``0..len-1``, the first completion token at ``len``, no blocks)."""
    return PromptInputs(
        features=jnp.zeros((*prompt_ids.shape, model.config.hidden_size), model.dtype),
        is_image=jnp.zeros(prompt_ids.shape, bool),
        rope=rotary(model.config, positions_from_mask(prompt_mask)),
        next_position=jnp.sum(prompt_mask.astype(jnp.int32), axis=1),
        blocks=jnp.zeros(prompt_ids.shape, jnp.int32),
    )


def prompt_embeddings(
    model: Transformer, prompt_ids: Int[Array, "p lp"], prompt: PromptInputs
) -> Float[Array, "p lp d"]:
    """``embed(prompt_ids)`` with ``prompt.features`` at the image tokens (``embed``'s dtype;
    an image token's id is not looked up: it may lie outside the vocabulary)."""
    e = embed(model, jnp.where(prompt.is_image, 0, prompt_ids))
    return jnp.where(prompt.is_image[..., None], prompt.features.astype(e.dtype), e)


def features_at(
    is_image: Bool[Array, "p lp"], features: Float[Array, "n d"], dtype
) -> Float[Array, "p lp d"]:
    """``features`` (one row per image token, in the batch's row-major token order) placed at the
    ``is_image`` tokens, zeros elsewhere: ``PromptInputs.features``. The count (``n`` equal to the
    number of image tokens) is the caller's to check on the host."""
    flat = is_image.reshape(-1)
    rank = jnp.clip(jnp.cumsum(flat.astype(jnp.int32)) - 1, 0, max(features.shape[0] - 1, 0))
    placed = jnp.take(features.astype(dtype), rank, axis=0).reshape(*is_image.shape, -1)
    return jnp.where(is_image[..., None], placed, jnp.zeros((), dtype))


def prompt_hidden_states(
    model: Transformer,
    input_ids: Int[Array, "b t"],
    attention_mask: Int[Array, "b t"],
    prompt: PromptInputs,
    *,
    remat: bool = False,
) -> Float[Array, "b t d"]:
    """Final-norm hidden states of whole sequences taken as image prompts (``hidden_states`` with
    ``prompt``'s embeddings, RoPE tables and bidirectional blocks): the full-sequence forward the
    families' parity with transformers is checked on. ``remat`` recomputes each layer in the
    backward pass."""
    positions = positions_from_mask(attention_mask)
    attend = full_attention(model, positions, attention_mask.astype(bool), prompt.blocks)
    no_kv = lambda q, k, v, li, sliding: (attend(q, k, v, li, sliding)[0], None)  # noqa: E731
    x = prompt_embeddings(model, input_ids, prompt)
    h, _, _ = run_layers(model, x, positions, no_kv, rope=prompt.rope, remat=remat)
    return h
