"""``math_verify``: a host reward that checks a final answer with Hugging Face's ``math-verify``.

Needs the optional extra ``math`` (``math-verify[antlr4_13_2]``; ``pip install -e '.[math]'`` in the
checkout). Importing
this module does not import the library; constructing ``MathVerify()`` does, and raises
``ImportError`` naming the extra when it is missing.

Plain numbers are read here, not by the library, which takes the ``e`` of e-notation for Euler's
number (``1e-7`` as ``e - 7``, ``2e3`` as ``6e``): ``plain_number`` reads one, ``number_text``
writes it out positionally, and ``normalise_numbers`` does so for both sides of a check.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import functools
import gc
import logging
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from relax.rewards.columns import DEFAULT_ANSWER_FIELD, column

INSTALL_HINT = "pip install -e '.[math]' in the relax checkout"
RETRY_S = 0.05  # a timeout that was swallowed is raised again this often until the check ends
# A reference that already marks its math ($...$, \(...\), \[...\], \boxed{...}) is parsed as written.
_DELIMITED_RE = re.compile(r"\\boxed|(?<!\\)\$|\\\(|\\\[")
MAX_EXPONENT = (
    1000  # plain numbers beyond 10^+-1000 are not read (their digits are not written out)
)
# One plain number: sign, digits (grouped in threes by "," or not), decimals, e-notation; or ".5".
PLAIN_NUMBER_RE = re.compile(
    r"[+-]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
)
# LaTeX thousands separators between two digits: {,}  ,\!  \,  "\ "  " "  (read as ",")
_SEPARATOR_RE = re.compile(r"(?<=\d)(?:\{,\}|,\\!|\\,|\\ | )(?=\d)")
# An e-notation number standing alone in a text (not "x1e5", "1e5x", "1.2.3e4"); its sign stays as written.
_E_NOTATION_RE = re.compile(r"(?<![\w.\\])(?:\d+(?:\.\d*)?|\.\d+)[eE][+-]?\d+(?!\w|\.\d)")
_BOX_OPEN_RE = re.compile(r"\\boxed\s*\{")
_JOIN_RE = re.compile(r"\s*\$?\s*(?:,?\s*(?:and|or)|,)\s*\$?\s*")  # between two boxes of one answer


class CheckTimeout(BaseException):
    """A check ran past ``timeout_s``. A ``BaseException`` so that the library's and sympy's
    ``except Exception`` handlers let it through to us instead of swallowing it."""


def _library():
    """The ``math_verify`` module, or ``ImportError`` naming the extra that installs it."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            f"the math_verify reward needs the math-verify library: {INSTALL_HINT}"
        ) from e
    # its "Timeout is disabled" warning, at every call: relax bounds each check itself (``deadline``)
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return math_verify


@functools.cache
def _extraction_configs() -> tuple[tuple, tuple]:
    """(reference, completion) extraction configs: LaTeX then plain expressions; for the
    completion a ``\\boxed{}`` answer has the highest priority (0, before "final answer is")."""
    mv = _library()
    gold = (mv.LatexExtractionConfig(), mv.ExprExtractionConfig())
    pred = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    return gold, pred


def plain_number(text: str) -> decimal.Decimal | None:
    """The value of a text that is wholly one plain number, else None. Read as::

        strip whitespace, enclosing $...$, one trailing "." and a leading currency \\$; "\u2212" -> "-"
        {,}  ,\\!  \\,  "\\ "  " "  between two digits -> ","
        [+-] (digits | d{1,3}(,ddd)+) [.digits] [(e|E)[+-]digits]   or   [+-] .digits [(e|E)...]

    ("1e-7", "1E-7", "2.5e3", "-3.", ".5", "+4", "1,000", "1{,}000", "$2.50$"), the commas dropped;
    None beyond 10^+-``MAX_EXPONENT``. Not numbers: "1,5" (not grouped in threes: a list),
    "e - 7", "10^2", "1/2", "5 apples"."""
    t = text.strip()
    t = t[:-1] if t.endswith(".") else t  # a sentence's period, outside or inside the $...$
    t = t.strip().strip("$").strip()
    t = t[:-1] if t.endswith(".") else t
    t = t[2:] if t.startswith("\\$") else t
    t = _SEPARATOR_RE.sub(",", t.strip().replace("\u2212", "-"))
    if not PLAIN_NUMBER_RE.fullmatch(t):
        return None
    value = decimal.Decimal(t.replace(",", ""))
    return value if abs(value.adjusted()) <= MAX_EXPONENT else None


