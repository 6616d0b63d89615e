"""Preference data: ``Record``s -> tokenized pairs (DPO family, ORPO) and unpaired rows (KTO), and
their fixed-shape batches in the prefix-shared forward's layout.

Columns (TRL's names):

- pairs: ``prompt``, ``chosen``, ``rejected``;
- unpaired (KTO): ``prompt``, ``completion``, ``label`` (a JSON/parquet bool: True = desirable).

Each value is a string or a list of chat messages (``{"role", "content"}`` dicts).

- **Standard rows** (all strings) are raw text: the prompt is ``tokenizer.encode(prompt)`` with the
  special tokens the tokenizer itself adds (a BOS for Llama-style tokenizers, as
  ``relax.data.prompts`` does for sampling), a completion ``tokenizer.encode(text,
  add_special_tokens=False)``.
- **Conversational rows** (any of the values a list) go through the tokenizer's chat template,
  as TRL does: the prompt messages rendered with ``add_generation_prompt=True``; a completion is
  what rendering ``prompt + completion`` adds after that text, tokenized on its own. A string
  prompt counts as one user message, a string completion as one assistant message. Without a
  ``prompt`` column, ``chosen`` and ``rejected`` may be whole conversations sharing their first
  messages (TRL's implicit prompt): the shared messages are the prompt, the rest the completions.
- **EOS**: every completion ends with an end-of-sequence id, as the sampler's completions do
  (it stops at the first of ``eos_token_ids``). A completion whose last EOS id is followed by
  whitespace only (a chat template's newline after its end-of-turn token: Qwen's
  ``<|im_end|>\n``, Gemma's ``<end_of_turn>\n``) is cut after that EOS; one that has none gets
  the tokenizer's ``eos_token_id`` (its first ``eos_token_ids`` without one) appended. (TRL
  appends an EOS in every case, ``<|im_end|>\n<|im_end|>`` for Qwen.)
- **Budgets**: a prompt longer than ``max_prompt_tokens`` is an error by default; with
  ``truncate_prompt=True`` it keeps its LAST tokens (after a leading BOS, which is kept), as
  ``relax.data.prompts`` and TRL do. A completion (EOS included) longer than
  ``max_completion_tokens`` is always an error: cutting it would train on a different answer
  than the one the data judged.

Every error names the file, the 1-based row and the field (``relax.data.files``).

Batches (``collate_pairs`` -> ``PairBatch``, ``collate_unpaired`` -> ``UnpairedBatch``):
``prompt_ids`` / ``prompt_mask`` int32 ``[P, Lp]`` left-padded; ``tokens`` / ``mask`` int32
``[P, 2, N]`` right-padded, index 0 the chosen completion (KTO: the row's own completion), index 1
the rejected one (KTO: the mismatched completion for the KL estimate, see ``encode_unpaired``);
``loss_mask`` int32 ``[P]`` (1 per real row); KTO adds ``label`` int32 ``[P]`` (1 = desirable).
Reference log-probs attached to the examples (``with_reference``) come out as ``ref_logps``
float32 ``[P, 2]``, one per completion in the order of ``tokens``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from relax.data.completion_encoding import Budget, Encoder, RowErrors, check_value, conversational
from relax.data.files import Record, as_record, require_fields
from relax.models.decoder.prompt_inputs import PromptInputs
from relax.models.vision.families import Pixels
from relax.text.base import TextTokenizer
from relax.text.sentencepiece_model import pad_left

PAIR_FIELDS = ("prompt", "chosen", "rejected")
UNPAIRED_FIELDS = ("prompt", "completion", "label")


@dataclasses.dataclass(frozen=True)
class Pair:
    """One preference pair, tokenized. ``chosen`` / ``rejected`` end with an EOS id.
    ``ref``: the reference model's sequence log-probs ``(chosen, rejected)`` once attached."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    file: str
    row: int
    ref: tuple[float, float] | None = None


@dataclasses.dataclass(frozen=True)
class Unpaired:
    """One KTO row, tokenized: ``completion`` (with EOS) judged ``desirable`` or not, and
    ``kl_completion``, another row's completion, for the KL reference point. ``ref``: the
    reference model's log-probs ``(completion, kl_completion)`` given this prompt, once attached."""

    prompt: list[int]
    completion: list[int]
    kl_completion: list[int]
    desirable: bool
    file: str
    row: int
    ref: tuple[float, float] | None = None


