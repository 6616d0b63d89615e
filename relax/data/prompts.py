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
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, TypeVar

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
from relax.data.prompt_budget import OVERLONG, OverBudget, PromptStats, cut_chat, cut_plain
from relax.text.base import TextTokenizer
from relax.text.sentencepiece_model import pad_left

T = TypeVar("T")
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


class _Example(NamedTuple):
    ids: list[int]
    text: str
    answer: Any
    data_source: Any
    extras: dict[str, Any]


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


@dataclasses.dataclass(frozen=True)
class PreparedPrompts:
    """Rows formatted, tokenized and checked against the budget (``prepare_prompts``):
    ``examples`` (the rows kept, in order), whether the data has a data-source column, and
    ``stats`` (lengths, rows over budget, the first prompt) for the start-up report."""

    examples: list[_Example]
    has_source: bool
    stats: PromptStats


def prepare_prompts(
    rows: Sequence[Record], cfg: DataConfig, tokenizer: TextTokenizer
) -> PreparedPrompts:
    """Format, tokenize and budget-check every row; errors name the file, row and field.

    If any row has a data-source column, every row must. Over-budget rows are handled per
    ``cfg.overlong`` and counted in ``stats``."""
    used = {cfg.prompt_field, cfg.answer_field, cfg.data_source_field}
    extra_keys = sorted({k for r in rows for k in r.record} - used)
    source = cfg.data_source_field
    has_source = source is not None and any(source in r.record for r in rows)
    required = [cfg.prompt_field] + ([cfg.answer_field] if cfg.answer_field is not None else [])
    required += [source] if has_source else []
    required += list(cfg.required_fields)
    examples, lengths, over, uncuttable = [], [], [], 0
    for r in rows:
        require_fields(r, required)
        prompt = r.record[cfg.prompt_field]
        try:
            text, ids = format_prompt(prompt, cfg, tokenizer)
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
            cut = cut_to_budget(prompt, ids, cfg, tokenizer) if cfg.overlong == "truncate" else None
            uncuttable += cfg.overlong == "truncate" and cut is None
            if cut is None:
                continue
            text, ids = cut
        examples.append(
            _Example(
                ids=ids,
                text=text,
                answer=r.record[cfg.answer_field] if cfg.answer_field is not None else None,
                data_source=r.record[source] if has_source else None,
                extras={k: r.record.get(k) for k in extra_keys},
            )
        )
    stats = PromptStats(
        lengths=np.asarray(lengths, dtype=np.int64),
        budget=cfg.max_prompt_tokens,
        over_budget=tuple(sorted(over, key=lambda o: -o.tokens)),
        action=cfg.overlong,
        kept=len(examples),
        uncuttable=uncuttable,
        first_prompt=examples[0].text if examples else "",
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

    def __call__(self, examples: list[_Example]) -> PromptBatch:
        length = _padded_length(examples, self.cfg) if self.length is None else self.length
        local = len(examples) // self.process_count
        mine = examples[self.process_index * local : (self.process_index + 1) * local]
        return _make_batch(mine, length, self.pad_id, self.has_source)


def _padded_length(examples: Sequence[_Example], cfg: DataConfig) -> int:
    """The smallest bucket (``max_prompt_tokens`` the last) that holds every example."""
    if not examples:
        raise ValueError("no prompt is within the budget: nothing to pad")
    longest = max(len(e.ids) for e in examples)
    return next(b for b in cfg.prompt_buckets + (cfg.max_prompt_tokens,) if b >= longest)


def _make_batch(
    examples: Sequence[_Example], length: int, pad_id: int, has_source: bool
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
    )


def prompt_batch(
    records: Sequence[Record | Mapping[str, Any]], cfg: DataConfig, tokenizer: TextTokenizer
) -> PromptBatch:
    """Format, tokenize and pad ``records`` (e.g. ``eval_records(cfg)``) into one batch.

    Same rules as the pipeline (fields, chat template, overlong, buckets), without shuffling
    or sharding. Errors name the file and row of a ``Record`` (``read_records``,
    ``eval_records``); a plain dict is named ``<records>`` and its 1-based index in ``records``.
    """
    if not records:
        raise ValueError("prompt_batch got no records")
    rows = [as_record(r, i) for i, r in enumerate(records, start=1)]
    prepared = prepare_prompts(rows, cfg, tokenizer)
    message = prepared.stats.over_budget_message("held-out")
    if message is not None:
        warnings.warn(message, stacklevel=2)
    return batch_of(prepared, cfg, tokenizer.pad_token_id)


def batch_of(prepared: PreparedPrompts, cfg: DataConfig, pad_id: int) -> PromptBatch:
    """All of ``prepared``'s examples as one batch, padded to the bucket of the longest."""
    return _make_batch(
        prepared.examples, _padded_length(prepared.examples, cfg), pad_id, prepared.has_source
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
) -> grain.IterDataset:
    """The training pipeline: an ``IterDataset`` of this process's ``PromptBatch``es.

    ``process_index`` / ``process_count`` default to ``jax.process_index()`` /
    ``jax.process_count()``; ``batch_size`` must divide by ``process_count``. ``iter()`` of the
    result is a ``grain.DatasetIterator`` with ``get_state()`` / ``set_state()``. ``splits``: the
    rows already read by ``read_splits(cfg)`` (default: read ``cfg.path`` here); ``prepared``: the
    training rows already prepared by ``prepare_prompts`` (then ``splits`` is not read).
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
            (read_splits(cfg) if splits is None else splits).train, cfg, tokenizer
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
            length=padded_length(prepared, cfg),
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
