"""Built-in host reward functions with TRL's signature ``fn(prompts, completions, **fields)``.

Select by name with ``get_reward(name)`` (``BUILTIN_REWARDS``), or build a configured variant
with its factory (``make_exact_match(answer_field=...)``, ``make_numeric_match(rel_tol=...)``,
``make_format_reward(pattern)``, ``MathVerify(timeout_s=...)``, ``CodeExec(scoring=...)``). Each
returns one value per completion::

    exact_match     1.0 if completion.strip() == str(answer).strip() else 0.0
    numeric_match   1.0 if |x - a| <= rel_tol * max(|x|, |a|) else 0.0
                    x = last number of the completion's final-answer region, a = the answer
    format_reward   1.0 if re.match(pattern, completion) else 0.0
    math_verify     1.0 if verify(parse(answer), parse(completion)) else 0.0       (math-verify)
                    completion: \\boxed{} first; answer: bare LaTeX read as \\boxed{answer}
    code_exec       fraction of the row's ``tests`` the completion's code passes, in the sandbox

and ``None`` (missing) where the row's answer is None, or not a number for ``numeric_match``, or
not parseable for ``math_verify``. ``math_verify`` needs ``pip install 'relax[math]'``; its entry
is a ``LazyReward``: the library is imported when ``get_reward`` builds it
(``relax.rewards.math_answers.MathVerify``, configurable there), not when this module is.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

from relax.rewards.code_exec import code_exec
from relax.rewards.columns import DEFAULT_ANSWER_FIELD, column
from relax.rewards.math_answers import MathVerify

DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"

# One number: optional sign (ASCII or Unicode minus; not after a word character or ")", so
# "10-3" reads as 10 and 3), digits with optional thousands commas ("1,234"), decimals, exponent;
# or a bare ".5".
_NUM = r"(?:(?<![\w)])[-\u2212])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
_NUMBER_RE = re.compile(
    rf"(?P<sign>(?<![\w)])[-\u2212])?\\[dt]?frac\{{\s*(?P<num>{_NUM})\s*\}}\{{\s*(?P<den>{_NUM})\s*\}}|(?P<x>{_NUM})"
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _to_float(s: str) -> float:
    return float(s.replace(",", "").replace("\u2212", "-"))


def _match_value(m: re.Match) -> float | None:
    if m.group("x") is not None:
        return _to_float(m.group("x"))
    den = _to_float(m.group("den"))
    if den == 0:
        return None
    value = _to_float(m.group("num")) / den
    return -value if m.group("sign") else value


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces matched; None if absent
    or unclosed."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def answer_region(text: str) -> str:
    """The final-answer part of a text: the last ``\\boxed{...}`` content if any, else the text after
    the last ``####`` (GSM8K) if any, else the whole text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1]
    return text


def extract_number(text: str) -> float | None:
    """The LAST number in ``answer_region(text)`` (``"1,234"`` -> 1234, ``"\\frac{1}{2}"`` -> 0.5,
    ``"-3.5"`` -> -3.5), or None if it holds none. Only the region is searched: a boxed answer
    wins over numbers written after it, and an empty box is no answer."""
    matches = list(_NUMBER_RE.finditer(answer_region(text)))
    return _match_value(matches[-1]) if matches else None


def parse_answer_number(answer: Any) -> float | None:
    """A reference answer as a float: a real number (not bool/NaN/inf), or a string whose
    ``answer_region`` is exactly one number (surrounding whitespace, ``$`` and a final ``.``
    allowed; so GSM8K's ``"... #### 72"`` gives 72). None otherwise."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Real):
        value = float(answer)
        return value if math.isfinite(value) else None
    if not isinstance(answer, str):
        return None
    region = answer_region(answer).strip().strip("$").strip().rstrip(".")
    m = _NUMBER_RE.fullmatch(region)
    return _match_value(m) if m else None


def make_exact_match(answer_field: str = DEFAULT_ANSWER_FIELD) -> Callable[..., list[float | None]]:
    """``exact_match`` reading the reference from column ``answer_field``::

    r_i = 1.0 if completions[i].strip() == str(answer[i]).strip() else 0.0   (None if answer is None)
    """

    def exact_match(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        answers = column(fields, answer_field, "exact_match")
        return [None if a is None else float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]

    return exact_match


def make_numeric_match(
    answer_field: str = DEFAULT_ANSWER_FIELD, *, rel_tol: float = 1e-6
) -> Callable[..., list[float | None]]:
    """``numeric_match`` reading the reference from column ``answer_field``::

    a = parse_answer_number(answer[i]);  x = extract_number(completions[i])
    r_i = None                                       if a is None (reference not a number)
          0.0                                        if x is None (no number in the completion)
          1.0 if |x - a| <= rel_tol * max(|x|, |a|)  else 0.0      (math.isclose; 0 only equals 0)
    """
    if not rel_tol >= 0:
        raise ValueError(f"rel_tol must be >= 0, got {rel_tol}")

    def numeric_match(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        out: list[float | None] = []
        for c, a in zip(completions, column(fields, answer_field, "numeric_match")):
            target = parse_answer_number(a)
            x = None if target is None else extract_number(c)
            out.append(None if target is None else float(x is not None and math.isclose(x, target, rel_tol=rel_tol)))
        return out

    return numeric_match


def make_format_reward(pattern: str = DEFAULT_FORMAT_PATTERN, flags: int = re.DOTALL) -> Callable[..., list[float]]:
    """``format_reward``: ``r_i = 1.0 if re.match(pattern, completions[i], flags) else 0.0``.

    ``re.match`` anchors at the start only; end the pattern with ``$`` to anchor the end. The
    default asks for ``<think>...</think>`` then ``<answer>...</answer>`` and nothing else
    (``DOTALL``: ``.`` spans newlines).
    """
    regex = re.compile(pattern, flags)

    def format_reward(prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float]:
        return [float(regex.match(c) is not None) for c in completions]

    return format_reward


exact_match = make_exact_match()
numeric_match = make_numeric_match()
format_reward = make_format_reward()


@dataclasses.dataclass(frozen=True)
class LazyReward:
    """A registry entry built on first use, ``factory()``, so that an optional dependency is
    imported (or its ``ImportError`` raised) only then. Callable like the reward it builds."""

    name: str
    factory: Callable[[], Callable[..., list[float | None]]]

    @property
    def __name__(self) -> str:
        return self.name

    def build(self) -> Callable[..., list[float | None]]:
        return self.factory()

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
        return self.build()(prompts, completions, **fields)


BUILTIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format_reward": format_reward,
    "math_verify": LazyReward("math_verify", MathVerify),  # MathVerify() imports math-verify
    "code_exec": code_exec,
}


def get_reward(name: str) -> Callable[..., list[float | None]]:
    """The built-in reward function called ``name`` (a ``LazyReward`` entry is built here); unknown
    names raise ``ValueError`` listing them."""
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(BUILTIN_REWARDS))}")
    entry = BUILTIN_REWARDS[name]
    return entry.build() if isinstance(entry, LazyReward) else entry
