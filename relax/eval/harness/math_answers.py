"""MATH answer checking as lm-evaluation-harness's ``hendrycks_math`` tasks do it
(``lm_eval/tasks/hendrycks_math/utils.py``, 0.4.13; itself the MATH paper's normalization).

- The target: ``remove_boxed(last_boxed_only_string(solution))``, the last ``\\boxed{...}`` (or
  ``\\fbox{...}``, or ``\\boxed x``) of the reference solution, its braces removed.
- The answer: the completion between its first and last ``$`` when it has at least two, else the
  whole completion.
- The verdict: ``is_equiv``: both strings normalized by ``strip_string`` (line breaks, ``\\!``,
  ``tfrac``/``dfrac``, ``\\left``/``\\right``, degrees, ``\\$``, a unit ``\\text{ ...}``, percent
  signs, leading zeros of decimals, a short ``x =`` prefix, ``\\sqrt3`` and ``\\frac12`` braces,
  spaces, ``0.5`` and ``a/b`` as fractions) and compared; if normalizing raises, the raw
  strings are compared.
"""

from __future__ import annotations

import dataclasses


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` of ``text`` with its braces balanced (None if
    there is none), or ``"\\boxed " + what follows the last "\\boxed "`` up to a ``$``."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    idx = text.rfind("\\boxed")
    if idx < 0:
        idx = text.rfind("\\fbox")
        if idx < 0:
            return None
    depth = 0
    for i in range(idx, len(text)):
        if text[i] == "{":
            depth += 1
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[idx : i + 1]
    return None


def remove_boxed(s: str) -> str:
    """``\\boxed{x}`` -> ``x``; ``\\boxed x`` -> ``x``. Anything else raises ValueError."""
    if "\\boxed " in s:
        if not s.startswith("\\boxed "):
            raise ValueError(f"not a \\boxed answer: {s!r}")
        return s[len("\\boxed ") :]
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{}} answer: {s!r}")
    return s[len("\\boxed{") : -1]


def _fix_fracs(string: str) -> str:
    substrs = string.split("\\frac")
    new = substrs[0]
    for sub in substrs[1:]:
        new += "\\frac"
        if sub[0] == "{":
            new += sub
        elif len(sub) < 2:
            return string
        else:
            a, b, rest = sub[0], sub[1], sub[2:]
            new += "{" + a + "}{" + b + "}" + rest if b != "{" else "{" + a + "}" + b + rest
    return new


def _fix_a_slash_b(string: str) -> str:
    parts = string.split("/")
    if len(parts) != 2:
        return string
    a, b = int(parts[0]), int(parts[1])  # a ValueError reaches is_equiv, as in lm-eval
    if string != f"{a}/{b}":
        return string
    return "\\frac{" + str(a) + "}{" + str(b) + "}"


def _remove_right_units(string: str) -> str:
    if "\\text{ " in string:
        splits = string.split("\\text{ ")
        if len(splits) != 2:
            raise ValueError(f"more than one unit in {string!r}")
        return splits[0]
    return string


def _fix_sqrt(string: str) -> str:
    if "\\sqrt" not in string:
        return string
    splits = string.split("\\sqrt")
    new = splits[0]
    for split in splits[1:]:
        new += "\\sqrt" + split if split[0] == "{" else "\\sqrt{" + split[0] + "}" + split[1:]
    return new


def strip_string(string: str) -> str:
    """lm-eval's ``strip_string`` (see the module docstring); may raise on odd input."""
    for old, new in (
        ("\n", ""),
        ("\\!", ""),
        ("\\\\", "\\"),
        ("tfrac", "frac"),
        ("dfrac", "frac"),
        ("\\left", ""),
        ("\\right", ""),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\$", ""),
    ):
        string = string.replace(old, new)
    string = _remove_right_units(string)
    string = string.replace("\\%", "")
    string = string.replace(" .", " 0.").replace("{.", "{0.")
    if not string:
        return string
    if string[0] == ".":
        string = "0" + string
    if len(string.split("=")) == 2 and len(string.split("=")[0]) <= 2:
        string = string.split("=")[1]
    string = _fix_sqrt(string).replace(" ", "")
    string = _fix_fracs(string)
    if string == "0.5":
        string = "\\frac{1}{2}"
    return _fix_a_slash_b(string)


def is_equiv(a: str | None, b: str | None) -> bool:
    """lm-eval's ``is_equiv``: equal after ``strip_string`` (raw equality if it raises)."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return strip_string(a) == strip_string(b)
    except Exception:  # noqa: BLE001 - lm-eval falls back to the raw strings on any error
        return a == b


def math_target(solution: str) -> str:
    """The reference answer of a MATH solution (its last boxed expression)."""
    boxed = last_boxed_only_string(solution)
    if boxed is None:
        raise ValueError(f"the solution has no \\boxed answer: {solution[-200:]!r}")
    return remove_boxed(boxed)


def dollar_answer(completion: str) -> str:
    """The completion between its first and last ``$`` (two or more), else all of it."""
    idx = [i for i, ch in enumerate(completion) if ch == "$"]
    return completion if len(idx) <= 1 else completion[idx[0] + 1 : idx[-1]]


@dataclasses.dataclass(frozen=True)
class MathEquiv:
    """hendrycks_math's ``exact_match``: ``is_equiv(dollar_answer(completion), target)``."""

    name: str = "exact_match"

    def __call__(self, prediction: str, reference: str) -> float:
        return float(is_equiv(dollar_answer(prediction), reference))
