"""Stages and their composition: a training step is ``compose(rollout, score, advantage, update)``.

A stage is a pure function ``(state, batch) -> (state, batch)`` over pytrees, marked jittable
(runs inside ``jax.jit``) or host (plain Python: tokenizers, Python reward functions, logging).
``compose`` fuses every run of adjacent jittable stages into ONE ``jax.jit`` and runs host stages
between them, so a step with one host stage in the middle is exactly two compiled programs.

    step = compose(stage(rollout), stage(score, jit=False), stage(advantage), stage(update))
    state, batch = step(state, batch)        # jit(rollout) -> score on host -> jit(advantage+update)

A batch is a pytree. Host data (prompt strings, dataset fields, pending reward futures) rides
BESIDE it, never through a jitted program: a ``WithHost(device, host)`` batch gives the jitted
segments ``device`` and host stages the pair (the online algorithms' typed phases,
``relax.algorithms.online.batch``). A plain dict batch may also mix both: its non-array entries are
passed around the jitted programs and are visible to host stages only.

Donation: a fused program donates its ``state`` argument (``donate_argnums=0``) when every stage in
it allows it (``donate_state=True``, the default), so the caller must use the RETURNED state and
must not keep references to the old one (its buffers may be deleted). Arrays shared between
``state`` and ``batch`` must not be donated: give the stage ``donate_state=False``.

A stage that reads the state but never changes it (``updates_state=False``, e.g. the rollout)
returns the state it was given; a program made only of such stages returns the batch alone, and
its caller gets back the very state object it passed: nothing is donated or copied. So when a
host stage after it raises (a reward function), the caller's state is intact and the step can
be retried or the state saved.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

StageFn = Callable[[Any, Any], tuple[Any, Any]]
PLACEMENTS = ("trainer", "sampler", "process")


@dataclasses.dataclass(frozen=True)
class Segment:
    """One unit of execution: a fused jitted program or a single host function."""

    names: tuple[str, ...]
    jittable: bool
    run: StageFn
    jitted: Any = None  # the jax.jit object of a jittable segment
    updates_state: bool = True  # False: the segment returns the state it was given
    waits: bool = False  # a host segment that collects work started earlier (``stage(waits=...)``)
    # A host segment that returns the batch it is given (a runner's weight copy between meshes):
    # a walk of the step's shapes (``relax.train.ahead``) passes the batch on without running it.
    keeps_batch: bool = False
    # A jitted segment's call arguments as ``jax.ShapeDtypeStruct`` s (with the shardings a runner
    # on a mesh gives them), from an abstract ``(state, batch)``: ``jitted.lower(*abstract(s, b))``
    # compiles the very program the run would, without arrays (``relax.train.ahead``, ``relax.plan``).
    abstract: StageFn | None = None


class SegmentRunner:
    """Runs ``self.segments`` in order; shared by ``Stage`` and ``relax.parallel.ShardedStep``."""

    segments: tuple[Segment, ...]

    def __call__(self, state: Any, batch: Any) -> tuple[Any, Any]:
        for seg in self.segments:
            state, batch = seg.run(state, batch)
        return state, batch

    @property
    def jitted(self) -> tuple[Any, ...]:
        """The ``jax.jit`` objects of the jittable segments (e.g. for ``._cache_size()``)."""
        return tuple(seg.jitted for seg in self.segments if seg.jittable)

    def cache_sizes(self) -> tuple[int, ...]:
        """Number of compiled executables cached per jitted segment (one per input signature)."""
        return tuple(j._cache_size() for j in self.jitted)


@dataclasses.dataclass(frozen=True)
class Stage(SegmentRunner):
    """A step ``(state, batch) -> (state, batch)``; calling it runs its compiled segments.

    ``fn`` is the pure (unjitted) function; for a composed stage it calls its ``parts`` in order.
    ``parts`` is empty for a leaf stage, else the flattened leaf stages. ``segments`` is the
    execution plan (built once, so repeated calls reuse the same jitted programs and caches).
    """

    fn: StageFn
    jittable: bool = True
    name: str | None = None
    donate_state: bool = True
    updates_state: bool = True
    placement: str = "trainer"
    reads_reference: bool = False
    waits: bool = False
    parts: tuple[Stage, ...] = ()
    segments: tuple[Segment, ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"stage {self.name}: placement {self.placement!r} is not one of {PLACEMENTS}"
            )
        object.__setattr__(self, "segments", _plan(self.parts if self.parts else (self,)))

    @property
    def leaves(self) -> tuple[Stage, ...]:
        """The leaf stages this stage runs, in order (itself for a leaf)."""
        return self.parts if self.parts else (self,)


def stage(
    fn: StageFn | None = None,
    *,
    jit: bool = True,
    name: str | None = None,
    donate_state: bool = True,
    updates_state: bool = True,
    placement: str = "trainer",
    reads_reference: bool = False,
    waits: bool = False,
) -> Stage | Callable[[StageFn], Stage]:
    """Wrap ``fn(state, batch) -> (state, batch)`` as a ``Stage``; usable as ``@stage(jit=False)``.

    ``jit=False`` marks a host stage (runs as plain Python, may convert to numpy, call tokenizers,
    have side effects). ``name`` defaults to ``fn.__name__``. ``donate_state`` allows a jitted
    program containing this stage to donate its input state. ``updates_state=False``: ``fn``
    returns the state it was given, unchanged (checked when traced; module docstring).
    Where a runner with several meshes puts it (``relax.parallel.ShardedStep``): ``placement``
    ("sampler": the rollout's devices, "trainer": the rest) and ``reads_reference`` (it reads
    ``state.ref``, which an offloading runner brings onto the devices for it). ``waits`` (host
    stages): it collects work an earlier stage started (the reward pool's scores), so a pipeline
    (``relax.train.pipeline``) runs it as late as it can, when its batch is about to be consumed.

    Args:
        fn: the pure function ``fn(state, batch) -> (state, batch)``. None: ``stage`` returns a
            decorator that wraps the function it is given, with the other arguments.
        jit: True (default): a jittable stage, fused into one ``jax.jit`` with the jittable
            stages next to it. False: a host stage, run as plain Python.
        name: the stage's name (its segment's, in plans and errors). None: ``fn.__name__``, or
            the name of ``fn``'s type when it has none.
        donate_state: whether a jitted program holding this stage may donate its input state
            (default True). False when ``state`` and ``batch`` share arrays.
        updates_state: True (default): ``fn`` may return a new state. False: it returns the
            state it was given, unchanged (checked when traced), and a program of such stages
            returns the caller's state object.
        placement: ``"trainer"`` (default) or ``"sampler"``: the devices a runner with several
            meshes runs the stage on. ``"process"`` (host stages): on several processes each
            runs it on its own rows with its own copy of the policy (``relax.parallel.local``),
            e.g. a multi-turn rollout whose device calls depend on its environments.
        reads_reference: the stage reads ``state.ref`` (default False); an offloading runner
            brings the reference onto the devices for it.
        waits: a host stage that collects work an earlier stage started (default False).

    Returns:
        A leaf ``Stage`` (its ``parts`` empty); with ``fn`` None, a decorator ``fn -> Stage``.
    """
    if fn is None:
        return lambda f: stage(
            f,
            jit=jit,
            name=name,
            donate_state=donate_state,
            updates_state=updates_state,
            placement=placement,
            reads_reference=reads_reference,
            waits=waits,
        )
    if isinstance(fn, Stage):
        raise TypeError("fn is already a Stage; compose it, or wrap its .fn")
    if not callable(fn):
        raise TypeError(f"stage fn must be callable, got {type(fn).__name__}")
    label = name if name is not None else getattr(fn, "__name__", type(fn).__name__)
    return Stage(
        fn=fn,
        jittable=jit,
        name=label,
        donate_state=donate_state,
        updates_state=updates_state,
        placement=placement,
        reads_reference=reads_reference,
        waits=waits,
    )


def compose(*stages: Stage, name: str | None = None) -> Stage:
    """Sequential composition ``s_k o ... o s_1`` as one ``Stage``.

    Composed stages are flattened into their leaf stages first, so fusion crosses nesting:
    ``compose(compose(a, b), c)`` with all three jittable is ONE jitted program. The result is
    jittable iff every part is, and allows donation iff every part does.

    Args:
        *stages: the ``Stage`` objects to run, in order; at least one. A composed stage counts
            as its leaf stages.
        name: the composed stage's name. None: the leaf stages' names joined by ``+``.

    Returns:
        A ``Stage`` whose ``parts`` are the leaf stages in order and whose ``fn`` calls them in
            turn. It updates the state if any leaf does, and reads the reference if any leaf does.
    """
    if not stages:
        raise ValueError("compose needs at least one stage")
    for s in stages:
        if not isinstance(s, Stage):
            raise TypeError(
                f"compose takes Stage objects (wrap functions with stage()), got {type(s).__name__}"
            )
    leaves = tuple(leaf for s in stages for leaf in s.leaves)
    return Stage(
        fn=_chain(leaves),
        jittable=all(s.jittable for s in leaves),
        name=name if name is not None else "+".join(s.name for s in leaves),
        donate_state=all(s.donate_state for s in leaves),
        updates_state=any(s.updates_state for s in leaves),
        reads_reference=any(s.reads_reference for s in leaves),
        parts=leaves,
    )


def _chain(leaves: tuple[Stage, ...]) -> StageFn:
    fns = tuple(s.fn for s in leaves)

    def chained(state, batch):
        for f in fns:
            state, batch = f(state, batch)
        return state, batch

    return chained


def group_leaves(
    leaves: tuple[Stage, ...], key: Callable[[Stage], Any] = lambda leaf: None
) -> list[list[Stage]]:
    """Adjacent jittable leaves with equal ``key`` form one group (one program); a host leaf is
    a group of its own."""
    groups: list[list[Stage]] = []
    for leaf in leaves:
        last = groups[-1][-1] if groups else None
        if leaf.jittable and last is not None and last.jittable and key(last) == key(leaf):
            groups[-1].append(leaf)
        else:
            groups.append([leaf])
    return groups


def batch_only(group: Sequence[Stage]) -> tuple[StageFn, bool]:
    """``(fn, updates_state)`` for a jitted program of ``group``: when no stage updates the state,
    ``fn(state, batch) -> batch`` (``keep_state`` puts the caller's state back), else the chain."""
    chain = _chain(tuple(group))
    if any(s.updates_state for s in group):
        return chain, True
    names = "+".join(s.name for s in group)

    def fn(state, batch):
        out_state, out = chain(state, batch)
        if any(
            a is not b
            for a, b in zip(jax.tree.leaves(out_state), jax.tree.leaves(state), strict=True)
        ):
            raise ValueError(f"stage(s) {names} declared updates_state=False but changed the state")
        return out

    return fn, False


def keep_state(jitted: Callable) -> StageFn:
    """``(state, batch) -> (state, jitted(state, batch))``: the caller's state object, untouched."""
    return lambda state, batch: (state, jitted(state, batch))


def _plan(leaves: tuple[Stage, ...]) -> tuple[Segment, ...]:
    """Group adjacent jittable leaves into one jitted segment each; host leaves stand alone."""
    segments = []
    for group in group_leaves(leaves):
        names = tuple(s.name for s in group)
        if group[0].jittable:
            fn, updates = batch_only(group)
            donate = (0,) if updates and all(s.donate_state for s in group) else ()
            jitted = jax.jit(fn, donate_argnums=donate)
            run = _host_passthrough(jitted if updates else keep_state(jitted))
            segments.append(
                Segment(
                    names=names,
                    jittable=True,
                    run=run,
                    jitted=jitted,
                    updates_state=updates,
                    abstract=call_args,
                )
            )
        else:
            segments.append(
                Segment(
                    names=names,
                    jittable=False,
                    run=group[0].fn,
                    updates_state=group[0].updates_state,
                    waits=group[0].waits,
                )
            )
    return tuple(segments)


@dataclasses.dataclass(frozen=True)
class WithHost:
    """A device batch (a pytree of arrays) and the host record beside it: a jitted segment gets
    ``device`` alone and returns the next one; the host record passes around it unchanged."""

    device: Any
    host: Any

    def replace(self, **fields: Any) -> WithHost:
        return dataclasses.replace(self, **fields)


def _is_device_value(value: Any) -> bool:
    # arrays (an empty container too) go into the jitted program; Python values (text, numbers
    # from the data rows, ...) stay on the host: as jit arguments they would retrace on change.
    # A ``jax.ShapeDtypeStruct`` stands for an array (a batch being planned, ``relax.plan``).
    return all(
        isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))
        for leaf in jax.tree.leaves(value)
    )


