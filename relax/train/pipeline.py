"""Asynchronous RL as a schedule: rollouts overlap updates with bounded staleness.

A step's segments split in two (``split_segments``): the producer, its leading segments that
leave the state as it is (rollout, rewards, environments: what runs on the sampler's weights),
and the consumer, the rest (advantage, update). Version ``v`` is the state after ``v`` updates
(``state.step``). With maximum staleness ``s`` and the weights pushed to the sampler every ``n``
updates (``1 <= n <= s + 1``), batch ``i`` is produced ``d = s + 1 - n`` iterations before its
update, on the weights of version::

    v(i) = n * floor(max(0, i - d) / n),        so that   i - v(i) <= s

when its update runs. The schedule, not thread timing, decides what every batch sees: a
pipelined run is reproducible bit for bit, and ``s = 0`` (``d = 0``, ``n = 1``) is the synchronous
loop itself, each batch produced on the live state and consumed at once.

Overlap (``d >= 1``), iteration ``j``: (1) the producer's device work of batch ``j + d`` is
dispatched (the rollout, on the sampler's copy of version ``v(j + d)``; a multi-turn rollout, a
host stage that decodes and steps the environments, waits for (4)); (2) batch ``j``'s last
producer stage that ``waits`` (``score_finish``, collecting the reward pool's scores) runs; (3)
the update of batch ``j`` is dispatched (JAX returns at once); (4) the producer's host work of
batch ``j + d`` up to its waiting stage (decoding, handing the completions to the reward pool,
environments) runs while the device updates; (5) the update's metrics are fetched. So the pool
scores batch ``j + d`` while the device runs the next rollout and update. On separate sampler and
trainer devices (``relax.parallel``) the rollout
runs on the sampler's devices meanwhile. The sampler's copy of a version (``sampler_view``: the
policy, its step and key) is taken before the update that would overwrite it; the batch of lag
``i - v(i) > 0`` samples with ``fold_in(key_v, lag)``.

Partial rollouts (``partial = K > 1``, ``relax.rollout.partial``): batch ``i`` is sampled over the
rollouts of updates ``i - K + 1 .. i``, ``max_new_tokens / K`` tokens in each, its tokens of the
versions of those rollouts; they take ``K - 1`` of the staleness (``d = s + 1 - n - (K - 1)``) and
the pipeline checks each batch's token versions against ``oldest_version(i) .. v(i)``. The
batches in progress belong to the data iterator's state (the ``PartialRollouts`` object stands in
for it), so a batch's data position is recorded when it starts, after the rollouts before it ran.

Resume: a checkpoint after update ``j`` holds the state, the sampler's copies of the older
versions that batches still in flight use (``AsyncConfig.live_versions``; a fixed number of slots,
``AsyncConfig.slots``) and the data position of batch ``j + 1``; resuming re-produces those
batches exactly as the uninterrupted run did (rewards deterministic, as any resume needs).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from relax.compose import Segment, split_host
from relax.objectives.off_policy import OffPolicyConfig
from relax.parallel.distributed import to_local


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """The pipeline (``--async.*``): ``staleness`` s (0: synchronous), ``push_every`` n (the
    sampler's weights refreshed every n updates, ``n <= s + 1``) and the ``correction`` of stale
    batches (``relax.objectives.off_policy``; applied when ``s > 0``)."""

    staleness: int = 0
    """Most policy versions a batch may lag behind the update that consumes it."""
    push_every: int = 1
    """Push the trainer's weights to the sampler every N updates (N <= staleness + 1)."""
    correction: OffPolicyConfig = OffPolicyConfig()
    partial: int = 1
    """Partial rollouts (``relax.rollout.partial``): each batch is sampled over this many rollouts,
    ``max_new_tokens / partial`` tokens of its unfinished completions in each, so no rollout waits
    for a batch's longest completion (1: a batch is sampled whole in one rollout). They take
    ``partial - 1`` versions of the staleness: the pipeline runs
    ``staleness + 1 - push_every - (partial - 1)`` batches ahead."""

    def __post_init__(self):
        if self.staleness < 0:
            raise ValueError(f"--async.staleness must be >= 0, got {self.staleness}")
        if not 1 <= self.push_every <= self.staleness + 1:
            raise ValueError(
                f"--async.push-every must be in [1, staleness + 1 = {self.staleness + 1}] so that "
                f"no batch is more than --async.staleness versions old, got {self.push_every}"
            )
        if self.partial < 1:
            raise ValueError(f"--async.partial must be >= 1, got {self.partial}")
        if self.staleness + 1 - self.push_every - (self.partial - 1) < 0:
            raise ValueError(
                f"--async.partial {self.partial} samples a batch over {self.partial} rollouts, so its first "
                f"tokens are {self.partial - 1} versions older than its last: it needs --async.staleness >= "
                f"{self.partial - 2 + self.push_every} (partial - 2 + push_every), got {self.staleness}"
            )

    @property
    def depth(self) -> int:
        """How many iterations ahead of its update a batch's (last) rollout runs:
        ``s + 1 - n - (partial - 1)``."""
        return self.staleness + 1 - self.push_every - (self.partial - 1)

    @property
    def off_policy(self) -> OffPolicyConfig | None:
        """The loss's correction: None when every batch is on-policy (``s = 0``) or it is "none"."""
        return self.correction if self.staleness > 0 and self.correction.kind != "none" else None

    def version(self, i: int) -> int:
        """``v(i)``: the policy version batch ``i`` is sampled with."""
        return self.push_every * (max(0, i - self.depth) // self.push_every)

    def oldest_version(self, i: int) -> int:
        """The version of batch ``i``'s oldest tokens: ``v(i)``, or with partial rollouts that of the
        rollout that started it, ``v(max(0, i - partial + 1))``."""
        return self.version(max(0, i - self.partial + 1))

    def live_versions(self, step: int, steps: int) -> tuple[int, ...]:
        """Versions older than ``step`` that batches ``step .. step + d`` (in flight, or next to be
        produced) are sampled with: the sampler copies a checkpoint at ``step`` must hold."""
        return tuple(
            sorted(
                {self.version(i) for i in range(step, min(step + self.depth + 1, steps))} - {step}
            )
        )

    def histogram(self, steps: int) -> dict[int, int]:
        """How many of ``steps`` updates consume a batch of each lag, its oldest tokens' (the
        pipeline checks every batch's recorded versions against the schedule)."""
        return dict(
            sorted(collections.Counter(i - self.oldest_version(i) for i in range(steps)).items())
        )

    @property
    def slots(self) -> int:
        """The most sampler copies any checkpoint holds (the schedule is periodic in n)."""
        horizon = 2 * (self.depth + self.push_every) + 2
        return max(len(self.live_versions(step, 10 * horizon)) for step in range(horizon))


def split_segments(
    segments: tuple[Segment, ...],
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """``(producer, consumer)``: the leading segments that do not update the state, and the rest."""
    first = next((k for k, seg in enumerate(segments) if seg.updates_state), None)
    if first is None or first == 0:
        raise ValueError(
            "a pipelined step needs leading stages that leave the state as it is (the rollout) "
            f"and a later one that updates it; its segments are {[seg.names for seg in segments]}"
        )
    return segments[:first], segments[first:]


def producer_part(state):
    """The part of a train state the producer reads: its policy, step (the version) and key."""
    return state.replace(
        opt_state=None, ref=None, ref_stats=None, critic=None, critic_opt_state=None
    )


@jax.jit
def copy_view(parts):
    """A copy of ``(policy, step, key)``, one program (compiled ahead with the step's,
    ``relax.algorithms.online.ahead``; copied leaf by leaf, each shape would compile its own)."""
    return jax.tree.map(jnp.copy, parts)


def sampler_view(state):
    """``producer_part(state)`` copied out of the state before an update overwrites it (the
    update donates its state)."""
    policy, step, key = jax.block_until_ready(copy_view((state.policy, state.step, state.key)))
    return producer_part(state).replace(policy=policy, step=step, key=key)


@dataclasses.dataclass
class Produced:
    """A batch on its way: the view it is sampled on, its batch, the producer segments still to
    run and the host time spent on it so far."""

    view: Any
    batch: dict
    todo: collections.deque
    time_s: float = 0.0


class Pipeline:
    """Runs a step's producer and consumer as ``cfg``'s schedule (module docstring).

    ``views``: the sampler copies restored from a checkpoint (version -> view). ``batches`` is
    the data iterator (``get_state``/``set_state``), ``make_batch(item)`` the step's input."""

    def __init__(
        self,
        segments: tuple[Segment, ...],
        cfg: AsyncConfig,
        batches,
        make_batch,
        views: dict[int, Any] | None = None,
    ):
        self.producer, self.consumer = split_segments(segments)
        self.cfg, self.batches, self.make_batch = cfg, batches, make_batch
        self.views: dict[int, Any] = dict(views or {})
        self.data_states: dict[int, Any] = {}
        self.in_flight: collections.deque[Produced] = collections.deque()

    # ------------------------------------------------------------------ checkpoints

    def data_state(self, step: int):
        """The data position of batch ``step`` (the next one to update on): recorded when it
        started, or now when it has not (every batch before it is produced)."""
        return self.data_states[step] if step in self.data_states else self.batches.get_state()

    def saved_views(self, state, step: int, steps: int) -> tuple:
        """``cfg.slots`` sampler copies for a checkpoint at ``step``: the live versions', padded
        with the state's own view (same structure, never read back)."""
        live = [self.views[v] for v in self.cfg.live_versions(step, steps)]
        return tuple(live + [producer_part(state)] * (self.cfg.slots - len(live)))

    # ------------------------------------------------------------------ producing

    def _view(self, state, i: int):
        """The state batch ``i`` is sampled on, its key folded with its lag (unchanged at lag 0)."""
        v = self.cfg.version(i)
        if v == int(state.step) and self.cfg.staleness == 0:
            return state  # synchronous: the live state, produced and consumed before it changes
        if v not in self.views:
            if v != int(state.step):
                raise RuntimeError(
                    f"batch {i} needs the weights of version {v}, which are gone (state at "
                    f"{int(state.step)}): the pipeline's schedule is broken"
                )
            self.views[v] = sampler_view(state)
        view, lag = self.views[v], i - v
        return view if lag == 0 else view.replace(key=jax.random.fold_in(view.key, lag))

    def _start(self, state, i: int) -> Produced:
        # the position before batch i: batch i - 1 is produced (its stages may read the data too:
        # partial rollouts, relax.rollout.partial)
        self.data_states[i] = self.batches.get_state()
        batch = self.make_batch(next(self.batches))
        return Produced(
            view=self._view(state, i), batch=batch, todo=collections.deque(self.producer)
        )

    def _advance(
        self, p: Produced, *, until_device: bool = False, until_wait: bool = False
    ) -> Produced:
        """Run ``p``'s producer segments; with ``until_device`` stop after the first jitted one
        (dispatched, not awaited) or before a host one (a multi-turn rollout's: it runs while the
        device updates), with ``until_wait`` before one that ``waits``."""
        t0 = time.perf_counter()
        while (
            p.todo
            and not (until_wait and p.todo[0].waits)
            and not (until_device and not p.todo[0].jittable)
        ):
            seg = p.todo.popleft()
            view, p.batch = seg.run(p.view, p.batch)
            if view is not p.view:
                raise ValueError(
                    f"stage(s) {'+'.join(seg.names)} changed the state: a pipelined step's "
                    "stages before the update must leave it as it is"
                )
            if until_device and seg.jittable:
                break
        p.time_s += time.perf_counter() - t0
        return p

    def _check_versions(self, j: int, batch) -> int:
        """The lag of batch ``j``'s oldest tokens; raises unless the versions its samples recorded
        are the schedule's: ``v(j)``, or with partial rollouts from ``oldest_version(j)`` to ``v(j)``."""
        # this process's rows (all a process can read): every row holds its batch's oldest
        # version, its completions' first tokens
        token_versions = getattr(batch, "token_versions", None)
        if token_versions is None:
            versions = np.unique(to_local(batch.policy_version))
        else:
            versions = np.unique(to_local(token_versions)[to_local(batch.mask) > 0])
        lo, hi = int(versions[0]), int(versions[-1])
        ok = (
            lo == self.cfg.oldest_version(j)
            and hi <= self.cfg.version(j)
            and 0 <= j - lo <= self.cfg.staleness
        )
        if not ok or (token_versions is None and lo != hi):
            raise RuntimeError(
                f"batch {j} was sampled by version(s) {versions.tolist()}, the schedule says "
                f"{self.cfg.oldest_version(j)}..{self.cfg.version(j)} (staleness bound "
                f"{self.cfg.staleness})"
            )
        return j - lo

    def _prune(self, step: int, steps: int) -> None:
        keep = set(self.cfg.live_versions(step, steps))
        for v in [v for v in self.views if v not in keep and v != step]:
            del self.views[v]
        for i in [i for i in self.data_states if i < step]:
            del self.data_states[i]

    # ------------------------------------------------------------------ the loop

    def run(self, state, start: int, steps: int) -> Iterator[tuple[Any, dict, dict]]:
        """Updates ``start .. steps - 1``: yields ``(state, batch, timings)`` after each, the batch
        the update returned (``metrics``, ``health``: awaited) and the iteration's host timings."""
        d = self.cfg.depth
        t_prologue = time.perf_counter()  # its time counts as the first iteration's
        while len(self.in_flight) < d and start + len(self.in_flight) < steps:
            self.in_flight.append(
                self._advance(self._start(state, start + len(self.in_flight)), until_wait=True)
            )
        for j in range(start, steps):
            t0 = t_prologue if j == start else time.perf_counter()
            ahead = (
                self._advance(self._start(state, j + d), until_device=d > 0)
                if j + d < steps
                else None
            )
            if d == 0:
                current = ahead
            else:
                current = self.in_flight.popleft()
                if ahead is not None:
                    self.in_flight.append(ahead)
            t_collect = time.perf_counter()
            batch = self._advance(current).batch  # what it waits for (the reward pool's scores)
            t_collect = time.perf_counter() - t_collect
            lag = self._check_versions(j, split_host(batch)[1])
            for seg in self.consumer:  # dispatched: the device updates while the host goes on
                state, batch = seg.run(state, batch)
            if ahead is not None and d > 0:
                self._advance(ahead, until_wait=True)  # its host work, while the device updates
            t_produced = time.perf_counter()
            out = split_host(batch)[1]
            jax.block_until_ready((out.metrics, out.health))
            t1 = time.perf_counter()
            self._prune(j + 1, steps)
            timings = {
                "time/step": t1 - t0,
                "time/wait_update": t1 - t_produced,
                "time/produce": 0.0 if ahead is None else ahead.time_s,
                "time/collect": t_collect,
                "staleness": float(lag),
            }
            yield state, batch, timings
