"""The environment protocol: what a multi-turn rollout talks to.

An environment wraps one dataset row for one trajectory::

    messages = env.reset(row)              # the conversation so far: system / user messages
    result = env.step(action)              # the policy's turn (its text and the sampled ids)
    result.observation                     # messages to append (tool results, user replies)
    result.reward, result.done, result.info

``Environment`` is the synchronous protocol; ``AsyncEnvironment`` the asynchronous one
(``areset`` / ``astep``), and ``as_async(env)`` runs a synchronous environment in a thread so a
batch of trajectories can step concurrently. Observations are chat messages, rendered by the
model's own chat template and tokenized once by the rollout; the policy's action keeps the
token ids it sampled (``Action.token_ids``): nothing is re-tokenized.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Action:
    """The policy's turn: the decoded ``text`` and the ``token_ids`` exactly as sampled."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What a step returns: ``observation`` messages to append (empty when ``done``), the
    ``reward`` of this step (None: none yet), ``done``, and ``info`` (counters for metrics, e.g.
    ``tool_calls`` and ``tool_errors``)."""

    observation: Sequence[Message]
    reward: float | None
    done: bool
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    def reset(self, row: Mapping[str, Any]) -> Sequence[Message]: ...

    def step(self, action: Action) -> StepResult: ...


@runtime_checkable
class AsyncEnvironment(Protocol):
    async def areset(self, row: Mapping[str, Any]) -> Sequence[Message]: ...

    async def astep(self, action: Action) -> StepResult: ...


@dataclasses.dataclass
class _Threaded:
    """A synchronous environment stepped in a worker thread (``asyncio.to_thread``)."""

    env: Environment

    async def areset(self, row: Mapping[str, Any]) -> Sequence[Message]:
        return await asyncio.to_thread(self.env.reset, row)

    async def astep(self, action: Action) -> StepResult:
        return await asyncio.to_thread(self.env.step, action)


def as_async(env: Environment | AsyncEnvironment) -> AsyncEnvironment:
    """``env`` itself if it is asynchronous, else a wrapper that steps it in a thread."""
    if isinstance(env, AsyncEnvironment):
        return env
    if not isinstance(env, Environment):
        raise TypeError(f"{type(env).__name__} has neither reset/step nor areset/astep")
    return _Threaded(env)


async def step_all(
    envs: Sequence[AsyncEnvironment], actions: Sequence[Action | None]
) -> list[StepResult | None]:
    """Step every environment whose action is not None, concurrently; None for the others
    (finished trajectories cost nothing)."""

    async def one(env, action):
        return None if action is None else await env.astep(action)

    return list(await asyncio.gather(*(one(e, a) for e, a in zip(envs, actions))))
