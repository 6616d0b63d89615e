"""``VerifiersEnvironment``: one trajectory of a ``verifiers`` environment, as relax's
``AsyncEnvironment`` (``relax.environments.protocol``).

    make_env = verifiers_factory("verifiers:my_taskset?size=64")
    env = make_env()                     # one per trajectory, all sharing one VerifiersSource
    messages = await env.areset(row)     # a row of source.rows(): the task's opening messages
    result = await env.astep(action)     # the policy's turn, sampled by relax

A turn that calls tools (``tool_format``, parsed and schema-checked by
``relax.environments.tools``) gets the tools' results back as ``"tool"`` messages; a malformed
call comes back as an ``error:`` tool message. A turn without a call is the policy's reply:

- **single-agent** (``vf.SingleAgentEnv``, every plain taskset): the reply ends the episode, as
  verifiers' chat loop ends when a response has no tool call;
- **an env's own episode** (a ``vf.Env`` subclass exported by the taskset module, e.g. one that
  answers with hints): its ``run(task, agents)`` runs as a coroutine beside the rollout; its
  seat's ``interaction(task)`` / ``await conv.turn(message)`` hands ``message`` to the policy as
  a user message and returns the policy's reply (a ``vf.Segment``); the episode ends when
  ``run`` returns. Its ``finalize(task, episode)`` then sees the one trace.

When the episode ends, the trajectory's messages (opening, the policy's replies with their tool
calls, tool results, the env's messages) become a ``vf.Trace`` and the task scores it
(``VerifiersSource.score``): the reward is the weighted sum of its rewards (``trace.reward``),
and each reward's score is in ``info`` as ``reward/<name>``. The policy's tokens are never
re-rendered: relax keeps the ids it sampled, and only the observations are rendered.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from typing import Any

from relax.environments.protocol import Action, StepResult
from relax.environments.tools import parse_tool_calls
from relax.environments.verifiers_source import VerifiersSource, load_source, prompt_messages

_DONE = object()  # the env's run() returned


class VerifiersEnvironment:
    """One trajectory over one task of ``source`` (module docstring)."""

    def __init__(self, source: VerifiersSource):
        self.source = source
        self.messages: list[dict] = []  # verifiers' message format, for scoring
        self.task = None
        self._outbox: asyncio.Queue | None = None  # env -> policy: messages, or _DONE
        self._inbox: asyncio.Queue | None = None  # policy -> env: reply texts
        self._run: asyncio.Task | None = None
        self._calls = 0

    def schemas(self) -> list[dict]:
        return self.source.schemas() or []

    async def areset(self, row: Mapping[str, Any]) -> list[dict]:
        await self.source.toolbox.start()
        self.task = self.source.task(row)
        if self.source.single:
            self.messages = prompt_messages(self.task.data)
            if not self.messages:
                raise ValueError("the task has no prompt and the single-agent env has no opener")
            return list(self.messages)
        self._outbox, self._inbox = asyncio.Queue(), asyncio.Queue()
        self._run = asyncio.ensure_future(self._drive())
        first = await self._outbox.get()
        if first is _DONE:
            self._run.result()  # the env's own error, if it raised
            raise ValueError(f"{type(self.source.env).__name__}.run ended before a policy turn")
        return list(self.messages)

    async def _drive(self) -> None:
        try:
            await self.source.env.run(self.task, _Agents(self.source.seat, self))
        finally:
            self._outbox.put_nowait(_DONE)

    async def astep(self, action: Action) -> StepResult:
        tools = self.source.tools
        calls, errors = parse_tool_calls(action.text, self.source.spec.tool_format, tools)
        info = {"tool_calls": len(calls) + len(errors), "tool_errors": len(errors)} if tools else {}
        if calls or errors:
            return await self._tool_turn(action.text, calls, errors, info)
        self.messages.append({"role": "assistant", "content": action.text})
        if self.source.single:
            return await self._finish(info)
        self._inbox.put_nowait(action.text)
        event = await self._outbox.get()
        if event is _DONE:
            self._run.result()
            return await self._finish(info)
        return StepResult(event, None, False, info)

    async def _tool_turn(self, text, calls, errors, info) -> StepResult:
        """The tools' results as tool messages (after the assistant message with its calls)."""
        ids = [f"call_{self._calls + k}" for k in range(len(calls) + len(errors))]
        self._calls += len(ids)
        vf_calls = [
            {"id": i, "name": c.name, "arguments": json.dumps(c.arguments)}
            for i, c in zip(ids, calls)
        ]
        self.messages.append({"role": "assistant", "content": text, "tool_calls": vf_calls})
        results = await asyncio.gather(
            *(self.source.toolbox.call(c.name, c.arguments) for c in calls)
        )
        observation = [
            {"role": "tool", "name": c.name, "content": r} for c, r in zip(calls, results)
        ]
        observation += [{"role": "tool", "name": "error", "content": f"error: {e}"} for e in errors]
        for i, m in zip(ids, observation):
            self.messages.append({**m, "tool_call_id": i})
        return StepResult(observation, None, False, info)

    async def _finish(self, info: dict) -> StepResult:
        trace = await self.source.score(self.task, self.messages)
        if not self.source.single:
            await self.source.env.finalize(self.task, _Episode([trace]))
        scores = {f"reward/{k}": r.score for k, r in trace.rewards.items() if r is not None}
        missing = sorted(k for k, r in trace.rewards.items() if r is None)
        if missing:
            raise RuntimeError(f"verifiers rewards {missing} did not score (the task's scoring)")
        return StepResult((), float(trace.reward), True, {**info, **scores})

    async def _turn(self, task, message: str | None) -> str:
        """A seat's ``turn(message)``: the message to the policy, the policy's reply back."""
        if self.messages:
            if not message:
                raise ValueError("a later turn of a verifiers interaction needs a user message")
            out = [{"role": "user", "content": message}]
        else:
            self.task = task  # the env may mint the task its seat plays
            out = prompt_messages(task.data) + (
                [{"role": "user", "content": message}] if message else []
            )
            if not out:
                raise ValueError("the first turn has no prompt and no user message")
        self.messages += out
        self._outbox.put_nowait(out)
        return await self._inbox.get()


