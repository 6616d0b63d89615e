"""Supervised and preference rows with images: SFT examples and DPO pairs whose prompt holds the
row's images, and their padded batches with the batch's pixels.

The images are the row's ``ImagePrompts.field`` (one value or a list, ``relax.data.images``), in
order. Every image row goes through the model's own chat template (its image placeholders come
from it), and each placeholder is expanded to the image's tokens as transformers' processor does
(``ImagePrompts.expand``):

- **SFT** (``encode_sft_images``): ``messages`` (a chat whose ``{"type": "image"}`` parts are as
  many as the row's images; the loss on the assistant turns, found by rendering prefixes as
  ``relax.data.supervised`` does) or ``prompt`` + ``completion`` (a string prompt is one user
  message of the row's images, then the text, ``image_messages``; a string completion one
  assistant message; the loss on the completion). A ``text`` row has no place for images: an
  error. An example is never cut (an image's tokens cannot be): one over ``max_length`` is an
  error naming the row.
- **Pairs** (``encode_image_pairs``): ``prompt`` (as SFT's) + ``chosen`` / ``rejected`` (text:
  strings or assistant messages), cut out of the rendered chat as ``relax.data.pairs`` does. A
  prompt over ``max_prompt_tokens`` is an error (never cut).

A bad image is an error naming the file, row and field (``bad_images="reject"``) or the row is
dropped and named in ``ImageRows.bad`` (``"drop"``). An example keeps its row's image field,
not its pixels: a batch decodes and processes its images again (``ImagePrompts.batch``).

Batches: ``ImageSFTBatch`` (one example per row, LEFT-padded: image sequences are not packed)
and ``ImagePairs`` (a ``PairBatch`` and its images).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
from jaxtyping import Int

from relax.data.completion_encoding import chat_completion
from relax.data.files import Record, as_record, require_fields
from relax.data.image_prompts import ImageBatch, ImagePrompts, image_messages
from relax.data.images.decode import ImageError
from relax.data.pairs import Pair, PairBatch, collate_pairs
from relax.text.base import TextTokenizer
from relax.text.sentencepiece_model import pad_left

__all__ = [
    "ImagePair",
    "ImagePairs",
    "ImageRows",
    "ImageSFTBatch",
    "ImageSFTExample",
    "collate_image_pairs",
    "collate_image_sft",
    "encode_image_pairs",
    "encode_sft_images",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSFTExample:
    """One SFT example with images: ``ids`` / ``loss_mask`` int32 ``[n]`` (as ``SFTExample``'s:
    1 where ``ids[t]`` is a target), ``source`` (the row's image field alone, decoded again per
    batch), ``images`` (how many) and ``origin`` (file and row, for errors)."""

    ids: np.ndarray
    loss_mask: np.ndarray
    source: Record
    images: int
    origin: str = ""

    def __len__(self) -> int:
        return int(self.ids.size)


@dataclasses.dataclass(frozen=True)
class ImagePair:
    """A tokenized preference pair (``relax.data.pairs.Pair``) whose prompt holds ``images``
    images, its row's image field in ``source``."""

    pair: Pair
    source: Record
    images: int


@dataclasses.dataclass(frozen=True)
class ImageRows(Generic[T]):
    """The encoded examples, the rows dropped for a bad image (each its error) and the images per
    kept example (``[len(examples)]``)."""

    examples: list[T]
    bad: tuple[str, ...] = ()

    @property
    def counts(self) -> np.ndarray:
        return np.asarray([e.images for e in self.examples], np.int64)

    def summary(self, label: str) -> str:
        """``"<label> images: N in all, a-b per example"`` and the dropped rows, named."""
        c = self.counts
        line = f"{label} images: {int(c.sum())} in all, {c.min() if c.size else 0}-" + (
            f"{c.max() if c.size else 0} per example"
        )
        if self.bad:
            more = f" and {len(self.bad) - 3} more" if len(self.bad) > 3 else ""
            line += (
                f"; WARNING: {len(self.bad)} {label} rows were dropped for a bad image: "
                + "; ".join(self.bad[:3])
                + more
            )
        return line


class ImageSFTBatch(NamedTuple):
    """SFT rows with images, one example per row, left-padded to ``t``: ``ids``, ``mask`` (1 at
    tokens) and ``loss_mask`` (1 where ``ids[t]`` is a target) int32 ``[r, t]``; ``images``: the
    batch's pixels for the vision tower, in row order."""

    ids: Int[np.ndarray, "r t"]
    mask: Int[np.ndarray, "r t"]
    loss_mask: Int[np.ndarray, "r t"]
    images: ImageBatch


