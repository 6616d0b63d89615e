"""A rising curriculum: batches from the easiest level until the policy masters it, then harder.

The rows carry a difficulty level ``l_0 < l_1 < ... < l_m``; each level has its own pipeline
(its rows, shuffled, in batches: ``relax.data.prompts.prompt_iterator``) and the batches come
from the current level's. After every update the run observes the batch's mean training reward
``r_t`` (``observe``); once ``window`` updates have been observed at level ``l_k``::

    k <- k + 1      when   (1 / window) * sum(r_{t - window + 1}, ..., r_t) >= threshold
                           and k < m

and the window starts afresh at the new level (a level is never left for an easier one). The
level, the window's rewards and every level's pipeline position are the iterator's state
(``get_state`` / ``set_state``, checkpointed with the train state), so a resumed run draws what
the uninterrupted run would have.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Sequence
from typing import Any


class RisingCurriculum:
    """Batches of the current level's ``iterators[k]`` (``levels[k]``, ascending); see the
    module docstring for when ``k`` rises."""

    def __init__(
        self,
        levels: Sequence[int],
        iterators: Sequence[Iterator],
        *,
        threshold: float,
        window: int,
    ):
        if len(levels) != len(iterators) or not levels:
            raise ValueError(f"{len(levels)} levels for {len(iterators)} pipelines")
        if list(levels) != sorted(set(levels)):
            raise ValueError(f"levels must be distinct and ascending, got {list(levels)}")
        if window < 1 or not math.isfinite(threshold):
            raise ValueError(
                f"window >= 1 and a finite threshold are required ({window}, {threshold})"
            )
        self.levels, self.iterators = tuple(levels), list(iterators)
        self.threshold, self.window = threshold, window
        self.index = 0
        self.rewards: collections.deque[float] = collections.deque(maxlen=window)

    @property
    def level(self) -> int:
        return self.levels[self.index]

    def __iter__(self) -> RisingCurriculum:
        return self

    def __next__(self) -> Any:
        return next(self.iterators[self.index])

    def observe(self, reward: float) -> None:
        """The mean training reward of the update just made (a NaN one, every sample's reward
        missing, counts as 0)."""
        self.rewards.append(0.0 if math.isnan(reward) else float(reward))
        full = len(self.rewards) == self.window
        if full and sum(self.rewards) / self.window >= self.threshold:
            if self.index + 1 < len(self.levels):
                self.index += 1
                self.rewards.clear()

    def get_state(self) -> dict:
        return {
            "level": self.level,
            "rewards": list(self.rewards),
            "pipelines": [it.get_state() for it in self.iterators],
        }

    def set_state(self, state: dict) -> None:
        if state.get("level") not in self.levels or len(state["pipelines"]) != len(self.levels):
            raise ValueError(
                f"the checkpoint's curriculum (level {state.get('level')}, "
                f"{len(state.get('pipelines', []))} levels) is not this run's (levels "
                f"{list(self.levels)})"
            )
        self.index = self.levels.index(state["level"])
        self.rewards = collections.deque(state["rewards"], maxlen=self.window)
        for it, s in zip(self.iterators, state["pipelines"]):
            it.set_state(s)
