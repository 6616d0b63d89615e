"""Reading a judge model's reply as a reward: a score or a verdict (``relax.rewards.generative_judge``).

Two modes, each a regular expression whose first group is read at its LAST match in the reply
(a judge that reasons first and states its result at the end is read at the end):

- ``score``: the group is a number ``s``; the reward is ``clip(s / max_score, 0, 1)``. Default
  pattern ``Score:\\s*(-?\\d+(?:\\.\\d+)?)`` (case-insensitive), e.g. ``"... Score: 7"`` with
  ``max_score`` 10 -> 0.7.
- ``verdict``: the group is a word looked up (case-insensitively) in ``verdicts``, pairs
  ``"word=value"``; default pattern ``Verdict:\\s*([A-Za-z]+)`` and verdicts ``yes/correct/A`` -> 1,
  ``no/incorrect/B`` -> 0.

A reply where the pattern does not match, or matches a number that does not parse, or a word not
in ``verdicts``, is unparsed: ``parse`` returns None, which the judge counts (``judge/unparsed``)
and handles by the run's ``--reward-on-error`` rule.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Literal

__all__ = ["DEFAULT_PATTERNS", "DEFAULT_VERDICTS", "JudgeParser", "parse_verdicts"]

DEFAULT_PATTERNS = {
    "score": r"(?i)score\s*:\s*(-?\d+(?:\.\d+)?)",
    "verdict": r"(?i)verdict\s*:\s*([A-Za-z]+)",
}
DEFAULT_VERDICTS = ("yes=1", "no=0", "correct=1", "incorrect=0", "A=1", "B=0")


def parse_verdicts(pairs: tuple[str, ...]) -> dict[str, float]:
    """``("yes=1", "no=0")`` -> ``{"yes": 1.0, "no": 0.0}`` (words lower-cased); a pair without
    ``=``, with an empty word, a value that is not a finite number, or a repeated word raises,
    naming it."""
    out: dict[str, float] = {}
    for pair in pairs:
        word, sep, value = pair.rpartition("=")
        word = word.strip().lower()
        try:
            v = float(value) if sep and word else math.nan
        except ValueError:
            v = math.nan
        if not math.isfinite(v):
            raise ValueError(f"judge verdict {pair!r} is not of the form word=number")
        if word in out:
            raise ValueError(f"judge verdict {word!r} is given twice")
        out[word] = v
    return out


@dataclasses.dataclass(frozen=True)
class JudgeParser:
    """``parser(reply) -> float in [0, 1] or None`` (unparsed), as the module docstring says.
    ``pattern`` None: the mode's default; it must have at least one group."""

    mode: Literal["score", "verdict"] = "score"
    pattern: str | None = None
    max_score: float = 10.0
    verdicts: tuple[str, ...] = DEFAULT_VERDICTS

    def __post_init__(self):
        if self.mode not in DEFAULT_PATTERNS:
            raise ValueError(f"judge parse mode must be score or verdict, got {self.mode!r}")
        if self.mode == "score" and not (math.isfinite(self.max_score) and self.max_score > 0):
            raise ValueError(f"judge max_score must be > 0, got {self.max_score}")
        try:
            regex = re.compile(self.pattern or DEFAULT_PATTERNS[self.mode])
        except re.error as e:
            raise ValueError(f"judge pattern {self.pattern!r} is not a regex: {e}") from None
        if regex.groups < 1:
            raise ValueError(
                f"judge pattern {regex.pattern!r} needs a group: (...) around the value"
            )
        object.__setattr__(self, "_regex", regex)
        table = parse_verdicts(self.verdicts) if self.mode == "verdict" else {}
        object.__setattr__(self, "_table", table)

    def __call__(self, reply: str) -> float | None:
        matches = list(self._regex.finditer(reply))
        if not matches or matches[-1].group(1) is None:
            return None
        found = matches[-1].group(1).strip()
        if self.mode == "verdict":
            return self._table.get(found.lower())
        try:
            s = float(found)
        except ValueError:
            return None
        if not math.isfinite(s):
            return None
        return min(max(s / self.max_score, 0.0), 1.0)