def number_text(value: decimal.Decimal) -> str:
    """A plain number as math-verify reads it exactly: an integer's digits ("2e3" -> "2000",
    "-3." -> "-3", "-0" -> "0"), else a positional decimal with no exponent ("1e-7" ->
    "0.0000001", "2.50" -> "2.50")."""
    if value == value.to_integral_value():
        return str(int(value))
    return format(value, "f")


def _boxes(text: str) -> list[tuple[int, int, int]]:
    """(start of ``\\boxed``, start of content, end of content) of each ``\\boxed{...}``, nested
    braces matched, in the order they close; unclosed ones left out. One pass over the text."""
    opens = {
        m.end() - 1: m.start() for m in _BOX_OPEN_RE.finditer(text)
    }  # each box's "{" -> "\\boxed"
    spans, boxes, depth = [], [], 0  # boxes: (start, content start, depth inside) of each open box
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            if i in opens:
                boxes.append((opens[i], i + 1, depth))
        elif ch == "}":
            if boxes and boxes[-1][2] == depth:
                start, content, _ = boxes.pop()
                spans.append((start, content, i))
            depth -= 1
    return spans


def final_boxes(text: str) -> str | None:
    """The completion's boxed answer: its last ``\\boxed{}`` (not inside another), with the boxes
    just before it that "and", "or" or "," join to it, as ``\\boxed{a}, \\boxed{b}`` (math-verify
    reads that as the set {a, b}); None without a closed box. Earlier boxes do not count, so
    ``\\boxed{2} ... on reflection \\boxed{3}`` answers 3, not {2, 3}."""
    top = []  # boxes not inside another, in text order
    for box in sorted(_boxes(text)):
        if not top or box[0] > top[-1][2]:
            top.append(box)
    if not top:
        return None
    group = [top.pop()]
    while top and _JOIN_RE.fullmatch(text[top[-1][2] + 1 : group[0][0]]):
        group.insert(0, top.pop())
    return ", ".join(text[start : end + 1] for start, _, end in group)


def normalise_numbers(text: str) -> str | None:
    """``text`` with its plain numbers written as ``number_text``, so that math-verify reads them::

        the whole text, if it is one plain_number         "1e-7" -> "0.0000001", "-3." -> "-3"
        else each \\boxed{} content that is one            "\\boxed{1\\,000}" -> "\\boxed{1000}"
        and each e-notation number left in the text       "is 2.5e3." -> "is 2500."

    None if one is beyond 10^+-``MAX_EXPONENT`` (too long to write out: no answer). Everything
    else is left as written, ``e`` alone included (``e - 7``, ``6e``: Euler's number)."""
    whole = plain_number(text)
    if whole is not None:
        return number_text(whole)
    pieces, done = [], 0
    for _, start, end in sorted(_boxes(text), key=lambda box: box[1]):
        value = plain_number(text[start:end])
        if value is not None:  # a number's box holds no other box: the spans replaced do not nest
            pieces += [text[done:start], number_text(value)]
            done = end
    text = "".join(pieces) + text[done:]
    values = [decimal.Decimal(m.group()) for m in _E_NOTATION_RE.finditer(text)]
    if any(abs(v.adjusted()) > MAX_EXPONENT for v in values):
        return None
    return _E_NOTATION_RE.sub(lambda m: number_text(decimal.Decimal(m.group())), text)


def gold_text(answer: Any) -> str | None:
    """The reference as text for ``parse``: None if missing (None, bool, NaN/inf, empty or not a
    string) or beyond 10^+-``MAX_EXPONENT``; a number as ``number_text`` (``1e-07`` ->
    ``"0.0000001"``, ``2.0`` -> ``"2"``); a string through ``normalise_numbers`` (``"1e-7"`` ->
    ``"0.0000001"``), then as is if it delimits its math, else wrapped as ``\\boxed{answer}``
    (bare LaTeX such as ``x \\in [1, 2)`` is otherwise not extracted)."""
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, numbers.Real):
        if not math.isfinite(float(answer)):
            return None
        exact = decimal.Decimal(
            int(answer) if isinstance(answer, numbers.Integral) else repr(float(answer))
        )
        text = number_text(exact) if abs(exact.adjusted()) <= MAX_EXPONENT else None
    elif isinstance(answer, str):
        text = normalise_numbers(answer.strip())
    else:
        return None
    if not text:
        return None
    return text if _DELIMITED_RE.search(text) else f"\\boxed{{{text}}}"


