"""``load_tokenizer``: one entry point for every Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path

from relax.text.files import SENTENCEPIECE_MODEL, TOKENIZER_JSON
from relax.text.hf import HFTokenizer
from relax.text.sentencepiece import SentencePieceTokenizer


def load_tokenizer(path: str | os.PathLike[str]) -> HFTokenizer | SentencePieceTokenizer:
    """The tokenizer at ``path``, with its special tokens, stop tokens and chat template.

    ``path`` is a model directory (its ``tokenizer.json`` if present, else its sentencepiece
    ``tokenizer.model``), a ``tokenizer.json`` file (any ``*.json``), or a sentencepiece
    ``*.model`` file. The sidecar files (``tokenizer_config.json``, ``chat_template.jinja``,
    ``special_tokens_map.json``, ``generation_config.json``) are read from the directory, or from
    the file's directory. Nothing is downloaded. A path with nothing loadable raises
    ``FileNotFoundError`` naming it; a malformed file raises ``TokenizerFormatError`` (a
    ``ValueError``) naming the file.

    Args:
        path: a local model directory, a ``tokenizer.json`` file (any ``*.json``) or a
            sentencepiece ``*.model`` file.

    Returns:
        An ``HFTokenizer`` for a ``tokenizer.json``, or a ``SentencePieceTokenizer`` for a
            sentencepiece model; both are ``relax.text.base.TextTokenizer`` objects.
    """
    root = Path(path)
    if root.is_dir():
        if (root / TOKENIZER_JSON).is_file():
            return HFTokenizer.from_file(root / TOKENIZER_JSON, path=root)
        if (root / SENTENCEPIECE_MODEL).is_file():
            return SentencePieceTokenizer.from_file(root / SENTENCEPIECE_MODEL, path=root)
        present = sorted(p.name for p in root.iterdir())
        listing = ", ".join(present[:12]) + (", ..." if len(present) > 12 else "") or "nothing"
        raise FileNotFoundError(
            f"{root}: no {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL} to load a "
            f"tokenizer from (the directory holds: {listing})"
        )
    if root.is_file():
        if root.suffix == ".json":
            return HFTokenizer.from_file(root)
        if root.suffix == ".model":
            return SentencePieceTokenizer.from_file(root)
        raise ValueError(
            f"{root}: not a tokenizer file (expected a tokenizer.json or a "
            f"sentencepiece .model file, or a model directory)"
        )
    raise FileNotFoundError(f"tokenizer path not found: {root}")
