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

from relax.data.files import MissingFieldError, Record, as_record, require_fields
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


@dataclasses.dataclass(frozen=True)
class _Budget:
    max_prompt_tokens: int
    max_completion_tokens: int
    truncate_prompt: bool

    def __post_init__(self):
        if self.max_prompt_tokens < 1 or self.max_completion_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens={self.max_prompt_tokens} and max_completion_tokens="
                f"{self.max_completion_tokens} must be >= 1"
            )


class _Row:
    """Error messages naming the row's file, row and a field."""

    def __init__(self, r: Record):
        self.r = r

    def error(self, field: str, message: str) -> ValueError:
        return ValueError(f"{self.r.file}: row {self.r.row}: field {field!r}: {message}")


def _eos_id(tokenizer: TextTokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    if eos is None:
        raise ValueError(
            f"tokenizer {tokenizer.path} has no eos token: completions need one to end"
        )
    return eos


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple))


def _empty(value: Any) -> bool:
    """No text: an empty / blank string, no messages, or messages whose contents are all blank."""
    if isinstance(value, str):
        return not value.strip()
    if _is_messages(value):
        return all(
            isinstance(m, Mapping)
            and not m.get("tool_calls")
            and (
                m.get("content") is None
                or (isinstance(m.get("content"), str) and not m["content"].strip())
            )
            for m in value
        )
    return False


def _check_value(row: _Row, field: str, value: Any) -> None:
    if not isinstance(value, str) and not _is_messages(value):
        raise row.error(
            field, f"must be a string or a list of chat messages, got {type(value).__name__}"
        )
    if _is_messages(value) and not all(isinstance(m, Mapping) and "role" in m for m in value):
        raise row.error(field, "chat messages must be dicts with a 'role'")