def split_host(batch: Any) -> tuple[Any, Any]:
    """``(host part, device part)`` of a batch: a ``WithHost``'s record and device batch; a dict's
    host entries and array entries (see ``_is_device_value``); else ``(None, batch)``."""
    if isinstance(batch, WithHost):
        return batch.host, batch.device
    if isinstance(batch, dict):
        host = {k: v for k, v in batch.items() if not _is_device_value(v)}
        return host, {k: v for k, v in batch.items() if k not in host}
    return None, batch


def join_host(host: Any, device: Any, like: Any) -> Any:
    """The inverse of ``split_host``: a batch of ``like``'s kind from its host and device parts."""
    if isinstance(like, WithHost):
        return WithHost(device, host)
    if isinstance(like, dict) and host:
        return {**host, **device}
    return device


def call_args(state: Any, batch: Any) -> tuple[Any, Any]:
    """A ``compose`` segment's jitted arguments: the state and the batch's device part."""
    return state, split_host(batch)[1]


def _host_passthrough(jitted: Callable) -> StageFn:
    """Run a jitted segment on the device part of a batch (``split_host``) and put the host part
    back beside its output: jittable stages cannot use host data anyway."""

    def run(state, batch):
        host, dev = split_host(batch)
        state, out = jitted(state, dev)
        return state, join_host(host, out, batch)

    return run
