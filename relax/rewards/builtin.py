"""Built-in host reward functions with TRL's signature ``fn(prompts, completions, **fields)``.

Select by name with ``get_reward(name)`` (``BUILTIN_REWARDS``), or build a configured variant
with its factory (``make_exact_match(answer_field=...)``, ``make_numeric_match(rel_tol=...)``,
``make_format_reward(pattern)``, ``MathVerify(timeout_s=...)``, ``CodeExec(scoring=...)``). Each
returns one value per completion::

    exact_match     1.0 if completion.strip() == str(answer).strip() else 0.0
    numeric_match   1.0 if |x - a| <= rel_tol * max(|x|, |a|) else 0.0
                    x = the completion's final answer when it is wholly one number, a = the
                    answer; an answer that is not one (x-5, 10^2, 5 apples) goes to math_verify
                    if math-verify is installed, else scores 0.0
    format_reward   1.0 if re.match(pattern, completion) else 0.0
    math_verify     1.0 if verify(parse(answer), parse(completion)) else 0.0       (math-verify)
                    completion: \\boxed{} first; answer: bare LaTeX read as \\boxed{answer}
    code_exec       fraction of the row's ``tests`` the completion's code passes, in the sandbox
    reasoning_gym   the row's reasoning-gym task's score_answer(extract_answer(completion), entry)
                    (``relax.rewards.reasoning_gym``; the row's ``entry`` column);
                    reasoning_gym_plain: the whole completion is the answer (no tags)

and ``None`` (missing) where the row's answer is None, or not a number for ``numeric_match``, or
not parseable for ``math_verify``. ``math_verify`` needs the ``math`` extra (``pip install -e '.[math]'``); its entry
is a ``LazyReward``: the library is imported when ``get_reward`` builds it
(``relax.rewards.math_answers.MathVerify``, configurable there), not when this module is.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from relax.rewards.code_exec import code_exec
from relax.rewards.columns import DEFAULT_ANSWER_FIELD, column
from relax.rewards.math_answers import MathVerify, plain_number
from relax.rewards.reasoning_gym import ReasoningGymReward

DEFAULT_FORMAT_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"

# One number: optional sign (ASCII or Unicode minus; not after a word character or ")", so
# "10-3" reads as 10 and 3), digits with optional thousands commas ("1,234"), decimals, exponent;
# or a bare ".5".
_NUM = (
    r"(?:(?<![\w)])[-\u2212])?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+)"
)
_NUMBER_RE = re.compile(
    rf"(?P<sign>(?<![\w)])[-\u2212])?\\[dt]?frac\{{\s*(?P<num>{_NUM})\s*\}}\{{\s*(?P<den>{_NUM})\s*\}}|(?P<x>{_NUM})"
)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
# A whole answer that is a fraction: [+-]\frac{a}{b} (\dfrac, \tfrac), or a/b.
_FRACTION_RE = re.compile(
    r"(?P<sign>[-+\u2212]?)\\[dt]?frac\{(?P<num>[^{}]*)\}\{(?P<den>[^{}]*)\}|(?P<a>[^/]+)/(?P<b>[^/]+)"
)
# A number in free text: \frac{a}{b}, or digits (commas in threes), decimals, exponent, "/b"; with
# its sign only where that cannot be a minus between two terms (not after a word, ")" or "}").
_FREE_NUMBER_RE = re.compile(
    r"(?<![\w.,\\/^_{}])[-+\u2212]?(?:\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"
    r"|(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?(?:/\d+(?:\.\d+)?)?)"
)
# Next to the last number of a free text, these make it a term of an expression, not the answer:
_OPS = "-+\u2212/^_<>\u2264\u2265\u2260\u00d7\u00b7\u00f7\u221a%"  # and Unicode minus <= >= != times cdot div sqrt
_STAR = r"(?<!\*)\*(?!\*)"  # a product; "**" is markdown bold
_COMMAND = (
    r"\\(?!(?:text|mathrm|quad|qquad)\b)[a-zA-Z]+"  # \le, \cdot, \times, \pi; not \text, \quad
)
_BEFORE_RE = re.compile(
    rf"(?:[{_OPS}]|{_STAR}|{_COMMAND})\s*$"
)  # "=" is allowed: "x = 5" answers 5
_AFTER_RE = re.compile(
    rf"[\w^_/%(\[{{!']|[.,]\d|\s*(?:[{_OPS}=]|{_STAR}|\\%|{_COMMAND}|percent|\u03c0|(?:pi|sqrt|e|i)\b)"
)
# A LaTeX text unit ending a whole answer: 5\text{ apples}, 10\,\mathrm{cm} (letters, no digits or braces)
_UNIT_RE = re.compile(r"\\(?:text|mathrm|mbox)\s*\{(?=[^{}]*[A-Za-z])[^{}\d]*\}[\s$.]*$")
_SPACES = ("\\,", "\\;", "\\:", "\\!")  # LaTeX spacing before a unit, with whitespace and ~


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
    """The final-answer part of a text: the last ``\\boxed{...}`` content if any, else the line after
    the last ``####`` (GSM8K; the next line if that one is empty) if any, else the whole text."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0]
    return text