class _Encoder:
    """Tokenizes prompts and completions of rows and checks them against the budget."""

    def __init__(self, tokenizer: TextTokenizer, budget: _Budget):
        self.tok, self.budget, self.eos = tokenizer, budget, _eos_id(tokenizer)

    def split_implicit(
        self, row: _Row, first: str, second: str, a: Any, b: Any
    ) -> tuple[list, list, list]:
        """TRL's implicit prompt: the messages ``a`` and ``b`` share first, then their own."""
        if not (_is_messages(a) and _is_messages(b)):
            raise MissingFieldError(
                f"{row.r.file}: row {row.r.row}: missing field 'prompt' (row has "
                f"{sorted(row.r.record)}; without it {first!r} and {second!r} must be "
                "conversations sharing their first messages)"
            )
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        if n == 0:
            raise row.error(
                first, f"no prompt column, and {first!r} and {second!r} share no first message"
            )
        return list(a[:n]), list(a[n:]), list(b[n:])

    def prompt(
        self, row: _Row, prompt: Any, chat: bool
    ) -> tuple[list[int], str | None, list | None]:
        """``(ids, rendered text or None, messages or None)`` of the prompt, budget applied."""
        if chat:
            if not self.tok.has_chat_template:
                raise row.error(
                    "prompt",
                    f"chat messages need a chat template; tokenizer {self.tok.path} has none",
                )
            messages = (
                [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
            )
            try:
                text = self.tok.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # the template's own errors (roles, raise_exception)
                raise row.error("prompt", f"chat template failed: {e}") from e
            ids = self.tok.encode(text, add_special_tokens=False)
        else:
            messages, text = None, None
            ids = self.tok.encode(prompt, add_special_tokens=True)
        if not ids:
            raise row.error(
                "prompt", "is empty (the first completion token needs a prompt token before it)"
            )
        limit = self.budget.max_prompt_tokens
        if len(ids) > limit:
            if not self.budget.truncate_prompt:
                raise row.error(
                    "prompt",
                    f"has {len(ids)} tokens > max_prompt_tokens={limit} (truncate_prompt is off)",
                )
            head = 1 if self.tok.bos_token_id is not None and ids[0] == self.tok.bos_token_id else 0
            ids = ids[:head] + ids[len(ids) - (limit - head) :]
        return ids, text, messages

    def _end(self, ids: list[int]) -> list[int]:
        """``ids`` ending at an EOS: cut after the last EOS id that only whitespace follows (a chat
        template's newline after its end-of-turn token), else with one appended."""
        eos = set(self.tok.eos_token_ids)
        for k in range(len(ids) - 1, -1, -1):
            if ids[k] in eos:
                if not self.tok.decode(ids[k + 1 :]).strip():
                    return ids[: k + 1]
                break
        return ids + [self.eos]

    def completion(
        self, row: _Row, field: str, value: Any, prompt_text: str | None, messages: list | None
    ) -> list[int]:
        """The completion's ids with an EOS at the end, checked against the budget."""
        if _empty(value):
            raise row.error(field, "is empty")
        if messages is None:
            ids = self.tok.encode(value, add_special_tokens=False)
        else:
            turn = (
                [{"role": "assistant", "content": value}] if isinstance(value, str) else list(value)
            )
            try:
                full = self.tok.apply_chat_template(messages + turn, tokenize=False)
            except Exception as e:
                raise row.error(field, f"chat template failed: {e}") from e
            if not full.startswith(prompt_text):
                raise row.error(
                    field,
                    "the chat template does not render the prompt with the generation prompt "
                    "as the start of the conversation with this completion, so the completion "
                    "cannot be cut out of it",
                )
            ids = self.tok.encode(full[len(prompt_text) :], add_special_tokens=False)
        if not ids:
            raise row.error(field, "is empty (no tokens)")
        ids = self._end(ids)
        limit = self.budget.max_completion_tokens
        if len(ids) > limit:
            raise row.error(
                field, f"has {len(ids)} tokens with its EOS > max_completion_tokens={limit}"
            )
        return ids


def chat_completion(
    tokenizer: TextTokenizer,
    r: Record,
    field: str,
    value: Any,
    prompt_text: str,
    messages: list,
    *,
    max_completion_tokens: int,
) -> list[int]:
    """Row ``r``'s completion ``field`` after the chat ``messages`` (rendered with the generation
    prompt as ``prompt_text``): its ids ending with an EOS, cut out as a conversational row's are
    (module docstring), checked against ``max_completion_tokens``; errors name the row."""
    enc, row = _Encoder(tokenizer, _Budget(1, max_completion_tokens, False)), _Row(r)
    _check_value(row, field, value)
    return enc.completion(row, field, value, prompt_text, messages)


def _conversational(*values: Any) -> bool:
    return any(_is_messages(v) for v in values)


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
    enc = _Encoder(tokenizer, _Budget(max_prompt_tokens, max_completion_tokens, truncate_prompt))
    pairs = []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        row = _Row(r)
        require_fields(r, ("chosen", "rejected"))
        chosen, rejected = r.record["chosen"], r.record["rejected"]
        for field, value in (("chosen", chosen), ("rejected", rejected)):
            _check_value(row, field, value)
        if "prompt" in r.record:
            prompt = r.record["prompt"]
            _check_value(row, "prompt", prompt)
        else:
            prompt, chosen, rejected = enc.split_implicit(
                row, "chosen", "rejected", chosen, rejected
            )
        ids, text, messages = enc.prompt(row, prompt, _conversational(prompt, chosen, rejected))
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
    enc = _Encoder(tokenizer, _Budget(max_prompt_tokens, max_completion_tokens, truncate_prompt))
    rows = []
    for i, rec in enumerate(records, start=1):
        r = as_record(rec, i)
        row = _Row(r)
        require_fields(r, UNPAIRED_FIELDS)
        prompt, completion, label = (r.record[k] for k in UNPAIRED_FIELDS)
        _check_value(row, "prompt", prompt)
        _check_value(row, "completion", completion)
        if not isinstance(label, (bool, np.bool_)):
            raise row.error(
                "label", f"must be a bool (true: desirable), got {type(label).__name__} {label!r}"
            )
        ids, text, messages = enc.prompt(row, prompt, _conversational(prompt, completion))
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
