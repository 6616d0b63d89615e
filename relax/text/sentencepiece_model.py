"""Host-side tokenization: a sentencepiece wrapper and left padding into buckets (chat templates and
Hugging Face tokenizers: ``relax.text``).

Tokenizing runs on the host at the edge of the jitted program (docs/architecture.md, "Principles"). Prompts leave
here as fixed-shape, left-padded ``int32`` arrays ``[B, L]`` with a mask, ``L`` drawn from a
small set of bucket sizes so the sampler compiles once per bucket. Nothing is ever downloaded:
``train_sentencepiece`` builds a tiny model from text for tests and demos.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import sentencepiece as spm

Truncate = Literal["left", "error"]


def _bucket_length(longest: int, bucket_sizes: Sequence[int] | None) -> int:
    """Smallest bucket >= ``longest``; the largest bucket if none fits (rows then truncate).

    ``bucket_sizes=None`` means powers of two from 16, unbounded.
    """
    if bucket_sizes is None:
        length = 16
        while length < longest:
            length *= 2
        return length
    if not bucket_sizes or min(bucket_sizes) < 1:
        raise ValueError(f"bucket_sizes must be non-empty positive ints, got {bucket_sizes!r}")
    fitting = [b for b in bucket_sizes if b >= longest]
    return min(fitting) if fitting else max(bucket_sizes)


def pad_left(
    seqs: Sequence[Sequence[int]],
    *,
    pad_id: int,
    length: int | None = None,
    bucket_sizes: Sequence[int] | None = None,
    truncate: Truncate = "error",
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token rows into ``(ids int32 [B, L], mask int32 [B, L])``.

    ``L`` is ``length`` if given, else the smallest of ``bucket_sizes`` that holds the longest
    row (default buckets: 16, 32, 64, ...). A row longer than ``L`` keeps its last ``L`` tokens
    with ``truncate="left"`` and raises ValueError with ``truncate="error"``. Empty rows raise.
    """
    if truncate not in ("left", "error"):
        raise ValueError(f"truncate must be 'left' or 'error', got {truncate!r}")
    if length is not None and bucket_sizes is not None:
        raise ValueError("pass either length or bucket_sizes, not both")
    if length is not None and length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    rows = [[int(t) for t in row] for row in seqs]
    if not rows:
        raise ValueError("pad_left got no rows")
    empty = [i for i, row in enumerate(rows) if not row]
    if empty:
        raise ValueError(f"row {empty[0]} is empty")
    longest = max(len(row) for row in rows)
    target = length if length is not None else _bucket_length(longest, bucket_sizes)
    ids = np.full((len(rows), target), pad_id, dtype=np.int32)
    mask = np.zeros((len(rows), target), dtype=np.int32)
    for i, row in enumerate(rows):
        if len(row) > target:
            if truncate == "error":
                raise ValueError(f"row {i} has length {len(row)} > target length {target}")
            row = row[-target:]
        ids[i, target - len(row) :] = row
        mask[i, target - len(row) :] = 1
    return ids, mask