def extract_number(text: str) -> float | None:
    """The LAST number in ``answer_region(text)`` (``"1,234"`` -> 1234, ``"\\frac{1}{2}"`` -> 0.5,
    ``"-3.5"`` -> -3.5), or None if it holds none. A loose reader (``"10-3"`` -> 3, ``"x^{2}"`` ->
    2) for custom rewards; ``numeric_match`` reads strictly, with ``final_answer``."""
    matches = list(_NUMBER_RE.finditer(answer_region(text)))
    return _match_value(matches[-1]) if matches else None


def _drop_unit(text: str) -> str:
    """``text`` without a LaTeX text unit that ends it and the spacing before that
    (``"10\\,\\mathrm{cm}."`` -> ``"10"``); ``text`` itself if none ends it."""
    m = _UNIT_RE.search(text)
    if m is None:
        return text
    head, rest = text[: m.start()], None
    while rest != head:
        rest, head = head, head.rstrip(" \t\n~")
        head = head[:-2] if head.endswith(_SPACES) else head
    return head


def number_value(text: str) -> Fraction | None:
    """The exact value of an answer that is wholly one number, else None::

        plain_number(text)                 "72", "-2.50", "1,000", "1e-7", "$5$", "\\$5", "+4", "5."
        a/b or [+-]\\frac{a}{b}             a, b plain numbers, b != 0: "1/10", "-\\frac{3}{4}" (\\dfrac, \\tfrac)

    (whitespace, enclosing ``$``, a final ``.`` and a LaTeX text unit such as ``\\text{ apples}``
    stripped). Not numbers: "x-5", "7\\le x", "10^2", "5 apples" (letters in math are variables:
    "5 x" is 5x), "50\\%", "\\sqrt{2}", "1/0", ""."""
    text = _drop_unit(text)
    value = plain_number(text)
    if value is not None:
        return Fraction(value)
    t = text.strip().rstrip(".").strip().strip("$").strip()
    m = _FRACTION_RE.fullmatch(t)
    if m is None:
        return None
    num, den = (
        plain_number(m.group(k) or "")
        for k in (("num", "den") if m.group("a") is None else ("a", "b"))
    )
    if num is None or den is None or den == 0:
        return None
    return Fraction(num) / Fraction(den) * (-1 if m.group("sign") in ("-", "\u2212") else 1)


