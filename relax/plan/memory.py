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
optimizer, and the batch; a reward model's weights (``--reward-model``) and a vision-language
model's frozen vision part (``--image-field``) are resident beside them on the trainer's chips.
The temporaries of a sampler program hold its KV caches
(``relax.rollout.sampler.cache_bytes``, divided over the chips that split their rows and heads)
and its own copy of the weights (``sampler_weights_per_chip``: the layers' matrices fused in the
decode layout, 1 byte each plus scales for an 8-bit sampler, with its 8-bit head); the rest of
the temporaries are activations and scratch. A program the compiler refuses for
memory (TPU: ``RESOURCE_EXHAUSTED``) has no analysis: its need is read from the message.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp

from relax.models.config.sharding import EXPERT_AXIS, batch_shards, decode_layout
from relax.models.layers.quantized import STACKED_WEIGHTS

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
    sampler_weights: int = 0
    """A sampler's own copy of the weights on this chip (``sampler_weights_per_chip``), counted out
    of its temporaries as ``kv_cache`` is (0 outside the sampler)."""
    vision: int = 0
    """A vision-language run's frozen vision part (tower and projection) on this chip: laid out
    once on the trainer's chips and resident through the run (``relax.plan.vision``)."""

    @property
    def fits(self) -> bool:
        return self.error is None and self.total <= self.limit


def with_reward_model(m: ProgramMemory, weights: int) -> ProgramMemory:
    """``m`` with a reward model's ``weights`` (bytes on its chip) resident beside it."""
    return dataclasses.replace(m, reward_model=weights, total=m.total + weights)


def with_vision(m: ProgramMemory, weights: int) -> ProgramMemory:
    """``m`` with a vision part's ``weights`` (bytes on its chip) resident beside it."""
    return dataclasses.replace(m, vision=weights, total=m.total + weights)


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
    sampler_weights: int = 0,
) -> ProgramMemory:
    """The breakdown of one program; ``kv_cache`` and ``sampler_weights``: a sampler's KV caches and
    weight copy per chip (0 outside the sampler), both counted out of its temporaries."""
    state, batch = args
    parts, batch_bytes = state_parts(state), per_chip(batch)
    if compiled is None:  # refused for memory: the message counts the temporaries
        needed, available = oom_bytes(error or "")
        temp, outputs, limit = needed or 0, 0, available or limit
    else:
        m = compiled.memory_analysis()
        temp, outputs = m.temp_size_in_bytes, m.output_size_in_bytes - m.alias_size_in_bytes
    kv = min(kv_cache, temp)
    copy = min(sampler_weights, temp - kv)
    return ProgramMemory(
        name,
        **parts,
        batch=batch_bytes,
        kv_cache=kv,
        sampler_weights=copy,
        activations=temp - kv - copy,
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


def sampler_weights_per_chip(
    config,
    precision: str,
    param_dtype,
    compute_dtype,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
) -> int:
    """A sampler's own copy of the weights on one chip of ``mesh`` (``relax.rollout.sampler``'s
    decode weights): every layer matrix, whole along the model width and split as the decode layout
    splits it (``decode_layout``: heads and MLP units over ``tensor``, experts over ``expert`` and
    their units over ``tensor``), in ``param_dtype``; for an 8-bit ``precision`` (int8 / fp8) the
    quantized ones (``STACKED_WEIGHTS``) 1 byte each plus a ``compute_dtype`` scale per output
    channel (split with the output axis: q/k/v and gate/up), and its own 8-bit head ``[V, D]``
    (vocabulary rows, and their scales, over ``tensor``). Norms and biases are not counted."""
    with jax.sharding.use_abstract_mesh(getattr(mesh, "abstract_mesh", mesh)):
        layout = decode_layout(config)
    t, scale = layout.tensor_size, jnp.dtype(compute_dtype).itemsize
    split = {"wq": layout.heads, "wk": layout.heads, "wv": layout.heads, "wo": layout.heads}
    split.update({w: layout.mlp for w in ("w_gate", "w_up", "w_down")})
    experts = (mesh.shape[EXPERT_AXIS] if layout.experts else 1) * (t if layout.expert_mlp else 1)
    total = 0
    for name, shape in config.stacked_shapes().items():
        if name.endswith("norm") or name.startswith("b"):
            continue
        share = experts if name.startswith("expert_") else (t if split.get(name) else 1)
        n = math.prod(shape)
        if precision == "model" or name not in STACKED_WEIGHTS:
            total += n * jnp.dtype(param_dtype).itemsize // share
            continue
        output_split = name in ("wq", "wk", "wv", "w_gate", "w_up")
        total += n // share + n // shape[-2] * scale // (share if output_split else 1)
    if precision != "model":
        rows = t if layout.vocab else 1
        total += config.vocab_size * (config.hidden_size + scale) // rows
    return total
