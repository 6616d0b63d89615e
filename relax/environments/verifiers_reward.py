"""A single-turn ``verifiers`` environment's rewards as GRPO / PPO reward functions.

    fns = rubric_functions("verifiers:my_taskset")   # one RewardFunction per verifiers reward
    # each fn(prompts, completions, vf_task=[...]) -> [score, ...] (TRL's signature)

Each completion is scored as verifiers scores an episode: a ``vf.Trace`` of the task's opening
messages and the completion as the assistant's reply, scored by ``Task.score``
(``VerifiersSource.score``). Every reward of the task (``@vf.reward`` methods, plugged rewards,
judges) is one relax reward function with its verifiers weight, so relax's weighted sum
(``relax.rewards.shaping.combine``) is ``trace.reward`` and each reward is a metric of its own.
A trace is scored once per (task, completion) and shared by the functions of one process.

The functions are picklable (the worker pool, ``--reward-workers``, sends them to worker
processes): each loads its environment by spec on first use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from relax.environments.verifiers_source import load_source, prompt_messages, run_sync
from relax.rewards.contract import RewardFunction

_SCORED: dict[tuple[str, str, str], dict[str, float | None]] = {}  # per process
_CACHE_LIMIT = 4096


class VerifiersReward:
    """The reward ``name`` of the environment ``spec`` (module docstring)."""

    def __init__(self, spec: str, name: str):
        self.spec, self.name = spec, name
        self.__name__ = name

    def __call__(
        self, prompts: Sequence[Any], completions: Sequence[str], vf_task=None, **_: Any
    ) -> list[float | None]:
        if vf_task is None:
            raise KeyError(
                f"verifiers reward {self.name!r}: the rows need the column 'vf_task' "
                "(written by --env verifiers:<id>)"
            )
        return [self._score(t, c).get(self.name) for t, c in zip(vf_task, completions)]

    def _score(self, data: Mapping[str, Any], completion: str) -> dict[str, float | None]:
        key = (self.spec, json.dumps(data, sort_keys=True), completion)
        if key not in _SCORED:
            if len(_SCORED) >= _CACHE_LIMIT:
                _SCORED.clear()
            source = load_source(self.spec)
            task = source.task({"vf_task": data})
            messages = prompt_messages(task.data) + [{"role": "assistant", "content": completion}]
            trace = run_sync(source.score(task, messages))
            unknown = sorted(set(trace.rewards) - set(source.reward_weights()))
            if unknown:
                raise ValueError(
                    f"verifiers environment {self.spec!r} scored rewards {unknown} it does not "
                    "declare (a reward returning keyed scores): relax reports declared rewards"
                )
            _SCORED[key] = {k: None if r is None else r.score for k, r in trace.rewards.items()}
        return _SCORED[key]


def rubric_functions(spec: str) -> list[RewardFunction]:
    """One ``RewardFunction`` per reward of ``spec``'s task type, with its verifiers weight."""
    weights = load_source(spec).reward_weights()
    return [RewardFunction(VerifiersReward(spec, n), name=n, weight=w) for n, w in weights.items()]
