"""reasoning-gym's tasks as an environment for the agent trainer: ``relax agent --env
reasoning_gym:<name>[,<name>...][?attempts=K&answer=tagged|plain]``.

The rows are reasoning-gym's (``relax.tasks.reasoning_gym``, options ``--reasoning-gym.*``); an
episode asks a row's question and scores each answer with the row's own task's scorer
(``relax.rewards.reasoning_gym``)::

    score_k = score_answer_e(extract_answer(answer_k), e)        (answer=tagged, the default)
    score_k = score_answer_e(answer_k.strip(), e)                (answer=plain)

An answer that scores 1 ends the episode; a lower one gets a user turn saying so and asking again,
up to ``attempts`` answers (1: single-turn). The episode's reward is its last answer's score (the
earlier turns' rewards are 0), so a right answer at any attempt is worth 1; ``--agent.per-turn``
gives each turn its own advantage; ``turns`` in the metrics is the answers given. The scorers are
pure Python over strings: no sandbox.
"""

from __future__ import annotations

import dataclasses
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

from relax.environments.protocol import Action, Message, StepResult
from relax.rewards.reasoning_gym import ENTRY_FIELD, as_entry, extract, scorer

SCHEME = "reasoning_gym:"
ANSWER_MODES = ("tagged", "plain")


def is_reasoning_gym(spec: str | None) -> bool:
    """Whether ``spec`` names reasoning-gym tasks (``reasoning_gym:<names>``)."""
    return spec is not None and spec.startswith(SCHEME)


@dataclasses.dataclass(frozen=True)
class ReasoningGymSpec:
    """``--env reasoning_gym:<names>?attempts=K&answer=tagged|plain``: the task part
    (``reasoning_gym:<names>``, as ``--task`` takes it), the answers an episode allows and how an
    answer is read."""

    task: str
    attempts: int = 1
    answer: str = "tagged"

    @classmethod
    def parse(cls, spec: str) -> ReasoningGymSpec:
        task, _, query = spec.partition("?")
        fields: dict[str, Any] = {}
        for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
            if key == "attempts":
                try:
                    fields["attempts"] = int(value)
                except ValueError:
                    raise ValueError(
                        f"--env {spec!r}: attempts={value!r} is not a whole number"
                    ) from None
            elif key == "answer":
                fields["answer"] = value
            else:
                raise ValueError(f"--env {spec!r}: unknown option {key!r} (attempts, answer)")
        out = cls(task, **fields)
        if out.attempts < 1:
            raise ValueError(f"--env {spec!r}: attempts must be >= 1")
        if out.answer not in ANSWER_MODES:
            raise ValueError(f"--env {spec!r}: answer={out.answer!r}, one of {ANSWER_MODES}")
        return out


class ReasoningGymEnv:
    """One episode on one row (``relax.environments.Environment``): the question, then up to
    ``attempts`` answers scored by the row's task (module docstring)."""

    def __init__(self, spec: ReasoningGymSpec, system_prompt: str | None):
        self.spec, self.system_prompt = spec, system_prompt
        self.entry: dict | None = None
        self.left = 0

    def reset(self, row: Mapping[str, Any]) -> Sequence[Message]:
        entry = as_entry(row.get(ENTRY_FIELD))
        if entry is None:
            raise ValueError(
                f"--env {self.spec.task}: the row has no reasoning-gym {ENTRY_FIELD!r} "
                f"(its fields: {', '.join(row)})"
            )
        self.entry, self.left = entry, self.spec.attempts
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return [*system, {"role": "user", "content": entry["question"]}]

    def score(self, text: str) -> float:
        """The row's task's score of the answer ``text``."""
        answer = extract(text) if self.spec.answer == "tagged" else text.strip()
        return float(scorer(self.entry["metadata"]["source_dataset"])(answer, self.entry))

    def step(self, action: Action) -> StepResult:
        if self.entry is None or self.left <= 0:
            raise RuntimeError("step() after the episode ended (or before reset)")
        score, self.left = self.score(action.text), self.left - 1
        if score >= 1.0 or self.left == 0:
            self.left = 0
            return StepResult((), score, True)
        ask = "That is not right. Try again" + (
            ": give the final answer inside <answer></answer>."
            if self.spec.answer == "tagged"
            else ": reply with the final answer only."
        )
        return StepResult(({"role": "user", "content": ask},), None, False)
