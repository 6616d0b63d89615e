"""A reward model as a token reward: GRPO / PPO score completions with it on device.

    rm = load_reward_model("out/rm")
    reward_fns = [reward_model_reward(rm, weight=1.0), RewardFunction(exact_match)]
    step = make_grpo_step(cfg, StepParts(reward_fns=reward_fns, decode=decode, ...))

``reward_model_reward`` returns a ``TokenRewardFunction``: ``score_tokens`` runs it inside its own
``jax.jit`` on the rollout's arrays (prompts ``[P, Lp]`` left-padded, completions ``[P, G, N]``),
one batched forward of the reward model, no decoding and no host round trip; the score of each
completion is ``relax.models.heads.reward_model.sequence_rewards`` (read at its last valid token).

The weights are an argument of the compiled program, never constants in it: the token reward's
``params`` are the reward model's arrays, which ``score_tokens`` passes to the jit beside the token
arrays; its ``fn`` is a :class:`RewardModelScorer`, which holds only the model's static part (its
config and structure), hashes and compares by identity (a jit static must hash, and an
``equinox.Module`` holding arrays hashes by value) and puts the model back together from the
arrays it is given. So a compile does not grow with the reward model, and its weights may be
laid out on a mesh (``relax.parallel.state_shardings``) like any argument.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from relax.data.pairs import right_pad
from relax.models.forward.forward_pass import ForwardPass, check_train_attention
from relax.models.heads.reward_model import RewardModel, sequence_rewards
from relax.rewards.token_rewards import TokenRewardFunction
from relax.text.sentencepiece_model import pad_left

__all__ = ["RewardModelScorer", "TextRewardModel", "reward_model_reward"]


class RewardModelScorer:
    """``scorer(params, prompt_ids, prompt_mask, completion_ids, completion_mask) -> [P, G]``
    float32: the ``sequence_rewards`` of the reward model made of ``params`` (its arrays,
    ``scorer.params(model)``) and the static part kept here. Hashes and compares by identity
    (module docstring)."""

    __slots__ = ("static", "groups_per_pass", "attention", "ignore_pad_tokens")

    def __init__(
        self,
        model: RewardModel,
        *,
        groups_per_pass: int | None = None,
        attention: str = "auto",
        ignore_pad_tokens: bool = True,
    ):
        if not isinstance(model, RewardModel):
            raise TypeError(
                f"need a relax.models.heads.reward_model.RewardModel, got {type(model).__name__}"
            )
        check_train_attention(attention)
        if groups_per_pass is not None and groups_per_pass < 1:
            raise ValueError(f"groups_per_pass must be >= 1 or None, got {groups_per_pass}")
        self.static = eqx.partition(model, eqx.is_array)[1]
        self.groups_per_pass, self.attention = groups_per_pass, attention
        self.ignore_pad_tokens = ignore_pad_tokens

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @staticmethod
    def params(model: RewardModel):
        """The arrays of ``model``: what the scorer is called with."""
        return eqx.partition(model, eqx.is_array)[0]

    def __call__(self, params, prompt_ids, prompt_mask, completion_ids, completion_mask):
        p = prompt_ids.shape[0]
        groups = (
            self.groups_per_pass
            if self.groups_per_pass is not None and p % self.groups_per_pass == 0
            else None
        )
        return sequence_rewards(
            eqx.combine(params, self.static),
            jnp.asarray(prompt_ids),
            jnp.asarray(prompt_mask).astype(jnp.int32),
            jnp.asarray(completion_ids),
            jnp.asarray(completion_mask).astype(jnp.int32),
            ForwardPass(attention=self.attention, groups_per_pass=groups),
            ignore_pad_tokens=self.ignore_pad_tokens,
        )

    def __repr__(self) -> str:
        c = self.static.config
        return (
            f"RewardModelScorer({c.family}, {c.num_layers} layers, hidden {c.hidden_size}, "
            f"groups_per_pass={self.groups_per_pass})"
        )


def reward_model_reward(
    model: RewardModel,
    *,
    name: str = "reward_model",
    weight: float = 1.0,
    groups_per_pass: int | None = None,
    attention: str = "auto",
    ignore_pad_tokens: bool = True,
) -> TokenRewardFunction:
    """A ``TokenRewardFunction`` scoring each completion with ``model`` (``sequence_rewards``);
    its ``params`` are ``model``'s arrays, as they are laid out (place ``model`` on a mesh first
    to score with it sharded).

    ``groups_per_pass``: prompt groups per forward (a ``lax.map`` over slices; e.g. 1 on a CPU,
    where a group's activations stay in cache; ignored when it does not divide P); None: all at
    once. ``attention`` and ``ignore_pad_tokens`` as ``sequence_rewards``'s.
    """
    scorer = RewardModelScorer(
        model,
        groups_per_pass=groups_per_pass,
        attention=attention,
        ignore_pad_tokens=ignore_pad_tokens,
    )
    return TokenRewardFunction(scorer, name, weight, params=RewardModelScorer.params(model))


class TextRewardModel:
    """A host reward (TRL's signature) that scores ``prompt + completion`` TEXTS with a reward model
    and its own tokenizer, for a reward model whose tokenizer is not the policy's.

    Each sample is encoded as the reward-model trainer encodes a string row (``relax.data.pairs``):
    the prompt with the tokenizer's special tokens (through its chat template as one user message
    when ``chat`` is True), the completion without them and one EOS after it; the prompt keeps its
    last ``max_prompt_tokens`` tokens, the completion its first ``max_completion_tokens`` (EOS
    included). Samples go through the model ``batch_size`` at a time (the last batch padded), one
    compiled program per (prompt, completion) length bucket; the weights are an argument of that
    program, not constants in it. Runs in the trainer process (it holds device arrays): give it
    to ``make_score`` directly, never to a worker pool.
    """

    __name__ = "reward_model"

    def __init__(
        self,
        model: RewardModel,
        tokenizer,
        *,
        batch_size: int = 32,
        max_prompt_tokens: int = 1024,
        max_completion_tokens: int = 1024,
        chat: bool = False,
        attention: str = "auto",
    ):
        if not isinstance(model, RewardModel):
            raise TypeError(
                f"need a relax.models.heads.reward_model.RewardModel, got {type(model).__name__}"
            )
        if chat and not tokenizer.has_chat_template:
            raise ValueError(
                f"chat=True needs a chat template; tokenizer {tokenizer.path} has none"
            )
        for name, value in (
            ("batch_size", batch_size),
            ("max_prompt_tokens", max_prompt_tokens),
            ("max_completion_tokens", max_completion_tokens),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.model, self.tokenizer, self.batch_size, self.chat = model, tokenizer, batch_size, chat
        self.max_prompt_tokens, self.max_completion_tokens = (
            max_prompt_tokens,
            max_completion_tokens,
        )
        how = ForwardPass(attention=attention)
        self._score = eqx.filter_jit(functools.partial(_text_scores, how=how))

    def encode(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if self.chat:
            text = tok.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            ids = tok.encode(text, add_special_tokens=False)
        else:
            ids = tok.encode(prompt, add_special_tokens=True)
        eos = tok.eos_token_id if tok.eos_token_id is not None else tok.eos_token_ids[0]
        body = tok.encode(completion, add_special_tokens=False)[
            : self.max_completion_tokens - 1
        ] + [eos]
        return ids[-self.max_prompt_tokens :], body

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float]:
        rows = [self.encode(p, c) for p, c in zip(prompts, completions)]
        out: list[float] = []
        if not rows:
            return out
        pad = (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else rows[0][1][-1]
        )  # masked
        for start in range(0, len(rows), self.batch_size):
            chunk = rows[start : start + self.batch_size]
            chunk = chunk + [chunk[-1]] * (self.batch_size - len(chunk))  # a fixed batch shape
            prompt_ids, prompt_mask = pad_left(
                [r[0] for r in chunk], pad_id=pad, bucket_sizes=BUCKETS
            )
            n = next(b for b in BUCKETS if b >= max(len(r[1]) for r in chunk))
            tokens, mask = right_pad([r[1] for r in chunk], n, pad)
            scores = self._score(
                self.model, prompt_ids, prompt_mask, tokens[:, None], mask[:, None]
            )
            out += [
                float(s) for s in np.asarray(scores)[: min(self.batch_size, len(rows) - start), 0]
            ]
        return out


BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _text_scores(model, prompt_ids, prompt_mask, tokens, mask, *, how: ForwardPass):
    return sequence_rewards(model, prompt_ids, prompt_mask, tokens, mask, how)
