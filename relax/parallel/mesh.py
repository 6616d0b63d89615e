"""Meshes and logical-axis sharding rules; the step on a mesh is ``relax.parallel.step``
(docs/architecture.md, "Scale").

Mesh: four named axes, always all present (size 1 when unused), in this device order::

    data    pure data parallelism: the batch is split, parameters are replicated
    expert  the batch is split like ``data`` (attention and every dense part are data-parallel
            over it) AND the experts of every sparse layer are split: each device holds
            E / expert experts, and tokens meet their experts through an explicit exchange over
            this axis (``relax.models.moe.expert_parallel``: all-gather of the rows and their
            routing, reduce-scatter of the expert outputs). For a dense model: one more data axis
    fsdp    the batch is split AND parameters / optimizer state are sharded (ZeRO-3 style)
    tensor  tensor parallelism: attention heads, MLP width (each expert's too) and the
            vocabulary are split

``MeshSpec.parse("data=2,fsdp=4")`` (missing axes are 1; one axis may be ``-1``: all the
remaining devices) and ``make_mesh(spec)``.

Parameters carry LOGICAL axis names (``relax.models.config.sharding.LOGICAL_AXES``: every parameter of
``relax.models.Transformer``); ``rules`` map them to mesh axes. ``DEFAULT_RULES``:

    logical axis    mesh axis  what it shards
    vocab           tensor     embedding / lm_head rows (vocabulary-parallel embedding and head)
    embed           fsdp       the model width D of every matrix and norm (FSDP), experts' included
    q_heads         tensor     query heads (Hq * head_dim, split at head boundaries)
    kv_heads        tensor     key/value heads (Hkv * head_dim, split at head boundaries)
    mlp             tensor     the MLP width F (and a shared expert's width Fs)
    experts         expert     the experts E of a sparse layer's expert_gate / up / down (E % expert != 0:
                               ShardingError naming the parameter)
    expert_mlp      tensor     each expert's width Fe (split like a dense MLP's F)
    router_experts  -          the router's E columns (router and shared expert: replicated over expert)
    shared_router_unit -       the shared expert's gate column
    layers          -          the stacked layer axis is never sharded (it is scanned over)
    head_dim        -          q_norm / k_norm scales
    lora_rank       -          the rank of LoRA factors (A and B shard like their weight otherwise)
    vision_heads    tensor     a vision tower's attention heads (its fused q/k/v's 3 H heads too)
    vision_mlp      tensor     a vision tower's MLP width, its patch merger's / projector's columns
    patch           -          a vision tower's flattened patch pixels and its patch positions

A vision-language model's frozen vision part (``vision_shardings`` / ``shard_vision``) is laid
out by the same rules: ``relax.models.config.sharding.VISION_LOGICAL_AXES`` names its weights'
dimensions (its width is ``embed``, over ``fsdp``), so a run's rules shard it with the language
model, and its own logical names let rules replicate it alone (``("vision_mlp", None)``).

A mesh axis of size 1 shards nothing. A dimension that does not split evenly over its mesh
axes is an ERROR (``ShardingError`` naming the parameter, the dimension and the mesh axis),
never a silent replication: pick another mesh or pass rules mapping that logical axis to
``None``. Head dimensions must split at head boundaries (``num_heads % tensor == 0``; a head axis's heads are its size
over the config's ``head_dim``).

The batch (``batch_sharding``): leading axis (prompts) over ``("data", "expert", "fsdp")``, the rest
replicated; everything else in the train state (step, PRNG key, running statistics, optimizer
counters) is replicated; optimizer moments (and float32 master weights) are sharded like their
parameters.

The step on a mesh (``ShardedStep``): the composed GRPO stage's leaves are regrouped into
segments like ``relax.compose`` does (adjacent jittable stages fuse into one ``jax.jit``), and
the shardings are EXPLICIT at every segment boundary: inputs are placed before each call
(``jax.device_put`` / ``jax.make_array_from_process_local_data``) and every output is pinned
with ``jax.lax.with_sharding_constraint`` (the state to its shardings, so the next call sees the
same layout and nothing recompiles; batch arrays to the batch sharding). Inside a segment the
partitioner propagates from those. Host stages (reward functions) see this process's rows.
With a sampler mesh (``sampler_devices``), the rollout runs on its own devices with its own
copy of the policy, refreshed from the trainer's after every update (``time/weight_transfer``).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from relax.models.adapters.tower import ModuleLoRA
from relax.models.config.sharding import (
    BATCH_AXES,
    HEAD_AXES,
    LOGICAL_AXES,
    VISION_LOGICAL_AXES,
    batch_shards,
    path_name,
)
from relax.models.decoder.transformer import Transformer
from relax.parallel import distributed

AXES = ("data", "expert", "fsdp", "tensor")
Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]
DEFAULT_RULES: Rules = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("layers", None),
    ("head_dim", None),
    ("vision_heads", "tensor"),
    ("vision_mlp", "tensor"),
    ("patch", None),
)


class ShardingError(ValueError):
    """A mesh that does not fit the devices, the model or the batch; the message says which."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Sizes of the (data, expert, fsdp, tensor) mesh axes; ``-1`` (at most one) takes the remaining
    devices."""

    data: int = 1
    expert: int = 1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.shape
        if any(s == 0 or s < -1 for s in sizes) or sizes.count(-1) > 1:
            raise ShardingError(
                f"mesh {self}: axis sizes must be >= 1 (one may be -1), got {sizes}"
            )

    @classmethod
    def parse(cls, text: str | MeshSpec) -> MeshSpec:
        """``"data=2,expert=1,fsdp=4,tensor=1"`` (any order, missing axes are 1, ``""`` is one device)."""
        if isinstance(text, MeshSpec):
            return text
        sizes: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            name, sep, value = (s.strip() for s in part.partition("="))
            if not sep or name not in AXES:
                raise ShardingError(
                    f"mesh spec {text!r}: {part!r} is not <axis>=<size> with axis one of {AXES}"
                )
            if name in sizes:
                raise ShardingError(f"mesh spec {text!r} gives axis {name!r} twice")
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ShardingError(
                    f"mesh spec {text!r}: size of {name!r} is not an integer: {value!r}"
                ) from None
        return cls(**sizes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes in ``AXES`` order."""
        return tuple(getattr(self, a) for a in AXES)

    def resolve(self, num_devices: int) -> MeshSpec:
        """The spec with ``-1`` filled in; ``ShardingError`` if it does not use exactly ``num_devices``."""
        known = math.prod(s for s in self.shape if s != -1)
        shape = self.shape
        if -1 in shape:
            if num_devices % known:
                raise ShardingError(
                    f"mesh {self}: {num_devices} devices do not divide by the other axes ({known})"
                )
            shape = tuple(num_devices // known if s == -1 else s for s in shape)
        if math.prod(shape) != num_devices:
            raise ShardingError(
                f"mesh {self} needs {' x '.join(map(str, shape))} = {math.prod(shape)} devices, "
                f"but {num_devices} device(s) are given"
            )
        return MeshSpec(**dict(zip(AXES, shape)))

    def __str__(self) -> str:
        return ",".join(f"{a}={s}" for a, s in zip(AXES, self.shape))


def make_mesh(spec: str | MeshSpec, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with axes ``AXES`` (data, expert, fsdp, tensor) over ``devices`` (default: every
    device of every process, arranged for the physical topology by ``jax.make_mesh``; given TPU
    chips are arranged so too where they form a slice)."""
    spec = MeshSpec.parse(spec)
    pool = list(jax.devices() if devices is None else devices)
    shape = spec.resolve(len(pool)).shape
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    if devices is None:
        return jax.make_mesh(shape, AXES, auto)
    if pool[0].platform == "tpu":  # e.g. relax.plan's compile-only chips: laid out for the torus
        try:
            return jax.make_mesh(shape, AXES, auto, devices=pool)
        except (
            ValueError,
            NotImplementedError,
            AssertionError,
        ):  # a part of a slice: in the given order
            pass
    return Mesh(np.asarray(pool, dtype=object).reshape(shape), AXES)


# ------------------------------------------------------------------------------ parameters


def _rule_axes(rules: Rules, logical: str) -> tuple[str, ...]:
    for name, target in rules:
        if name == logical:
            return (
                () if target is None else ((target,) if isinstance(target, str) else tuple(target))
            )
    return ()


def partition_spec(
    name: str,
    shape: tuple[int, ...],
    mesh: Mesh,
    model_config=None,
    rules: Rules = DEFAULT_RULES,
    *,
    table: Mapping[str, tuple[str, ...]] = LOGICAL_AXES,
) -> P:
    """The ``PartitionSpec`` of parameter ``name`` (a key of ``table``: ``LOGICAL_AXES``, or
    ``VISION_LOGICAL_AXES`` for a vision part's weights) of ``shape``. A head axis
    (``HEAD_AXES``) splits at head boundaries of ``model_config.head_dim`` (its size over
    ``head_dim`` heads) when a config is given."""
    if name not in table:
        which = "VISION_LOGICAL_AXES" if table is VISION_LOGICAL_AXES else "LOGICAL_AXES"
        raise ShardingError(
            f"parameter {name} has no logical axes (add it to relax.models.config.sharding.{which})"
        )
    logical = table[name]
    if len(logical) != len(shape):
        raise ShardingError(f"parameter {name} has shape {shape} but logical axes {logical}")
    used: set[str] = set()
    entries: list[Any] = []
    for dim, (axis, size) in enumerate(zip(logical, shape)):
        named = _rule_axes(rules, axis)
        for a in named:  # a rule naming an axis the mesh lacks is a typo, not "replicate"
            if a not in mesh.shape:
                raise ShardingError(
                    f"rule {axis!r} -> {a!r}: the mesh has no axis {a!r} ({tuple(mesh.shape)})"
                )
        axes = tuple(a for a in named if mesh.shape[a] > 1)
        for a in axes:
            if a in used:
                raise ShardingError(f"parameter {name}: mesh axis {a!r} would shard two dimensions")
        if not axes:
            entries.append(None)
            continue
        n = math.prod(mesh.shape[a] for a in axes)
        units, what = size, f"size {size}"
        if axis in HEAD_AXES and model_config is not None:
            heads = size // model_config.head_dim
            units, what = heads, f"{heads} heads x {model_config.head_dim}"
        if units % n:
            where = "x".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise ShardingError(
                f"parameter {name} {tuple(shape)}: dimension {dim} ({axis}, {what}) does not split over "
                f"mesh axis {where}; use a mesh whose {'/'.join(axes)} size divides {units}, or rules "
                f"mapping {axis!r} to None"
            )
        used.update(axes)
        entries.append(axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def param_shardings(
    model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, memory_kind: str | None = None
) -> Transformer:
    """A pytree like ``model`` whose leaves are the ``NamedSharding`` of each parameter."""
    cfg = model.config

    def leaf(path, x):
        return NamedSharding(
            mesh,
            partition_spec(path_name(path), tuple(x.shape), mesh, cfg, rules),
            memory_kind=memory_kind,
        )

    return jax.tree_util.tree_map_with_path(leaf, model)


def shard_model(model: Transformer, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Transformer:
    """``model`` laid out on ``mesh`` by ``rules``."""
    return jax.device_put(model, param_shardings(model, mesh, rules))


@dataclasses.dataclass(frozen=True)
class _HeadDim:
    """What ``partition_spec`` reads of a config: the head width its head axes split at."""

    head_dim: int


def vision_shardings(
    vision: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES, *, trained: bool = False
) -> Any:
    """A pytree like ``vision`` (a vision-language model's frozen vision part,
    ``relax.models.vision``'s ``VisionLanguage.vision``) whose leaves are the ``NamedSharding`` of
    each weight: ``VISION_LOGICAL_AXES`` mapped by ``rules`` as the language model's parameters
    are, heads split at ``vision.vision_head_dim`` boundaries. The part is frozen (never
    trained: no optimizer state, no gradient), so a weight with a dimension that does not split
    evenly (Qwen2.5-VL-7B's vision MLP of 3,420 over tensor = 8) is replicated whole, with one
    warning naming every such weight and why, rather than refused as a trained weight is.
    ``trained``: the part trains (``--train-vision``): such a weight is a ``ShardingError``."""
    heads = _HeadDim(vision.vision_head_dim)
    whole: list[str] = []

    def leaf(path, x):
        name = path_name(path)
        try:
            spec = partition_spec(
                name, tuple(x.shape), mesh, heads, rules, table=VISION_LOGICAL_AXES
            )
        except ShardingError as e:
            if trained or name not in VISION_LOGICAL_AXES:
                raise
            whole.append(str(e))
            spec = P()
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(leaf, vision)
    if whole:
        warnings.warn(
            f"{len(whole)} frozen vision weight(s) replicated on every device (they do not split "
            f"over mesh {dict(mesh.shape)}): " + "; ".join(whole),
            stacklevel=2,
        )
    return out


def _is_vision(x: Any) -> bool:
    """A vision-language model's vision part (``relax.models.vision``: it names its head width)."""
    return isinstance(x, eqx.Module) and hasattr(type(x), "vision_head_dim")


def shard_vision(vision: Any, mesh: Mesh, rules: Rules = DEFAULT_RULES) -> Any:
    """``vision`` (a frozen vision part) laid out on ``mesh`` by ``rules`` (``vision_shardings``)."""
    return jax.device_put(vision, vision_shardings(vision, mesh, rules))


def replicated(mesh: Mesh, memory_kind: str | None = None) -> NamedSharding:
    return NamedSharding(mesh, P(), memory_kind=memory_kind)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (prompt) axis over ``BATCH_AXES`` (data, expert, fsdp), the other axes replicated."""
    return NamedSharding(mesh, P(BATCH_AXES))


def state_shardings(
    state: Any,
    mesh: Mesh,
    rules: Rules = DEFAULT_RULES,
    *,
    reference_memory_kind: str | None = None,
) -> Any:
    """Shardings for a ``TrainState`` (or any pytree holding models): every ``Transformer`` in it
    (the policy, the reference, optimizer moments and master weights, which optax keeps in the
    parameters' own pytree type) is sharded by ``rules``, and so is a trained vision part
    (``state.vision`` and its moments: ``vision_shardings(trained=True)``; a tower with adapters,
    ``ModuleLoRA``: its frozen base as a frozen part, the factors replicated); every other leaf
    (step, PRNG key, running statistics, optimizer counts) is replicated.
    ``reference_memory_kind`` places the reference model (``state.ref``) in that memory (e.g.
    ``"pinned_host"``)."""

    def sharding(x, memory_kind):
        if isinstance(x, Transformer):
            return param_shardings(x, mesh, rules, memory_kind=memory_kind)
        if isinstance(x, ModuleLoRA):  # a tower's adapters: its frozen base as a frozen part's
            factors = lambda t: jax.tree.map(lambda _: replicated(mesh), t)  # noqa: E731
            return ModuleLoRA(
                vision_shardings(x.base, mesh, rules), factors(x.a), factors(x.b), x.scale
            )
        if _is_vision(x):
            return vision_shardings(x, mesh, rules, trained=True)
        return replicated(mesh)

    def shard(tree, memory_kind=None):
        return jax.tree.map(
            lambda x: sharding(x, memory_kind),
            tree,
            is_leaf=lambda x: isinstance(x, (Transformer, ModuleLoRA)) or _is_vision(x),
        )

    if reference_memory_kind is not None and state.ref is not None:
        return dataclasses.replace(
            shard(state.replace(ref=None)), ref=shard(state.ref, reference_memory_kind)
        )
    return shard(state)


def batch_axes_text(mesh) -> str:
    """``"data x fsdp = 4 x 1"`` (``expert`` named only when the mesh splits it)."""
    axes = [a for a in BATCH_AXES if a in mesh.axis_names and (a != "expert" or mesh.shape[a] > 1)]
    return f"{' x '.join(axes)} = {' x '.join(str(mesh.shape[a]) for a in axes)}"


def batch_leaf_sharding(x: Any, mesh: Mesh, rows: int) -> NamedSharding:
    """Batch sharding for an array whose leading axis has ``rows`` (the prompt count), else replicated."""
    return batch_sharding(mesh) if np.ndim(x) >= 1 and np.shape(x)[0] == rows else replicated(mesh)


# The field whose leading axis is a batch's rows, the axis split over the batch axes: its prompts
# (every online and preference batch), else its packed rows (``relax.data.packing.PackedBatch``).
ROW_FIELDS = ("prompt_ids", "ids")


def row_array(batch: Any) -> Any:
    """A batch's first ``ROW_FIELDS`` entry (a dict's entry or a typed batch's field); None when
    it has none."""
    for name in ROW_FIELDS:
        ids = batch.get(name) if isinstance(batch, Mapping) else getattr(batch, name, None)
        if ids is not None:
            return ids
    return None


def prompt_rows(batch: Any) -> int | None:
    """The row count of a device batch (``row_array``'s leading axis); None when it has none."""
    ids = row_array(batch)
    return None if ids is None else ids.shape[0]


def place_batch(batch: Any, mesh: Mesh) -> Any:
    """Device entries of ``batch`` as global arrays on ``mesh``: arrays with the row axis
    (``prompt_rows``' size) split over ``BATCH_AXES``, others replicated. Host-local
    arrays (numpy, or this process's rows) are assembled with
    ``jax.make_array_from_process_local_data``; arrays on another mesh are moved."""
    ids = row_array(batch)
    global_rows = ids.shape[0] if distributed.is_global(ids) else ids.shape[0] * jax.process_count()
    if global_rows % batch_shards(mesh):
        raise ShardingError(
            f"{global_rows} prompts per step do not split over {batch_axes_text(mesh)}; use a "
            f"batch size divisible by {batch_shards(mesh)}"
        )

    def leaf(x):
        rows = global_rows if distributed.is_global(x) else global_rows // jax.process_count()
        return distributed.to_global(x, batch_leaf_sharding(x, mesh, rows))

    return jax.tree.map(leaf, batch)


def place_rows(tree: Any, mesh: Mesh, rows: int) -> Any:
    """``tree``'s arrays (this process's, e.g. a program's output on ``mesh``) laid out for a
    step on ``mesh``: those whose leading axis has ``rows`` split over ``BATCH_AXES``, others
    replicated; all replicated when ``rows`` does not split evenly (e.g. a held-out batch, which
    the evaluation slices into chunks)."""
    return jax.device_put(tree, rows_shardings(tree, mesh, rows))


def rows_shardings(tree: Any, mesh: Mesh, rows: int) -> Any:
    """``place_rows``' layout of ``tree`` (arrays or ``ShapeDtypeStruct`` s): a sharding per leaf."""
    if rows % batch_shards(mesh):
        return jax.tree.map(lambda _: replicated(mesh), tree)
    return jax.tree.map(lambda x: batch_leaf_sharding(x, mesh, rows), tree)


def place_process_rows(tree: Any, mesh: Mesh, *, shared: bool) -> Any:
    """A process's ``tree`` (computed on its own devices, e.g. on ``relax.parallel.local``'s
    ``local_mesh``) as global arrays on ``mesh``, through host memory: ``shared`` (every process
    holds the same whole batch, e.g. the held-out one) replicated; else this process's
    contiguous rows of the global batch, the leaves with the row axis split over the batch axes
    as ``place_batch`` splits ``prompt_ids``."""
    host = jax.tree.map(np.asarray, tree)
    if shared:
        return distributed.put(host, jax.tree.map(lambda _: replicated(mesh), host))
    rows = jax.tree.leaves(host)[0].shape[0]
    return jax.tree.map(
        lambda x: distributed.to_global(x, batch_leaf_sharding(x, mesh, rows)), host
    )


def constrain_batch(batch: Any, mesh: Mesh, rows: int) -> Any:
    """``with_sharding_constraint`` of every array in ``batch`` (inside jit) to the batch rule."""
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, batch_leaf_sharding(x, mesh, rows)), batch
    )
