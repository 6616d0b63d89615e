"""Completions packed across prompt groups into bins, on the host: which prompt copies and
completions share a bin, and the layout the training forwards read
(``relax.models.forward.completion_packing.CompletionBins``).

The prompt groups are taken in order; each group's completions, longest first, go into the
current bin (behind a copy of their prompt, the first time the group meets that bin) while one
fits, else the bin is closed and the next one opened (as verl's and NeMo-RL's dynamic batching fill
micro-batches by token count, but keeping the prompt shared inside each bin). A bin closes when
no completion of the group fits in what is left of its ``S`` slots, or when it holds
``completions_per_bin``; so every closed bin holds at least
``c_min = min(completions_per_bin, floor((S - Lp - N) / (Lp + N)) + 1)`` completions, and a batch
of ``P x G`` completions never needs more than ``floor(P G / c_min) + 1`` bins: that many bins,
one static shape whatever the lengths, the ones a batch leaves empty skipped at run time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from relax.models.attention.stream import block_pairs
from relax.models.forward.completion_packing import CompletionBins

__all__ = ["PACKING_MODES", "BinSizes", "PackingConfig", "bin_fill", "pack_bins"]

PACKING_MODES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class BinSizes:
    """A run's bin layout: ``bins`` bins of ``tokens`` slots, each with at most ``completions``
    completions, attention in blocks of ``block`` slots."""

    tokens: int
    completions: int
    bins: int
    block: int


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """How the training forwards (update, reference, proximal) lay out a batch's completions.

    ``mode``: ``"on"`` packs every batch into bins (``relax.models.forward.completion_packing``),
    ``"off"`` keeps the completions padded to the budget, ``"auto"`` packs where the backend's
    passes say so (``relax.passes.Passes.auto_packs``: CPU) and the train attention is the group
    kernel (not where the fused dense kernel runs it: GPU in 16 bits; there ``"on"`` packs and
    each bin's attention is one fused kernel over its mask).
    ``bin_tokens``: slots per bin, S, at least the prompt bucket plus the budget. None (the
    default): twice that, rounded up to the attention block. The update's micro-batches are
    whole bins (one each on a cache-sized CPU, elsewhere as many per device as the token budget
    holds, ``relax.passes.Passes.micro_batches``); larger bins leave more slots empty in a
    batch's last bin.
    ``completions_per_bin``: at most this many completions per bin (the loss reads a bin's
    completions as rows of N). None: ``8 S / N``.
    """

    mode: str = "auto"
    bin_tokens: int | None = None
    completions_per_bin: int | None = None

    def __post_init__(self):
        if self.mode not in PACKING_MODES:
            raise ValueError(f"packing mode {self.mode!r}: valid {', '.join(PACKING_MODES)}")
        for name in ("bin_tokens", "completions_per_bin"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"packing {name} must be >= 1, got {getattr(self, name)}")

    def applies(self, train_attention: str, auto_packs: bool = True) -> bool:
        """Whether to pack, given the resolved train attention (``"group"`` or ``"dense"``) and
        whether ``"auto"`` packs on this backend (``Passes.auto_packs``). ``"on"`` packs with
        either: the bins' attention is the block-sparse loop for ``"group"``, one fused kernel
        per bin over the dense mask for ``"dense"`` (``relax.models.forward.binned``)."""
        auto = self.mode == "auto" and auto_packs and train_attention == "group"
        return self.mode == "on" or auto

    def slots(self, prompt_len: int, budget: int, *, block: int) -> int:
        """Slots per bin, S (``bin_tokens``, rounded up to the attention ``block``), checked to
        hold a prompt of ``prompt_len`` and a completion of ``budget``."""
        need = prompt_len + budget
        s = _round_up(2 * need if self.bin_tokens is None else self.bin_tokens, block)
        if s < need:
            raise ValueError(
                f"packing bin_tokens={self.bin_tokens} is shorter than a prompt ({prompt_len}) "
                f"plus the completion budget ({budget})"
            )
        return s

    def sizes(
        self,
        prompts: int,
        generations: int,
        prompt_len: int,
        budget: int,
        *,
        block: int,
        multiple: int = 1,
    ) -> BinSizes:
        """The bin layout of ``prompts x generations`` completions of ``budget`` tokens behind
        prompts of ``prompt_len``: bins of ``slots`` slots, rounded up to a multiple of
        ``multiple``."""
        need = prompt_len + budget
        s = self.slots(prompt_len, budget, block=block)
        cp = (
            max(1, 8 * s // budget)
            if self.completions_per_bin is None
            else self.completions_per_bin
        )
        cp = min(cp, prompts * generations)
        c_min = max(1, min(cp, (s - need) // need + 1))
        return BinSizes(s, cp, _round_up(prompts * generations // c_min + 1, multiple), block)

    def describe(self, train_attention: str, max_new_tokens: int, auto_packs: bool = True) -> str:
        """One line for a start-up report: the layout the training forwards will use."""
        if not self.applies(train_attention, auto_packs):
            return (
                f"completions padded to {max_new_tokens} tokens in the update (packing {self.mode}, "
                f"{train_attention} train attention)"
            )
        size = "2 x (prompt + budget)" if self.bin_tokens is None else str(self.bin_tokens)
        per = "8 S / N" if self.completions_per_bin is None else str(self.completions_per_bin)
        return (
            f"completions packed across groups into bins of {size} slots (at most {per} completions "
            "each) in the update, reference and proximal forwards: one layout, micro-batches of "
            "whole bins (grad_accum applies to padded batches), the empty bins skipped; "
            + (
                "each bin's attention one fused kernel over its mask"
                if train_attention == "dense"
                else "attention over the visible key blocks only"
            )
        )


def pack_bins(
    prompt_ids: np.ndarray,
    prompt_mask: np.ndarray,
    tokens: np.ndarray,
    mask: np.ndarray,
    sizes: BinSizes,
) -> CompletionBins:
    """The bins (``relax.models.forward.completion_packing``) of a batch: left-padded
    ``prompt_ids``/``prompt_mask [P, Lp]``, completions ``tokens``/``mask [P, G, N]``, as numpy
    arrays. Raises, naming the completion, if a mask row is not a prefix, and if a prompt with
    its completion does not fit a bin."""
    prompt_ids, prompt_mask = np.asarray(prompt_ids), np.asarray(prompt_mask)
    tokens = np.asarray(tokens)
    p, lp = prompt_ids.shape
    _, g, n = tokens.shape
    lengths, p_len = _lengths(mask), _prompt_lengths(prompt_mask)
    plan = _plan(lengths, p_len, sizes)
    if len(plan) > sizes.bins:  # the module docstring's bound says it cannot happen
        raise AssertionError(f"pack_bins: {len(plan)} bins needed, the layout has {sizes.bins}")
    s, u, c = sizes.tokens, sizes.bins, sizes.completions
    stream = {k: np.zeros((u, s), np.int32) for k in ("ids", "positions", "docs", "prefix_of")}
    stream["source"] = np.full((u, s), -1, np.int32)
    stream["predictor"] = np.zeros((u, s), np.int32)
    members, member_start = np.full((u, c), -1, np.int32), np.zeros((u, c), np.int32)
    bin_of, start = np.zeros((p, g), np.int32), np.zeros((p, g), np.int32)
    w = (s // sizes.block) * (s // sizes.block + 1) // 2
    pairs, num_pairs = np.zeros((u, w, 2), np.int32), np.zeros((u,), np.int32)
    prefix = np.zeros((u, s), bool)
    for b, items in enumerate(plan):
        at, doc, last = 0, 0, {}
        for j, (i, k) in enumerate(items):
            if i not in last:  # the group's prompt copy, then its completions
                m, doc = int(p_len[i]), doc + 1
                _fill(stream, b, at, m, prompt_ids[i, lp - m :], np.arange(m), doc, i)
                stream["source"][b, at : at + m] = i * lp + lp - m + np.arange(m)
                stream["predictor"][b, at : at + m] = np.maximum(at + np.arange(m) - 1, at)
                last[i], at = at + max(m, 1) - 1, at + m
            length, doc = int(lengths[i, k]), doc + 1
            _fill(
                stream, b, at, length, tokens[i, k, :length], p_len[i] + np.arange(length), doc, i
            )
            stream["source"][b, at : at + length] = p * lp + (i * g + k) * n + np.arange(length)
            stream["predictor"][b, at : at + length] = np.r_[last[i], at + np.arange(length - 1)]
            members[b, j], member_start[b, j] = i * g + k, at
            bin_of[i, k], start[i, k] = b, at
            at += length
        prefix[b] = (stream["source"][b] >= 0) & (stream["source"][b] < p * lp)
        listed, num_pairs[b] = block_pairs(
            stream["docs"][b], stream["prefix_of"][b], prefix[b], sizes.block
        )
        pairs[b] = listed
    return CompletionBins(
        **stream,
        prefix=prefix,
        pairs=pairs,
        num_pairs=num_pairs,
        members=members,
        member_start=member_start,
        bin_of=bin_of,
        start=start,
    )


def bin_fill(bins: CompletionBins) -> float:
    """Real tokens (prompt copies and completions) per slot of the bins that hold any."""
    docs = np.asarray(bins.docs)
    used = np.asarray(bins.num_pairs) > 0
    return float((docs[used] > 0).mean()) if used.any() else 0.0


def _fill(stream, b, at, length, ids, positions, doc, prompt):
    span = slice(at, at + length)
    stream["ids"][b, span] = ids
    stream["positions"][b, span] = positions
    stream["docs"][b, span] = doc
    stream["prefix_of"][b, span] = prompt + 1


def _plan(lengths: np.ndarray, p_len: np.ndarray, sizes: BinSizes) -> list[list[tuple[int, int]]]:
    """Per bin, its completions ``(p, g)`` in slot order (module docstring)."""
    bins, cur, used, seen = [], [], 0, set()
    for i in range(lengths.shape[0]):
        left = sorted(
            (k for k in range(lengths.shape[1]) if lengths[i, k] > 0), key=lambda k: -lengths[i, k]
        )
        while left:
            extra = 0 if i in seen else int(p_len[i])
            room = sizes.tokens - used - extra
            pick = next((k for k in left if lengths[i, k] <= room), None)
            if pick is None or len(cur) == sizes.completions:
                if not cur:
                    raise ValueError(
                        f"pack_bins: prompt {i} ({p_len[i]} tokens) with completion {left[0]} "
                        f"({lengths[i, left[0]]} tokens) does not fit a bin of {sizes.tokens} slots"
                    )
                bins.append(cur)
                cur, used, seen = [], 0, set()
                continue
            cur.append((i, pick))
            used, seen = used + extra + int(lengths[i, pick]), seen | {i}
            left.remove(pick)
    return bins + [cur] if cur else bins


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _prompt_lengths(prompt_mask: np.ndarray) -> np.ndarray:
    """Valid tokens per prompt ``[P]``, checking that each prompt is left-padded."""
    m = np.asarray(prompt_mask) > 0
    lengths = m.sum(-1)
    suffix = np.arange(m.shape[-1]) >= m.shape[-1] - lengths[:, None]
    if not np.array_equal(m, suffix):
        raise ValueError(
            f"pack_bins: the mask of prompt {np.argwhere((m != suffix).any(-1))[0, 0]} is not "
            "left-padded (0s, then 1s to the end)"
        )
    return lengths


def _lengths(mask: np.ndarray) -> np.ndarray:
    """Valid tokens per completion ``[P, G]``, checking that each mask row is a prefix."""
    m = np.asarray(mask) > 0
    lengths = m.sum(-1)
    prefix = np.arange(m.shape[-1]) < lengths[..., None]
    if not np.array_equal(m, prefix):
        p, g = np.argwhere((m != prefix).any(-1))[0]
        raise ValueError(
            f"pack_bins: the mask of completion {g} of prompt {p} is not a prefix "
            "(1s up to the stop token, then 0s); only contiguous completions can be packed"
        )
    return lengths