def last_number(text: str) -> Fraction | None:
    """The value of a free text's final answer: its LAST number (as ``_FREE_NUMBER_RE`` reads one:
    sign, thousands commas, decimals, exponent, ``a/b``, ``\\frac{a}{b}``) if it stands alone, else
    None. It stands alone unless a digit follows it anywhere, or next to it is an operator
    (``+ - * / ^ _ < > \\le \\cdot``..., ``=`` after it), a glued letter or ``(`` (``5x``,
    ``6e``, ``2(x+1)``), ``%`` or "percent", or after it ``pi``/``e``/``i``/``sqrt``; words of
    prose after it are allowed: ``"The answer is 42 apples."`` -> 42, ``"x = -3"`` -> -3,
    ``"so 1/2"`` -> 1/2; ``"x-5"``, ``"10^2"``, ``"7 \\le x"``, ``"10-3"``, ``"2 pi"`` -> None."""
    matches = list(_FREE_NUMBER_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    before, after = text[max(0, m.start() - 100) : m.start()], text[m.end() :]
    if any(ch.isdigit() for ch in after) or _BEFORE_RE.search(before) or _AFTER_RE.match(after):
        return None
    return number_value(m.group())


def final_answer(text: str) -> tuple[Fraction | None, str]:
    """A completion's final answer: (its value if it is wholly one number, else None; the answer
    as the math check is given it)::

        last \\boxed{c} (or \\fbox{c})       number_value(c)       "\\boxed{c}"
        else the line L after ####        number_value(L)       "\\boxed{L}"
        else the free text                last_number(text)     text
    """
    boxed = last_boxed(text)
    if boxed is None and "####" in text:
        boxed = answer_region(text)
    if boxed is not None:
        return number_value(boxed), (f"\\boxed{{{boxed}}}" if boxed.strip() else "")
    return last_number(text), text


def _reference(answer: Any) -> tuple[Fraction, Any] | None:
    """(exact value, the reference as the math check is given it) of a reference answer that is a
    number: a real number (not bool/NaN/inf), or a string whose ``answer_region`` is wholly one
    (``number_value``; GSM8K's ``"... #### 72"`` gives 72). None otherwise."""
    if isinstance(answer, bool):
        return None
    if isinstance(answer, numbers.Real):
        if not math.isfinite(float(answer)):
            return None
        return Fraction(
            int(answer) if isinstance(answer, numbers.Integral) else float(answer)
        ), answer
    if not isinstance(answer, str):
        return None
    region = answer_region(answer)
    value = number_value(region)
    return None if value is None else (value, region.strip())


def parse_answer_number(answer: Any) -> float | None:
    """A reference answer as a float: a real number (not bool/NaN/inf), or a string whose
    ``answer_region`` is wholly one number (``number_value``: surrounding whitespace, ``$`` and a
    final ``.`` allowed; so GSM8K's ``"... #### 72"`` gives 72). None otherwise."""
    ref = _reference(answer)
    return None if ref is None else float(ref[0])


def _math_checker() -> MathVerify | None:
    """A ``MathVerify(numbers_only=True)`` for answers that are not plain numbers, or None
    without math-verify."""
    try:
        return MathVerify(numbers_only=True)
    except ImportError:
        return None


def make_exact_match(answer_field: str = DEFAULT_ANSWER_FIELD) -> Callable[..., list[float | None]]:
    """``exact_match`` reading the reference from column ``answer_field``::

    r_i = 1.0 if completions[i].strip() == str(answer[i]).strip() else 0.0   (None if answer is None)
    """

    def exact_match(
        prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        answers = column(fields, answer_field, "exact_match")
        return [
            None if a is None else float(c.strip() == str(a).strip())
            for c, a in zip(completions, answers)
        ]

    return exact_match


def _close(x: Fraction, a: Fraction, rel_tol: Fraction) -> bool:
    """``|x - a| <= rel_tol * max(|x|, |a|)``, exactly (so 0 only equals 0)."""
    return abs(x - a) <= rel_tol * max(abs(x), abs(a))


def make_numeric_match(
    answer_field: str = DEFAULT_ANSWER_FIELD, *, rel_tol: float = 1e-6, math_fallback: bool = True
) -> Callable[..., list[float | None]]:
    """``numeric_match`` reading the reference from column ``answer_field``::

    a = exact value of answer[i]: a number, or a string wholly one number (after ####, if any)
    x, text = final_answer(completions[i])     x = None where the answer is not wholly a number
    r_i = None                                         if a is None (reference not a number)
          1.0 if |x - a| <= rel_tol * max(|x|, |a|)    else 0.0    if x is a number (exact)
          MathVerify(numbers_only=True)(text, answer)  if math_fallback and math-verify is installed
          0.0                                          otherwise

    Only a whole answer is a number: ``\\boxed{x-5}``, ``\\boxed{7\\le x}``, ``\\boxed{10^2}``
    are not 5, 7, 2 (math-verify reads them as expressions), ``\\boxed{1/10}`` is 0.1, and
    ``1e-7`` is 10^-7, not ``e - 7``. A LaTeX text unit is dropped (``\\boxed{12\\text{ dollars}}``
    is 12), bare words are not (``\\boxed{5 apples}``: in math, letters are variables), so those
    go to math-verify, which drops the unit words it knows, or score 0 without it. The last box
    counts; text after it does not. ``rel_tol`` is relative: 0 only equals 0.
    """
    if isinstance(rel_tol, bool) or not (
        isinstance(rel_tol, numbers.Real) and 0 <= rel_tol < math.inf
    ):
        raise ValueError(f"rel_tol must be a finite number >= 0, got {rel_tol!r}")
    if not isinstance(math_fallback, bool):
        raise ValueError(f"math_fallback must be a bool, got {math_fallback!r}")
    tol = Fraction(rel_tol)

    def numeric_match(
        prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        out: list[float | None] = []
        deferred: list[
            tuple[int, str, Any]
        ] = []  # (row, answer text, reference) for the math check
        for i, (c, a) in enumerate(zip(completions, column(fields, answer_field, "numeric_match"))):
            ref = _reference(a)
            if ref is None:
                out.append(None)
                continue
            x, text = final_answer(c)
            out.append(0.0 if x is None else float(_close(x, ref[0], tol)))
            if x is None and text:
                deferred.append((i, text, ref[1]))
        checker = _math_checker() if math_fallback and deferred else None
        if checker is not None:
            scores = checker(
                [""] * len(deferred), [d[1] for d in deferred], answer=[d[2] for d in deferred]
            )
            for (i, _, _), r in zip(deferred, scores):
                out[i] = r or 0.0
        return out

    return numeric_match


def make_format_reward(
    pattern: str = DEFAULT_FORMAT_PATTERN, flags: int = re.DOTALL
) -> Callable[..., list[float]]:
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

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        return self.build()(prompts, completions, **fields)


BUILTIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
    "format_reward": format_reward,
    "math_verify": LazyReward("math_verify", MathVerify),  # MathVerify() imports math-verify
    "code_exec": code_exec,
    # reasoning-gym's own scorer per row (relax.rewards.reasoning_gym; imports reasoning-gym on use)
    "reasoning_gym": LazyReward("reasoning_gym", ReasoningGymReward),
    "reasoning_gym_plain": LazyReward(
        "reasoning_gym_plain", functools.partial(ReasoningGymReward, tags=False)
    ),
}


def get_reward(name: str) -> Callable[..., list[float | None]]:
    """The built-in reward function called ``name`` (a ``LazyReward`` entry is built here); unknown
    names raise ``ValueError`` listing them."""
    if name not in BUILTIN_REWARDS:
        raise ValueError(f"unknown reward {name!r}; valid: {', '.join(sorted(BUILTIN_REWARDS))}")
    entry = BUILTIN_REWARDS[name]
    return entry.build() if isinstance(entry, LazyReward) else entry