class PairBatch(eqx.Module):
    """Preference pairs in the prefix-shared forward's layout (``collate_pairs``): the batch of
    the DPO family and of reward-model training.

    ``prompt_ids`` / ``prompt_mask``: the prompts, left-padded to ``lp``. ``tokens`` / ``mask``: the
    two completions of each prompt, right-padded to ``n``: index 0 the chosen one, 1 the rejected
    one. ``loss_mask``: 1 for a real pair, 0 for a padding row that counts nowhere (None: every
    pair is real). ``ref_logps``: the reference model's sequence log-probs of the two completions,
    attached to the examples (``with_reference``) or set by a step's reference stage (None: none
    yet). ``ref_is_policy``: set with them by a step's reference stage: True when the reference
    model was bitwise the policy and ``ref_logps`` are placeholders (the loss then reads the
    policy's own log-probs). ``margin``: a margin per pair that the Bradley-Terry loss subtracts
    (TRL's ``margin`` column; None: none). ``prompt``: image prompts' inputs (the frozen vision
    tower's features, RoPE tables and blocks, ``relax.models.decoder.prompt_inputs``; None: text
    prompts), set from the batch's pixels before the step (``relax.data.image_rows``);
    ``pixels``: those images, when the tower trains (``relax.train.vision_tower``).
    """

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p 2 n"]
    mask: Int[Array, "p 2 n"]
    loss_mask: Int[Array, " p"] | None = None
    ref_logps: Float[Array, "p 2"] | None = None
    ref_is_policy: Bool[Array, ""] | None = None
    margin: Float[Array, " p"] | None = None
    prompt: PromptInputs | None = None
    pixels: Pixels | None = None


class UnpairedBatch(eqx.Module):
    """Unpaired KTO rows in the prefix-shared forward's layout (``collate_unpaired``).

    ``prompt_ids`` / ``prompt_mask``: the prompts, left-padded to ``lp``. ``tokens`` / ``mask``: two
    completions per prompt, right-padded to ``n``: index 0 the row's own completion, 1 its KL
    completion (another row's, ``encode_unpaired``). ``label``: 1 where the row's completion is
    desirable, 0 where it is not. ``loss_mask``: 1 for a real row, 0 for a padding row (None:
    every row is real). ``ref_logps``: the reference model's sequence log-probs of the two
    completions (attached, ``with_reference``, or set by the step's reference stage; None: none
    yet); ``ref_is_policy``: set with them by the step: True when they are placeholders because
    the reference model was bitwise the policy. ``kl``: KTO's reference point ``z0`` of the batch,
    a scalar, set by the step's ``reference_point`` stage (None: not yet).
    """

    prompt_ids: Int[Array, "p lp"]
    prompt_mask: Int[Array, "p lp"]
    tokens: Int[Array, "p 2 n"]
    mask: Int[Array, "p 2 n"]
    label: Int[Array, " p"]
    loss_mask: Int[Array, " p"] | None = None
    ref_logps: Float[Array, "p 2"] | None = None
    ref_is_policy: Bool[Array, ""] | None = None
    kl: Float[Array, ""] | None = None


def encode_pairs(
    records: Sequence[Record | Mapping[str, Any]],
    tokenizer: TextTokenizer,
    *,
    max_prompt_tokens: int,
    max_completion_tokens: int,
    truncate_prompt: bool = False,
) -> list[Pair]:
    """Every row of ``records`` (``read_records``; plain dicts are named ``<records>`` and their
    1-based index) as a ``Pair`` (module docstring: formats, EOS and budgets). Errors
    (``MissingFieldError``, ``ValueError``, ``TypeError``) name the file, row and field."""
    if not records:
        raise ValueError("encode_pairs got no records")
    enc = Encoder(tokenizer, Budget(max_prompt_tokens, max_completion_tokens, truncate_prompt))
    pairs = []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        row = RowErrors(r)
        require_fields(r, ("chosen", "rejected"))
        chosen, rejected = r.record["chosen"], r.record["rejected"]
        for field, value in (("chosen", chosen), ("rejected", rejected)):
            check_value(row, field, value)
        if "prompt" in r.record:
            prompt = r.record["prompt"]
            check_value(row, "prompt", prompt)
        else:
            prompt, chosen, rejected = enc.split_implicit(
                row, "chosen", "rejected", chosen, rejected
            )
        ids, text, messages = enc.prompt(row, prompt, conversational(prompt, chosen, rejected))
        pairs.append(
            Pair(
                prompt=ids,
                chosen=enc.completion(row, "chosen", chosen, text, messages),
                rejected=enc.completion(row, "rejected", rejected, text, messages),
                file=r.file,
                row=r.row,
            )
        )
    return pairs


