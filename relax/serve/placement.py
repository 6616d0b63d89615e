"""A request's arrays on the service's mesh (``--parallel.mesh``): rows split over the batch axes.

    mesh = mesh_of(session.state)              # the mesh the session's state lives on (None: one device)
    rows = place_rows(rows, mesh, "data")      # rows over data x fsdp x expert, the rest replicated

A batch whose row count (``relax.parallel.mesh.row_array``: its ``prompt_ids`` or ``ids``) splits
over the mesh's batch shards is laid out as a trainer's batch (``relax.parallel.mesh.place_batch``);
one that does not (e.g. 3 rows on 4 shards) is replicated on every device, which computes the
same result with every device doing all of it, and a warning says so (not for a sampling
request's prompts: one prompt is the usual request, and its completions are the sampler's to lay
out). Datum rows are padded to a
multiple of the shards instead (``relax.serve.datum.datum_rows``: empty rows add nothing to a
datum loss's sums), so they are always split.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
from jax.sharding import Mesh

from relax.models.config.sharding import batch_shards
from relax.parallel.mesh import place_batch, prompt_rows, replicated


def shards(mesh: Mesh | None) -> int:
    """The batch shards of ``mesh`` (1 without one)."""
    return 1 if mesh is None else batch_shards(mesh)


def place_rows(batch: Any, mesh: Mesh | None, what: str | None) -> Any:
    """``batch`` on ``mesh``: its rows split over the batch axes, else (rows that do not split,
    or no row field) replicated, with a warning naming ``what`` (the request's field; None: no
    warning, e.g. a sampling request's one prompt, whose G completions the sampler lays out)."""
    if mesh is None:
        return batch
    rows, n = prompt_rows(batch), batch_shards(mesh)
    if rows is not None and rows % n == 0:
        return place_batch(batch, mesh)
    if what is not None:
        warnings.warn(
            f"{what}: {rows} rows do not split over the mesh's {n} batch shards; replicated on every "
            "device (send a multiple of the shards to split them)",
            stacklevel=2,
        )
    return jax.device_put(batch, replicated(mesh))
