"""Completions of text prompts with relax's sampler, cut as lm-evaluation-harness cuts them.

Each prompt is ``tokenizer.encode(prompt)`` with the special tokens the tokenizer adds (as
transformers' tokenizer call does for lm-eval's ``hf`` model), its last ``max_context -
max_new_tokens`` tokens kept (lm-eval's left truncation). Prompts are sorted by length (longest
first, as lm-eval batches them), sampled ``batch_size`` at a time (the last batch padded by
repeating its first prompt) and returned in the original order. A completion is its tokens up to
the first stop token, decoded with the special tokens skipped, then cut before the first of
``until`` (``truncate_at_stops``; lm-eval adds the tokenizer's eos string to ``until``).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
import numpy as np

from relax.eval.harness.filters import truncate_at_stops
from relax.rollout.config import RolloutConfig
from relax.rollout.sampler import generate_with
from relax.rollout.sampling import SamplingConfig
from relax.text.base import TextTokenizer
from relax.text.sentencepiece_model import pad_left


def encode_prompts(tokenizer: TextTokenizer, prompts: Sequence[str], keep: int) -> list[list[int]]:
    """Token ids of each prompt, its last ``keep`` tokens (lm-eval's ``left_truncate_len``); a
    warning counts the prompts cut. The tokenizer's special tokens are added unless the prompt
    starts with the BOS text (lm-eval's ``has_bos_prefix``)."""
    if keep < 1:
        raise ValueError(f"the model's context leaves {keep} tokens for the prompt")
    bos = tokenizer.special_tokens.get("bos_token")
    rows = [  # a prompt that starts with the BOS text (a chat template's) gets no second one
        tokenizer.encode(p, add_special_tokens=not (bos and p.startswith(bos))) for p in prompts
    ]
    cut = [i for i, r in enumerate(rows) if len(r) > keep]
    if cut:
        warnings.warn(
            f"{len(cut)} of {len(rows)} prompts are longer than the {keep} tokens the context "
            f"leaves them and keep their last {keep} (as lm-eval does); items {cut[:10]}",
            stacklevel=2,
        )
    return [r[-keep:] for r in rows]


def stop_strings(tokenizer: TextTokenizer, until: Sequence[str]) -> tuple[str, ...]:
    """``until`` plus the tokenizer's eos string (lm-eval's ``handle_stop_sequences``)."""
    eos = tokenizer.special_tokens.get("eos_token")
    return tuple(until) + ((eos,) if eos and eos not in until else ())


def generate_texts(
    model,
    tokenizer: TextTokenizer,
    prompts: Sequence[str],
    *,
    until: Sequence[str],
    max_new_tokens: int,
    num_samples: int = 1,
    temperature: float = 0.0,
    batch_size: int = 16,
    key=None,
) -> list[tuple[str, ...]]:
    """``num_samples`` completions of each prompt (greedy at ``temperature`` 0), cut at ``until``."""
    if not prompts:
        return []
    context = int(model.config.max_position_embeddings)
    rows = encode_prompts(tokenizer, prompts, context - max_new_tokens)
    rcfg = RolloutConfig(
        num_generations=num_samples,
        max_new_tokens=max_new_tokens,
        sampling=SamplingConfig(temperature=temperature),
        eos_ids=tuple(tokenizer.eos_token_ids),
        pad_id=tokenizer.pad_token_id,
    )
    stops = stop_strings(tokenizer, until)
    key = jax.random.key(0) if key is None else key
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    out: list[tuple[str, ...] | None] = [None] * len(rows)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = [rows[i] for i in idx] + [rows[idx[0]]] * (batch_size - len(idx))
        ids, mask = pad_left(batch, pad_id=tokenizer.pad_token_id)
        r = generate_with(model, ids, mask, jax.random.fold_in(key, start), rcfg)
        tokens, masks = np.asarray(r.tokens), np.asarray(r.mask)
        for j, i in enumerate(idx):
            texts = tokenizer.decode_batch(tokens[j], masks[j], skip_special_tokens=True)
            out[i] = tuple(truncate_at_stops(t, stops) for t in texts)
    return out  # type: ignore[return-value]
