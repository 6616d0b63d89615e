"""Validation of named options (loss types, modes, estimators...)."""

from __future__ import annotations


def check_choice(name: str, value: str, valid: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the option and listing the valid values unless ``value`` is one."""
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}; valid: {', '.join(valid)}")
