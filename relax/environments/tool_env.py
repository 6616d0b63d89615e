"""``ToolEnvironment``: a dataset row as a conversation in which the model may call tools.

    env = ToolEnvironment([calculator], fmt="hermes", answer_reward=exact_answer, max_turns=4)
    messages = env.reset({"prompt": "What is 123 * 456?", "answer": "56088"})
    result = env.step(Action(text))        # text: the model's turn, decoded

Each turn of the model either calls tools (format ``fmt``, ``relax.environments.tools``) or
answers. Calls are run and their results come back as ``{"role": "tool", "name", "content"}``
messages; a malformed call (bad JSON, unknown tool, wrong arguments) and a tool that raises come
back as a ``"tool"`` message whose content starts with ``error:``, and the trajectory goes on.
A turn without a call is the final answer: ``done``, with ``answer_reward(row, text)``. After
``max_turns`` model turns the trajectory ends with reward 0.0 and ``info["truncated"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relax.environments.protocol import Action, Message, StepResult
from relax.environments.tools import Tool, parse_tool_calls, run_call

AnswerReward = Callable[[Mapping[str, Any], str], float]


class ToolEnvironment:
    """One trajectory over one row (module docstring). ``prompt_field``: the row's user message;
    ``system_prompt``: an optional system message first."""

    def __init__(
        self,
        tools: Sequence[Tool],
        *,
        fmt: str,
        answer_reward: AnswerReward,
        max_turns: int,
        prompt_field: str = "prompt",
        system_prompt: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.tools = {t.name: t for t in tools}
        self.fmt, self.answer_reward, self.max_turns = fmt, answer_reward, max_turns
        self.prompt_field, self.system_prompt = prompt_field, system_prompt
        self.row: Mapping[str, Any] = {}
        self.turns = 0

    def schemas(self) -> list[dict]:
        """The tools for the chat template's ``tools=``."""
        return [t.schema() for t in self.tools.values()]

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        if self.prompt_field not in row:
            raise KeyError(
                f"ToolEnvironment needs the column {self.prompt_field!r}; got columns {sorted(row)}"
            )
        self.row, self.turns = row, 0
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return system + [{"role": "user", "content": str(row[self.prompt_field])}]

    def step(self, action: Action) -> StepResult:
        self.turns += 1
        calls, errors = parse_tool_calls(action.text, self.fmt, tuple(self.tools.values()))
        info = {"tool_calls": len(calls) + len(errors), "tool_errors": len(errors)}
        if not calls and not errors:
            return StepResult((), float(self.answer_reward(self.row, action.text)), True, info)
        if self.turns >= self.max_turns:
            return StepResult((), 0.0, True, {**info, "truncated": True})
        observation = [
            {"role": "tool", "name": c.name, "content": run_call(self.tools[c.name], c)}
            for c in calls
        ]
        observation += [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in errors]
        return StepResult(observation, None, False, info)
