"""Compiling a plan's programs: each distinct program once, and a deep sampler's second shallow
compile in a worker process beside the others.

The target compilers hold the Python interpreter while they compile (two threads compile no
faster than one), so ``Compiler.later`` hands a program to a spawned process that builds and
compiles it again from its recipe (the run's config, the model config and the target: all
plain data) and sends back what a plan reads of it (``CompiledRecord``: the memory analysis
and the optimized HLO text), while this process compiles the rest.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import multiprocessing
import time
from typing import Any, Callable


def compile_program(lowered) -> tuple[Any, str | None, float]:
    """``lowered.compile()``; an out-of-memory refusal is returned as its message, not raised."""
    t0 = time.perf_counter()
    try:
        return lowered.compile(), None, time.perf_counter() - t0
    except Exception as e:  # the compile-only clients raise JaxRuntimeError
        if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
            raise
        return None, str(e).splitlines()[0], time.perf_counter() - t0


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """The fields of a compiled program's ``memory_analysis()`` a plan reads."""

    argument_size_in_bytes: int
    output_size_in_bytes: int
    alias_size_in_bytes: int
    temp_size_in_bytes: int


@dataclasses.dataclass(frozen=True)
class CompiledRecord:
    """What a plan reads of a program compiled in another process (duck-types the executable)."""

    memory: MemoryStats
    text: str

    @classmethod
    def of(cls, compiled) -> CompiledRecord:
        m = compiled.memory_analysis()
        return cls(MemoryStats(m.argument_size_in_bytes, m.output_size_in_bytes, m.alias_size_in_bytes,
                               m.temp_size_in_bytes), compiled.as_text())

    def memory_analysis(self) -> MemoryStats:
        return self.memory

    def as_text(self) -> str:
        return self.text


def sampler_record(make_algorithm, run, model, target) -> tuple[CompiledRecord | None, str | None, float]:
    """In a worker: the sampler of ``run`` (``make_algorithm(run)``) for ``model`` on ``target``,
    built and compiled, as ``(record, error, seconds)``."""
    from relax.plan import targets
    from relax.plan.programs import is_sampler, online_programs

    programs = online_programs(run, make_algorithm(run), model, targets.devices(target), compile_fn=compile_program,
                               until=is_sampler)
    p = programs[-1]
    return (None if p.compiled is None else CompiledRecord.of(p.compiled)), p.error, p.compile_s


class Compiler:
    """A ``compile_fn`` that compiles each distinct program (by its lowered text) once: the plans
    of one run with other flags (``relax.plan.suggest``) share the programs a flag does not
    change. ``workers``: processes for ``later`` (0: compile there and then)."""

    def __init__(self, compile_fn: Callable[[Any], tuple] = compile_program, workers: int = 1):
        self.compile_fn, self.workers = compile_fn, workers
        self.done: dict[str, tuple] = {}
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    @staticmethod
    def key(lowered) -> str:
        return hashlib.sha256(lowered.as_text().encode()).hexdigest()

    def __call__(self, lowered) -> tuple:
        key = self.key(lowered)
        if key not in self.done:
            self.done[key] = self.compile_fn(lowered)
        return self.done[key]

    def later(self, lowered, recipe: Callable[[], tuple]) -> Callable[[], tuple]:
        """``lowered``'s result, to be collected by calling what this returns; with workers it is
        compiled meanwhile in a worker process by ``recipe`` (picklable; it must build the same
        program), otherwise now."""
        key = self.key(lowered)
        if key in self.done or not self.workers:
            result = self(lowered)
            return lambda: result
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers,
                                                                mp_context=multiprocessing.get_context("spawn"))
        future = self._pool.submit(recipe)

        def collect() -> tuple:
            self.done[key] = future.result()
            return self.done[key]
        return collect
