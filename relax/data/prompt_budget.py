"""Prompts over the token budget: counted, reported, and dropped, refused or cut by name.

A prompt is over budget when its formatted token ids (after the chat template) number more than
``max_prompt_tokens``. Nothing happens to it in silence: every such row is counted
(``PromptStats.over_budget``, ``prompts_over_budget`` in a run's metrics and summary) and named
in the start-up report, longest first. What then happens is ``DataConfig.overlong``:

- ``"drop"`` (the default): the row is left out of the data.
- ``"reject"``: an error naming the file, row and token count.
- ``"truncate"``: the row is cut to fit, keeping what matters:

  * a plain-text prompt keeps its LAST tokens (the end of a prompt holds the question), after a
    leading BOS, which is kept;
  * a chat prompt keeps the template's header, every system message and the generation prompt
    whole: the content of the last user message loses its leading tokens, the fewest with which
    the rendered prompt fits (a binary search over the number of content tokens kept, rendering
    the template each time). A prompt whose other parts alone exceed the budget cannot be cut so:
    it is dropped, and counted as ``uncuttable``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

OVERLONG = ("drop", "reject", "truncate")
PERCENTILES = (50, 90, 99)


class OverBudget(NamedTuple):
    """A row whose prompt is over budget: where it is, and its token count before any cut."""

    file: str
    row: int
    tokens: int


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """What formatting and tokenizing a set of rows found (``relax.data.prompts.prepare_prompts``).

    ``lengths``: every row's prompt length in tokens, before any cut. ``over_budget``: the rows over
    ``budget``, longest first. ``action``: ``DataConfig.overlong``. ``kept``: rows in the data after
    it (cut rows included). ``uncuttable``: rows ``"truncate"`` could not cut (dropped).
    ``first_prompt``: the first row's prompt as the model sees it (formatted, after any cut).
    Image prompts (``relax.data.image_prompts``): ``images``, each kept row's image count (None:
    text prompts); ``bad_images``, the error of each row dropped for a bad image."""

    lengths: np.ndarray
    over_budget: tuple[OverBudget, ...]
    budget: int
    action: str
    kept: int
    uncuttable: int = 0
    first_prompt: str = ""
    images: np.ndarray | None = None
    bad_images: tuple[str, ...] = ()

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def dropped(self) -> int:
        """Rows left out of the data: over budget and dropped, uncuttable, or a bad image."""
        return self.rows + len(self.bad_images) - self.kept

    def percentiles(self) -> dict[str, int]:
        """``{"p50": ..., "p90": ..., "p99": ..., "max": ...}`` of the prompt lengths before any cut."""
        if not self.rows:
            return {}
        values = {
            f"p{q}": int(np.percentile(self.lengths, q, method="higher")) for q in PERCENTILES
        }
        return {**values, "max": int(self.lengths.max())}

    def summary(self) -> dict[str, Any]:
        """The figures a run's summary and start-up report carry."""
        return {
            "rows": self.rows + len(self.bad_images),
            "kept": self.kept,
            "prompts_over_budget": len(self.over_budget),
            "dropped": self.dropped,
            "overlong": self.action,
            "max_prompt_tokens": self.budget,
            "prompt_tokens": self.percentiles(),
            **({} if self.images is None else self.image_summary()),
        }

    def image_summary(self) -> dict[str, Any]:
        """Image prompts' figures: images in all, per prompt (min / max), rows dropped for a bad image."""
        counts = self.images if self.images is not None and len(self.images) else np.zeros(1, int)
        return {
            "images": int(counts.sum()),
            "images_per_prompt": {"min": int(counts.min()), "max": int(counts.max())},
            "bad_images": len(self.bad_images),
        }

    def bad_images_message(self, label: str, limit: int = 3) -> str | None:
        """One warning line on the rows dropped for a bad image, or None when there are none."""
        if not self.bad_images:
            return None
        named = "; ".join(self.bad_images[:limit])
        more = f" and {len(self.bad_images) - limit} more" if len(self.bad_images) > limit else ""
        return (
            f"WARNING: {len(self.bad_images)} {label} rows were dropped for a bad image: {named}{more}"
            " (--bad-images reject refuses them)"
        )

    def over_budget_message(self, label: str, limit: int = 5) -> str | None:
        """One warning line naming the longest over-budget rows, or None when there are none."""
        if not self.over_budget:
            return None
        named = ", ".join(
            f"{o.file} row {o.row} ({o.tokens} tokens)" for o in self.over_budget[:limit]
        )
        more = f" and {len(self.over_budget) - limit} more" if len(self.over_budget) > limit else ""
        fate = {"drop": "dropped", "truncate": "cut to fit (--overlong truncate)"}[self.action]
        uncut = (
            f"; {self.uncuttable} could not be cut (the template and system prompt alone are over) and were dropped"
            if self.uncuttable
            else ""
        )
        return (
            f"WARNING: {len(self.over_budget)} of {self.rows} {label} prompts are over --max-prompt-tokens "
            f"{self.budget}: {named}{more}; {fate}{uncut}. --overlong reject refuses them, --overlong truncate "
            f"cuts them, a larger --max-prompt-tokens keeps them whole."
        )


def cut_plain(ids: Sequence[int], budget: int, bos: int | None) -> list[int]:
    """The last tokens of ``ids``, ``budget`` in all, after a leading BOS (kept)."""
    ids = list(ids)
    head = 1 if bos is not None and ids and ids[0] == bos else 0
    return ids[:head] + ids[len(ids) - (budget - head) :]


def cut_chat(
    messages: Sequence[dict],
    budget: int,
    render: Callable[[list[dict]], list[int]],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
) -> list[dict] | None:
    """``messages`` with the content of the last user message cut from its start, by the fewest
    tokens with which ``len(render(messages)) <= budget``; None when no cut of it fits.

    ``render``: messages -> the formatted prompt's ids; ``encode`` / ``decode``: content text <->
    ids without special tokens. The other messages (system prompt included) are never touched."""
    users = [
        i
        for i, m in enumerate(messages)
        if isinstance(m, dict) and m.get("role") == "user" and isinstance(m.get("content"), str)
    ]
    if not users:
        return None
    at = users[-1]
    content = encode(messages[at]["content"])

    def with_tail(keep: int) -> list[dict]:
        text = decode(content[len(content) - keep :]) if keep else ""
        return [*messages[:at], {**messages[at], "content": text}, *messages[at + 1 :]]

    if len(render(with_tail(0))) > budget:
        return None
    lo, hi = 0, len(content)  # with_tail(lo) fits; find the largest keep that does
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(render(with_tail(mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return with_tail(lo)
