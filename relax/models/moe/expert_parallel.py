"""The experts of a sparse layer on a mesh with an ``expert`` axis: expert parallelism, the token
exchange explicit (``jax.shard_map``).

Without an ``expert`` axis (or of size 1) ``experts_ffn`` is ``relax.models.moe.experts.sparse_ffn``.
With one of size ``ep``, each device holds its ``nl`` rows (split over the batch axes, data x
fsdp x expert, as the rest of the step) and ``El = E / ep`` experts (``relax.parallel.mesh``:
``experts`` -> expert; each expert's width ``Fe`` over ``tensor`` where that divides it, as the
parameter rules lay it out). Per sparse layer, on device ``r`` of an expert group::

    1. all-gather over expert      xg [ep nl, D], eg / wg [ep nl, k]   the group's rows, in device order
    2. local key of each pair      e - r El  if r El <= e < (r+1) El, else El (none)
    3. pairs sorted by key         the local pairs first, grouped by local expert; the others lie
                                   beyond sum(sizes), where grouped_matmul gives 0 (no product)
    4. y_r[t] = sum_{j: e_tj local} w_tj FFN_{e_tj}(xg[t])              [ep nl, D]
    5. reduce-scatter over expert  device r gets its nl rows of sum_r' y_r' = sparse_ffn(x)
       (then a psum over tensor when Fe is split: each tensor shard holds Fe / t of every unit)

Dropless: every pair is computed by the device holding its expert, with no capacity limit.
Gradients flow through the transposes: the backward all-gathers the output cotangent and
reduce-scatters the input's (same collectives, same volume).

Volume per device and sparse layer (rows of D numbers): the all-gather receives ``(ep-1) nl``
rows and the reduce-scatter sends ``(ep-1) nl`` (plus the routing, ``2 k`` numbers a row). A
ragged all-to-all dispatch and combine moves ``k nl (ep-1) / ep`` rows each way on average (each
choice on a uniformly loaded expert): the same for ``k = ep``, ``ep / k`` times less for ``k <
ep``. The all-gather + reduce-scatter is chosen for its static shapes (no ragged counts, no
capacity, nothing dropped) at that price. On CPU ``grouped_matmul``'s tiles are sized for all
``ep nl k`` pairs (static shapes), so there the emulation multiplies zero rows where an
accelerator's grouped kernel skips them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from relax.models.config.sharding import EXPERT_AXIS, TENSOR_AXIS, ambient_batch_axes
from relax.models.moe.experts import sparse_ffn

Act = Callable[[Array], Array]


def experts_ffn(
    x: Float[Array, "n d"],
    experts: Int[Array, "n k"],
    weights: Float[Array, "n k"],
    w_gate: Float[Array, "e d f"],
    w_up: Float[Array, "e d f"],
    w_down: Float[Array, "e f d"],
    act: Act,
) -> Float[Array, "n d"]:
    """``relax.models.moe.experts.sparse_ffn``, its experts split over the ambient mesh's ``expert`` axis
    (module docstring); exactly ``sparse_ffn`` without one."""
    ep = ambient_axis_size(EXPERT_AXIS)
    if ep == 1:
        return sparse_ffn(x, experts, weights, w_gate, w_up, w_down, act)
    if w_gate.shape[0] % ep:
        raise ValueError(
            f"{w_gate.shape[0]} experts do not split over mesh axis {EXPERT_AXIS}={ep}"
        )
    return _expert_parallel(x, experts, weights, w_gate, w_up, w_down, act)


def ambient_axis_size(name: str) -> int:
    """The size of mesh axis ``name`` of the mesh being traced with (``jax.set_mesh``), 1 without it."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[name] if name in getattr(mesh, "axis_names", ()) else 1


def _expert_parallel(x, experts, weights, w_gate, w_up, w_down, act: Act):
    """One ``shard_map`` over the ambient mesh: rows over its batch axes (padded with rows routed
    to no expert when they do not split evenly), experts over ``expert``, ``Fe`` over ``tensor``
    where it divides."""
    batch = ambient_batch_axes()
    shards = math.prod(ambient_axis_size(a) for a in batch)
    t = ambient_axis_size(TENSOR_AXIS)
    width = TENSOR_AXIS if t > 1 and w_gate.shape[-1] % t == 0 else None
    n, pad = x.shape[0], -x.shape[0] % shards
    if pad:  # expert id E: on no device
        x, weights = (jnp.pad(a, ((0, pad), (0, 0))) for a in (x, weights))
        experts = jnp.pad(experts, ((0, pad), (0, 0)), constant_values=w_gate.shape[0])
    rows, columns = P(batch), P(EXPERT_AXIS, None, width)
    local = jax.shard_map(
        functools.partial(_local_experts, act=act, width=width),
        out_specs=rows,
        in_specs=(rows, rows, rows, columns, columns, P(EXPERT_AXIS, width, None)),
    )
    return local(x, experts, weights, w_gate, w_up, w_down)[:n]


def _local_experts(
    x: Float[Array, "nl d"],
    experts: Int[Array, "nl k"],
    weights: Float[Array, "nl k"],
    w_gate: Float[Array, "el d fl"],
    w_up: Float[Array, "el d fl"],
    w_down: Float[Array, "el fl d"],
    *,
    act: Act,
    width: str | None,
) -> Float[Array, "nl d"]:
    """Steps 1-5 of the module docstring on one device (inside the ``shard_map``)."""
    gather = lambda a: jax.lax.all_gather(a, EXPERT_AXIS, tiled=True)  # noqa: E731  [ep nl, ...]
    xg, eg, wg = gather(x), gather(experts), gather(weights)
    el = w_gate.shape[0]
    key = eg - jax.lax.axis_index(EXPERT_AXIS) * el
    key = jnp.where((key >= 0) & (key < el), key, el)
    y = local_sparse_ffn(xg, key, wg, w_gate, w_up, w_down, act)
    y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
    return y if width is None else jax.lax.psum(y, width)


# the local experts' pairs: ``sparse_ffn`` with another device's pairs keyed ``el`` (in no group: 0)
local_sparse_ffn = sparse_ffn
