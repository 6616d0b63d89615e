"""``numeric_match`` (relax.rewards.builtin) against a table of answers whose verdicts are written
out by hand (issue 33: answer checks that do not reward nonsense).

A final answer is compared as a number only when it is WHOLLY a number; any other answer goes to
math-verify (installed here), or scores 0 without it (``math_fallback=False``)."""

import importlib.util
from fractions import Fraction

import pytest

from relax.rewards.builtin import (
    final_answer,
    last_number,
    make_numeric_match,
    number_value,
    numeric_match,
)

NEEDS_LIBRARY = pytest.mark.skipif(
    importlib.util.find_spec("math_verify") is None, reason="needs the math extra"
)
LIMIT = "math-verify limitation"
GSM8K = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips altogether.\n#### 72"
# (reference, completion, right verdict (math-verify installed), verdict without math-verify
# [, xfail reason for the first]). The second column is the documented rule where it differs
# from the first: an answer that is not wholly a number scores 0 without math-verify.
TABLE = [
    # the red team's cases: a number inside an answer is not the answer
    ("10", r"\boxed{1/10}", 0.0, 0.0),  # 1/10 = 0.1
    ("0.1", r"\boxed{1/10}", 1.0, 1.0),
    ("5", r"\boxed{x-5}", 0.0, 0.0),
    ("7", r"\boxed{7\le x}", 0.0, 0.0),
    ("2", r"\boxed{10^2}", 0.0, 0.0),
    ("100", r"\boxed{10^2}", 1.0, 0.0),
    ("1e-7", r"\boxed{e - 7}", 0.0, 0.0),  # Euler's number: e - 7 = -4.28...
    ("2e3", r"\boxed{6e}", 0.0, 0.0),  # 6e = 16.3...
    # e-notation on both sides
    ("1e-7", r"\boxed{0.0000001}", 1.0, 1.0),
    ("1e-7", r"\boxed{1E-7}", 1.0, 1.0),
    ("0.0000001", r"\boxed{1e-7}", 1.0, 1.0),
    ("1e-7", r"\boxed{10^{-7}}", 1.0, 0.0),
    ("2.5e3", r"\boxed{2500}", 1.0, 1.0),
    ("2000", "#### 2e3", 1.0, 1.0),
    ("1e-7", r"\boxed{1e-6}", 0.0, 0.0),
    ("1e-7", r"\boxed{0.0000002}", 0.0, 0.0),  # relative tolerance: twice as large is wrong
    ("1e-7", r"\boxed{0}", 0.0, 0.0),
    (1e-7, r"\boxed{1e-7}", 1.0, 1.0),
    # negative numbers
    ("-3", r"\boxed{-3}", 1.0, 1.0),
    ("-3", r"\boxed{3}", 0.0, 0.0),
    ("3", r"\boxed{-3}", 0.0, 0.0),
    ("-3", r"\boxed{-3.}", 1.0, 1.0),
    ("-3", "\\boxed{\u22123}", 1.0, 1.0),  # Unicode minus
    ("-3", "so x = -3", 1.0, 1.0),
    ("3", "10-3", 0.0, 0.0),  # 10 - 3 = 7
    ("7", "10-3", 0.0, 0.0),  # arithmetic left undone is not the answer (math-verify: equal)
    ("-0.5", r"\boxed{-\frac{1}{2}}", 1.0, 1.0),
    (-2.5, "#### -2.5", 1.0, 1.0),
    ("0", r"\boxed{-0}", 1.0, 1.0),
    # trailing zeros
    ("2.5", r"\boxed{2.50}", 1.0, 1.0),
    ("2.50", "#### 2.5", 1.0, 1.0),
    ("72", r"\boxed{72.00}", 1.0, 1.0),
    ("0", r"\boxed{0.0000001}", 0.0, 0.0),  # 0 only equals 0
    # thousands separators
    ("1000", r"\boxed{1,000}", 1.0, 1.0),
    ("1,000", r"\boxed{1000}", 1.0, 1.0),
    ("1000", r"\boxed{1{,}000}", 1.0, 1.0),
    ("1234567", "#### 1,234,567", 1.0, 1.0),
    ("1000", "The total is 1,000.", 1.0, 1.0),
    ("15", r"\boxed{1,5}", 0.0, 0.0),  # not grouped in threes: the list 1, 5
    # a final answer without a box
    ("42", "The answer is 42.", 1.0, 1.0),
    ("42", "#### 42", 1.0, 1.0),
    ("42", "#### 42\nI hope it is correct.", 1.0, 1.0),
    (GSM8K, r"so \boxed{72}", 1.0, 1.0),
    (GSM8K, "#### 72", 1.0, 1.0),
    ("42", "The answer is **42**.", 1.0, 1.0),
    ("42", "The answer is $42$.", 1.0, 1.0),
    ("5", "The answer is x-5.", 0.0, 0.0),
    ("2", "The answer is 10^2.", 0.0, 0.0),
    ("10", "The answer is 1/10.", 0.0, 0.0),
    ("0.1", "The answer is 1/10.", 1.0, 1.0),
    ("42", "I do not know.", 0.0, 0.0),
    # units and words: a LaTeX text unit is dropped; bare words in math are variables
    ("12", r"\boxed{12\text{ dollars}}", 1.0, 1.0),
    ("12", r"\boxed{\$12}", 1.0, 1.0),
    ("5", r"\boxed{5 apples}", 1.0, 0.0),
    ("42", "#### 42 dollars", 1.0, 0.0, f"{LIMIT}: 'dollars' is read as the product d*o*l*l*a*r*s"),
    ("42", "The answer is 42 apples.", 1.0, 1.0),  # prose after a free-text number
    ("2", "The answer is $2\\pi$.", 0.0, 0.0),
    (
        "2",
        "The answer is 2 pi.",
        0.0,
        0.0,
        f"{LIMIT}: in plain text 'pi' is a word; the 2 before it is read",
    ),
    ("0.5", r"\boxed{50\%}", 1.0, 0.0),
    # fractions
    ("0.75", r"\boxed{\frac{3}{4}}", 1.0, 1.0),
    ("0.75", r"\boxed{\dfrac{3}{4}}", 1.0, 1.0),
    ("0.75", "#### 3/4", 1.0, 1.0),
    ("0.5", r"\boxed{\frac{2}{4}}", 1.0, 1.0),
    (r"\frac{1}{3}", r"\boxed{0.3333333}", 1.0, 1.0),  # 1e-7 relative, within rel_tol
    (r"\frac{1}{3}", r"\boxed{0.333}", 0.0, 0.0),
    (
        "0.7071067811865476",
        r"\boxed{\frac{\sqrt{2}}{2}}",
        1.0,
        0.0,
    ),  # a float reference: equal to 6 decimals
    ("0.5", r"\boxed{1/0}", 0.0, 0.0),
    # a restated question: what GRPO on SmolLM2 learned to write for one-digit sums when this
    # fallback rewarded it (session 34), and sums / products left undone
    ("-3", "To find 6 - 9, we need to subtract the two numbers and", 0.0, 0.0),
    ("10", "To calculate 8 + 2, we simply add them together.", 0.0, 0.0),
    ("5", r"\boxed{2+3}", 0.0, 0.0),
    ("12", r"\boxed{3 \times 4}", 0.0, 0.0),
    ("2500", r"\boxed{2.5 \times 10^{3}}", 1.0, 0.0),  # scientific notation is a number
    ("-0.5", r"\boxed{-\frac{2}{4}}", 1.0, 1.0),
    # an empty box
    ("5", r"\boxed{}", 0.0, 0.0),
    ("0", r"\boxed{}", 0.0, 0.0),
    # several boxes: the last counts
    ("3", r"\boxed{2} then, on reflection, \boxed{3}", 1.0, 1.0),
    ("2", r"\boxed{2} then, on reflection, \boxed{3}", 0.0, 0.0),
    # text after the box does not count
    ("72", r"so \boxed{72}. Check: 72 + 28 = 100", 1.0, 1.0),
    ("100", r"so \boxed{72}. Check: 72 + 28 = 100", 0.0, 0.0),
    # references that are not a number: missing
    ("seven", "7", None, None),
    ("x + 1", r"\boxed{x+1}", None, None),
    ("10^2", r"\boxed{100}", None, None),
    (None, "7", None, None),
]
STRICT = make_numeric_match(math_fallback=False)


