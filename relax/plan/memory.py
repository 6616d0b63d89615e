"""What one compiled program needs per chip, and of what.

The compiler's ``memory_analysis()`` gives a program's bytes per device: arguments, outputs,
outputs aliased to (donated) arguments, and temporaries. While a program runs, the whole train
state it is called with stays in HBM, whether the program reads it or not (XLA drops unused
arguments from its own count: the sampler does not read the optimizer state, which is still
there). So a program's peak need is taken as::

    total = state + batch + outputs - aliased + temporaries

with ``state`` and ``batch`` each chip's shard of the program's abstract arguments: the policy's
weights, the optimizer state (moments and master weights), the reference model (unless it is
offloaded to host memory for that program; a distillation's teacher), the critic with its
optimizer, and the batch; a reward model's weights (``--reward-model``) are resident beside them
on the trainer's chips. The temporaries of a sampler program hold its KV caches
(``relax.rollout.sampler.cache_bytes``, divided over the chips that split their rows and heads);
the rest of the temporaries are activations and scratch. A program the compiler refuses for
memory (TPU: ``RESOURCE_EXHAUSTED``) has no analysis: its need is read from the message.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax

from relax.models.config.sharding import batch_shards

_SIZE = re.compile(r"([\d.]+)\s*([KMGT]?)(?:i?B)?")
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def per_chip(tree: Any) -> int:
    """Bytes of one chip's shard of every ``ShapeDtypeStruct`` (with a sharding) in ``tree``."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = (
            x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        )
        total += math.prod(shape) * x.dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Bytes per chip of one program (``total`` against the chip's ``limit``)."""

    name: str
    weights: int
    optimizer: int
    reference: int
    critic: int
    batch: int
    kv_cache: int
    activations: int
    outputs: int
    total: int
    limit: int
    error: str | None = None
    compile_s: float = 0.0
    depths: tuple[int, ...] = ()
    """The depths the program was compiled at when it was extrapolated to the model's
    (``relax.plan.depth``); empty when it was compiled whole."""
    reward_model: int = 0
    """The run's reward model (``--reward-model``) on this chip: loaded once and resident on the
    trainer's chips through the run (``relax.plan.reward_model``)."""

    @property
    def fits(self) -> bool:
        return self.error is None and self.total <= self.limit


def with_reward_model(m: ProgramMemory, weights: int) -> ProgramMemory:
    """``m`` with a reward model's ``weights`` (bytes on its chip) resident beside it."""
    return dataclasses.replace(m, reward_model=weights, total=m.total + weights)


def oom_bytes(message: str) -> tuple[int | None, int | None]:
    """``(needed, available)`` from a compiler's out-of-memory message, where it says them, e.g.
    "the total memory required for HLO temporaries (19.53G) exceeds available HBM (15.75G)"."""
    needed = re.search(r"required[^(]*\(([^)]+)\)", message) or re.search(
        r"Used\s+([\d.]+\s*[KMGT]?)", message
    )
    avail = re.search(r"available HBM\s*\(([^)]+)\)", message) or re.search(
        r"of\s+([\d.]+\s*[KMGT]?)\s+hbm", message
    )
    return _size(needed.group(1)) if needed else None, _size(avail.group(1)) if avail else None


def _size(text: str) -> int | None:
    m = _SIZE.search(text)
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


def state_parts(state: Any) -> dict[str, int]:
    """Per-chip bytes of a (sharded, abstract) ``TrainState``'s models and optimizer states."""
    get = lambda name: per_chip(getattr(state, name, None))
    return {
        "weights": get("policy"),
        "optimizer": get("opt_state"),
        "reference": get("ref"),
        "critic": get("critic") + get("critic_opt_state"),
    }


def program_memory(
    name: str,
    compiled: Any,
    args: tuple[Any, Any],
    *,
    limit: int,
    kv_cache: int = 0,
    error: str | None = None,
    compile_s: float = 0.0,
) -> ProgramMemory:
    """The breakdown of one program; ``kv_cache``: its KV caches per chip (0 outside the sampler)."""
    state, batch = args
    parts, batch_bytes = state_parts(state), per_chip(batch)
    if compiled is None:  # refused for memory: the message counts the temporaries
        needed, available = oom_bytes(error or "")
        temp, outputs, limit = needed or 0, 0, available or limit
    else:
        m = compiled.memory_analysis()
        temp, outputs = m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes
    kv = min(kv_cache, temp)
    return ProgramMemory(
        name,
        **parts,
        batch=batch_bytes,
        kv_cache=kv,
        activations=temp - kv,
        outputs=outputs,
        total=sum(parts.values()) + batch_bytes + outputs + temp,
        limit=limit,
        error=error,
        compile_s=compile_s,
    )


def kv_heads_per_chip(config, mesh: jax.sharding.Mesh) -> int:
    """KV heads a chip holds in the sampler's decode layout (``relax.models.config.sharding.decode_layout``):
    split over ``tensor`` where they divide, else whole."""
    tensor = mesh.shape.get("tensor", 1)
    return (
        config.num_kv_heads // tensor if config.num_kv_heads % tensor == 0 else config.num_kv_heads
    )


def kv_cache_per_chip(total_bytes: int, mesh: jax.sharding.Mesh, config) -> int:
    """A sampler's KV caches per chip: rows split over the batch axes, KV heads as ``kv_heads_per_chip``."""
    return (
        total_bytes * kv_heads_per_chip(config, mesh) // (config.num_kv_heads * batch_shards(mesh))
    )
