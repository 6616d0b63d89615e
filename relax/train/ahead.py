"""Every program of a step compiled before the step first runs (docs/architecture.md, "Compiled
before the first step").

A step is a few jitted segments with host segments between them (``relax.compose``). ``lower_step``
walks it without running it: each jitted segment is lowered with the arguments it will be called
with (``Segment.abstract`` of the state's and the batch's ``call_avals``), each host segment runs
for real on zeros of the shapes it will get (``run_host``), so the next segment sees the batch
the run would give it. ``compile_programs`` then compiles the lowered programs together, from a
thread pool (XLA compiles outside the interpreter lock).

``jax.jit`` reuses an executable that ``lower(...).compile()`` built for arguments of the same
shapes, dtypes, weak types and shardings (jax 0.10 caches the lowering by the traced program and
its arguments' shardings, and the executable with the lowering): the run's first call of each
program then compiles nothing. A committed array (placed on a device on purpose, e.g. restored
from a checkpoint) and an uncommitted one are different arguments, so ``call_avals`` keeps the
sharding of committed arrays only, and a program on one device returns committed arrays when an
argument was committed. A state whose arguments change after the first update (committed by
it) is walked again from the state the update returns (``walk_step``), until the state a walk
leaves is the one it started from.

``relax.plan.programs`` walks a run's step for a target's compile-only devices the same way.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from relax.compose import Segment, join_host, split_host
from relax.parallel.mesh import place_batch

HostRun = Callable[[Segment, Any, Any], Any]
"""``run_host(segment, state, batch) -> batch``: what a host segment makes of a batch of zeros."""


@dataclasses.dataclass(frozen=True)
class Lowering:
    """One jitted segment as a step calls it: its stage names, the index of its segment, its call
    arguments (``ShapeDtypeStruct`` s), the lowered program (None when its outputs were given,
    ``lower_step``'s ``known``) and its results' shapes (what the next segment is called with)."""

    name: str
    segment: int
    args: tuple[Any, Any]
    lowered: Any
    outputs: Any


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A lowered program compiled: the executable (None with ``error``) and its compile seconds."""

    lowering: Lowering
    compiled: Any
    error: str | None
    seconds: float

    @property
    def name(self) -> str:
        return self.lowering.name


def is_array(x: Any) -> bool:
    """numpy and jax arrays, and ``ShapeDtypeStruct`` s (a lowered program's ``out_info`` too)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def call_aval(x: Any) -> Any:
    """A call argument as ``jax.jit`` keys it: shape, dtype, weak type, and the sharding of a
    committed jax array (None for an uncommitted one, a numpy array or a Python scalar: jit places
    those itself); a ``ShapeDtypeStruct`` as it is."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array):
        sharding = x.sharding if x.committed else None
        weak = getattr(x, "weak_type", False)  # a typed key array has none
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=weak, sharding=sharding)
    if isinstance(x, (np.ndarray, np.generic)):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if isinstance(x, (bool, int, float, complex)):
        weak = not isinstance(x, bool)
        return jax.ShapeDtypeStruct((), jax.numpy.result_type(x), weak_type=weak)
    return x


def call_avals(tree: Any) -> Any:
    """``call_aval`` of every leaf of ``tree`` (a ``WithHost``'s host record kept)."""
    return device_map(call_aval, tree)


def device_map(fn: Callable, batch: Any) -> Any:
    """``fn`` over the leaves of a batch's device part (``relax.compose.split_host``); the host
    part as it is."""
    host, device = split_host(batch)
    return join_host(host, jax.tree.map(fn, device), batch)


def zeros(tree: Any) -> Any:
    """Zeros for every ``ShapeDtypeStruct`` of a batch (what a host segment reads): numpy arrays,
    or jax arrays committed to the one device of a single-device sharding."""

    def leaf(x):
        if not isinstance(x, jax.ShapeDtypeStruct):
            return x
        value = np.zeros(x.shape, x.dtype)
        if isinstance(x.sharding, SingleDeviceSharding):
            return jax.device_put(value, x.sharding)
        return value

    return device_map(leaf, tree)


def output_avals(out_info: Any, args: tuple[Any, Any]) -> Any:
    """A lowered program's results as its caller gets them: shape, dtype and weak type, committed
    to the device of its committed single-device arguments when it has any (on a mesh the runner
    lays the next program's arguments out itself: no sharding)."""
    committed = next(
        (
            x.sharding
            for x in jax.tree.leaves(args)
            if isinstance(getattr(x, "sharding", None), SingleDeviceSharding)
        ),
        None,
    )
    return jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=committed)
            if is_array(x)
            else x
        ),
        out_info,
    )


def _signature(segment: int, args: Any) -> tuple:
    leaves, treedef = jax.tree.flatten(args)
    return segment, treedef, tuple(leaves)


