"""Prompt data: jsonl / parquet records -> a grain pipeline of fixed-shape ``PromptBatch``es.

The GRPO trainer pulls one ``PromptBatch`` per step. Everything here runs on the host.

Loading is eager: at build time every row is read, its prompt formatted (chat template) and
tokenized, so a missing field, a bad JSON line or an overlong prompt (``overlong="reject"``)
fails before training starts, with the file, the 1-based row (the line number for jsonl) and
the field in the message (rows carry their origin as ``Record``s; reading the files, and the
rules for jsonl encodings and line endings, are in ``relax.data.files``). The grain pipeline
then only shuffles, repeats, batches and pads:

    MapDataset.source(examples).shuffle(seed).repeat(num_epochs)
        .batch(batch_size, drop_remainder=True).map(collate).to_iter_dataset()

- ``shuffle`` draws a new, seed-determined order every epoch; epochs are concatenated and cut
  into global batches of ``batch_size`` prompts (a batch may straddle two epochs); with a
  finite ``num_epochs`` the last partial batch is dropped, so every batch has the same shape.
- Multi-process: ``batch_size`` is the GLOBAL number of prompts per step. Every process builds
  the same global batch and keeps the contiguous slice ``[i * P/n : (i+1) * P/n]`` for process
  ``i`` of ``n``; the slices are disjoint and their union, in process order, is the global
  batch (the layout ``jax.make_array_from_process_local_data`` expects for a data-sharded
  batch axis). The padded length is chosen from the whole global batch, so every process
  gets the same ``Lp``.
- Padding: left, to ``max_prompt_tokens`` or, with ``prompt_buckets``, to the smallest bucket
  (``max_prompt_tokens`` the top one) holding the longest prompt of the whole training data
  (``pad_to="data"``, the default: every batch has one shape, so the step compiles once) or of
  the global batch (``pad_to="batch"``: fewer pad tokens, one shape per bucket; ``batch_lengths``
  lists them, for a run to compile ahead).
- Tokens: a plain-text prompt is ``tokenizer.encode(text)`` with the special tokens the
  tokenizer itself adds (a BOS for Llama-style tokenizers, nothing for Qwen's); a chat prompt is
  the model's own chat template, tokenized as transformers does (``apply_chat_template``: the
  template writes any BOS, none is added twice).
- Prompts over ``max_prompt_tokens`` are counted and named (``PromptStats``), then dropped
  (``overlong="drop"``, the default), refused (``"reject"``: an error naming the file, row and
  token length) or cut (``"truncate"``, keeping a chat prompt's header and system prompt whole):
  ``relax.data.prompt_budget``.
- The iterator is a grain ``DatasetIterator``: ``get_state()`` / ``set_state()`` resume
  exactly where a run left off (checkpoint the state with the train state).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import grain
import numpy as np

from relax.data.files import (  # noqa: F401 - re-exported: relax.data.prompts is the public module
    RECORDS_LABEL,
    SUFFIXES,
    MissingFieldError,
    PathLike,
    Record,
    as_record,
    load_records,
    read_records,
    require_fields,
    resolve_files,
)
from relax.data.image_prompts import ImageBatch, ImagePrompts, image_messages
from relax.data.images.decode import ImageError
from relax.data.prompt_budget import OverBudget, PromptStats
from relax.data.prompt_format import (  # noqa: F401 - re-exported: relax.data.prompts is the public module
    CHAT_TEMPLATE_MODES,
    PAD_TO,
    DataConfig,
    chat_messages,
    cut_to_budget,
    format_prompt,
    render,
    uses_chat_template,
)
from relax.text.base import TextTokenizer
from relax.text.sentencepiece_model import pad_left

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One process's share of a step's prompts (``P`` = batch_size / process_count).

    ``prompts`` are the formatted texts (after the chat template; a chat prompt cut to the budget
    is the cut one, a cut plain-text prompt its whole text);
    ``fields`` holds every other column of the rows (None where a row lacks it);
    ``data_source`` is None when the data has no data-source column.
    """

    prompt_ids: np.ndarray  # int32 [P, Lp], left-padded
    prompt_mask: np.ndarray  # int32 [P, Lp], 1 on real tokens
    prompts: list[str]
    answers: list[Any]
    fields: dict[str, list[Any]]
    data_source: list[str] | None
    images: ImageBatch | None = None  # image prompts' pixels (relax.data.image_prompts)


