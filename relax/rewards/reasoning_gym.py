"""The reward of reasoning-gym rows (``--task reasoning_gym:<names>``): each task's own scorer.

For a completion ``c`` of a row whose reasoning-gym entry is ``e`` (the ``entry`` column, a dict
or its JSON text)::

    reward = score_answer_e(extract_answer(c), e)       in [0, 1]

with ``extract_answer`` reasoning-gym's own (``reasoning_gym.utils``: the text inside the last
``<answer>...</answer>``, stripped; None when there is none, which the scorers score 0) and
``score_answer_e`` the ``score_answer`` of the task ``e["metadata"]["source_dataset"]``
(``reasoning_gym.get_score_answer_fn``), so each row of a mixture is scored by its own task. The
scorers are pure Python over strings: they run in-process (or in the reward workers), with no
sandbox. A row without an entry scores None (missing). reasoning-gym is imported on first use.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from typing import Any

from relax.rewards.columns import column

ENTRY_FIELD = "entry"


@functools.cache
def scorer(name: str) -> Callable[[str | None, dict], float]:
    """reasoning-gym's ``score_answer`` of the task ``name``."""
    from reasoning_gym import get_score_answer_fn

    return get_score_answer_fn(name)


def extract(completion: str) -> str | None:
    """reasoning-gym's ``extract_answer``: the last ``<answer>...</answer>``'s text, or None."""
    from reasoning_gym.utils import extract_answer

    return extract_answer(completion)


def to_json(value: Any) -> Any:
    """``value`` as JSON data that ``from_json`` turns back into it exactly: a tuple becomes
    ``{"__tuple__": [...]}``, a set ``{"__set__": [...]}`` and a dict with a key that is not a
    string ``{"__items__": [[k, v], ...]}`` (scorers compare metadata grids as tuples, and plain
    JSON would give lists); anything else JSON cannot hold raises ``TypeError``."""
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"__set__": [to_json(v) for v in sorted(value, key=repr)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {k: to_json(v) for k, v in value.items()}
        return {"__items__": [[to_json(k), to_json(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    raise TypeError(f"{type(value).__name__} is not JSON data: {value!r:.80}")


def from_json(value: Any) -> Any:
    """The inverse of ``to_json``."""
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if value.keys() == {"__tuple__"}:
        return tuple(from_json(v) for v in value["__tuple__"])
    if value.keys() == {"__set__"}:
        return {from_json(v) for v in value["__set__"]}
    if value.keys() == {"__items__"}:
        return {from_json(k): from_json(v) for k, v in value["__items__"]}
    return {k: from_json(v) for k, v in value.items()}


def as_entry(value: Any) -> dict | None:
    """An ``entry`` cell (``to_json``'s form, or its JSON text) as the reasoning-gym entry; None
    stays None."""
    if value is None:
        return None
    return from_json(json.loads(value) if isinstance(value, str) else value)


class ReasoningGymReward:
    """``fn(prompts, completions, entry=[...], **fields) -> [score]`` (TRL's signature).

    ``tags`` False (the reward ``reasoning_gym_plain``, for models that do not write the tags):
    the whole completion, stripped, is the answer; reasoning-gym's default scorer then gives a
    completion that contains the answer partial credit ``len(answer) / len(completion)``."""

    def __init__(self, entry_field: str = ENTRY_FIELD, tags: bool = True):
        self.entry_field = entry_field
        self.tags = tags
        self.__name__ = "reasoning_gym" if tags else "reasoning_gym_plain"

    def __call__(
        self, prompts: Sequence[str], completions: Sequence[str], **fields
    ) -> list[float | None]:
        entries = column(fields, self.entry_field, self.__name__)
        out: list[float | None] = []
        for completion, cell in zip(completions, entries, strict=True):
            entry = as_entry(cell)
            if entry is None:
                out.append(None)
                continue
            name = entry["metadata"]["source_dataset"]
            answer = extract(completion) if self.tags else completion.strip()
            out.append(float(scorer(name)(answer, entry)))
        return out
