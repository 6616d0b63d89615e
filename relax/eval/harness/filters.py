"""Answer extraction as lm-evaluation-harness's filters do it (``lm_eval/filters``, 0.4.13).

A filter pipeline turns one completion into the string the metric compares with the target.
GSM8K's two pipelines are a regex then ``take_first`` (one completion per item, so ``take_first``
is the identity here):

    strict-match      regex  ``#### (\\-?[0-9\\.\\,]+)``                group_select 0
    flexible-extract  regex  ``(-?[$0-9.,]{2,})|(-?[0-9]+)``         group_select -1

``RegexFilter`` (lm-eval's ``regex``): ``m = re.findall(pattern, text)``; no match gives
``fallback`` (``"[invalid]"``); otherwise ``m[group_select]``, and when the pattern has several
groups (``findall`` returns tuples) the first non-empty group of that match (``fallback`` if all
are empty); the result is ``.strip()``-ed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class RegexFilter:
    """lm-eval's ``regex`` filter on one completion (see the module docstring)."""

    pattern: str
    group_select: int = 0
    fallback: str = "[invalid]"

    def __call__(self, text: str) -> str:
        found = re.findall(self.pattern, text if isinstance(text, str) else "")
        if not found:
            return self.fallback
        match = found[self.group_select]
        if isinstance(match, tuple):
            groups = [g for g in match if g]
            match = groups[0] if groups else self.fallback
        return match.strip()


@dataclasses.dataclass(frozen=True)
class PrefixPrompt:
    """``prompt + completion`` (lm-eval's HumanEval ``build_predictions``: the program to run is
    the function header and docstring, then the model's body). ``prompt`` is set per item by
    ``FilterPipeline.apply``."""

    def __call__(self, text: str, prompt: str = "") -> str:
        return prompt + text


@dataclasses.dataclass(frozen=True)
class FilterPipeline:
    """A named pipeline: its steps applied in order (lm-eval's ``filter_list`` entry)."""

    name: str
    steps: tuple[RegexFilter | PrefixPrompt, ...]

    def apply(self, completion: str, prompt: str = "") -> str:
        """The extracted answer of one completion (``prompt``: the text the item's prompt ended
        with, for ``PrefixPrompt``)."""
        out = completion
        for step in self.steps:
            out = step(out, prompt) if isinstance(step, PrefixPrompt) else step(out)
        return out


def apply_all(pipelines: Sequence[FilterPipeline], completion: str, prompt: str = "") -> dict:
    """``{pipeline name: extracted answer}`` for one completion."""
    return {p.name: p.apply(completion, prompt) for p in pipelines}


def truncate_at_stops(text: str, until: Sequence[str]) -> str:
    """lm-eval's ``postprocess_generated_text``: for each non-empty stop string in order, keep the
    text before its first occurrence (``text.split(stop)[0]``), so the result ends before the
    earliest stop string of any kind."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
