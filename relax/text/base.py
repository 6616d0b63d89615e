"""The interface every relax text tokenizer has, with transformers' names.

    tok = load_tokenizer("path/to/Qwen2.5-0.5B-Instruct")
    ids = tok.apply_chat_template(messages, add_generation_prompt=True)   # list[int]
    text = tok.decode(completion_ids, skip_special_tokens=True)

:class:`TextTokenizer` implements what does not depend on the vocabulary format (special ids,
stop tokens, padding id, chat templates); subclasses implement ``encode``, ``decode``,
``token_to_id``, ``vocab_size`` and ``save_pretrained``.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from relax.text.chat_template import render_chat, select_template
from relax.text.files import ChatTemplates, Sidecars

# apply_chat_template arguments of transformers that relax does not implement: refused rather
# than passed to the template as variables.
_UNSUPPORTED_CHAT_ARGS = (
    "return_tensors",
    "padding",
    "truncation",
    "max_length",
    "tokenizer_kwargs",
    "return_assistant_tokens_mask",
    "sanitize_control_tokens",
)


class TextTokenizer(abc.ABC):
    """A tokenizer plus what its model directory says about special tokens and chat format.

    - ``bos_token_id``: the id of the configured ``bos_token`` (None when there is none).
    - ``eos_token_ids``: the configured ``eos_token``'s id, then every ``eos_token_id`` of the
      directory's ``generation_config.json`` not already listed (Llama 3 Instruct:
      ``<|eot_id|>``, ``<|end_of_text|>``, ``<|eom_id|>``). Generation stops on any of them.
    - ``pad_token_id``: the configured ``pad_token``'s id; without one the first of
      ``eos_token_ids`` (TRL's choice), and 0 if there is no eos either. Padding is carried by
      the attention mask, so a pad id that is also a real token is harmless.
    - ``vocab_size``: the embedding-relevant size, the largest token id + 1 (added tokens
      included), which can be less than a model's (padded) embedding table.
    """

    path: Path
    _sidecars: Sidecars

    # ---- format-specific ----

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds what the tokenizer adds (e.g. BOS)."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids [T]`` (a list, numpy or jax array, or one int); special tokens dropped if
        asked. A 2-D array raises: use ``decode_batch``."""

    @abc.abstractmethod
    def token_to_id(self, token: str) -> int | None:
        """The id of ``token`` (a vocabulary or added token), or None if it has none."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """The largest token id + 1."""

    @abc.abstractmethod
    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write the tokenizer files into ``directory`` (created if needed); returns it."""

    # ---- shared ----

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """``encode`` applied to each text."""
        return [self.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    def decode_batch(
        self,
        ids: Sequence[Sequence[int]] | np.ndarray,
        mask: np.ndarray | None = None,
        skip_special_tokens: bool = False,
    ) -> list[str]:
        """``decode`` of each row of ``ids [B, T]`` (lists, numpy or jax); with ``mask [B, T]``
        only the positions where it is nonzero (e.g. a rollout's completion mask)."""
        if mask is not None:
            rows, mask = np.asarray(ids), np.asarray(mask)
            if rows.ndim != 2 or mask.shape != rows.shape:
                raise ValueError(
                    f"decode_batch needs ids [B, T] and a mask of the same shape, got "
                    f"{rows.shape} and {mask.shape}"
                )
            ids = [row[m != 0] for row, m in zip(rows, mask)]
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in ids]

    @property
    def special_tokens(self) -> dict[str, str]:
        """Named special token strings (``{"bos_token": ..., "eos_token": ..., ...}``, only those
        set, plus model-specific ``*_token`` ones); the chat template sees these as variables."""
        return self._sidecars.token_strings

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own eos (transformers' ``eos_token_id``); see ``eos_token_ids``."""
        return self._special_id("eos_token")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = [] if self.eos_token_id is None else [self.eos_token_id]
        ids += [i for i in self._sidecars.generation_eos if i not in ids]
        return tuple(ids)

    @property
    def pad_token_id(self) -> int:
        pad = self._special_id("pad_token")
        if pad is not None:
            return pad
        eos = self.eos_token_ids
        return eos[0] if eos else 0

    @property
    def chat_template(self) -> ChatTemplates | None:
        """The template source, a ``{name: source}`` dict of several, or None."""
        return self._sidecars.chat_template

    @property
    def has_chat_template(self) -> bool:
        return self._sidecars.chat_template is not None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        documents: Sequence[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
        **kwargs: Any,
    ) -> list[int] | str:
        """Render ``messages`` with the model's chat template; ids if ``tokenize`` else text.

        As transformers: ``chat_template`` names one of several templates (or is a template
        source itself), tools select a ``"tool_use"`` template when there is one, extra keyword
        arguments become template variables (e.g. ``enable_thinking=False``), and the rendered
        text is tokenized with ``add_special_tokens=False``, so a template that writes
        ``bos_token`` gives exactly one BOS. Unlike transformers 5 (whose default is
        ``return_dict=True``) ids come back as a plain ``list[int]``.
        """
        unsupported = [k for k in _UNSUPPORTED_CHAT_ARGS if k in kwargs]
        if kwargs.get("return_dict"):
            unsupported.append("return_dict=True")
        if unsupported:
            raise TypeError(f"apply_chat_template does not support {', '.join(unsupported)}")
        kwargs.pop("return_dict", None)
        template = select_template(self.chat_template, chat_template, tools, self.path)
        text = render_chat(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            variables={**self.special_tokens, **kwargs},
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.token_to_id(token)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_ids}, pad={self.pad_token_id}, "
            f"chat_template={self.has_chat_template})"
        )


def ids_list(ids: Iterable[int] | np.ndarray) -> list[int]:
    """``ids [T]`` (a list, a numpy/jax array or a single int) as a list of Python ints."""
    array = np.asarray(ids)
    if array.ndim > 1:
        raise ValueError(
            f"decode takes one sequence of ids [T], got shape {array.shape}; "
            f"use decode_batch for [B, T]"
        )
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got dtype {array.dtype}")
    return [int(t) for t in array.reshape(-1)]
