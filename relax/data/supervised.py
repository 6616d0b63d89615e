"""Supervised rows: records -> token examples with a loss mask -> padded or packed batches.

**Examples** (``encode_sft``): each ``relax.data.files.Record`` is one of three kinds, told
apart by its columns (names configurable):

- ``messages``: a chat, a list of ``{role, content}`` messages, rendered with the tokenizer's
  own chat template (``tokenizer.apply_chat_template``). The loss is on the assistant turns
  only, found by rendering prefixes (as TRL's ``assistant_only_loss`` without generation tags):
  assistant turn ``i`` is the tokens between the render of ``messages[:i]`` with the
  generation prompt and the render of ``messages[:i+1]``, so the turn's header is not a target
  and its content and end-of-turn tokens are. A template that does not render prefixes as
  token prefixes of the whole chat is an error (the turns cannot be located).
- ``prompt`` + ``completion``: the loss is on the completion only. A string prompt is encoded as
  plain text with the tokenizer's special tokens (a BOS where it adds one), the completion without
  them, and the EOS is appended to the completion. A prompt that is a message list goes through
  the chat template (with the generation prompt) and the completion (a string: one assistant
  message; or a message list) is the rest of the rendered chat, ended as the template ends a turn.
- ``text``: plain text, the loss on every token (but the first, which nothing predicts), EOS appended.

``SFTExample.loss_mask`` is aligned with ``ids``: 1 where the token at ``t`` is a target, i.e.
predicted from ``t - 1``; it is always 0 at ``t = 0``.

**Errors** name the file, the 1-based row and the field: a missing column (``MissingFieldError``),
an empty completion / text / chat, a chat without an assistant turn, a value of the wrong type.

**Truncation policy**: an example longer than ``max_length`` tokens is an error naming the file,
row, field and length, unless ``truncate=True``: then it is cut from the END to ``max_length``
tokens (the prompt and the start of the answer are kept), and it is still an error if the cut
leaves no loss token.

**Batches** of these examples (``pack``, ``pad_rows``, ``pack_rows``, ``stack_rows``: a
``PackedBatch``) and ``pad_examples`` are built by ``relax.data.packing``; they are importable
from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from relax.data.files import MissingFieldError, Record, as_record, require_fields
from relax.data.packing import (
    PACK_METHODS,
    PackedBatch,
    loss_tokens,
    pack,
    pack_plan,
    pack_rows,
    pad_examples,
    pad_rows,
    padding_fraction,
    stack_rows,
)
from relax.text.base import TextTokenizer

__all__ = [
    "PACK_METHODS",
    "PackedBatch",
    "SFTExample",
    "encode_sft",
    "encode_sft_record",
    "loss_tokens",
    "pack",
    "pack_plan",
    "pack_rows",
    "pad_examples",
    "pad_rows",
    "padding_fraction",
    "stack_rows",
]


# ------------------------------------------------------------------------------ examples


@dataclasses.dataclass(frozen=True, eq=False)
class SFTExample:
    """One tokenized example: ``ids`` and ``loss_mask`` int32 ``[n]`` (1 where ``ids[t]`` is a
    target, predicted from ``t - 1``; 0 at ``t = 0``); ``origin`` names its file and row, for errors."""

    ids: np.ndarray
    loss_mask: np.ndarray
    origin: str = ""

    def __post_init__(self):
        ids, mask = np.asarray(self.ids, np.int32), np.asarray(self.loss_mask, np.int32)
        where = f"{self.origin}: " if self.origin else ""
        if ids.ndim != 1 or mask.shape != ids.shape or ids.size == 0:
            raise ValueError(
                f"{where}an SFTExample needs ids and loss_mask of one non-empty length, got "
                f"{ids.shape} and {mask.shape}"
            )
        if mask[0]:
            raise ValueError(
                f"{where}the first token of an example cannot be a target (loss_mask[0] must be 0)"
            )
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "loss_mask", mask)

    def __len__(self) -> int:
        return int(self.ids.size)


def encode_sft(
    records: Sequence[Record | Mapping[str, Any]],
    tokenizer: TextTokenizer,
    *,
    max_length: int,
    truncate: bool = False,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    text_field: str = "text",
) -> list[SFTExample]:
    """Every record as an ``SFTExample`` (module docstring: kinds, masks, truncation, errors).
    Plain dicts are named ``<records>`` and their 1-based index in errors."""
    if max_length < 2:
        raise ValueError(f"max_length={max_length} leaves no room for a target (at least 2)")
    rows = [as_record(r, i) for i, r in enumerate(records, start=1)]
    return [
        encode_sft_record(
            r,
            tokenizer,
            max_length=max_length,
            truncate=truncate,
            messages_field=messages_field,
            prompt_field=prompt_field,
            completion_field=completion_field,
            text_field=text_field,
        )
        for r in rows
    ]


def encode_sft_record(
    r: Record,
    tokenizer: TextTokenizer,
    *,
    max_length: int,
    truncate: bool = False,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
    text_field: str = "text",
) -> SFTExample:
    """One record as an ``SFTExample`` (see ``encode_sft``)."""
    cols = r.record
    if messages_field in cols:
        ids, mask, field = _encode_chat(r, messages_field, tokenizer) + (messages_field,)
    elif prompt_field in cols or completion_field in cols:
        require_fields(r, [prompt_field, completion_field])
        ids, mask, field = _encode_prompt_completion(
            r, prompt_field, completion_field, tokenizer, max_length
        )
    elif text_field in cols:
        ids, mask, field = _encode_text(r, text_field, tokenizer) + (text_field,)
    else:
        raise MissingFieldError(
            f"{r.file}: row {r.row}: missing field: a supervised row needs {messages_field!r}, "
            f"{prompt_field!r} + {completion_field!r}, or {text_field!r} (row has {sorted(cols)})"
        )
    where = f"{r.file}: row {r.row}"
    if len(ids) > max_length:
        if not truncate:
            raise ValueError(
                f"{where}: field {field!r}: the example has {len(ids)} tokens > max_length="
                f"{max_length} (pass truncate=True to cut it from the end)"
            )
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise ValueError(
                f"{where}: field {field!r}: cut to max_length={max_length} tokens, the example "
                "keeps no loss token (its targets all lie past the cut)"
            )
    return SFTExample(np.asarray(ids, np.int32), np.asarray(mask, np.int32), origin=where)


def _fail(r: Record, field: str, msg: str) -> ValueError:
    return ValueError(f"{r.file}: row {r.row}: field {field!r}: {msg}")


def _eos(r: Record, field: str, tokenizer: TextTokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise _fail(
            r, field, f"tokenizer {tokenizer.path} has no EOS token to end the example with"
        )
    return tokenizer.eos_token_id


def _with_eos(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else ids + [eos]


def _empty(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0)


def _encode_text(r: Record, field: str, tokenizer: TextTokenizer) -> tuple[list[int], list[int]]:
    text = r.record[field]
    if not isinstance(text, str):
        raise _fail(r, field, f"expected a string, got {type(text).__name__}")
    if not text:
        raise _fail(r, field, "is empty")
    ids = _with_eos(tokenizer.encode(text, add_special_tokens=True), _eos(r, field, tokenizer))
    return ids, [0] + [1] * (len(ids) - 1)


def _messages(r: Record, field: str, value: Any) -> list[Mapping[str, Any]]:
    if not isinstance(value, (list, tuple)):
        raise _fail(r, field, f"expected a list of chat messages, got {type(value).__name__}")
    if not value:
        raise _fail(r, field, "is empty")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or "role" not in m:
            raise _fail(r, field, f"message {i} is not a {{role, content}} mapping: {m!r}")
    return list(value)


def _render(
    r: Record, field: str, tokenizer: TextTokenizer, messages, generation_prompt: bool
) -> list[int]:
    if not tokenizer.has_chat_template:
        raise _fail(
            r, field, f"chat messages need a chat template; tokenizer {tokenizer.path} has none"
        )
    try:
        return list(
            tokenizer.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tokenize=True
            )
        )
    except Exception as e:  # template errors (raise_exception, undefined names) of any type
        raise _fail(r, field, f"the chat template failed: {e}") from e


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _encode_chat(r: Record, field: str, tokenizer: TextTokenizer) -> tuple[list[int], list[int]]:
    """The whole chat; the loss on each assistant turn (found by rendering prefixes)."""
    messages = _messages(r, field, r.record[field])
    ids = _render(r, field, tokenizer, messages, False)
    mask = [0] * len(ids)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not turns:
        raise _fail(r, field, "has no assistant message: nothing to train on")
    for i in turns:
        m = messages[i]
        if _empty(m.get("content")) and not m.get("tool_calls"):
            raise _fail(r, field, f"assistant message {i} is empty")
        start = _render(r, field, tokenizer, messages[:i], True) if i else []
        end = _render(r, field, tokenizer, messages[: i + 1], False)
        if not (_is_prefix(start, end) and _is_prefix(end, ids)) or len(end) == len(start):
            raise _fail(
                r,
                field,
                f"the chat template does not render the chat up to message {i} as a prefix "
                "of the whole chat, so the assistant tokens cannot be located",
            )
        mask[max(len(start), 1) : len(end)] = [1] * (len(end) - max(len(start), 1))
    return ids, mask


def _encode_prompt_completion(
    r: Record, prompt_field: str, completion_field: str, tokenizer: TextTokenizer, max_length: int
) -> tuple[list[int], list[int], str]:
    """``[prompt | completion]``, the loss on the completion; the third value is the field to
    blame when the example is too long (the prompt when it alone fills ``max_length``)."""
    prompt, completion = r.record[prompt_field], r.record[completion_field]
    if _empty(completion):
        raise _fail(r, completion_field, "is empty")
    if isinstance(prompt, str):
        if not isinstance(completion, str):
            kind = type(completion).__name__
            raise _fail(r, completion_field, f"expected a string after a string prompt, got {kind}")
        p = tokenizer.encode(prompt, add_special_tokens=True)
        c = _with_eos(
            tokenizer.encode(completion, add_special_tokens=False),
            _eos(r, completion_field, tokenizer),
        )
    elif isinstance(prompt, (list, tuple)):
        p_msgs = _messages(r, prompt_field, prompt)
        c_msgs = (
            [{"role": "assistant", "content": completion}]
            if isinstance(completion, str)
            else _messages(r, completion_field, completion)
        )
        p = _render(r, prompt_field, tokenizer, p_msgs, True)
        full = _render(r, completion_field, tokenizer, p_msgs + c_msgs, False)
        if not _is_prefix(p, full) or len(full) == len(p):
            raise _fail(
                r,
                completion_field,
                "the chat template does not render the prompt as a prefix of the "
                "prompt + completion chat, so the completion cannot be located",
            )
        c = full[len(p) :]
    else:
        raise _fail(
            r,
            prompt_field,
            f"expected a string or a list of chat messages, got {type(prompt).__name__}",
        )
    ids = p + c
    mask = [0] * len(p) + [1] * len(c)
    mask[0] = (
        0  # with an empty prompt (and no BOS) the first completion token has nothing before it
    )
    return ids, mask, prompt_field if len(p) >= max_length else completion_field
