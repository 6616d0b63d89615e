"""Scale: meshes and logical-axis sharding rules (``mesh``), a composed step run on a mesh
(``step``), multi-host initialisation (``distributed``). See docs/architecture.md, "Scale"."""

from relax.parallel import distributed
from relax.parallel.mesh import (
    AXES,
    BATCH_AXES,
    DEFAULT_RULES,
    MeshSpec,
    Rules,
    ShardingError,
    batch_sharding,
    batch_shards,
    constrain_batch,
    make_mesh,
    param_shardings,
    partition_spec,
    place_batch,
    place_process_rows,
    place_rows,
    replicated,
    shard_model,
    shard_vision,
    state_shardings,
    vision_shardings,
)
from relax.parallel.step import ParallelConfig, ShardedStep, check_batch

__all__ = [
    "AXES",
    "BATCH_AXES",
    "DEFAULT_RULES",
    "MeshSpec",
    "ParallelConfig",
    "Rules",
    "ShardedStep",
    "ShardingError",
    "batch_sharding",
    "batch_shards",
    "check_batch",
    "constrain_batch",
    "distributed",
    "make_mesh",
    "param_shardings",
    "partition_spec",
    "place_batch",
    "place_process_rows",
    "place_rows",
    "replicated",
    "shard_model",
    "shard_vision",
    "state_shardings",
    "vision_shardings",
]
