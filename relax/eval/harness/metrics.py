"""Per-item metrics and their aggregation as lm-evaluation-harness computes them (0.4.13).

``exact_match`` (lm-eval's ``exact_match_hf_evaluate``, one prediction against one reference):
each regex of ``regexes_to_ignore`` is deleted (``re.sub(r, "", s)``, in order) from both
strings, then both are lower-cased (``ignore_case``), stripped of ``string.punctuation``
(``ignore_punctuation``) and of digits (``ignore_numbers``); the verdict is 1.0 when they are equal.

Aggregation (``mean``) and its standard error (lm-eval's ``mean_stderr``)::

    mean   = sum(x) / n
    stderr = sqrt(sum((x - mean)^2) / (n - 1)) / sqrt(n)      (NaN when n < 2)
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ExactMatch:
    """lm-eval's ``exact_match`` with its options (GSM8K: ``ignore_case``, the regexes
    ``,``, ``\\$``, ``(?s).*#### ``, ``\\.$``)."""

    regexes_to_ignore: tuple[str, ...] = ()
    ignore_case: bool = False
    ignore_punctuation: bool = False
    ignore_numbers: bool = False
    name: str = "exact_match"

    def normalize(self, text: str) -> str:
        """``text`` as the comparison sees it."""
        for regex in self.regexes_to_ignore:
            text = re.sub(regex, "", text)
        if self.ignore_case:
            text = text.lower()
        if self.ignore_punctuation:
            text = text.translate(str.maketrans("", "", string.punctuation))
        if self.ignore_numbers:
            text = text.translate(str.maketrans("", "", string.digits))
        return text

    def __call__(self, prediction: str, reference: str) -> float:
        return float(self.normalize(prediction) == self.normalize(reference))


def mean(values: Sequence[float]) -> float:
    """The arithmetic mean (NaN for no values)."""
    return float(sum(values) / len(values)) if len(values) else float("nan")


def mean_stderr(values: Sequence[float]) -> float:
    """lm-eval's ``mean_stderr``: the sample standard deviation (ddof 1) over sqrt(n); NaN for
    fewer than two values."""
    n = len(values)
    if n < 2:
        return float("nan")
    mu = mean(values)
    return math.sqrt(sum((x - mu) ** 2 for x in values) / (n - 1)) / math.sqrt(n)
