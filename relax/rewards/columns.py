"""The dataset columns a host reward reads (the ``fields`` of TRL's reward signature)."""

from __future__ import annotations

DEFAULT_ANSWER_FIELD = "answer"


def column(fields: dict[str, list], name: str, fn_name: str) -> list:
    """``fields[name]``, or ``KeyError`` naming the reward ``fn_name``, the column and the columns there are."""
    if name not in fields:
        raise KeyError(f"{fn_name} needs the dataset column {name!r}; got columns {sorted(fields)}")
    return fields[name]