class _Interaction:
    """Stands for ``vf.Interaction``: ``turn(message)`` returns a ``vf.Segment`` of the reply."""

    def __init__(self, env: VerifiersEnvironment, task):
        self._env, self._task = env, task

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> bool:
        return False

    async def turn(self, message: str | None = None):
        from verifiers.v1 import AssistantMessage
        from verifiers.v1.agent import Segment

        reply = await self._env._turn(self._task, message)
        return Segment(messages=[AssistantMessage(content=reply)])


class _Seat:
    """Stands for the policy's ``vf.Agent`` seat: ``interaction(task)`` and ``run(task)``."""

    def __init__(self, env: VerifiersEnvironment):
        self._env, self.trainable = env, True

    def interaction(self, task) -> _Interaction:
        return _Interaction(self._env, task)

    async def run(self, task) -> None:
        async with self.interaction(task) as conv:
            await conv.turn()


class _Agents:
    """Stands for ``vf.Agents``: the one seat relax plays."""

    def __init__(self, seat: str, env: VerifiersEnvironment):
        self._seat, self._agent = seat, _Seat(env)

    def __getattr__(self, name: str):
        if name == self.__dict__.get("_seat"):
            return self.__dict__["_agent"]
        raise AttributeError(
            f"relax plays only the seat {self.__dict__.get('_seat')!r}, not {name!r}"
        )


class _Episode:
    """Stands for ``vf.Episode`` in ``Env.finalize``: its ``traces``."""

    def __init__(self, traces):
        self.traces = traces


def verifiers_factory(spec: str) -> Callable[[], VerifiersEnvironment]:
    """``make_env`` for ``--env verifiers:<id>``: a fresh environment per trajectory over the
    source loaded once."""
    source = load_source(spec)
    return lambda: VerifiersEnvironment(source)
