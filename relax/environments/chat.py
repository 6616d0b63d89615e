"""Conversations as token ids, rendered by the model's own chat template, for multi-turn rollouts.

    chat = ChatFormat(tokenizer, tools=env.schemas())
    prompt = chat.prompt_ids(messages)           # the conversation so far + the assistant header
    obs = chat.observation_ids(tool_messages)    # what the template writes after a sampled turn

A trajectory is never re-rendered or re-tokenized: the policy's turns stay the token ids it
sampled, and each observation is tokenized once and appended. ``observation_ids`` is the text
the template writes between the end of an assistant turn (its stop token, which the policy
sampled) and the next assistant header::

    render(base + observation, add_generation_prompt=True)[len(render(base) up to the stop token):]

where ``base`` is a fixed conversation ending with an assistant turn: e.g. for ChatML the
``"\\n<|im_start|>user\\n<tool_response>...</tool_response><|im_end|>\\n<|im_start|>assistant\\n"`` that
follows a sampled ``<|im_end|>``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relax.environments.protocol import Message
from relax.text.base import TextTokenizer

_MARK = "\x00relax-turn\x00"  # stands for a sampled assistant turn in the base conversation


class ChatFormat:
    """Renders prompts and observations with ``tokenizer``'s chat template (``tools``: JSON schemas
    for the template's ``tools=``; ``template_kwargs``: extra template variables). ``stop_ids``:
    the tokens that end an assistant turn (default: the tokenizer's stop tokens)."""

    def __init__(
        self,
        tokenizer: TextTokenizer,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        stop_ids: tuple[int, ...] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ):
        if not tokenizer.has_chat_template:
            raise ValueError(
                f"{tokenizer!r} has no chat template: multi-turn rollouts render their prompts and "
                "observations with it"
            )
        self.tokenizer, self.tools = tokenizer, None if tools is None else list(tools)
        self.stop_ids = tuple(tokenizer.eos_token_ids) if stop_ids is None else tuple(stop_ids)
        if not self.stop_ids:
            raise ValueError(
                f"{tokenizer!r} has no stop token: pass stop_ids that end an assistant turn"
            )
        self.kwargs = dict(template_kwargs or {})
        self._base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        self._base_text = self._render(self._base)
        self._cut = self._turn_end(self._base_text)

    def _render(self, messages, add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            tools=self.tools,
            **self.kwargs,
        )

    def _turn_end(self, text: str) -> int:
        """Where a sampled turn ends in ``text``: after the mark and the stop token that follows it."""
        at = text.find(_MARK)
        if at < 0:
            raise ValueError(
                "the chat template does not write an assistant message's content verbatim"
            )
        end = at + len(_MARK)
        for stop in self.stop_ids:
            piece = self.tokenizer.decode([stop])
            if piece and text.startswith(piece, end):
                return end + len(piece)
        names = [self.tokenizer.decode([s]) for s in self.stop_ids]
        raise ValueError(
            f"the chat template does not end an assistant turn with a stop token {names}: "
            f"after the content it writes {text[end : end + 40]!r}"
        )

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The conversation and the assistant header the policy continues from."""
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tools=self.tools, **self.kwargs
        )

    def observation_text(self, messages: Sequence[Message]) -> str:
        """What the template writes after a sampled turn's stop token: ``messages`` and the next
        assistant header (module docstring)."""
        full = self._render(self._base + list(messages), add_generation_prompt=True)
        if not full.startswith(self._base_text[: self._cut]):
            raise ValueError(
                "the chat template renders an earlier assistant turn differently once messages "
                f"follow it; observations {[m.get('role') for m in messages]} cannot be appended "
                "as tokens"
            )
        return full[self._cut :]

    def observation_ids(self, messages: Sequence[Message]) -> list[int]:
        """``observation_text`` tokenized once (no special tokens added)."""
        return self.tokenizer.encode(self.observation_text(messages), add_special_tokens=False)