class ImagePairs(NamedTuple):
    """Preference pairs with images: the ``PairBatch`` and its prompts' pixels, in row order."""

    pairs: PairBatch
    images: ImageBatch


def _fail(r: Record, field: str, msg: str) -> ValueError:
    return ValueError(f"{r.file}: row {r.row}: field {field!r}: {msg}")


def _image_parts(messages: Sequence[Any]) -> int:
    """How many ``{"type": "image"}`` parts the messages hold."""
    return sum(
        1
        for m in messages
        if isinstance(m, Mapping) and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, Mapping) and part.get("type") == "image"
    )


def _render(r: Record, field: str, tokenizer: TextTokenizer, messages, prompt: bool) -> str:
    if not tokenizer.has_chat_template:
        raise _fail(
            r, field, f"image rows need a chat template; tokenizer {tokenizer.path} has none"
        )
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=prompt, tokenize=False
        )
    except Exception as e:  # template errors (raise_exception, undefined names) of any type
        raise _fail(r, field, f"the chat template failed: {e}") from e


class _Tokens:
    """A row's rendered texts -> token ids, each image placeholder expanded to its tokens."""

    def __init__(self, tokenizer: TextTokenizer, images: ImagePrompts, decoded: list[np.ndarray]):
        self.tok, self.images, self.decoded = tokenizer, images, decoded

    def __call__(self, text: str, messages: Sequence[Any]) -> list[int]:
        expanded = self.images.expand(text, self.decoded[: _image_parts(messages)])
        return list(self.tok.encode(expanded, add_special_tokens=False))


def _is_prefix(prefix: list[int], ids: list[int]) -> bool:
    return len(prefix) <= len(ids) and ids[: len(prefix)] == prefix


def _chat_example(r: Record, field: str, tokenizer, tokens: _Tokens, count: int):
    """A chat with images: ``(ids, loss_mask)``, the loss on each assistant turn."""
    try:
        messages = image_messages(r.record[field], count)
    except (TypeError, ValueError) as e:
        raise _fail(r, field, str(e)) from e
    ids = tokens(_render(r, field, tokenizer, messages, False), messages)
    mask = [0] * len(ids)
    turns = [
        i for i, m in enumerate(messages) if isinstance(m, Mapping) and m.get("role") == "assistant"
    ]
    if not turns:
        raise _fail(r, field, "has no assistant message: nothing to train on")
    for i in turns:
        start = tokens(_render(r, field, tokenizer, messages[:i], True), messages[:i]) if i else []
        end = tokens(_render(r, field, tokenizer, messages[: i + 1], False), messages[: i + 1])
        if not (_is_prefix(start, end) and _is_prefix(end, ids)) or len(end) == len(start):
            raise _fail(
                r,
                field,
                f"the chat template does not render the chat up to message {i} as a prefix of "
                "the whole chat, so the assistant tokens cannot be located",
            )
        mask[max(len(start), 1) : len(end)] = [1] * (len(end) - max(len(start), 1))
    return ids, mask


def _prompt_completion_example(
    r: Record, prompt_field: str, completion_field: str, tokenizer, tokens: _Tokens, count: int
):
    """``[prompt with images | completion]``: ``(ids, loss_mask)``, the loss on the completion."""
    completion = r.record[completion_field]
    if completion is None or (isinstance(completion, (str, list)) and not completion):
        raise _fail(r, completion_field, "is empty")
    try:
        p_msgs = image_messages(r.record[prompt_field], count)
    except (TypeError, ValueError) as e:
        raise _fail(r, prompt_field, str(e)) from e
    c_msgs = (
        [{"role": "assistant", "content": completion}]
        if isinstance(completion, str)
        else list(completion)
    )
    if _image_parts(c_msgs):
        raise _fail(r, completion_field, "holds image parts: a row's images belong in its prompt")
    p = tokens(_render(r, prompt_field, tokenizer, p_msgs, True), p_msgs)
    full = tokens(_render(r, completion_field, tokenizer, p_msgs + c_msgs, False), p_msgs)
    if not _is_prefix(p, full) or len(full) == len(p):
        raise _fail(
            r,
            completion_field,
            "the chat template does not render the prompt as a prefix of the prompt + completion "
            "chat, so the completion cannot be located",
        )
    return full, [0] * len(p) + [1] * (len(full) - len(p))


def _decoded(r: Record, images: ImagePrompts, bad: list[str]) -> list[np.ndarray] | None:
    """The row's images; None when one is bad and ``images.bad_images`` drops the row."""
    try:
        return images.decode(r)
    except ImageError as e:
        if images.bad_images == "reject":
            raise
        bad.append(str(e))
        return None