class Tokenizer:
    """A sentencepiece model plus the special ids relax needs.

    Special ids come from the model unless overridden by the ``pad_id``/``bos_id``/``eos_id``
    keyword arguments. sentencepiece reports -1 for a special the model lacks; then:

    - ``bos_id`` / ``eos_id`` are ``None`` (``add_bos``/``add_eos`` then raise);
    - ``pad_id`` falls back to ``eos_id`` if the model has one, else to 0. Padding is always
      carried by the mask, so a pad that equals eos or a real token is harmless there.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        pad_id: int | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
    ) -> None:
        self.path = Path(path)
        self._sp = _load_processor(self.path)
        for name, value in {"pad_id": pad_id, "bos_id": bos_id, "eos_id": eos_id}.items():
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(f"{name}={value} is outside the vocabulary of {self.vocab_size}")
        model_bos, model_eos, model_pad = self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()
        if bos_id is None and model_bos >= 0:
            bos_id = model_bos
        if eos_id is None and model_eos >= 0:
            eos_id = model_eos
        if pad_id is None:
            pad_id = model_pad if model_pad >= 0 else (eos_id if eos_id is not None else 0)
        self._bos, self._eos, self._pad = bos_id, eos_id, pad_id

    @classmethod
    def load(cls, path: str | os.PathLike[str], **kwargs: Any) -> Tokenizer:
        """Load a sentencepiece ``.model`` file; kwargs as for the constructor."""
        return cls(path, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        # The processor itself does not pickle; ship the model bytes (for grain workers).
        state = self.__dict__.copy()
        state["_sp"] = self._sp.serialized_model_proto()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        proto = state.pop("_sp")
        self.__dict__.update(state)
        self._sp = spm.SentencePieceProcessor(model_proto=proto)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally wrapped in bos/eos."""
        ids = [int(t) for t in self._sp.encode(text)]
        return self._special("bos_id", add_bos) + ids + self._special("eos_id", add_eos)

    def encode_batch(
        self, texts: Sequence[str], *, add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """``encode`` applied to each text."""
        return [self.encode(t, add_bos=add_bos, add_eos=add_eos) for t in texts]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``.

        With ``skip_special`` leading pads are dropped, decoding stops at the first eos, and
        remaining pad/bos ids are dropped. Without it every id is rendered, specials as their
        pieces (e.g. ``"</s>"``).
        """
        ids = [int(t) for t in np.asarray(ids).reshape(-1)]
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}")
        if not skip_special:
            return self._decode_with_specials(ids)
        start = 0
        while start < len(ids) and ids[start] == self.pad_id:
            start += 1
        ids = ids[start:]
        if self.eos_id is not None and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        drop = {self.pad_id, self.bos_id}
        return self._sp.decode([t for t in ids if t not in drop])

    def decode_batch(
        self, ids_2d: Any, mask: Any = None, *, skip_special: bool = True
    ) -> list[str]:
        """Decode each row of ``ids_2d [B, T]`` (numpy or jax); with ``mask [B, T]`` only the
        positions where it is 1 are decoded."""
        ids_2d = np.asarray(ids_2d)
        if ids_2d.ndim != 2:
            raise ValueError(f"decode_batch expects ids of shape [B, T], got {ids_2d.shape}")
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != ids_2d.shape:
                raise ValueError(f"mask shape {mask.shape} != ids shape {ids_2d.shape}")
        rows = ids_2d if mask is None else [row[m == 1] for row, m in zip(ids_2d, mask)]
        return [self.decode(row, skip_special=skip_special) for row in rows]

    def pad_left(
        self,
        seqs: Sequence[Sequence[int]],
        *,
        length: int | None = None,
        bucket_sizes: Sequence[int] | None = None,
        truncate: Truncate = "error",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Module-level ``pad_left`` with this tokenizer's ``pad_id``."""
        return pad_left(
            seqs, pad_id=self.pad_id, length=length, bucket_sizes=bucket_sizes, truncate=truncate
        )

    def encode_prompts(
        self,
        texts: Sequence[str],
        *,
        length: int | None = None,
        bucket_sizes: Sequence[int] | None = None,
        add_bos: bool = True,
        truncate: Truncate = "error",
    ) -> tuple[np.ndarray, np.ndarray]:
        """``encode_batch`` then ``pad_left``: ``(ids int32 [B, L], mask int32 [B, L])``."""
        seqs = self.encode_batch(texts, add_bos=add_bos)
        return self.pad_left(seqs, length=length, bucket_sizes=bucket_sizes, truncate=truncate)

    def _special(self, name: str, wanted: bool) -> list[int]:
        if not wanted:
            return []
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"{self.path} has no {name[:3]} token; pass {name}= to Tokenizer")
        return [value]

    def _decode_with_specials(self, ids: list[int]) -> str:
        out, run = [], []
        for t in ids:
            if self._sp.is_control(t):
                out.append(self._sp.decode(run))
                out.append(self._sp.id_to_piece(t))
                run = []
            else:
                run.append(t)
        out.append(self._sp.decode(run))
        return "".join(out)


def _load_processor(path: Path) -> spm.SentencePieceProcessor:
    """Read and parse a ``.model`` file, naming the file in any error."""
    if not path.is_file():
        raise FileNotFoundError(f"sentencepiece model file not found: {path}")
    try:
        proto = path.read_bytes()
    except OSError as e:
        raise OSError(f"cannot read sentencepiece model file {path}: {e}") from e
    try:
        return spm.SentencePieceProcessor(model_proto=proto)
    except (RuntimeError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a valid sentencepiece model: {e}") from e


def train_sentencepiece(
    texts: Iterable[str],
    model_prefix: str | os.PathLike[str],
    *,
    vocab_size: int,
    model_type: Literal["bpe", "unigram", "char"] = "bpe",
    user_defined_symbols: Sequence[str] = (),
    character_coverage: float = 1.0,
) -> Path:
    """Train a small sentencepiece model in-process and return the ``.model`` path.

    Specials: pad=0, unk=1, bos=2, eos=3. ``vocab_size`` is a soft limit (small corpora may
    yield fewer pieces). Text is not normalised and whitespace is kept as is, so
    ``decode(encode(s)) == s`` for text made of characters seen in training.
    """
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("train_sentencepiece needs at least one non-empty text")
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_prefix=str(prefix),
            vocab_size=vocab_size,
            model_type=model_type,
            user_defined_symbols=list(user_defined_symbols),
            character_coverage=character_coverage,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,  # all four specials exist
            hard_vocab_limit=False,  # small corpora: fewer pieces than asked is fine
            normalization_rule_name="identity",  # keep text exactly (no NFKC)
            remove_extra_whitespaces=False,
            num_threads=1,  # tiny corpora; deterministic
            minloglevel=2,  # quiet
        )
    except RuntimeError as e:  # e.g. vocab_size smaller than the character set
        msg = f"training sentencepiece model {prefix} (vocab_size={vocab_size}) failed: {e}"
        raise ValueError(msg) from e
    return prefix.with_name(prefix.name + ".model")
