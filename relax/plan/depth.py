"""A deep model's sampler planned from two shallow compiles of it.

The sampler's decode loop runs the layers as a Python loop, once per completion-cache block
(``relax.rollout.sampler``), so its program grows with layers x blocks and the target compiler's
time with it: most of a plan's time on a 2-core host (RESULTS.md). Every layer of the loop is the
same code over its own buffers, so what the program needs grows by the same amount per layer.
``relax plan`` therefore compiles the sampler of the same run at two depths ``a < b`` (the model
truncated to its first ``a`` and ``b`` layers, widths unchanged) and extends the line through
them to the model's ``L`` layers::

    f(L) = f(a) + (L - a) * (f(b) - f(a)) / (b - a)

for its temporaries (KV caches, fused weights, activations), outputs, FLOPs, bytes, roofline
seconds, collectives and cache copies. What is known exactly is not extrapolated: the state and
batch the program is called with (the full model's, sharded) and the KV caches
(``sampler.cache_bytes``). The depths are multiples of the period of the model's layer kinds
(Gemma 3: five sliding layers to one full, so 6 and 12), and the plan says which programs were
extrapolated; ``--exact`` compiles every layer instead (RESULTS.md compares the two). A layer's
kind is its attention kind (sliding or full) and, in a mixture of experts, its MLP kind (dense
or sparse: ``ModelConfig.dense_layers``); a truncated model keeps both of its first layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from relax.models.config.model import ModelConfig
from relax.plan.hlo_summary import ProgramTraffic
from relax.plan.memory import ProgramMemory, per_chip, state_parts

MIN_DEPTH = 4
"""The shallowest depth compiled: below it the TPU compiler keeps a larger share of a layer's
buffers in on-chip memory, and the line through two depths would be too flat (RESULTS.md)."""


def kinds_period(config: ModelConfig) -> int | None:
    """The smallest ``p`` with the layer kinds (attention, MLP) repeating every ``p`` layers from
    the first; None when they do not (e.g. Qwen2's sliding window on the top layers only, or an
    MoE model whose first layer alone is dense)."""
    kinds = tuple(zip(config.sliding_layers, config.sparse_layers))
    for p in range(1, len(kinds) + 1):
        if all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p if p < len(kinds) else None
    return None


def depths(config: ModelConfig) -> tuple[int, int] | None:
    """The two depths ``a < b`` to compile the sampler at, or None when the model is too shallow
    for that to save time (``a + b >= L``) or its layer kinds do not repeat."""
    p = kinds_period(config)
    if p is None:
        return None
    a = p * -(-MIN_DEPTH // p)
    b = 2 * a
    return (a, b) if a + b < config.num_layers else None


def shallow(config: ModelConfig, layers: int) -> ModelConfig:
    """``config`` with its first ``layers`` layers only, each of its kinds (``layer_types``, and
    ``dense_layers`` in a mixture of experts)."""
    kinds = None if config.layer_types is None else config.layer_types[:layers]
    dense = tuple(i for i in config.dense_layers if i < layers)
    return dataclasses.replace(config, num_layers=layers, layer_types=kinds, dense_layers=dense)


def deepen_outputs(outputs: Any, config: ModelConfig) -> Any:
    """A shallow sampler's abstract outputs as the model of ``config`` gives them: the recorded
    experts of a mixture (``relax.models.forward.routes.Routes``, sparse layers on axis -2) for all of its
    sparse layers (every other output does not depend on depth)."""

    def leaf(path, x):
        if not any(getattr(k, "name", None) == "routes" for k in path):
            return x
        shape = (*x.shape[:-2], config.num_sparse_layers, x.shape[-1])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree_util.tree_map_with_path(leaf, outputs)


def _line(fa: float, fb: float, a: int, b: int, n: int) -> float:
    return fa + (n - a) * (fb - fa) / (b - a)


def extend_memory(
    name: str,
    args: tuple[Any, Any],
    kv_cache: int,
    ma: ProgramMemory,
    mb: ProgramMemory,
    a: int,
    b: int,
    n: int,
    *,
    sampler_weights: int = 0,
) -> ProgramMemory:
    """The ``n``-layer program's memory: the state and batch of its ``args``, its KV caches
    ``kv_cache`` and weight copy ``sampler_weights`` exactly, its temporaries and outputs on the
    line through the programs ``ma`` and ``mb`` compiled at depths ``a`` and ``b``. A shallow
    program the compiler refused for memory passes its message on (the deep one needs more
    still)."""
    temp = lambda m: m.kv_cache + m.sampler_weights + m.activations
    temporaries = round(_line(temp(ma), temp(mb), a, b, n))
    outputs = round(_line(ma.outputs, mb.outputs, a, b, n))
    kv = min(kv_cache, temporaries)
    copy = min(sampler_weights, temporaries - kv)
    parts, batch = state_parts(args[0]), per_chip(args[1])
    refused = mb if mb.error else ma if ma.error else None
    return ProgramMemory(
        name,
        **parts,
        batch=batch,
        kv_cache=kv,
        sampler_weights=copy,
        activations=temporaries - kv - copy,
        outputs=outputs,
        total=sum(parts.values()) + batch + outputs + temporaries,
        limit=(refused or mb).limit,
        error=refused and refused.error,
        compile_s=ma.compile_s + mb.compile_s,
        depths=(a, b),
    )


def extend_traffic(
    ta: ProgramTraffic, tb: ProgramTraffic, a: int, b: int, n: int
) -> ProgramTraffic:
    """The ``n``-layer program's traffic on the line through depths ``a`` and ``b``."""
    line = lambda x, y: _line(x, y, a, b, n)
    count = lambda x, y: max(round(line(x, y)), 0)

    def collectives(ca: dict, cb: dict) -> dict:
        return {
            k: (
                count(ca.get(k, (0, 0))[0], cb.get(k, (0, 0))[0]),
                count(ca.get(k, (0, 0))[1], cb.get(k, (0, 0))[1]),
            )
            for k in sorted({*ca, *cb})
        }

    return ProgramTraffic(
        name=tb.name,
        flops=line(ta.flops, tb.flops),
        bytes=line(ta.bytes, tb.bytes),
        seconds=line(ta.seconds, tb.seconds),
        collectives=collectives(ta.collectives, tb.collectives),
        decode_collectives=collectives(ta.decode_collectives, tb.decode_collectives),
        decode_step_seconds=line(ta.decode_step_seconds, tb.decode_step_seconds),
        cache_copies=count(ta.cache_copies, tb.cache_copies),
        decode_step_bytes=line(ta.decode_step_bytes, tb.decode_step_bytes),
    )