def encode_unpaired(
    records: Sequence[Record | Mapping[str, Any]],
    tokenizer: TextTokenizer,
    *,
    max_prompt_tokens: int,
    max_completion_tokens: int,
    truncate_prompt: bool = False,
) -> list[Unpaired]:
    """Every KTO row of ``records`` as an ``Unpaired`` (formats, EOS and budgets as ``encode_pairs``).

    ``label`` must be a bool. The KL completion of row ``i`` is row ``i - 1``'s completion (the
    first row takes the last row's), fixed here in data order as TRL fixes its mismatched pairs
    when it prepares the data, so that reference log-probs can be precomputed per row; a one-row
    dataset pairs its completion with itself.
    """
    if not records:
        raise ValueError("encode_unpaired got no records")
    enc = Encoder(tokenizer, Budget(max_prompt_tokens, max_completion_tokens, truncate_prompt))
    rows = []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        row = RowErrors(r)
        require_fields(r, UNPAIRED_FIELDS)
        prompt, completion, label = (r.record[k] for k in UNPAIRED_FIELDS)
        check_value(row, "prompt", prompt)
        check_value(row, "completion", completion)
        if not isinstance(label, (bool, np.bool_)):
            raise row.error(
                "label", f"must be a bool (true: desirable), got {type(label).__name__} {label!r}"
            )
        ids, text, messages = enc.prompt(row, prompt, conversational(prompt, completion))
        rows.append(
            (ids, enc.completion(row, "completion", completion, text, messages), bool(label), r)
        )
    return [
        Unpaired(
            prompt=ids,
            completion=c,
            kl_completion=rows[i - 1][1],
            desirable=d,
            file=r.file,
            row=r.row,
        )
        for i, (ids, c, d, r) in enumerate(rows)
    ]


def with_reference(examples: Sequence[Pair | Unpaired], logps: np.ndarray) -> list[Pair | Unpaired]:
    """``examples`` with their reference log-probs attached: ``logps`` ``[n, 2]`` (pairs: chosen,
    rejected; unpaired: completion, KL completion), row ``i`` for example ``i``."""
    logps = np.asarray(logps, np.float32)
    if logps.shape != (len(examples), 2):
        raise ValueError(
            f"reference log-probs {logps.shape} do not match {len(examples)} examples (want [n, 2])"
        )
    return [dataclasses.replace(e, ref=(float(a), float(b))) for e, (a, b) in zip(examples, logps)]


def right_pad(
    seqs: Sequence[Sequence[int]], length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` ``[len(seqs), length]`` int32, each row right-padded (a longer one is an error)."""
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(
                f"a completion has {len(s)} tokens > the batch's completion length {length}"
            )
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return ids, mask


def _collate(
    prompts, first, second, refs, *, pad_id, prompt_length, completion_length
) -> dict[str, Any]:
    """The fields both batch types share, by name (``PairBatch`` / ``UnpairedBatch``)."""
    if not prompts:
        raise ValueError("cannot collate an empty batch")
    longest = max(len(p) for p in prompts)
    if longest > prompt_length:
        raise ValueError(
            f"a prompt has {longest} tokens > the batch's prompt length {prompt_length}"
        )
    prompt_ids, prompt_mask = pad_left(prompts, pad_id=pad_id, length=prompt_length)
    a, am = right_pad(first, completion_length, pad_id)
    b, bm = right_pad(second, completion_length, pad_id)
    ref = np.asarray(refs, np.float32) if all(r is not None for r in refs) else None
    return dict(
        prompt_ids=np.asarray(prompt_ids, np.int32),
        prompt_mask=np.asarray(prompt_mask, np.int32),
        tokens=np.stack([a, b], axis=1),
        mask=np.stack([am, bm], axis=1),
        loss_mask=np.ones(len(prompts), np.int32),
        ref_logps=ref,
    )


def collate_pairs(
    pairs: Sequence[Pair], *, pad_id: int, prompt_length: int, completion_length: int
) -> PairBatch:
    """A batch of pairs (module docstring): ``prompt_ids``/``prompt_mask`` ``[P, prompt_length]``,
    ``tokens``/``mask`` ``[P, 2, completion_length]`` (0 chosen, 1 rejected), ``loss_mask`` ``[P]``,
    and ``ref_logps`` ``[P, 2]`` when every pair has them."""
    return PairBatch(
        **_collate(
            [p.prompt for p in pairs],
            [p.chosen for p in pairs],
            [p.rejected for p in pairs],
            [p.ref for p in pairs],
            pad_id=pad_id,
            prompt_length=prompt_length,
            completion_length=completion_length,
        )
    )


def collate_unpaired(
    examples: Sequence[Unpaired], *, pad_id: int, prompt_length: int, completion_length: int
) -> UnpairedBatch:
    """A KTO batch: as ``collate_pairs`` with ``tokens[:, 0]`` the rows' completions and
    ``tokens[:, 1]`` their KL completions, ``label`` ``[P]`` (1 = desirable), and ``ref_logps``
    ``[P, 2]`` (completion, KL completion) when every row has them."""
    shared = _collate(
        [e.prompt for e in examples],
        [e.completion for e in examples],
        [e.kl_completion for e in examples],
        [e.ref for e in examples],
        pad_id=pad_id,
        prompt_length=prompt_length,
        completion_length=completion_length,
    )
    return UnpairedBatch(**shared, label=np.asarray([e.desirable for e in examples], np.int32))
