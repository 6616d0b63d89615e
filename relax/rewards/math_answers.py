"""``math_verify``: a host reward that checks a final answer with Hugging Face's ``math-verify``.

Needs the optional extra ``pip install 'relax[math]'`` (``math-verify[antlr4_13_2]``). Importing
this module does not import the library; constructing ``MathVerify()`` does, and raises
``ImportError`` naming the extra when it is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import functools
import gc
import math
import numbers
import re
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from relax.rewards.columns import DEFAULT_ANSWER_FIELD, column

INSTALL_HINT = "pip install 'relax[math]'"
RETRY_S = 0.05  # a timeout that was swallowed is raised again this often until the check ends
# A reference that already marks its math ($...$, \(...\), \[...\], \boxed{...}) is parsed as written.
_DELIMITED_RE = re.compile(r"\\boxed|(?<!\\)\$|\\\(|\\\[")


class CheckTimeout(BaseException):
    """A check ran past ``timeout_s``. A ``BaseException`` so that the library's and sympy's
    ``except Exception`` handlers let it through to us instead of swallowing it."""


def _library():
    """The ``math_verify`` module, or ``ImportError`` naming the extra that installs it."""
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(f"the math_verify reward needs the math-verify library: {INSTALL_HINT}") from e
    return math_verify


@functools.cache
def _extraction_configs() -> tuple[tuple, tuple]:
    """(reference, completion) extraction configs: LaTeX then plain expressions; for the
    completion a ``\\boxed{}`` answer has the highest priority (0, before "final answer is")."""
    mv = _library()
    gold = (mv.LatexExtractionConfig(), mv.ExprExtractionConfig())
    pred = (mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig())
    return gold, pred


def gold_text(answer: Any) -> str | None:
    """The reference as text for ``parse``: None if missing (None, bool, NaN/inf, empty or not a
    string); a number written positionally (``1e-07`` -> ``"0.0000001"``); a string that already
    delimits its math as is; any other string wrapped as ``\\boxed{answer}`` (bare LaTeX such as
    ``x \\in [1, 2)`` is otherwise not extracted)."""
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, numbers.Real):
        if not math.isfinite(float(answer)):
            return None
        exact = answer if isinstance(answer, numbers.Integral) else decimal.Decimal(repr(float(answer)))
        text = format(exact, "d" if isinstance(exact, numbers.Integral) else "f")
    elif isinstance(answer, str):
        text = answer.strip()
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


@dataclasses.dataclass(frozen=True)
class MathVerify:
    """``math_verify`` reading the reference from column ``answer_field``::

        g = parse(gold_text(answer[i]))                 LaTeX, then plain expressions
        p = parse(completions[i])                       \\boxed{} first, else "final answer is",
                                                        "answer:", the last LaTeX or number
        r_i = None   if g == [] (reference missing or unparseable, or its parse timed out)
              0.0    if p == [] (no parseable answer) or the check ran past timeout_s
              1.0 if verify(g, p, float_rounding, strict) else 0.0

    ``gold_text`` wraps a bare reference as ``\\boxed{answer}``. ``verify`` compares numbers
    rounded to ``float_rounding`` decimals when one side is a float (``0.333333 == 1/3`` but
    ``0.333 != 1/3`` at 6), else symbolically (``2\\sqrt{2} == \\sqrt{8}``); ``strict=False`` lets
    variable names differ and a set match a tuple. A percentage ``50\\%`` equals both ``50`` and
    ``0.5`` (the library's rule). The reference is parsed once per distinct value in a call.

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

    def __post_init__(self):
        if not isinstance(self.answer_field, str) or not self.answer_field:
            raise ValueError(f"answer_field must be a non-empty string, got {self.answer_field!r}")
        if isinstance(self.timeout_s, bool) or not (isinstance(self.timeout_s, numbers.Real)
                                                    and 0 < self.timeout_s < math.inf):
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        if isinstance(self.float_rounding, bool) or not isinstance(self.float_rounding, int) or self.float_rounding < 0:
            raise ValueError(f"float_rounding must be an int >= 0, got {self.float_rounding!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be a bool, got {self.strict!r}")
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
        """1.0 if the completion's answer verifies against the parsed reference ``gold``, else 0.0
        (no parseable answer, or parse + verify past ``timeout_s``)."""
        mv = _library()
        try:
            with deadline(self.timeout_s):
                pred = mv.parse(completion, _extraction_configs()[1], parsing_timeout=None)
                return float(bool(pred) and mv.verify(gold, pred, float_rounding=self.float_rounding,
                                                      strict=self.strict, timeout_seconds=None))
        except CheckTimeout:
            return 0.0

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **fields) -> list[float | None]:
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