class _Example(NamedTuple):
    ids: list[int]
    text: str
    answer: Any
    data_source: Any
    extras: dict[str, Any]
    images: Record | None = None  # the row's image field alone (``relax.data.image_prompts``)


def train_eval_split(
    items: Sequence[T], eval_fraction: float, seed: int
) -> tuple[list[T], list[T]]:
    """Deterministic held-out split: ``(train, eval)``, each in the original order.

    ``round(len * eval_fraction)`` items (at least one if the fraction is > 0) chosen by a
    permutation seeded with ``seed``; the same inputs always give the same split.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    n = len(items)
    n_eval = max(round(n * eval_fraction), 1) if eval_fraction > 0 else 0
    if n_eval >= n and n_eval > 0:
        raise ValueError(f"eval_fraction={eval_fraction} of {n} rows leaves nothing to train on")
    held = set(np.random.default_rng(seed).permutation(n)[:n_eval].tolist())
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


@dataclasses.dataclass(frozen=True)
class DataSplits:
    """The rows of ``cfg.path``, read once and split (``read_splits``): pass it to both
    ``eval_records`` and ``prompt_dataset`` so that a large dataset is not read twice."""

    train: list[Record]
    eval: list[Record]


def read_splits(cfg: DataConfig) -> DataSplits:
    """Read ``cfg.path`` once and split it by ``cfg.eval_fraction`` / ``cfg.seed``."""
    return DataSplits(*train_eval_split(read_records(cfg.path), cfg.eval_fraction, cfg.seed))


def eval_records(cfg: DataConfig, splits: DataSplits | None = None) -> list[Record]:
    """The rows ``cfg.eval_fraction`` holds out of training (empty when it is 0), as ``Record``s
    (``.record`` is the row's dict) so that ``prompt_batch`` errors name the file and row."""
    return list((read_splits(cfg) if splits is None else splits).eval)


# ------------------------------------------------------------------------- formatting


@dataclasses.dataclass(frozen=True)
class PreparedPrompts:
    """Rows formatted, tokenized and checked against the budget (``prepare_prompts``):
    ``examples`` (the rows kept, in order), whether the data has a data-source column, and
    ``stats`` (lengths, rows over budget, the first prompt) for the start-up report."""

    examples: list[_Example]
    has_source: bool
    stats: PromptStats


def _image_prompt(
    r: Record, prompt: Any, cfg: DataConfig, tokenizer: TextTokenizer, images: ImagePrompts
) -> tuple[str, list[int], Record, int]:
    """An image row's ``(text, ids, its image field alone, image count)``: the images decoded
    (``ImageError`` naming the row), the prompt rendered with image parts by the chat template,
    each image's placeholder expanded to its tokens (``relax.data.image_prompts``)."""
    decoded = images.decode(r)
    messages = chat_messages(image_messages(prompt, len(decoded)), cfg, tokenizer)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    text = images.expand(rendered, decoded)
    source = Record(r.file, r.row, {images.field: r.record[images.field]})
    return text, tokenizer.encode(text, add_special_tokens=False), source, len(decoded)


def prepare_prompts(
    rows: Sequence[Record],
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    images: ImagePrompts | None = None,
) -> PreparedPrompts:
    """Format, tokenize and budget-check every row; errors name the file, row and field.

    If any row has a data-source column, every row must. Over-budget rows are handled per
    ``cfg.overlong`` and counted in ``stats`` (an image prompt is never cut: ``truncate`` drops
    it). ``images``: the rows are image prompts (``relax.data.image_prompts``); a row with a bad
    image is an error or dropped and counted (``images.bad_images``)."""
    used = {cfg.prompt_field, cfg.answer_field, cfg.data_source_field}
    used |= set() if images is None else {images.field}
    extra_keys = sorted({k for r in rows for k in r.record} - used)
    source_field = cfg.data_source_field
    has_source = source_field is not None and any(source_field in r.record for r in rows)
    required = [cfg.prompt_field] + ([cfg.answer_field] if cfg.answer_field is not None else [])
    required += [source_field] if has_source else []
    required += list(cfg.required_fields)
    examples, lengths, over, uncuttable = [], [], [], 0
    bad, image_counts = [], []
    for r in rows:
        require_fields(r, required)
        prompt = r.record[cfg.prompt_field]
        source, count = None, 0
        try:
            if images is None:
                text, ids = format_prompt(prompt, cfg, tokenizer)
            else:
                text, ids, source, count = _image_prompt(r, prompt, cfg, tokenizer, images)
        except ImageError as e:
            if images.bad_images == "reject":
                raise
            bad.append(str(e))
            continue
        except (TypeError, ValueError) as e:
            raise ValueError(f"{r.file}: row {r.row}: field {cfg.prompt_field!r}: {e}") from e
        if not text:
            raise ValueError(f"{r.file}: row {r.row}: field {cfg.prompt_field!r} is empty")
        lengths.append(len(ids))
        if len(ids) > cfg.max_prompt_tokens:
            over.append(OverBudget(str(r.file), r.row, len(ids)))
            if cfg.overlong == "reject":
                raise ValueError(
                    f"{r.file}: row {r.row}: prompt has {len(ids)} tokens > "
                    f"max_prompt_tokens={cfg.max_prompt_tokens} (overlong='reject')"
                )
            cuttable = cfg.overlong == "truncate" and source is None
            cut = cut_to_budget(prompt, ids, cfg, tokenizer) if cuttable else None
            uncuttable += cfg.overlong == "truncate" and cut is None
            if cut is None:
                continue
            text, ids = cut
        examples.append(
            _Example(
                ids=ids,
                text=text,
                answer=r.record[cfg.answer_field] if cfg.answer_field is not None else None,
                data_source=r.record[source_field] if has_source else None,
                extras={k: r.record.get(k) for k in extra_keys},
                images=source,
            )
        )
        image_counts.append(count)
    stats = PromptStats(
        lengths=np.asarray(lengths, dtype=np.int64),
        budget=cfg.max_prompt_tokens,
        over_budget=tuple(sorted(over, key=lambda o: -o.tokens)),
        action=cfg.overlong,
        kept=len(examples),
        uncuttable=uncuttable,
        first_prompt=examples[0].text if examples else "",
        images=np.asarray(image_counts, np.int64) if images is not None else None,
        bad_images=tuple(bad),
    )
    return PreparedPrompts(examples, has_source, stats)


@dataclasses.dataclass(frozen=True)
class _Collate:
    """A global batch of examples -> this process's ``PromptBatch`` (a grain map)."""

    cfg: DataConfig
    pad_id: int
    process_index: int
    process_count: int
    has_source: bool
    length: int | None = None  # every batch's (pad_to="data"); None: each batch's own bucket
    images: ImagePrompts | None = None

    def __call__(self, examples: list[_Example]) -> PromptBatch:
        length = _padded_length(examples, self.cfg) if self.length is None else self.length
        local = len(examples) // self.process_count
        mine = examples[self.process_index * local : (self.process_index + 1) * local]
        return _make_batch(mine, length, self.pad_id, self.has_source, self.images)


def _padded_length(examples: Sequence[_Example], cfg: DataConfig) -> int:
    """The smallest bucket (``max_prompt_tokens`` the last) that holds every example."""
    if not examples:
        raise ValueError("no prompt is within the budget: nothing to pad")
    longest = max(len(e.ids) for e in examples)
    return next(b for b in cfg.prompt_buckets + (cfg.max_prompt_tokens,) if b >= longest)


def _make_batch(
    examples: Sequence[_Example],
    length: int,
    pad_id: int,
    has_source: bool,
    images: ImagePrompts | None = None,
) -> PromptBatch:
    ids, mask = pad_left([e.ids for e in examples], pad_id=pad_id, length=length)
    keys = examples[0].extras.keys() if examples else ()
    return PromptBatch(
        prompt_ids=ids,
        prompt_mask=mask,
        prompts=[e.text for e in examples],
        answers=[e.answer for e in examples],
        fields={k: [e.extras[k] for e in examples] for k in keys},
        data_source=[e.data_source for e in examples] if has_source else None,
        images=None if images is None else images.batch([e.images for e in examples]),
    )


def prompt_batch(
    records: Sequence[Record | Mapping[str, Any]],
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    images: ImagePrompts | None = None,
) -> PromptBatch:
    """Format, tokenize and pad ``records`` (e.g. ``eval_records(cfg)``) into one batch.

    Same rules as the pipeline (fields, chat template, overlong, buckets), without shuffling
    or sharding. Errors name the file and row of a ``Record`` (``read_records``,
    ``eval_records``); a plain dict is named ``<records>`` and its 1-based index in ``records``.
    """
    if not records:
        raise ValueError("prompt_batch got no records")
    rows = [as_record(r, i) for i, r in enumerate(records, start=1)]
    prepared = prepare_prompts(rows, cfg, tokenizer, images)
    for message in (
        prepared.stats.over_budget_message("held-out"),
        prepared.stats.bad_images_message("held-out"),
    ):
        if message is not None:
            warnings.warn(message, stacklevel=2)
    return batch_of(prepared, cfg, tokenizer.pad_token_id, images)


def batch_of(
    prepared: PreparedPrompts, cfg: DataConfig, pad_id: int, images: ImagePrompts | None = None
) -> PromptBatch:
    """All of ``prepared``'s examples as one batch, padded to the bucket of the longest."""
    return _make_batch(
        prepared.examples,
        _padded_length(prepared.examples, cfg),
        pad_id,
        prepared.has_source,
        images,
    )


def padded_length(prepared: PreparedPrompts, cfg: DataConfig) -> int | None:
    """The length every training batch is padded to (``pad_to="data"``), or None when each batch
    picks its own bucket (``pad_to="batch"``)."""
    return _padded_length(prepared.examples, cfg) if cfg.pad_to == "data" else None


def batch_lengths(prepared: PreparedPrompts, cfg: DataConfig) -> tuple[int, ...]:
    """Every length a training batch of ``prepared`` can be padded to, shortest first: the one of
    ``padded_length``, or (``pad_to="batch"``) the bucket of each kept prompt."""
    if cfg.pad_to == "data":
        return (_padded_length(prepared.examples, cfg),)
    return tuple(sorted({_padded_length([e], cfg) for e in prepared.examples}))


# ----------------------------------------------------------------------------- pipeline


def prompt_dataset(
    cfg: DataConfig,
    tokenizer: TextTokenizer,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
    splits: DataSplits | None = None,
    prepared: PreparedPrompts | None = None,
    images: ImagePrompts | None = None,
    padded_as: PreparedPrompts | None = None,
) -> grain.IterDataset:
    """The training pipeline: an ``IterDataset`` of this process's ``PromptBatch``es.

    ``process_index`` / ``process_count`` default to ``jax.process_index()`` /
    ``jax.process_count()``; ``batch_size`` must divide by ``process_count``. ``iter()`` of the
    result is a ``grain.DatasetIterator`` with ``get_state()`` / ``set_state()``. ``splits``: the
    rows already read by ``read_splits(cfg)`` (default: read ``cfg.path`` here); ``prepared``: the
    training rows already prepared by ``prepare_prompts`` (then ``splits`` is not read);
    ``images``: the rows are image prompts (``relax.data.image_prompts``), each batch's images
    decoded and processed when it is collated. ``padded_as``: pad as these prompts would be
    (a part of the data, e.g. one level of a curriculum, padded as the whole).
    """
    if process_index is None or process_count is None:
        import jax

        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} not in [0, {process_count})")
    if cfg.batch_size % process_count:
        n = process_count
        raise ValueError(f"batch_size={cfg.batch_size} does not divide over {n} processes")
    if prepared is None:
        prepared = prepare_prompts(
            (read_splits(cfg) if splits is None else splits).train, cfg, tokenizer, images
        )
    examples, has_source = prepared.examples, prepared.has_source
    if not examples:
        raise ValueError(
            f"no training prompt is within max_prompt_tokens={cfg.max_prompt_tokens} "
            f"({len(prepared.stats.over_budget)} over it, overlong={cfg.overlong!r})"
        )
    if cfg.num_epochs is not None and len(examples) * cfg.num_epochs < cfg.batch_size:
        raise ValueError(
            f"{len(examples)} rows x {cfg.num_epochs} epochs make no full batch of {cfg.batch_size}"
        )
    ds = grain.MapDataset.source(examples)
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs)
    ds = ds.batch(cfg.batch_size, drop_remainder=True, batch_fn=list)
    ds = ds.map(
        _Collate(
            cfg,
            tokenizer.pad_token_id,
            process_index,
            process_count,
            has_source,
            length=padded_length(prepared if padded_as is None else padded_as, cfg),
            images=images,
        )
    )
    # Rows are in memory and collation is cheap: no reader threads (they would only fight
    # over the GIL), a small prefetch buffer.
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=1))


def prompt_iterator(
    cfg: DataConfig, tokenizer: TextTokenizer, **kwargs: Any
) -> grain.DatasetIterator:
    """``iter(prompt_dataset(cfg, tokenizer, **kwargs))``."""
    return iter(prompt_dataset(cfg, tokenizer, **kwargs))
