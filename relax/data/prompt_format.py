"""How a prompt row becomes text and token ids: ``DataConfig`` (where prompts come from and how
they are formatted, tokenized and batched), the chat-template rules (``chat_messages``,
``render``, ``format_prompt``) and the cut of an over-budget prompt (``cut_to_budget``).
``relax.data.prompts`` re-exports them and runs the pipeline."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any, Literal

from relax.data.files import PathLike
from relax.data.prompt_budget import OVERLONG, cut_chat, cut_plain
from relax.text.base import TextTokenizer

CHAT_TEMPLATE_MODES = ("auto", "always", "never")
PAD_TO = ("data", "batch")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from and how they are formatted, tokenized and batched.

    ``path``: a ``.jsonl`` / ``.parquet`` file, a directory (its ``*.jsonl`` and ``*.parquet``
    files, sorted by name) or a sequence of those, read in order. ``answer_field`` /
    ``data_source_field`` may be None (no answers / no data source). ``chat_template``: a prompt
    that is a list of ``{role, content}`` messages always goes through the tokenizer's chat
    template; a string prompt is wrapped as one user message and goes through it too with
    ``"always"``, and with ``"auto"`` when the tokenizer has a template (a chat model), while
    ``"never"`` tokenizes strings as they are (and refuses message lists). ``system_prompt`` (a
    chat template must be in use) is prepended as a system message unless the messages start
    with one. ``eval_fraction`` holds that share of the rows out of training, chosen by ``seed``
    (see ``train_eval_split`` and ``eval_records``). ``overlong``: what happens to a prompt over
    ``max_prompt_tokens`` (``relax.data.prompt_budget``). ``pad_to``: the length batches are
    padded to, the bucket of the longest prompt of the ``"data"`` (one shape) or of each ``"batch"``.
    ``required_fields``: other columns every row must have (e.g. the tests a reward runs), checked
    when the rows are prepared, before any compute.
    """

    path: PathLike | Sequence[PathLike]
    batch_size: int
    max_prompt_tokens: int
    prompt_field: str = "prompt"
    answer_field: str | None = "answer"
    data_source_field: str | None = "data_source"
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None
    overlong: Literal["drop", "reject", "truncate"] = "drop"
    chat_template: Literal["auto", "always", "never"] = "auto"
    system_prompt: str | None = None
    prompt_buckets: tuple[int, ...] = ()
    eval_fraction: float = 0.0
    pad_to: Literal["data", "batch"] = "data"
    required_fields: tuple[str, ...] = ()

    def __post_init__(self):
        # Plain strings so the config serialises (checkpoints store it as JSON).
        single = isinstance(self.path, (str, os.PathLike))
        path = os.fspath(self.path) if single else tuple(os.fspath(p) for p in self.path)
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "prompt_buckets", tuple(self.prompt_buckets))
        object.__setattr__(self, "required_fields", tuple(self.required_fields))
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.max_prompt_tokens < 2:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} leaves no room")
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {self.overlong!r}")
        if self.pad_to not in PAD_TO:
            raise ValueError(f"pad_to must be one of {PAD_TO}, got {self.pad_to!r}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"num_epochs must be None (forever) or >= 1, got {self.num_epochs}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        if self.chat_template not in CHAT_TEMPLATE_MODES:
            raise ValueError(
                f"chat_template must be one of {CHAT_TEMPLATE_MODES}, got {self.chat_template!r}"
            )
        if self.system_prompt is not None and self.chat_template == "never":
            raise ValueError("system_prompt needs a chat template (chat_template='never')")
        b = self.prompt_buckets
        if list(b) != sorted(set(b)) or (b and (b[0] < 1 or b[-1] > self.max_prompt_tokens)):
            raise ValueError(f"prompt_buckets must increase within [1, max_prompt_tokens], got {b}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")


def uses_chat_template(cfg: DataConfig, tokenizer: TextTokenizer) -> bool:
    """Whether string prompts go through the chat template (``DataConfig.chat_template``)."""
    return cfg.chat_template == "always" or (
        cfg.chat_template == "auto" and tokenizer.has_chat_template
    )


def chat_messages(prompt: Any, cfg: DataConfig, tokenizer: TextTokenizer) -> list[dict] | None:
    """The chat messages ``prompt`` becomes (system prompt prepended), or None for a plain-text
    prompt tokenized as it is (see ``DataConfig`` on chat templates)."""
    if isinstance(prompt, str) and not uses_chat_template(cfg, tokenizer):
        if cfg.system_prompt is not None:
            raise ValueError(
                f"system_prompt needs a chat template; tokenizer {tokenizer.path} has none"
            )
        return None
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)):
        if cfg.chat_template == "never":
            raise ValueError(
                "a list of chat messages needs a chat template (chat_template='never')"
            )
        messages = list(prompt)
    else:
        kind = type(prompt).__name__
        raise TypeError(f"prompt must be a string or a list of chat messages, got {kind}")
    if cfg.system_prompt is not None and not (messages and _role(messages[0]) == "system"):
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return messages


def render(messages: list[dict], tokenizer: TextTokenizer) -> tuple[str, list[int]]:
    """``(text, ids)`` of chat ``messages`` with the generation prompt, as transformers renders them."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)


def format_prompt(prompt: Any, cfg: DataConfig, tokenizer: TextTokenizer) -> tuple[str, list[int]]:
    """``(text, token ids)`` of one prompt value (see ``DataConfig`` on chat templates)."""
    messages = chat_messages(prompt, cfg, tokenizer)
    if messages is None:
        return prompt, tokenizer.encode(prompt, add_special_tokens=True)
    return render(messages, tokenizer)


def _role(message: Any) -> Any:
    return message.get("role") if isinstance(message, dict) else None


def cut_to_budget(
    prompt: Any, ids: list[int], cfg: DataConfig, tokenizer: TextTokenizer
) -> tuple[str, list[int]] | None:
    """``(text, ids)`` of an over-budget prompt cut to ``max_prompt_tokens`` as
    ``relax.data.prompt_budget`` says (plain text: its last tokens, the text left whole; chat: the
    last user message's content from its start, rendered again), or None when it cannot be cut so."""
    budget = cfg.max_prompt_tokens
    messages = chat_messages(prompt, cfg, tokenizer)
    if messages is None:
        return prompt, cut_plain(ids, budget, tokenizer.bos_token_id)
    cut = cut_chat(
        messages,
        budget,
        render=lambda m: render(m, tokenizer)[1],
        encode=lambda t: tokenizer.encode(t, add_special_tokens=False),
        decode=tokenizer.decode,
    )
    return None if cut is None else render(cut, tokenizer)
