"""Tokenizing a row's prompt and completions for the preference trainers (``relax.data.pairs``)
and image rows (``relax.data.image_rows``): standard rows as raw text, conversational rows through
the tokenizer's chat template with each completion cut out of the rendered conversation, every
completion ending at an EOS, prompts and completions checked against their budgets, every error
naming the file, the row and the field (the rules: ``relax.data.pairs``' docstring)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from relax.data.files import MissingFieldError, Record
from relax.text.base import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Budget:
    """A row's token budgets: ``max_prompt_tokens`` (cut from the left with ``truncate_prompt``,
    else an error) and ``max_completion_tokens`` (EOS included; always an error over it)."""

    max_prompt_tokens: int
    max_completion_tokens: int
    truncate_prompt: bool

    def __post_init__(self):
        if self.max_prompt_tokens < 1 or self.max_completion_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} and max_completion_tokens="
                f"{self.max_completion_tokens} must be >= 1"
            )


class RowErrors:
    """Error messages naming the row's file, row and a field."""

    def __init__(self, r: Record):
        self.r = r

    def error(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.r.file}: row {self.r.row}: field {field!r}: {message}")


def eos_id(tokenizer: TextTokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    if eos is None:
        raise ValueError(
            f"tokenizer {tokenizer.path} has no eos token: completions need one to end"
        )
    return eos


def is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def is_empty(value: Any) -> bool:
    """No text: an empty / blank string, no messages, or messages whose contents are all blank."""
    if isinstance(value, str):
        return not value.strip()
    if is_messages(value):
        return all(
            isinstance(m, Mapping)
            and not m.get("tool_calls")
            and (
                m.get("content") is None
                or (isinstance(m.get("content"), str) and not m["content"].strip())
            )
            for m in value
        )
    return False


def check_value(row: RowErrors, field: str, value: Any) -> None:
    if not isinstance(value, str) and not is_messages(value):
        raise row.error(
            field, f"must be a string or a list of chat messages, got {type(value).__name__}"
        )
    if is_messages(value) and not all(isinstance(m, Mapping) and "role" in m for m in value):
        raise row.error(field, "chat messages must be dicts with a 'role'")


class Encoder:
    """Tokenizes prompts and completions of rows and checks them against the budget."""

    def __init__(self, tokenizer: TextTokenizer, budget: Budget):
        self.tok, self.budget, self.eos = tokenizer, budget, eos_id(tokenizer)

    def split_implicit(
        self, row: RowErrors, first: str, second: str, a: Any, b: Any
    ) -> tuple[list, list, list]:
        """TRL's implicit prompt: the messages ``a`` and ``b`` share first, then their own."""
        if not (is_messages(a) and is_messages(b)):
            raise MissingFieldError(
                f"{row.r.file}: row {row.r.row}: missing field 'prompt' (row has "
                f"{sorted(row.r.record)}; without it {first!r} and {second!r} must be "
                "conversations sharing their first messages)"
            )
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        if n == 0:
            raise row.error(
                first, f"no prompt column, and {first!r} and {second!r} share no first message"
            )
        return list(a[:n]), list(a[n:]), list(b[n:])

    def prompt(
        self, row: RowErrors, prompt: Any, chat: bool
    ) -> tuple[list[int], str | None, list | None]:
        """``(ids, rendered text or None, messages or None)`` of the prompt, budget applied."""
        if chat:
            if not self.tok.has_chat_template:
                raise row.error(
                    "prompt",
                    f"chat messages need a chat template; tokenizer {self.tok.path} has none",
                )
            messages = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            )
            try:
                text = self.tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # the template's own errors (roles, raise_exception)
                raise row.error("prompt", f"chat template failed: {e}") from e
            ids = self.tok.encode(text, add_special_tokens=False)
        else:
            messages, text = None, None
            ids = self.tok.encode(prompt, add_special_tokens=True)
        if not ids:
            raise row.error(
                "prompt", "is empty (the first completion token needs a prompt token before it)"
            )
        limit = self.budget.max_prompt_tokens
        if len(ids) > limit:
            if not self.budget.truncate_prompt:
                raise row.error(
                    "prompt",
                    f"has {len(ids)} tokens > max_prompt_tokens={limit} (truncate_prompt is off)",
                )
            head = 1 if self.tok.bos_token_id is not None and ids[0] == self.tok.bos_token_id else 0
            ids = ids[:head] + ids[len(ids) - (limit - head) :]
        return ids, text, messages

    def _end(self, ids: list[int]) -> list[int]:
        """``ids`` ending at an EOS: cut after the last EOS id that only whitespace follows (a chat
        template's newline after its end-of-turn token), else with one appended."""
        eos = set(self.tok.eos_token_ids)
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] in eos:
                if not self.tok.decode(ids[k + 1 :]).strip():
                    return ids[: k + 1]
                break
        return ids + [self.eos]

    def completion(
        self, row: RowErrors, field: str, value: Any, prompt_text: str | None, messages: list | None
    ) -> list[int]:
        """The completion's ids with an EOS at the end, checked against the budget."""
        if is_empty(value):
            raise row.error(field, "is empty")
        if messages is None:
            ids = self.tok.encode(value, add_special_tokens=False)
        else:
            turn = (
                [{"role": "assistant", "content": value}] if isinstance(value, str) else list(value)
            )
            try:
                full = self.tok.apply_chat_template(messages + turn, tokenize=False)
            except Exception as e:
                raise row.error(field, f"chat template failed: {e}") from e
            if not full.startswith(prompt_text):
                raise row.error(
                    field,
                    "the chat template does not render the prompt with the generation prompt "
                    "as the start of the conversation with this completion, so the completion "
                    "cannot be cut out of it",
                )
            ids = self.tok.encode(full[len(prompt_text) :], add_special_tokens=False)
        if not ids:
            raise row.error(field, "is empty (no tokens)")
        ids = self._end(ids)
        limit = self.budget.max_completion_tokens
        if len(ids) > limit:
            raise row.error(
                field, f"has {len(ids)} tokens with its EOS > max_completion_tokens={limit}"
            )
        return ids


def chat_completion(
    tokenizer: TextTokenizer,
    r: Record,
    field: str,
    value: Any,
    prompt_text: str,
    messages: list,
    *,
    max_completion_tokens: int,
) -> list[int]:
    """Row ``r``'s completion ``field`` after the chat ``messages`` (rendered with the generation
    prompt as ``prompt_text``): its ids ending with an EOS, cut out as a conversational row's are
    (module docstring), checked against ``max_completion_tokens``; errors name the row."""
    enc, row = Encoder(tokenizer, Budget(1, max_completion_tokens, False)), RowErrors(r)
    check_value(row, field, value)
    return enc.completion(row, field, value, prompt_text, messages)


def conversational(*values: Any) -> bool:
    return any(is_messages(v) for v in values)