def _can_interrupt() -> bool:
    """A SIGALRM timer can interrupt us: main thread of the main interpreter, POSIX ``setitimer``."""
    return threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer")


class _Alarm:
    """The SIGALRM handler of one ``deadline``: raises ``CheckTimeout`` while armed."""

    def __init__(self):
        self.armed = True

    def __call__(self, signum, frame):
        if self.armed and not _in_gc_callback(frame):
            raise CheckTimeout


def _in_gc_callback(frame) -> bool:
    """Whether ``frame`` runs inside a ``gc.callbacks`` entry (such as JAX's), where Python would
    print and drop our exception; the next repeat of the timer raises it elsewhere."""
    codes = {getattr(cb, "__code__", None) for cb in gc.callbacks}
    while frame is not None:
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Raise ``CheckTimeout`` in the block after ``seconds``, then again every ``RETRY_S`` until it
    ends (``ITIMER_REAL``; main thread only, elsewhere a no-op). The repeats matter: an exception
    raised where Python ignores it (a gc callback, a ``__del__``) or that some code swallows would
    otherwise leave the block unbounded. A timer already pending is re-armed with what was left."""
    if not _can_interrupt():
        yield
        return
    alarm, start = _Alarm(), time.monotonic()
    old_handler = signal.signal(signal.SIGALRM, alarm)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds, RETRY_S)
    try:
        yield
    finally:
        while alarm.armed:  # a timeout raised as the block ends lands here: absorb it, disarm
            try:
                alarm.armed = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            except CheckTimeout:
                alarm.armed = True
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay > 0:
            left = old_delay - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), old_interval)


def _power_of_ten(e: Any) -> bool:
    return e.is_Pow and e.base == 10 and e.exp.is_Integer


def _reciprocal(e: Any) -> bool:
    return e.is_Pow and e.base.is_Integer and e.exp == -1


def written_as_a_number(e: Any) -> bool:
    """Whether a parsed answer (a sympy expression) is a number as written: a number, a fraction
    ``a/b``, a percentage ``n\\%``, a power of ten or ``a \\times 10^k``; or a value that no
    number writes exactly (``\\frac{\\sqrt{2}}{2}``). Not a rational value left as arithmetic
    (``6 - 9``, ``2+3``, ``3 \\times 4``): a restated question is not its answer."""
    from sympy import Expr  # math-verify's own dependency

    if not isinstance(e, Expr):
        return False  # a set, an interval, a relation
    if not e.is_rational:
        return True  # irrational or symbolic: no number writes it exactly
    if e.is_Number or _power_of_ten(e):
        return True
    if not e.is_Mul:
        return False
    parts = e.args
    if not all(a.is_Number or _power_of_ten(a) or _reciprocal(a) for a in parts):
        return False
    return sum(1 for a in parts if a.is_Integer and abs(a) > 1) <= 1


@dataclasses.dataclass(frozen=True)
class MathVerify:
    """``math_verify`` reading the reference from column ``answer_field``::

        g = parse(gold_text(answer[i]))                 LaTeX, then plain expressions
        c = normalise_numbers(completions[i])           plain numbers written out: 1e-7 -> 0.0000001
        p = parse(final_boxes(c) or c)                  the last \\boxed{} (with those joined to it by
                                                        "and", "or", ","), else "final answer is",
                                                        "answer:", the last LaTeX or number
        r_i = None   if g == [] (reference missing or unparseable, or its parse timed out)
              0.0    if p == [] (no parseable answer) or the check ran past timeout_s
              0.0    if numbers_only and p is not written as a number (written_as_a_number)
              1.0 if verify(g, p, float_rounding, strict) else 0.0

    ``gold_text`` writes a plain-number reference out the same way and wraps a bare reference as
    ``\\boxed{answer}``. So ``1e-7`` is 10^-7 on both sides, never ``e - 7`` (a lone ``e`` stays
    Euler's number), and ``\\boxed{1 000}`` is 1000. ``verify`` compares numbers
    rounded to ``float_rounding`` decimals when one side is a float (``0.333333 == 1/3`` but
    ``0.333 != 1/3`` at 6), else symbolically (``2\\sqrt{2} == \\sqrt{8}``); ``strict=False`` lets
    variable names differ and a set match a tuple. A percentage ``50\\%`` equals both ``50`` and
    ``0.5`` (the library's rule). The rounding is absolute: at 6 decimals every float of size
    below 5e-7 rounds to 0 (``0.0000002 == 1e-7``); raise ``float_rounding`` for answers that
    small. The reference is parsed once per distinct value in a call.

    Timeouts: the library's own ``signal.alarm`` timeouts are turned off (they raise
    ``ValueError`` outside the main thread). In the main thread (a reward-pool worker) parsing the
    reference, and parsing + verifying a completion, each run under a ``timeout_s`` SIGALRM
    timer. In any other thread (the trainer's daemon thread when ``relax.rewards.functions`` has
    a timeout) nothing bounds a check here: the caller's timeout is the only bound, and a call
    it abandons runs on. A signal is handled between bytecodes, so one long C call (a huge
    integer power) can overrun the timer until it returns. The library logs once per process
    that its timeout is disabled.
    """

    answer_field: str = DEFAULT_ANSWER_FIELD
    timeout_s: float = 5.0
    float_rounding: int = 6
    strict: bool = True
    numbers_only: bool = False
    """Score 0 an answer that is arithmetic on numbers (``6 - 9`` for -3): ``numeric_match``'s
    check, where the reference is a number and a restated expression would be rewarded."""

    def __post_init__(self):
        if not isinstance(self.answer_field, str) or not self.answer_field:
            raise ValueError(f"answer_field must be a non-empty string, got {self.answer_field!r}")
        if isinstance(self.timeout_s, bool) or not (
            isinstance(self.timeout_s, numbers.Real) and 0 < self.timeout_s < math.inf
        ):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if (
            isinstance(self.float_rounding, bool)
            or not isinstance(self.float_rounding, int)
            or self.float_rounding < 0
        ):
            raise ValueError(f"float_rounding must be an int >= 0, got {self.float_rounding!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")
        if not isinstance(self.numbers_only, bool):
            raise ValueError(f"numbers_only must be a bool, got {self.numbers_only!r}")
        _library()

    @property
    def __name__(self) -> str:
        return "math_verify"

    def parse_gold(self, text: str) -> list:
        """``parse(text)`` of a ``gold_text``; ``[]`` if unparseable or past ``timeout_s``."""
        try:
            with deadline(self.timeout_s):
                return _library().parse(text, _extraction_configs()[0], parsing_timeout=None)
        except CheckTimeout:
            return []

    def check(self, completion: str, gold: list) -> float:
        """1.0 if the completion's answer (its ``final_boxes`` if it has a box, else the text), its
        plain numbers written out (``normalise_numbers``), verifies against the parsed reference
        ``gold``; else 0.0 (no parseable answer, a number beyond 10^+-``MAX_EXPONENT``, or parse +
        verify past ``timeout_s``)."""
        mv = _library()
        completion = normalise_numbers(completion)
        if completion is None:
            return 0.0
        completion = final_boxes(completion) or completion
        try:
            with deadline(self.timeout_s):
                pred = mv.parse(completion, _extraction_configs()[1], parsing_timeout=None)
                return float(
                    bool(pred)
                    and (not self.numbers_only or written_as_a_number(pred[0]))
                    and mv.verify(
                        gold,
                        pred,
                        float_rounding=self.float_rounding,
                        strict=self.strict,
                        timeout_seconds=None,
                    )
                )
        except CheckTimeout:
            return 0.0

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        answers = column(fields, self.answer_field, "math_verify")
        golds: dict[str, list] = {}
        out: list[float | None] = []
        for completion, answer in zip(completions, answers):
            text = gold_text(answer)
            if text is not None and text not in golds:
                golds[text] = self.parse_gold(text)
            gold = [] if text is None else golds[text]
            out.append(self.check(completion, gold) if gold else None)
        return out