def lower_step(
    segments: Sequence[Segment],
    state: Any,
    batch: Any,
    *,
    run_host: HostRun,
    views: Callable[[Any], Any] | None = None,
    known: dict[str, Any] | None = None,
    until: Callable[[str], bool] | None = None,
    seen: dict | None = None,
    host_state: Any = None,
    place: bool = False,
) -> tuple[list[Lowering], Any]:
    """Lower each jitted segment of one step called with ``(state, batch)`` (``call_avals``), in
    order; a host segment's batch is ``run_host(segment, state, zeros)`` (a ``keeps_batch`` one's:
    the zeros). Returns the lowerings
    and the state the step leaves.

    ``views``: the state the segments before the first that updates it are called with (a
    pipelined run's producer reads a copy of the policy, ``relax.train.pipeline.producer_part``).
    ``known``: outputs of programs (by name) not to be lowered. ``until``: stop after the first
    program whose name it accepts. ``seen``: the outputs of the programs already lowered, by
    segment and arguments (a program met again with the same arguments is not lowered again, nor
    listed; updated in place). ``host_state``: the state host segments get (e.g. the run's own,
    for a host stage that runs programs of its own; default: the abstract one). ``place``: lay
    each host segment's batch out on the next program's mesh as a runner does (``_place``; a run's
    walk, not a plan's, whose devices hold nothing)."""
    lowerings, known = [], known or {}
    seen = {} if seen is None else seen
    updated, hosted = False, None
    for index, seg in enumerate(segments):
        updated = updated or seg.updates_state  # the first that updates it, and all after, consume
        view = views if views is not None and not updated else (lambda s: s)
        if not seg.jittable:
            given = view(state if host_state is None else host_state)
            hosted = zeros(batch) if seg.keeps_batch else run_host(seg, given, zeros(batch))
            batch = call_avals(hosted)
            continue
        called = view(state)
        name = "+".join(seg.names)
        args = seg.abstract(called, batch)
        if place:
            _place(hosted, program_mesh(args))
        hosted = None
        signature = _signature(index, args)
        if signature in seen:
            outputs = seen[signature]
        elif name in known:
            if seg.updates_state:
                raise ValueError(f"program {name} updates the state: its outputs cannot be given")
            outputs = seen[signature] = known[name]
            lowerings.append(Lowering(name, index, args, None, outputs))
        else:
            with _mesh_of(args):
                lowered = seg.jitted.lower(*args)
            outputs = seen[signature] = output_avals(lowered.out_info, args)
            lowerings.append(Lowering(name, index, args, lowered, outputs))
        if seg.updates_state:
            # called with the state as it is (``relax.compose``), its caller gets the state it returns;
            # a runner that lays the state out (``ShardedStep``) lays the returned one out alike
            new_state, outputs = outputs
            state = new_state if args[0] is called else state
        batch = join_host(split_host(batch)[0], outputs, batch)
        if until is not None and until(name):
            break
    return lowerings, state


def _place(hosted: Any, mesh: jax.sharding.Mesh | None) -> None:
    """A host segment's batch laid out on ``mesh`` as a runner lays it out before its next program
    (``relax.parallel.place_batch``), on one process: the placement's own programs (one per
    array shape) are compiled too. On several processes the walk's host segments see the global
    batch where the run's see their own rows: nothing to place."""
    if hosted is not None and mesh is not None and jax.process_count() == 1:
        place_batch(split_host(hosted)[1], mesh)


def program_mesh(args: Any) -> jax.sharding.Mesh | None:
    """The mesh of a program's arguments' named shardings (None on a single device)."""
    for x in jax.tree.leaves(args):
        mesh = getattr(getattr(x, "sharding", None), "mesh", None)
        if mesh is not None:
            return mesh
    return None


def _mesh_of(args: Any):
    """The context a program is traced in: its arguments' mesh (``jax.set_mesh``), as a runner on
    a mesh calls it, or none."""
    mesh = program_mesh(args)
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def walk_step(
    segments: Sequence[Segment],
    state: Any,
    batch: Any,
    *,
    run_host: HostRun,
    views: Callable[[Any], Any] | None = None,
    seen: dict | None = None,
    host_state: Any = None,
    place: bool = True,
    passes: int = 3,
) -> list[Lowering]:
    """``lower_step`` from ``state`` (``call_avals``), then again from the state each walk leaves
    while it differs from the one the walk started from (e.g. the state committed by the first
    update): the programs of the step's first call and of every later one, in at most ``passes``
    walks. ``place``: ``lower_step``'s (on by default: a run's walk)."""
    seen = {} if seen is None else seen
    out: list[Lowering] = []
    state = call_avals(state)
    for _ in range(passes):
        new, after = lower_step(
            segments,
            state,
            batch,
            run_host=run_host,
            views=views,
            seen=seen,
            host_state=host_state,
            place=place,
        )
        out += new
        if _signature(0, after) == _signature(0, state):
            break
        state = after
    return out


def compile_programs(lowerings: Sequence[Lowering], *, workers: int = 1) -> list[Compiled]:
    """Compile each lowering that has a ``lowered`` program (``timed_compile``), ``workers`` at a
    time from a thread pool; in the lowerings' order."""
    todo = [lo for lo in lowerings if lo.lowered is not None]
    if workers <= 1 or len(todo) <= 1:
        results = [timed_compile(lo.lowered) for lo in todo]
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
            results = list(pool.map(lambda lo: timed_compile(lo.lowered), todo))
    return [Compiled(lo, *result) for lo, result in zip(todo, results, strict=True)]


def timed_compile(lowered: Any) -> tuple[Any, None, float]:
    """``(lowered.compile(), None, seconds)``: a plan's ``compile_fn`` contract (an error raises)."""
    t0 = time.perf_counter()
    compiled = lowered.compile()
    return compiled, None, time.perf_counter() - t0


def default_workers() -> int:
    """Compile threads: one per two CPU cores this process may use (on the 2-core development host
    two threads were slower than one: docs/architecture.md, "Compiled before the first step")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // 2)
