"""Sentencepiece ``.model`` tokenizers behind the common interface.

Wraps :class:`relax.text.sentencepiece_model.Tokenizer` (which stays the sentencepiece reader). Conventions:

- Special tokens: those of a ``tokenizer_config.json`` next to the model when it sets them,
  else the model's own ``bos``/``eos``/``unk``/``pad`` pieces. Every configured special or added
  token must be a piece of the model (sentencepiece vocabularies cannot grow here).
- ``encode`` first splits the text on the special and added token strings (longest first),
  which become their ids, and encodes the pieces between them with sentencepiece, each with its
  dummy-prefix space: transformers' sentencepiece backend with ``legacy=True``. So ``"<s>"``
  written by a chat template is the BOS id, as transformers tokenizes Llama-2 chats.
- ``add_special_tokens=True`` adds BOS before the text (the sentencepiece / Llama-2 convention)
  and no EOS; ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json`` change that.
- ``decode(skip_special_tokens=True)`` drops the special tokens (and unk) and decodes with
  sentencepiece, which keeps leading and repeated spaces; ``False`` writes them as their
  pieces (``"<s>"``). transformers' python backend differs there: it strips the text and joins
  special tokens with spaces (``"<s> Hello"``).

``save_pretrained`` writes ``tokenizer.model`` and a config with ``tokenizer_class:
"SentencePieceBackend"``, ``legacy: true`` and ``special_tokens_pattern`` (``"bos"`` etc.): in
transformers 5.23 that class runs sentencepiece itself, so its ids equal these on text. The
``LlamaTokenizer`` class instead converts the model to a BPE ``tokenizers`` pipeline whose
whitespace and unknown-character handling differ from sentencepiece.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import sentencepiece as spm

from relax.text.base import TextTokenizer, ids_list
from relax.text.files import SENTENCEPIECE_MODEL, Sidecars, TokenizerFormatError, read_sidecars
from relax.text.saving import copy_file, save_sidecars
from relax.text.sentencepiece_model import Tokenizer

_PATTERNS = {
    (True, False): "bos",
    (False, True): "eos",
    (True, True): "bos_eos",
    (False, False): "none",
}


class SentencePieceTokenizer(TextTokenizer):
    """A sentencepiece model with its directory's special tokens and chat template."""

    def __init__(self, model_path: Path, *, path: Path, sidecars: Sidecars) -> None:
        self.path = path
        self._model_path = model_path
        self._tok = Tokenizer(model_path)
        sp = _processor(self._tok)
        named = dict(sidecars.named_tokens)
        for name, index in (
            ("bos_token", sp.bos_id()),
            ("eos_token", sp.eos_id()),
            ("unk_token", sp.unk_id()),
            ("pad_token", sp.pad_id()),
        ):
            if name not in named and name not in sidecars.config and index >= 0:
                named[name] = sp.id_to_piece(index)
        self._sidecars = dataclasses.replace(sidecars, named_tokens=named)
        where = sidecars.directory / "tokenizer_config.json"
        added = [
            (spec["content"], bool(spec.get("special", False))) for _, spec in sidecars.added_tokens
        ]
        strings = (
            [(s, True) for s in self._sidecars.token_strings.values()]
            + [(s, True) for s in self._sidecars.extra_strings]
            + added
        )
        self._ids: dict[str, int] = {}
        skip = set()
        for token, special in strings:
            index = self.token_to_id(token)
            if index is None:
                raise TokenizerFormatError(
                    f"{where}: token {token!r} is not a piece of {model_path}"
                )
            self._ids[token] = index
            if special:
                skip.add(index)
        if sp.unk_id() >= 0:
            skip.add(sp.unk_id())
        self._skip_ids = frozenset(skip)
        longest_first = sorted((t for t in self._ids if t), key=len, reverse=True)
        self._split = (
            re.compile("(" + "|".join(map(re.escape, longest_first)) + ")")
            if longest_first
            else None
        )
        config = sidecars.config
        pattern = config.get("special_tokens_pattern", "bos")
        self._add_bos = bool(config.get("add_bos_token", pattern in ("bos", "bos_eos")))
        self._add_eos = bool(config.get("add_eos_token", pattern in ("eos", "bos_eos")))

    @classmethod
    def from_file(
        cls, model_path: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None
    ) -> SentencePieceTokenizer:
        """Load ``model_path`` and the sidecar files next to it; ``path`` (default: the file)
        is what errors and ``.path`` name."""
        model_path = Path(model_path)
        return cls(
            model_path,
            path=Path(path) if path is not None else model_path,
            sidecars=read_sidecars(model_path.parent),
        )

    @property
    def tokenizer(self) -> Tokenizer:
        """The wrapped :class:`relax.text.sentencepiece_model.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = [text] if self._split is None else self._split.split(text)
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(self._ids[piece])
            elif piece:
                ids += self._tok.encode(piece)
        if add_special_tokens:
            bos, eos = self.bos_token_id, self.eos_token_id
            ids = ([bos] if self._add_bos and bos is not None else []) + ids
            ids = ids + ([eos] if self._add_eos and eos is not None else [])
        return ids

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        ids = ids_list(ids)
        if skip_special_tokens:
            ids = [t for t in ids if t not in self._skip_ids]
        return self._tok.decode(ids, skip_special=False)

    def token_to_id(self, token: str) -> int | None:
        sp = _processor(self._tok)
        index = sp.piece_to_id(token)
        return index if 0 <= index < self.vocab_size and sp.id_to_piece(index) == token else None

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.model`` (copied), ``tokenizer_config.json`` (see the module doc)
        and the chat template / special tokens / generation files as they came."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        copy_file(self._model_path, out / SENTENCEPIECE_MODEL)
        updates = {
            "special_tokens_pattern": _PATTERNS[self._add_bos, self._add_eos],
            "add_bos_token": self._add_bos,
            "add_eos_token": self._add_eos,
            "legacy": True,
        }
        save_sidecars(self._sidecars, out, tokenizer_class="SentencePieceBackend", updates=updates)
        return out


def _processor(tok: Tokenizer) -> spm.SentencePieceProcessor:
    """The processor inside ``relax.text.sentencepiece_model.Tokenizer`` (for piece lookups it does not expose)."""
    return tok._sp
