"""``tokenizer.json`` tokenizers (byte-level BPE and the rest), loaded as transformers 5.23 does.

The ``tokenizers`` library does the tokenizing; this module sets it up the way transformers'
``TokenizersBackend`` (a.k.a. ``PreTrainedTokenizerFast``) does in ``from_pretrained``:

- the post-processor in ``tokenizer.json`` decides what ``add_special_tokens=True`` adds (a
  ``TemplateProcessing`` with ``<|begin_of_text|> $A`` for Llama 3, nothing for Qwen). With a
  ``tokenizer.json`` present transformers 5 DROPS ``add_bos_token`` / ``add_eos_token`` from
  ``tokenizer_config.json`` (``_from_pretrained``), so they change nothing, here neither. A
  ``tokenizer.json`` without a post-processor gets ``TemplateProcessing("$A:0")``: nothing added.
- every ``added_tokens_decoder`` entry of the config is re-added (its flags win over the
  ``tokenizer.json`` ones, e.g. ``special``, which ``skip_special_tokens`` uses), then every
  named, model-specific or extra special token not yet in the vocabulary is added as a new
  special token (new ids after the largest one), in transformers' order.
- truncation and padding stored in ``tokenizer.json`` are switched off (transformers switches
  them off for every call that does not ask for them); ``split_special_tokens`` is honoured;
  ``clean_up_tokenization_spaces`` applies to decoding except for BPE models (transformers 5.23
  skips it there, with a warning).

``tokenizer.json`` is always used as written. transformers picks a class from
``tokenizer_class`` (and ``config.json``'s ``model_type``): ``PreTrainedTokenizerFast`` /
``TokenizersBackend``, and the class it forces for repos it knows declare a wrong one (Qwen2,
DeepSeek-R1 distills, byte-level files declared ``LlamaTokenizer``), load the file as written;
model-specific classes (``Qwen2Tokenizer`` for Qwen3, ``LlamaTokenizer``, ``GemmaTokenizer``,
``GPT2Tokenizer``, ...) rebuild normalizer / pre-tokenizer / decoder in code around the file's
vocabulary, merges and post-processor. For the real repositories that is meant to be the same (the
tests check a Qwen2 pipeline under ``Qwen2Tokenizer``); a ``tokenizer.json`` that departs from its
class's pipeline tokenizes differently in transformers. ``save_pretrained`` therefore writes
``tokenizer_class: "PreTrainedTokenizerFast"``. Not replicated: the Mistral regex patch
(``fix_mistral_regex``), remote code (``auto_map``), GGUF and tekken files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, processors

from relax.text.base import TextTokenizer, ids_list
from relax.text.files import (
    TOKENIZER_JSON,
    Sidecars,
    TokenizerFormatError,
    TokenSpec,
    read_sidecars,
    token_content,
)
from relax.text.saving import copy_file, save_sidecars

# transformers' cleanup of spaces before punctuation (clean_up_tokenization).
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)


class HFTokenizer(TextTokenizer):
    """A ``tokenizer.json`` tokenizer with its directory's special tokens and chat template.

    Build with :func:`relax.text.load_tokenizer` or :meth:`from_file`. Pickles (for data-loader
    workers): the backend serialises itself, templates are kept as source strings.
    """

    def __init__(
        self, backend: tokenizers.Tokenizer, *, path: Path, tokenizer_json: Path, sidecars: Sidecars
    ) -> None:
        self.path = path
        self._backend = backend
        self._tokenizer_json = tokenizer_json
        self._sidecars = sidecars
        self._clean_up = (
            bool(sidecars.config.get("clean_up_tokenization_spaces", False))
            and type(backend.model).__name__ != "BPE"
        )
        self._vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @classmethod
    def from_file(
        cls, tokenizer_json: str | os.PathLike[str], *, path: str | os.PathLike[str] | None = None
    ) -> HFTokenizer:
        """Load ``tokenizer_json`` and the sidecar files next to it; ``path`` (default: the
        file) is what errors and ``.path`` name."""
        tokenizer_json = Path(tokenizer_json)
        sidecars = read_sidecars(tokenizer_json.parent)
        backend = _read_backend(tokenizer_json)
        _configure(backend, sidecars)
        return cls(
            backend,
            path=Path(path) if path is not None else tokenizer_json,
            tokenizer_json=tokenizer_json,
            sidecars=sidecars,
        )

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The configured ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """``encode`` of each text, in parallel in the Rust backend."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        text = self._backend.decode(ids_list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write ``tokenizer.json`` (the source file copied), ``tokenizer_config.json`` (the
        source config with ``tokenizer_class: "PreTrainedTokenizerFast"``, so transformers loads
        ``tokenizer.json`` as is), the chat template files, ``special_tokens_map.json`` and
        ``generation_config.json`` as they came (see ``relax.text.saving``)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        if self._tokenizer_json.is_file():
            copy_file(self._tokenizer_json, out / TOKENIZER_JSON)
        else:  # the source is gone: the configured backend is equivalent (config re-adds are no-ops)
            self._backend.save(str(out / TOKENIZER_JSON))
        save_sidecars(self._sidecars, out, tokenizer_class="PreTrainedTokenizerFast")
        return out


def _read_backend(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception subclass on bad files
        raise TokenizerFormatError(f"{path} is not a valid tokenizer.json: {e}") from e


def _added_token(spec: TokenSpec, *, special: bool | None = None) -> AddedToken:
    """An AddedToken from a configured token: a string is a special token (transformers)."""
    if isinstance(spec, str):
        return AddedToken(spec, special=True)
    token = AddedToken(**spec)
    if special is not None and not token.special:
        token.special = special
    return token


def _configure(backend: tokenizers.Tokenizer, sidecars: Sidecars) -> None:
    """Apply what transformers' ``TokenizersBackend.__init__`` does to a loaded tokenizer.json."""
    backend.no_truncation()
    backend.no_padding()
    if backend.post_processor is None:
        backend.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    to_add = [AddedToken(**spec) for _, spec in sidecars.added_tokens]
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    known |= {t.content for t in to_add}
    for spec in sidecars.named_tokens.values():
        if token_content(spec) not in known:
            to_add.append(_added_token(spec, special=True))
            known.add(token_content(spec))
    for spec in sidecars.extra_tokens:
        if token_content(spec) not in known:
            to_add.append(_added_token(spec))
            known.add(token_content(spec))
    if to_add:
        backend.add_tokens(to_add)
    backend.encode_special_tokens = bool(sidecars.config.get("split_special_tokens", False))


__all__ = ["HFTokenizer"]
