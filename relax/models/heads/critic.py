"""The value model PPO trains: a critic with its own backbone, or a value head on the policy.

    critic = init_critic(policy)                        # a copy of the policy's backbone, head 0
    values = completion_values(critic, prompt_ids, prompt_mask, tokens, mask)   # [P, G, N] float32
    save_critic(critic, "out/critic")   # transformers' AutoModelForSequenceClassification, num_labels=1
    critic = load_critic("out/critic")

The value of a state is a linear read-out of its final-norm hidden state ``h``::

    V(s) = h(s) . w + b                                      (float32)

Alignment, as the log-probs' (and verl's critic): ``values[p, g, t]`` is the value of the state
before completion token ``t`` is emitted, read from the hidden state that predicts token ``t``: the
last prompt position for ``t = 0``, completion position ``t - 1`` for ``t > 0``
(``relax.models.forward.prefix_shared.completion_hidden``; each prompt runs once for its G completions).
Values at masked completion positions are finite but meaningless.

The critic's backbone has no ``lm_head``: its config is the policy's with
``tie_word_embeddings=True`` (the head an unused alias of the embedding), so no ``[V, D]`` matrix
is copied, trained or saved.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from relax.models.adapters.operations import merge_lora
from relax.models.config.families import BY_ARCHITECTURE, FAMILIES
from relax.models.config.model import ModelConfig
from relax.models.decoder.logprobs import logprobs_and_entropy_from_hidden
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.decoder.transformer import Transformer
from relax.models.forward.completion_packing import CompletionBins, to_padded
from relax.models.forward.forward_pass import DEFAULT_PASS, ForwardPass
from relax.models.forward.prefix_shared import CompletionRope, completion_hidden
from relax.models.hf.checkpoint import build_transformer, load_config, save_directory
from relax.models.hf.config import HFFormatError
from relax.models.hf.weights_io import FLOAT_DTYPES, open_weights

__all__ = [
    "Critic",
    "ValueHead",
    "check_reads_prompt_inputs",
    "completion_head_values",
    "completion_logprobs_and_values",
    "completion_values",
    "init_critic",
    "init_value_head",
    "load_critic",
    "save_critic",
    "value_architectures",
    "values_from_hidden",
]

_VALUE_KINDS = ("sequence", "token")  # the value-model architectures (a family's record names them)
LAYOUTS = ("auto", "sequence", "token")


class Critic(eqx.Module):
    """A value model: ``V = final_norm_hidden(backbone) . head + bias`` (the backbone's ``lm_head`` unused)."""

    backbone: Transformer
    head: Float[Array, " d"]
    bias: Float[Array, ""]


class ValueHead(eqx.Module):
    """A value read-out ``V = h . head + bias`` on another model's (the policy's) hidden states."""

    head: Float[Array, " d"]
    bias: Float[Array, ""]


def values_from_hidden(
    h: Float[Array, "*b d"], head: Float[Array, " d"], bias: Float[Array, ""]
) -> Float[Array, "*b"]:
    """``h . head + bias`` in float32 (an elementwise product and a sum: no reduced-precision matmul)."""
    f32 = jnp.float32
    return jnp.sum(h.astype(f32) * head.astype(f32), axis=-1) + bias.astype(f32)


def _headless(model: Transformer) -> Transformer:
    """``model`` without its ``lm_head`` (the config's head tied to the embedding, never used)."""
    return dataclasses.replace(
        model, lm_head=None, config=dataclasses.replace(model.config, tie_word_embeddings=True)
    )


def _head_init(d: int, head_std: float, key) -> Float[Array, " d"]:
    if head_std == 0.0:
        return jnp.zeros((d,), jnp.float32)
    if key is None:
        raise ValueError(f"head_std={head_std} needs a key")
    return head_std * jax.random.normal(key, (d,), jnp.float32)


def init_critic(policy: Transformer, *, key: Array | None = None, head_std: float = 0.0) -> Critic:
    """A critic whose backbone is a copy of ``policy``'s (new buffers: donating the policy's leaves
    it intact; no ``lm_head``), head ``N(0, head_std)`` (zeros by default: V = 0) in float32, bias 0."""
    backbone = jax.tree.map(jnp.copy, _headless(policy))
    return Critic(
        backbone, _head_init(policy.config.hidden_size, head_std, key), jnp.zeros((), jnp.float32)
    )


def init_value_head(
    config: ModelConfig, head_std: float = 0.0, *, key: Array | None = None
) -> ValueHead:
    """A value head for a policy of ``config``: head ``N(0, head_std)`` (zeros by default), bias 0, float32."""
    return ValueHead(_head_init(config.hidden_size, head_std, key), jnp.zeros((), jnp.float32))


# what an image prompt's inputs fix: their features' width and the RoPE their tables were made with
_PROMPT_INPUT_FIELDS = ("hidden_size", "head_dim", "rope_theta", "rope_scaling", "rope_local_theta")


def check_reads_prompt_inputs(critic: ModelConfig, policy: ModelConfig) -> None:
    """Raise ``ValueError`` unless a critic of config ``critic`` can read the image prompts'
    inputs (``PromptInputs``) made for a policy of config ``policy``: their features are
    ``[P, Lp, D]`` in the policy's hidden size and their RoPE tables the policy's, so the two
    configs must agree on ``hidden_size``, ``head_dim`` and the RoPE (``rope_theta``,
    ``rope_scaling``, ``rope_local_theta``). A critic made from the policy (``init_critic``) does."""
    differ = [
        f"{name} {getattr(critic, name)!r} (the policy's: {getattr(policy, name)!r})"
        for name in _PROMPT_INPUT_FIELDS
        if getattr(critic, name) != getattr(policy, name)
    ]
    if differ:
        raise ValueError(
            "image prompts: the critic reads the policy's image features and RoPE tables, but its "
            f"config differs: {'; '.join(differ)}; start the critic from the policy "
            "(no --ppo.critic-model) or from a value model of the same language model"
        )


def completion_values(
    critic: Critic,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    tokens: Int[Array, "p g n"],
    mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    rope: CompletionRope | None = None,
    packed: CompletionBins | None = None,
    prompt: PromptInputs | None = None,
) -> Float[Array, "p g n"]:
    """``V(prompt, tokens[<t])`` for every completion token (module docstring), float32, differentiable.

    Prompts are left-padded; ``how``, ``rope``, ``packed`` and ``prompt`` as
    ``relax.models.forward.prefix_shared.completion_hidden``'s (``packed``: the backbone runs over
    the packed rows, the values come back ``[P, G, N]``; ``prompt``: an image prompt's inputs,
    the policy's, which the backbone reads as the policy does: ``check_reads_prompt_inputs``).
    """
    h = completion_hidden(
        critic.backbone,
        prompt_ids,
        prompt_mask,
        tokens,
        mask,
        how,
        rope=rope,
        packed=packed,
        prompt=prompt,
    )
    return to_padded(values_from_hidden(h, critic.head, critic.bias), packed, tokens.shape[-1])


def completion_head_values(
    policy: Transformer,
    head: ValueHead,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    tokens: Int[Array, "p g n"],
    mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    rope: CompletionRope | None = None,
    packed: CompletionBins | None = None,
    prompt: PromptInputs | None = None,
) -> Float[Array, "p g n"]:
    """``V = h . head + bias`` of a value head on ``policy``'s hidden states, for every completion
    token, ``[P, G, N]`` (``completion_values``' alignment); ``how``, ``rope``, ``packed`` and
    ``prompt`` as ``completion_values``'."""
    h = completion_hidden(
        policy, prompt_ids, prompt_mask, tokens, mask, how, rope=rope, packed=packed, prompt=prompt
    )
    return to_padded(values_from_hidden(h, head.head, head.bias), packed, tokens.shape[-1])


def completion_logprobs_and_values(
    policy: Transformer,
    head: ValueHead,
    prompt_ids: Int[Array, "p lp"],
    prompt_mask: Int[Array, "p lp"],
    tokens: Int[Array, "p g n"],
    mask: Int[Array, "p g n"],
    how: ForwardPass = DEFAULT_PASS,
    *,
    temperature: float = 1.0,
    rope: CompletionRope | None = None,
    packed: CompletionBins | None = None,
    prompt: PromptInputs | None = None,
) -> tuple[Float[Array, "p g n"], Float[Array, "p g n"], Float[Array, "p g n"]]:
    """``(log p(tokens[t] | ...), entropy, V)`` per completion token from ONE forward of ``policy``.

    The log-probs and entropies are ``completion_logprobs``' with entropies (``how.chunk_size``,
    ``how.entropy_grad``; whatever ``how.with_entropy`` says); the values read the same hidden
    states through ``head`` (``V = h . head + bias``). ``packed``: the forward, the vocabulary
    projection and the value read-out run over the packed rows only; all three come back
    ``[P, G, N]``. ``prompt``: an image prompt's inputs (``completion_hidden``'s).
    """
    h = completion_hidden(
        policy, prompt_ids, prompt_mask, tokens, mask, how, rope=rope, packed=packed, prompt=prompt
    )
    targets = tokens if packed is None else packed.ids
    rows = targets.reshape(-1, targets.shape[-1])
    lp, ent = logprobs_and_entropy_from_hidden(
        policy,
        h.reshape(rows.shape + h.shape[-1:]),
        rows,
        temperature=temperature,
        chunk_size=how.chunk_size,
        entropy_grad=how.entropy_grad,
    )
    values = values_from_hidden(h, head.head, head.bias)
    n = tokens.shape[-1]
    return tuple(to_padded(x.reshape(targets.shape), packed, n) for x in (lp, ent, values))


# ----------------------------------------------------------------------------- Hugging Face directories


def save_critic(
    critic: Critic,
    directory: str | os.PathLike,
    *,
    layout: str = "auto",
    max_shard_bytes: int | None = None,
    dtype=None,
) -> None:
    """Write ``critic`` as a transformers value-model directory (``num_labels=1``).

    Tensors: the backbone as ``model.*`` (no ``lm_head``) and ``score.weight`` ``[1, D]``;
    ``config.json`` names the architecture and one label (``id2label``). ``layout``:

    - ``"sequence"``: ``<Family>ForSequenceClassification`` (TRL's value model; loads with
      ``AutoModelForSequenceClassification``). Its ``score`` has no bias, so the critic's bias must be
      0: a nonzero one is refused (``ValueError``), never dropped.
    - ``"token"``: ``<Family>ForTokenClassification`` (verl's critic), plus ``score.bias`` ``[1]``;
      not for Gemma 3 (transformers has no such class).
    - ``"auto"`` (default): ``"sequence"`` when the bias is exactly 0, else ``"token"``.

    ``max_shard_bytes`` and ``dtype`` as ``relax.models.hf.checkpoint.save_pretrained``'s.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown critic layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    backbone = _headless(merge_lora(critic.backbone))  # a LoRA backbone is written merged
    family, bias = backbone.config.family, np.asarray(critic.bias)
    if layout == "auto":
        layout = "sequence" if float(bias) == 0.0 else "token"
    rec = FAMILIES[family]
    if layout == "sequence" and float(bias) != 0.0:
        raise ValueError(
            f"critic bias is {float(bias)}, but {rec.sequence_classification}'s score has no bias; "
            "save with layout='token' (a ...ForTokenClassification, whose score has one)"
        )
    arch = rec.sequence_classification if layout == "sequence" else rec.token_classification
    if arch is None:
        other = "token" if layout == "sequence" else "sequence"
        raise ValueError(
            f"transformers has no {layout}-classification model for {family!r}: "
            f"save with layout={other!r}"
            + (" (needs a critic bias of 0)" if other == "sequence" else "")
        )
    extra = {"score.weight": np.asarray(critic.head)[None, :]}
    fields = {"architectures": [arch], "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    if layout == "token":
        extra["score.bias"] = bias.reshape(1)
        fields["classifier_dropout"] = 0.0
    save_directory(
        backbone,
        directory,
        max_shard_bytes=max_shard_bytes,
        dtype=dtype,
        extra=extra,
        hf_fields=fields,
    )


def value_architectures(kind: str | None = None) -> list[str]:
    """The transformers value-model architectures relax reads and writes (of one ``kind``,
    ``"sequence"`` or ``"token"``; None: both), sorted."""
    kinds = _VALUE_KINDS if kind is None else (kind,)
    return sorted(a for a, (k, _) in BY_ARCHITECTURE.items() if k in kinds)


def _critic_config(found: dict):
    """``config.json`` adapter for ``load_config``: checks the architecture and the one label,
    records the layout kind in ``found``, and hands on the family's causal-LM spelling."""

    def adapt(d: dict, source: str) -> dict:
        if not isinstance(d, dict):
            return d  # config_from_hf reports it
        archs = d.get("architectures")
        if archs is not None:
            if not (isinstance(archs, list) and len(archs) == 1 and archs[0] in BY_ARCHITECTURE):
                raise HFFormatError(
                    f"{source}: field 'architectures' = {archs!r} is not one value model; "
                    f"supported: {value_architectures()}"
                )
            found["kind"], family = BY_ARCHITECTURE[archs[0]]
            d = {**d, "architectures": [FAMILIES[family].causal_lm]}
        if found.get("kind") == "causal":
            return d  # a policy's directory: load_critic names the missing value head
        labels = d.get("id2label")
        if labels is not None and (not isinstance(labels, dict) or len(labels) != 1):
            raise HFFormatError(
                f"{source}: field 'id2label' = {labels!r}: a value model has one label (num_labels=1)"
            )
        if d.get("num_labels", 1) != 1:
            raise HFFormatError(
                f"{source}: field 'num_labels' = {d['num_labels']!r}: a value model has num_labels=1"
            )
        return d

    return adapt


def _score(where: dict, name: str, shape: tuple[int, ...], target) -> np.ndarray:
    f = where[name]
    code, stored = f.entries[name][:2]
    if stored != shape:
        raise HFFormatError(
            f"{f.path}: tensor {name!r} has shape {list(stored)}, expected {list(shape)} "
            "(a value head: num_labels=1)"
        )
    if code not in FLOAT_DTYPES:
        raise HFFormatError(
            f"{f.path}: tensor {name!r} has dtype {code}; "
            f"expected floating point ({', '.join(FLOAT_DTYPES)})"
        )
    a = np.array(f.read(name))
    return a.astype(
        target if target is not None else (np.float32 if a.dtype == np.float64 else a.dtype)
    )


def load_critic(
    directory: str | os.PathLike, *, dtype=jnp.float32, param_dtype=None, precision=None
) -> Critic:
    """A :class:`Critic` from a transformers value-model directory (``save_critic``'s, or
    ``<Family>ForSequenceClassification`` / ``ForTokenClassification`` with ``num_labels=1``).

    ``score.weight`` ``[1, D]`` is the head, ``score.bias`` ``[1]`` (token layout only) the bias
    (else 0); a stored ``lm_head.weight`` is ignored. ``dtype`` / ``param_dtype`` / ``precision`` as
    ``load_pretrained``'s (``param_dtype`` casts the head and bias too). Errors are
    :class:`HFFormatError` naming the file and tensor.
    """
    root, found = Path(directory), {}
    cfg = dataclasses.replace(load_config(root, _critic_config(found)), tie_word_embeddings=True)
    where, listing = open_weights(root)
    d, target = cfg.hidden_size, None if param_dtype is None else np.dtype(jnp.dtype(param_dtype))
    if "score.weight" not in where:
        hint = (
            " (a causal LM, not a value model: start a critic from it with init_critic(load_pretrained(...)))"
            if found.get("kind") == "causal"
            else ""
        )
        raise HFFormatError(f"{listing}: no tensor 'score.weight' (the value head, [1, {d}]){hint}")
    if "score.bias" in where and found.get("kind") == "sequence":
        raise HFFormatError(
            f"{where['score.bias'].path}: unexpected tensor 'score.bias': a "
            "...ForSequenceClassification score has no bias (transformers would drop it)"
        )
    head = _score(where, "score.weight", (1, d), target)[0]
    bias = (
        _score(where, "score.bias", (1,), target)[0]
        if "score.bias" in where
        else np.zeros((), head.dtype)
    )
    rest = {
        n: f for n, f in where.items() if n not in ("score.weight", "score.bias", "lm_head.weight")
    }
    backbone = build_transformer(cfg, rest, listing, dtype=dtype, param_dtype=param_dtype)
    if precision is not None:
        backbone = dataclasses.replace(backbone, precision=precision)
    return Critic(backbone, jnp.asarray(head), jnp.asarray(bias))
