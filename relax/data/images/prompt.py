"""Prompt text expansion: each image placeholder -> the text of its image, at the string level.

As ``ProcessorMixin.get_text_with_replacements`` (transformers 5.23): the i-th occurrence of the
placeholder is replaced by ``replacements[i]``, left to right, without rescanning the inserted
text; the number of placeholders must equal the number of images (``validate_inputs``).
(transformers' ``sanitize_control_tokens`` marking of user text is not modelled.)
"""

from __future__ import annotations

from collections.abc import Sequence


def expand_placeholders(text: str, placeholder: str, replacements: Sequence[str]) -> str:
    """``text`` with its ``placeholder`` occurrences replaced by ``replacements`` in order."""
    if not placeholder:
        raise ValueError("the image placeholder must be a non-empty string")
    parts = text.split(placeholder)
    if len(parts) - 1 != len(replacements):
        raise ValueError(
            f"the prompt holds {len(parts) - 1} {placeholder!r} placeholders for "
            f"{len(replacements)} images; each image needs one"
        )
    out = [parts[0]]
    for rep, part in zip(replacements, parts[1:], strict=True):
        out += [rep, part]
    return "".join(out)