def _params():
    for i, (ref, completion, right, without, *reason) in enumerate(TABLE):
        marks = [NEEDS_LIBRARY] + (
            [pytest.mark.xfail(reason=reason[0], strict=True)] if reason else []
        )
        yield pytest.param(numeric_match, ref, completion, right, id=f"{i}-math", marks=marks)
        yield pytest.param(STRICT, ref, completion, without, id=f"{i}-strict")


@pytest.mark.parametrize("fn, reference, completion, expected", list(_params()))
def test_table(fn, reference, completion, expected):
    assert fn(["q"], [completion], answer=[reference]) == [expected]


@NEEDS_LIBRARY
def test_table_in_one_call():
    """One batch: the math check is given only the answers that are not numbers, in their rows."""
    rows = [r for r in TABLE if len(r) == 4]
    assert len(rows) >= 70
    assert numeric_match(["q"] * len(rows), [r[1] for r in rows], answer=[r[0] for r in rows]) == [
        r[2] for r in rows
    ]


def test_without_the_library_non_numbers_score_zero(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "math_verify", None)
    fn = make_numeric_match()
    assert fn(
        ["q"] * 3, [r"\boxed{10^2}", r"\boxed{100}", "x"], answer=["100", "100", "seven"]
    ) == [0.0, 1.0, None]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("72", Fraction(72)),
        ("-2.50", Fraction(-5, 2)),
        ("1,000", Fraction(1000)),
        ("1e-7", Fraction(1, 10**7)),
        ("$5$.", Fraction(5)),
        (r"\$5", Fraction(5)),
        ("+4", Fraction(4)),
        ("1/10", Fraction(1, 10)),
        (r"-\frac{3}{4}", Fraction(-3, 4)),
        (r"\tfrac{-3}{4}", Fraction(-3, 4)),
        (r"5\text{ apples}", Fraction(5)),
        (r"10\,\mathrm{cm}", Fraction(10)),
        ("x-5", None),
        (r"7\le x", None),
        ("10^2", None),
        ("5 apples", None),
        (r"50\%", None),
        (r"\sqrt{2}", None),
        ("1/0", None),
        ("1/2/3", None),
        (r"\frac{a}{2}", None),
        (r"5\text{5}", None),
        ("", None),
    ],
)
def test_number_value(text, expected):
    assert number_value(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The answer is 42.", Fraction(42)),
        ("x = -3", Fraction(-3)),
        ("so 1/2", Fraction(1, 2)),
        ("costs $1,234.50.", Fraction("1234.5")),
        ("**42**", Fraction(42)),
        (r"$x = \frac{1}{10}$", Fraction(1, 10)),
        ("it is 5 eggs", Fraction(5)),
        ("x-5", None),
        ("10^2", None),
        (r"7 \le x", None),
        ("10-3", None),
        ("2 pi", None),
        ("50%", None),
        ("2 * 21", None),
        ("5x", None),
        (r"3\sqrt{2}", None),
        ("1,5", None),
        ("x^2", None),
        ("no number", None),
    ],
)
def test_last_number(text, expected):
    assert last_number(text) == expected


def test_final_answer_says_what_the_math_check_gets():
    assert final_answer(r"so \boxed{x-5} then 5") == (None, r"\boxed{x-5}")
    assert final_answer("#### 42 dollars\nbye") == (None, r"\boxed{42 dollars}")
    assert final_answer(r"\boxed{ }") == (None, "")
    assert final_answer("it is x-5") == (None, "it is x-5")
    assert final_answer(r"\fbox{7}") == (Fraction(7), r"\boxed{7}")


def test_options_are_checked():
    for bad in (-1e-6, float("nan"), float("inf"), "1e-6"):
        with pytest.raises(ValueError, match="rel_tol"):
            make_numeric_match(rel_tol=bad)
    with pytest.raises(ValueError, match="math_fallback"):
        make_numeric_match(math_fallback=1)
    assert make_numeric_match(rel_tol=1e-3)(["q"], [r"\boxed{0.333}"], answer=[r"\frac{1}{3}"]) == [
        1.0
    ]
