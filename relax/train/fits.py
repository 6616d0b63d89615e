"""Whether a run's compiled programs fit the memory of the devices they run on, checked before the
first step (the online trainers' compile-ahead, ``relax.algorithms.online.ahead``).

XLA's buffer assignment says what a compiled program allocates when it is called, per device
(``memory_analysis()``): its temporaries and its outputs, less those aliased to donated
arguments. Its arguments (the train state, the batch) are resident already. So beyond what the
devices hold, the program needs at least::

    need = temporaries + outputs - aliased

and it cannot run when ``need`` is over its devices' free memory (``relax.train.free_memory``:
``bytes_limit - bytes_in_use`` on an accelerator; on CPU devices, which share the host's memory,
the host's available memory against the sum of their needs). Two programs that run at once (a
pipelined sampler beside the update) need more than either, and an allocator loses some to
fragmentation: the need is a floor, so a program over it is one that cannot run, never one that
might.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from relax.parallel.distributed import max_over_processes
from relax.train.free_memory import free_bytes

GIB = 1 << 30

FreeBytes = Callable[[list], tuple[int, str, int]]
"""``free(devices) -> (bytes, what bounds them, devices the need is split over)``
(``free_bytes``'s contract: the split is 1 on CPU devices, which share the host's memory)."""


@dataclasses.dataclass(frozen=True)
class ProgramNeed:
    """What one compiled program allocates when called: ``bytes`` per device (module docstring),
    on ``devices``."""

    name: str
    bytes: int
    devices: tuple[Any, ...]


class DoesNotFit(RuntimeError):
    """A run's compiled program needs more memory than its devices have free."""


def allocated_bytes(compiled: Any) -> int | None:
    """What ``compiled`` (a ``jax.stages.Compiled``) allocates when it runs, per device: its
    temporaries and its outputs, less those aliased to donated arguments; None where the backend
    does not say."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # a backend without the analysis
        return None
    if m is None:
        return None
    return int(m.temp_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes)


def program_need(name: str, compiled: Any) -> ProgramNeed | None:
    """``compiled``'s need on this process's devices; None when its backend gives no memory
    analysis."""
    need = allocated_bytes(compiled)
    return None if need is None else ProgramNeed(name, need, program_devices(compiled))


def program_devices(compiled: Any) -> tuple[Any, ...]:
    """The devices of this process that ``compiled`` runs on: those of its input and output
    shardings (another process checks its own)."""
    shardings = [*_leaves(compiled.input_shardings), *_leaves(compiled.output_shardings)]
    found = {d for s in shardings for d in getattr(s, "device_set", ())}
    mine = jax.process_index()
    return tuple(sorted((d for d in found if d.process_index == mine), key=lambda d: d.id))


def _leaves(tree: Any) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "device_set"))


def size_text(n: int) -> str:
    """``n`` bytes for a reader: GiB from one GiB up, else MiB."""
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def shortfall(need: ProgramNeed, free: FreeBytes | None = None) -> str | None:
    """Why ``need`` cannot run on its devices (None: it fits their free memory): the bytes it
    needs and the bytes free, and what bounds them."""
    free = (lambda devices: free_bytes(devices, None)) if free is None else free
    if not need.devices or need.bytes <= 0:
        return None
    available, where, split = free(list(need.devices))
    shared = split == 1 and len(need.devices) > 1  # CPU devices: the host holds all of them
    total = need.bytes * len(need.devices) if shared else need.bytes
    if total <= available:
        return None
    per = f"{size_text(need.bytes)} per device x {len(need.devices)}" if shared else None
    return (
        f"{need.name} needs {size_text(total)}"
        + (f" ({per})" if per else " per device")
        + f" beyond the resident state and {size_text(max(available, 0))} are free ({where})"
    )


def check_fit(needs: Sequence[ProgramNeed], hint: str, free: FreeBytes | None = None) -> None:
    """Raise ``DoesNotFit`` naming every program of ``needs`` over its devices' free memory,
    followed by ``hint`` (the flags that make the run smaller). Every process of a multi-process
    run calls it, each for its own devices, and all of them raise when one does."""
    short = [s for s in (shortfall(n, free) for n in needs) if s is not None]
    if max_over_processes(len(short)) and not short:
        short = ["another process's programs do not fit its devices' memory (its log names them)"]
    if short:
        raise DoesNotFit(
            "the run's compiled programs do not fit in memory, so it stops before its first "
            "step:\n  " + "\n  ".join(short) + "\n" + hint
        )