def encode_sft_images(
    records: Sequence[Record | Mapping[str, Any]],
    tokenizer: TextTokenizer,
    images: ImagePrompts,
    *,
    max_length: int,
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    completion_field: str = "completion",
) -> ImageRows[ImageSFTExample]:
    """Every row as an ``ImageSFTExample`` (module docstring), the bad-image rows dropped or an
    error, as ``images.bad_images`` says. Errors name the file, row and field."""
    examples, bad = [], []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        cols = r.record
        if messages_field not in cols and prompt_field not in cols and completion_field not in cols:
            raise _fail(
                r,
                messages_field,
                f"an image row needs {messages_field!r} or {prompt_field!r} + "
                f"{completion_field!r} (row has {sorted(cols)}; a text row has no place for images)",
            )
        decoded = _decoded(r, images, bad)
        if decoded is None:
            continue
        tokens = _Tokens(tokenizer, images, decoded)
        if messages_field in cols:
            field = messages_field
            ids, mask = _chat_example(r, field, tokenizer, tokens, len(decoded))
        else:
            require_fields(r, [prompt_field, completion_field])
            field = completion_field
            ids, mask = _prompt_completion_example(
                r, prompt_field, completion_field, tokenizer, tokens, len(decoded)
            )
        if len(ids) > max_length:
            raise _fail(
                r,
                field,
                f"the example has {len(ids)} tokens > max_length={max_length} (an example with "
                "images is never cut: raise --sft.max-length)",
            )
        mask[0] = 0
        examples.append(
            ImageSFTExample(
                np.asarray(ids, np.int32),
                np.asarray(mask, np.int32),
                Record(r.file, r.row, {images.field: cols[images.field]}),
                len(decoded),
                origin=f"{r.file}: row {r.row}",
            )
        )
    return ImageRows(examples, tuple(bad))


def encode_image_pairs(
    records: Sequence[Record | Mapping[str, Any]],
    tokenizer: TextTokenizer,
    images: ImagePrompts,
    *,
    max_prompt_tokens: int,
    max_completion_tokens: int,
) -> ImageRows[ImagePair]:
    """Every row (``prompt``, ``chosen``, ``rejected``) as an ``ImagePair`` (module docstring);
    errors name the file, row and field."""
    pairs, bad = [], []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        require_fields(r, ("prompt", "chosen", "rejected"))
        decoded = _decoded(r, images, bad)
        if decoded is None:
            continue
        try:
            messages = image_messages(r.record["prompt"], len(decoded))
        except (TypeError, ValueError) as e:
            raise _fail(r, "prompt", str(e)) from e
        text = _render(r, "prompt", tokenizer, messages, True)
        ids = _Tokens(tokenizer, images, decoded)(text, messages)
        if len(ids) > max_prompt_tokens:
            raise _fail(
                r,
                "prompt",
                f"has {len(ids)} tokens > max_prompt_tokens={max_prompt_tokens} (a prompt with "
                "images is never cut)",
            )
        done = [
            chat_completion(
                tokenizer,
                r,
                f,
                r.record[f],
                text,
                messages,
                max_completion_tokens=max_completion_tokens,
            )
            for f in ("chosen", "rejected")
        ]
        pair = Pair(prompt=ids, chosen=done[0], rejected=done[1], file=r.file, row=r.row)
        source = Record(r.file, r.row, {images.field: r.record[images.field]})
        pairs.append(ImagePair(pair, source, len(decoded)))
    return ImageRows(pairs, tuple(bad))


def collate_image_sft(
    examples: Sequence[ImageSFTExample], *, length: int, pad_id: int, images: ImagePrompts
) -> ImageSFTBatch:
    """One example per row, left-padded to ``length`` tokens, and the batch's pixels."""
    ids, mask = pad_left([e.ids.tolist() for e in examples], pad_id=pad_id, length=length)
    loss, _ = pad_left([e.loss_mask.tolist() for e in examples], pad_id=0, length=length)
    return ImageSFTBatch(
        np.asarray(ids, np.int32),
        np.asarray(mask, np.int32),
        np.asarray(loss, np.int32),
        images.batch([e.source for e in examples]),
    )


def collate_image_pairs(
    pairs: Sequence[ImagePair],
    *,
    pad_id: int,
    prompt_length: int,
    completion_length: int,
    images: ImagePrompts,
) -> ImagePairs:
    """``collate_pairs`` of the pairs and their prompts' pixels."""
    batch = collate_pairs(
        [p.pair for p in pairs],
        pad_id=pad_id,
        prompt_length=prompt_length,
        completion_length=completion_length,
    )
    return ImagePairs(batch, images.batch([p.source for p in pairs]))
